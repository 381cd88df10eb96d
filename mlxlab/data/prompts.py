"""Prompt data for online training (GRPO): prompts the policy answers, and what rewards read.

One JSON object per line:

    {"prompt": "...", ...}                   a user message (raw text without a chat template)
    {"prompt": [messages...], ...}           a conversation to answer
    {"messages": [messages...], ...}         the same
    {"prompt": "...", "raw": true, ...}      the text as it is, no chat template

Every other field stays with the record and is handed to the reward functions beside each
completion (the built-in rewards read `schema`, `answer`, `answer_regex`: mlxlab/train/grpo/
rewards.py). A prompt is rendered with the model's chat template and its generation prompt
(a string becomes one user message); a tokenizer without a template, or `"raw": true`, encodes
the string as it is, with the tokenizer's special tokens (BOS), as `generate` does. A prompt
longer than `data.max_seq_length - grpo.max_tokens` tokens is skipped with a counted warning, or
refused (data.on_too_long=error). Errors name `file:line`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mlxlab.errors import UserError

log = logging.getLogger(__name__)


@dataclass
class Prompt:
    ids: list[int]
    """The rendered prompt's token ids (the completion follows them)."""
    record: dict
    """The JSONL record, as read (the rewards' view of the prompt)."""
    line: int = 0


@dataclass
class PromptSet:
    prompts: list[Prompt]
    source: str
    num_skipped: int = 0


def _messages(value, what: str) -> list[dict] | str:
    if not isinstance(value, list) or not value:
        return f"'{what}' must be a string or a non-empty list of messages"
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            return f"{what}[{i}] must be an object with a 'role'"
        if m.get("content") is None and not m.get("tool_calls"):
            return f"{what}[{i}] has no 'content'"
    return value


def split_record(record) -> str | list[dict] | tuple[str]:
    """The prompt of one record: a list of messages, a 1-tuple (text,) for a raw prompt, or why
    the record is bad (a string)."""
    if not isinstance(record, dict):
        return "expected a JSON object"
    if "prompt" not in record and "messages" not in record:
        return "expected 'prompt' (a string or messages) or 'messages'"
    key = "messages" if "messages" in record else "prompt"
    value = record[key]
    if isinstance(value, str):
        if not value:
            return f"'{key}' is empty"
        if record.get("raw"):
            return (value,)
        return [{"role": "user", "content": value}]
    if record.get("raw"):
        return "'raw': true needs the prompt as a string"
    return _messages(value, key)


def read_prompts(path: str | Path) -> list[tuple[int, dict, list[dict] | tuple[str]]]:
    """(line, record, prompt) of every record; the first ten problems as one error."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read {path}: {e}") from None
    out, errors = [], []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            errors.append(f"{path}:{lineno}: invalid JSON ({e.msg} at column {e.colno})")
            continue
        prompt = split_record(record)
        if isinstance(prompt, str):
            errors.append(f"{path}:{lineno}: {prompt}")
        else:
            out.append((lineno, record, prompt))
    if not out and not errors:
        errors.append(f"{path}: no prompts")
    if errors:
        more = f"\n  ... and {len(errors) - 10} more" if len(errors) > 10 else ""
        raise UserError("bad prompt data:\n  " + "\n  ".join(errors[:10]) + more)
    return out


def render(prompt: list[dict] | tuple[str], tokenizer) -> list[int]:
    """Token ids of a prompt: the chat template with its generation prompt, or a raw text
    encoded as `generate` encodes it (special tokens unless it starts with BOS)."""
    if isinstance(prompt, tuple) or not getattr(tokenizer, "chat_template", None):
        if isinstance(prompt, tuple):
            text = prompt[0]
        elif len(prompt) == 1 and prompt[0]["role"] == "user":
            text = prompt[0]["content"]
        else:
            raise UserError(
                "a conversation prompt needs a tokenizer with a chat template; give a string"
            )
        bos = getattr(tokenizer, "bos_token", None)
        return list(
            tokenizer.encode(text, add_special_tokens=bos is None or not text.startswith(bos))
        )
    return list(
        tokenizer.apply_chat_template(prompt, add_generation_prompt=True, return_dict=False)
    )


def load_prompt_split(path, tokenizer, data_cfg, max_tokens: int) -> PromptSet:
    """A prompt file, rendered and length-checked: a prompt longer than max_seq_length -
    max_tokens is skipped (counted) or, with data.on_too_long=error, refused."""
    limit = data_cfg.max_seq_length - max_tokens
    prompts, too_long = [], []
    for lineno, record, prompt in read_prompts(path):
        try:
            ids = render(prompt, tokenizer)
        except UserError as e:
            raise UserError(f"{path}:{lineno}: {e}") from None
        except Exception as e:  # noqa: BLE001 - the template's own complaint, e.g. role order
            raise UserError(f"{path}:{lineno}: the chat template refused it: {e}") from None
        if not ids:
            raise UserError(f"{path}:{lineno}: the prompt renders to no tokens")
        if len(ids) > limit:
            too_long.append(f"{path}:{lineno} has {len(ids)} tokens")
            continue
        prompts.append(Prompt(ids, record, lineno))
    if too_long and data_cfg.on_too_long == "error":
        raise UserError(
            f"{path}: {len(too_long)} prompts exceed data.max_seq_length - grpo.max_tokens = "
            f"{limit} tokens (data.on_too_long=error): " + "; ".join(too_long[:5])
        )
    if too_long:
        log.warning(
            f"warning: {len(too_long)} prompts in {path} are longer than data.max_seq_length - "
            f"grpo.max_tokens = {limit} tokens and were skipped"
        )
    if not prompts:
        raise UserError(f"{path}: no prompt fits in {limit} tokens")
    return PromptSet(prompts, str(path), len(too_long))


@dataclass
class PromptSampler:
    """Batches of `batch_size` prompts in a seeded order per epoch (a reshuffle each epoch), with
    the rollouts' random key: `state()` / `restore()` hold both, so a resumed run draws the same
    prompts and the same completions as the uninterrupted one.

    `shard=(rank, size)` (data parallel): every rank walks the same batches and takes prompts
    rank, rank + size, ... of each; the key is the world's, each rank folding its rank in when it
    draws (mlxlab/train/grpo/rollout.py)."""

    prompts: list[Prompt]
    batch_size: int
    seed: int
    shuffle: bool = True
    shard: tuple[int, int] = (0, 1)
    epoch: int = 0
    index: int = 0
    key: list[int] = field(default_factory=list)
    """The rollouts' random key (two uint32 words, MLX's key layout); set from the seed."""

    def __post_init__(self):
        if len(self.prompts) < self.batch_size:
            raise UserError(
                f"the dataset has {len(self.prompts)} prompts, fewer than "
                f"batch_size={self.batch_size}"
            )
        if not self.key:
            import mlx.core as mx

            self.key = [int(x) for x in np.array(mx.random.key(self.seed))]

    def __len__(self) -> int:
        return len(self.prompts) // self.batch_size

    def _order(self, epoch: int) -> np.ndarray:
        n = len(self.prompts)
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, epoch]).permutation(n)

    def next(self) -> list[Prompt]:
        """The next batch's prompts (this rank's share of it)."""
        if self.index >= len(self):
            self.epoch, self.index = self.epoch + 1, 0
        at = self.index * self.batch_size
        batch = self._order(self.epoch)[at : at + self.batch_size]
        self.index += 1
        rank, size = self.shard
        return [self.prompts[i] for i in batch[rank::size]]

    def one_pass(self, limit: int = 0):
        """Every prompt once, in order, in batches (validation); `limit` > 0 caps the batches.
        A data-parallel rank gets its share of each."""
        n = len(self.prompts)
        rank, size = self.shard
        batches = range(0, n, self.batch_size)
        for k, at in enumerate(batches):
            if limit and k >= limit:
                return
            yield self.prompts[at : at + self.batch_size][rank::size]

    def state(self) -> dict:
        return {
            "epoch": self.epoch,
            "index": self.index,
            "seed": self.seed,
            "batches": len(self),
            "rollout_key": list(self.key),
        }

    def restore(self, state: dict) -> None:
        if state.get("batches") != len(self) or "rollout_key" not in state:
            raise UserError(
                f"the checkpoint's prompt sampler had {state.get('batches')} batches, this run's "
                f"has {len(self)}: resume with the same prompts and batch_size"
            )
        self.epoch, self.index, self.seed = state["epoch"], state["index"], state["seed"]
        self.key = [int(x) for x in state["rollout_key"]]
