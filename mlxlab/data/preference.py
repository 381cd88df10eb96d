"""Preference data: pairs of a prompt with a chosen and a rejected response (DPO, ORPO).

One JSON object per line, in the shapes TRL and mlx-lm-lora use:

    {"prompt": "...", "chosen": "...", "rejected": "..."}                   strings
    {"messages": [...], "chosen": "..." | [...], "rejected": "..." | [...]}  a chat prompt
    {"prompt": [...], "chosen": [...], "rejected": [...]}                  conversational
    {"chosen": [...], "rejected": [...]}                                   implicit prompt

A response is a string (one assistant message) or a list of messages (assistant, tool, ...). In
the implicit shape both lists are whole conversations and the prompt is the messages they share
from the start. Each side is tokenized with the model's chat template as one conversation; the
prompt's tokens (the template up to the generation prompt) get no loss, and the two sides of a
pair are scored on their response tokens only. Errors name `file:line`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mlxlab.data.datasets import Example, checked_lines
from mlxlab.errors import UserError


@dataclass
class PairExample:
    chosen: Example
    rejected: Example


def _messages(value, what: str) -> list[dict] | str:
    """A list of messages, or why not."""
    if not isinstance(value, list) or not value:
        return f"'{what}' must be a string or a non-empty list of messages"
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            return f"{what}[{i}] must be an object with a 'role'"
        if m.get("content") is None and not m.get("tool_calls"):
            return f"{what}[{i}] has no 'content'"
        if m.get("content") is not None and not isinstance(m["content"], (str, list)):
            return f"{what}[{i}]: 'content' must be a string or a list of parts"
    return value


def split_record(record) -> tuple[list[dict], list[dict], list[dict]] | str:
    """(prompt messages, chosen messages, rejected messages) of one record, or why it is bad."""
    if not isinstance(record, dict):
        return "expected a JSON object"
    if "chosen" not in record or "rejected" not in record:
        return "expected 'chosen' and 'rejected' (and 'prompt' or 'messages')"
    sides = []
    for key in ("chosen", "rejected"):
        value = record[key]
        if isinstance(value, str):
            sides.append([{"role": "assistant", "content": value}])
            continue
        msgs = _messages(value, key)
        if isinstance(msgs, str):
            return msgs
        sides.append(msgs)
    prompt = record.get("messages", record.get("prompt"))
    if prompt is None:
        if not all(isinstance(record[k], list) for k in ("chosen", "rejected")):
            return "no 'prompt' or 'messages', and 'chosen'/'rejected' are not conversations"
        n = 0
        while n < min(map(len, sides)) - 1 and sides[0][n] == sides[1][n]:
            n += 1
        if n == 0:
            return "no 'prompt': 'chosen' and 'rejected' must share their first messages"
        return sides[0][:n], sides[0][n:], sides[1][n:]
    if isinstance(prompt, str):
        if not prompt:
            return "'prompt' is empty"
        prompt = [{"role": "user", "content": prompt}]
    else:
        prompt = _messages(prompt, "messages" if "messages" in record else "prompt")
        if isinstance(prompt, str):
            return prompt
    return prompt, sides[0], sides[1]


def read_pairs(path: str | Path) -> list[tuple[int, list[dict], list[dict], list[dict]]]:
    """Every record of a preference JSONL file as (line, prompt, chosen, rejected); the first
    ten problems as one error, each `file:line: what`."""
    lines = checked_lines(path, split_record, "preference", "examples")
    return [(lineno, *parts) for lineno, _, parts in lines]


def tokenize_pair(prompt: list[dict], chosen: list[dict], rejected: list[dict], tokenizer):
    """The two sides as Examples whose offset is the first response token: the prompt's tokens
    through the template's generation prompt (the longest prefix both sides share with it, where
    a template renders the prompt differently once a response follows)."""
    if not getattr(tokenizer, "chat_template", None):
        raise UserError("preference data needs a tokenizer with a chat template")
    head = list(
        tokenizer.apply_chat_template(prompt, add_generation_prompt=True, return_dict=False)
    )
    sides = []
    for response in (chosen, rejected):
        ids = list(tokenizer.apply_chat_template(prompt + response, return_dict=False))
        offset = 0
        while offset < min(len(head), len(ids)) and head[offset] == ids[offset]:
            offset += 1
        sides.append(Example(ids, offset))
    return PairExample(*sides)


def load_pair_split(path, tokenizer, cfg):
    """A preference file as a TokenizedSet whose examples are the pairs' sides in order (2k:
    chosen, 2k+1: rejected), each within cfg.max_seq_length: a longer side is cut there
    (data.on_too_long=truncate, counted and logged) or the file refused (error); a pair with a
    side that keeps no response token is skipped."""
    import logging

    from mlxlab.data.datasets import TokenizedSet

    log = logging.getLogger(__name__)
    examples, truncated, dropped, too_long = [], 0, 0, []
    for lineno, prompt, chosen, rejected in read_pairs(path):
        try:
            pair = tokenize_pair(prompt, chosen, rejected, tokenizer)
        except UserError:
            raise
        except Exception as e:  # noqa: BLE001 - the template's own complaint, e.g. role order
            raise UserError(f"{path}:{lineno}: the chat template refused it: {e}") from None
        sides = [pair.chosen, pair.rejected]
        if any(len(s.ids) > cfg.max_seq_length for s in sides):
            if cfg.on_too_long == "error":
                too_long.append(
                    f"{path}:{lineno} has {max(len(s.ids) for s in sides)} tokens on a side"
                )
                continue
            for s in sides:
                s.ids = s.ids[: cfg.max_seq_length]
            truncated += 1
        if any(s.offset >= len(s.ids) for s in sides):
            dropped += 1
            continue
        examples += sides
    if too_long:
        raise UserError(
            f"{path}: {len(too_long)} pairs exceed max_seq_length={cfg.max_seq_length} "
            "(data.on_too_long=error): " + "; ".join(too_long[:5])
        )
    if truncated:
        log.warning(
            f"warning: {truncated} pairs in {path} had a side truncated to "
            f"max_seq_length={cfg.max_seq_length}"
        )
    if dropped:
        log.warning(
            f"warning: {dropped} pairs in {path} have a side with no response token within "
            f"max_seq_length={cfg.max_seq_length} and were skipped"
        )
    if not examples:
        raise UserError(f"{path}: no pair has response tokens left on both sides")
    return TokenizedSet(examples, str(path), truncated)
