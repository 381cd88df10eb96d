"""Training data: local JSONL (or a saved `datasets` directory) in mlx-lm's three formats.

    {"messages": [{"role": ..., "content": ...}, ...], "tools": [...]}   chat
    {"prompt": "...", "completion": "..."}                                completions
    {"text": "..."}                                                       text

Each example becomes token ids and an `offset`: tokens before it are prompt and get no loss
when `mask_prompt` is on. Templates are applied exactly as mlx-lm's ChatDataset and
CompletionsDataset do, so the two train on the same tokens.

A chat or completions record may also carry `"loss_weights": [[start, end, weight], ...]`:
character spans of the response (the last message's content, or the completion) whose tokens
weigh `weight` in the loss instead of 1 (the loss is the weighted mean over response tokens; a
token overlapping several spans takes the last one's weight). mlx-lm ignores the key, so such a
file trains there unweighted. Used by the chunk task for the tokens that place a boundary.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from mlxlab.config import MAX_LOSS_WEIGHT, DataConfig
from mlxlab.errors import UserError

log = logging.getLogger(__name__)

FORMATS = ("chat", "completions", "text")


@dataclass
class Example:
    ids: list[int]
    offset: int  # first token that is trained on (0: all but the first)
    weights: list[float] | None = None  # per token of `ids`: its loss weight (None: all 1)


@dataclass
class TokenizedSet:
    examples: list[Example]
    source: str
    num_truncated: int = 0


def _format_of(record) -> str | None:
    if not isinstance(record, dict):
        return None
    if "messages" in record:
        return "chat"
    if "prompt" in record and "completion" in record:
        return "completions"
    if "text" in record:
        return "text"
    return None


def _check_record(record, fmt: str) -> str | None:
    """Why `record` is malformed for `fmt`, or None."""
    if fmt == "chat":
        msgs = record["messages"]
        if not isinstance(msgs, list) or not msgs:
            return "'messages' must be a non-empty list"
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or "role" not in m:
                return f"messages[{i}] must be an object with a 'role'"
            content = m.get("content")
            if content is None and not m.get("tool_calls"):
                return f"messages[{i}] has no 'content'"
            if content is not None and not (
                isinstance(content, str)
                or (isinstance(content, list) and all(isinstance(p, dict) for p in content))
            ):
                return f"messages[{i}].content must be a string or a list of content parts"
        if (
            "tools" in record
            and record["tools"] is not None
            and not isinstance(record["tools"], list)
        ):
            return "'tools' must be a list"
    elif fmt == "completions":
        if not isinstance(record["prompt"], str) or not isinstance(record["completion"], str):
            return "'prompt' and 'completion' must be strings"
    elif not isinstance(record["text"], str) or not record["text"]:
        return "'text' must be a non-empty string"
    if record.get("loss_weights") is None:
        return None
    if fmt == "text":
        return "'loss_weights' needs a response: use chat or completions records"
    return _check_loss_weights(record, fmt)


def _response(record: dict, fmt: str) -> str:
    """The trained response's text: the completion, or the last message's content."""
    if fmt == "completions":
        return record["completion"]
    content = record["messages"][-1].get("content")
    return content if isinstance(content, str) else ""


def _check_loss_weights(record: dict, fmt: str) -> str | None:
    spans = record["loss_weights"]
    if fmt == "chat" and record["messages"][-1].get("role") != "assistant":
        return "'loss_weights' needs the last message to be the assistant's response"
    if not isinstance(spans, list):
        return "'loss_weights' must be a list of [start, end, weight]"
    if fmt == "chat" and not isinstance(record["messages"][-1].get("content"), str):
        return "'loss_weights' needs the response's content to be a string"
    n = len(_response(record, fmt))

    def number(x) -> bool:
        return isinstance(x, int | float) and not isinstance(x, bool)

    for i, span in enumerate(spans):
        ok = (
            isinstance(span, list | tuple)
            and len(span) == 3
            and all(number(x) and float(x).is_integer() for x in span[:2])
            and number(span[2])
        )
        if not ok:
            return f"loss_weights[{i}] must be [start, end, weight] (two integers, a number)"
        start, end, weight = span
        if not 0 <= start < end <= n:
            return f"loss_weights[{i}]: [{start}, {end}) is not within the {n}-char response"
        if not 0 <= weight <= MAX_LOSS_WEIGHT:
            return f"loss_weights[{i}]: weight {weight} must be in [0, {MAX_LOSS_WEIGHT:g}]"
    return None


def token_weights(tokenizer, ids: list[int], response: int, text: str, spans) -> list[float]:
    """Per token of `ids`: the weight of the last span in `spans` ([start, end, weight] over the
    response `text`) that the token's characters overlap, else 1. The response tokens
    (ids[response:]) must decode to `text` first (then the template's end-of-turn tokens), or to
    it without its leading and trailing whitespace (templates that trim the content; the spans
    then shift with it). Each token's characters come from decoding the prefix up to it, so a
    character a byte-fallback tokenizer splits over tokens counts from its last one."""
    resp = ids[response:]
    decoded = tokenizer.decode(resp)
    shift = 0
    if not decoded.startswith(text):
        if not (text.strip() and decoded.startswith(text.strip())):
            raise UserError("loss_weights: the response's tokens do not decode to its text")
        shift = len(text) - len(text.lstrip())
    weights = [1.0] * len(ids)
    until = max(int(end) for _, end, _ in spans) - shift
    before = 0  # characters decoded before token k
    for k in range(len(resp)):
        if before >= until:
            break
        after = len(tokenizer.decode(resp[: k + 1]))
        for start, end, weight in spans:
            if start - shift < after and before < end - shift:
                weights[response + k] = float(weight)
        before = after
    return weights


def raise_errors(errors: list[str], what: str) -> None:
    """One UserError, `bad <what> data`, with the first ten of `errors` (`file:line: problem`),
    if there are any."""
    if errors:
        more = f"\n  ... and {len(errors) - 10} more" if len(errors) > 10 else ""
        raise UserError(f"bad {what} data:\n  " + "\n  ".join(errors[:10]) + more)


def text_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of every line of the UTF-8 file `path` (a BOM is dropped); a file
    that cannot be read, or a line that is not UTF-8, is a UserError naming it."""
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror or e}") from e
    out = []
    for lineno, line in enumerate(raw.splitlines(), 1):
        try:
            out.append((lineno, line.decode("utf-8-sig" if lineno == 1 else "utf-8")))
        except UnicodeDecodeError as e:
            raise UserError(f"{path}:{lineno}: not UTF-8 text ({e.reason})") from None
    return out


def checked_lines(path: str | Path, check, what: str, empty: str) -> list[tuple[int, dict, object]]:
    """(line, record, check(record)) of every non-blank line of the JSONL file `path`; `check`
    gives a record's parsed form, or a string that says why the record is bad. Lines that are no
    JSON and bad records are raised together (`raise_errors`, `what`), as is a file without one
    record (`<path>: no <empty>`)."""
    path = Path(path)
    out, errors = [], []
    for lineno, line in text_lines(path):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            errors.append(f"{path}:{lineno}: invalid JSON ({e.msg} at column {e.colno})")
            continue
        parsed = check(record)
        if isinstance(parsed, str):
            errors.append(f"{path}:{lineno}: {parsed}")
        else:
            out.append((lineno, record, parsed))
    if not out and not errors:
        errors.append(f"{path}: no {empty}")
    raise_errors(errors, what)
    return out


def validate_jsonl(path: Path) -> str:
    """Check every line; return the file's format. Errors name `file:line` (up to 10 of them)."""
    errors: list[str] = []
    formats: set[str] = set()
    count = 0
    for lineno, line in text_lines(path):
        if not line.strip():
            continue
        count += 1
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            errors.append(f"{path}:{lineno}: invalid JSON ({e.msg} at column {e.colno})")
            continue
        if isinstance(record, dict) and "chosen" in record and "rejected" in record:
            errors.append(
                f"{path}:{lineno}: a preference pair ('chosen'/'rejected'): train it with "
                "objective=dpo or objective=orpo"
            )
            continue
        fmt = _format_of(record)
        if fmt is None:
            errors.append(
                f"{path}:{lineno}: expected an object with 'messages', "
                "'prompt'+'completion', or 'text'"
            )
            continue
        formats.add(fmt)
        problem = _check_record(record, fmt)
        if problem:
            errors.append(f"{path}:{lineno}: {problem}")
    if len(formats) > 1:
        errors.append(f"{path}: mixes formats {sorted(formats)}; use one per file")
    if not count and not errors:
        errors.append(f"{path}: no examples")
    raise_errors(errors, "training")
    return formats.pop()


def read_records(path: str | Path) -> list[dict]:
    """Records of a .jsonl file (validated line by line) or a `datasets.save_to_disk` dir."""
    import datasets

    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local files only, never the hub
    datasets.disable_progress_bars()
    path = Path(path)
    if path.is_dir():
        try:
            ds = datasets.load_from_disk(str(path))
        except (FileNotFoundError, ValueError) as e:
            raise UserError(f"{path} is not a saved datasets directory ({e})") from e
        if isinstance(ds, datasets.DatasetDict):
            raise UserError(f"{path} holds splits {list(ds)}; point at one split's directory")
        records = [{k: v for k, v in r.items() if v is not None} for r in ds]
        for i, r in enumerate(records):
            fmt = _format_of(r)
            if fmt is None:
                raise UserError(
                    f"{path}: row {i} has none of 'messages', 'prompt'+'completion', 'text'"
                )
            if r.get("loss_weights") is not None and (problem := _check_record(r, fmt)):
                raise UserError(f"{path}: row {i}: {problem}")
        return records
    if not path.is_file():
        raise UserError(f"no such data file: {path}")
    validate_jsonl(path)
    try:
        ds = datasets.load_dataset("json", data_files=str(path), split="train")
    except Exception as e:  # arrow schema conflicts across lines, etc.
        raise UserError(f"{path}: datasets could not load it ({type(e).__name__}: {e})") from e
    # Arrow fills keys missing from some rows with None; drop those again.
    return [{k: v for k, v in r.items() if v is not None} for r in ds]


def tokenize(record: dict, tokenizer, mask_prompt: bool) -> Example:
    """Token ids and loss offset, as mlx-lm's dataset classes compute them."""
    fmt = _format_of(record)
    if fmt == "text":
        ids = list(tokenizer.encode(record["text"]))
        if ids[-1] != tokenizer.eos_token_id:
            ids.append(tokenizer.eos_token_id)
        return Example(ids, 0)
    if not getattr(tokenizer, "chat_template", None):
        raise UserError(f"{fmt} data needs a tokenizer with a chat template")
    if fmt == "chat":
        messages = record["messages"]
    else:
        messages = [
            {"role": "user", "content": record["prompt"]},
            {"role": "assistant", "content": record["completion"]},
        ]
    tools = record.get("tools")
    ids = list(tokenizer.apply_chat_template(messages, tools=tools, return_dict=False))
    spans = record.get("loss_weights")
    if not (mask_prompt or spans):
        return Example(ids, 0)
    add_gen = messages[-1].get("role") == "assistant"
    response = (  # a one-message chat has no prompt to mask (the template refuses an empty one)
        len(
            tokenizer.apply_chat_template(
                messages[:-1], tools=tools, add_generation_prompt=add_gen, return_dict=False
            )
        )
        if len(messages) > 1
        else 0
    )
    offset = response if mask_prompt else 0
    if not spans:
        return Example(ids, offset)
    text = _response(record, fmt)
    return Example(ids, offset, token_weights(tokenizer, ids, response, text, spans))


def load_split(path: str | Path, tokenizer, cfg: DataConfig) -> TokenizedSet:
    """Read, tokenize and length-check one split."""
    examples, truncated, dropped, too_long = [], 0, 0, []
    for i, record in enumerate(read_records(path)):
        try:
            ex = tokenize(record, tokenizer, cfg.mask_prompt)
        except UserError as e:
            raise UserError(f"{path}: example {i + 1}: {e}") from e
        if len(ex.ids) > cfg.max_seq_length:
            if cfg.on_too_long == "error":
                too_long.append(f"example {i + 1} has {len(ex.ids)} tokens")
                continue
            ex.ids = ex.ids[: cfg.max_seq_length]
            if ex.weights is not None:
                ex.weights = ex.weights[: cfg.max_seq_length]
            truncated += 1
        if ex.offset >= len(ex.ids) or (
            ex.weights is not None and not any(ex.weights[max(ex.offset, 1) :])
        ):
            dropped += 1  # all prompt (or the response was cut away, or weighs 0): nothing to learn
            continue
        examples.append(ex)
    if too_long:
        raise UserError(
            f"{path}: {len(too_long)} examples exceed max_seq_length="
            f"{cfg.max_seq_length} (data.on_too_long=error): " + "; ".join(too_long[:5])
        )
    if truncated:
        log.warning(
            f"warning: {truncated} of {i + 1} examples in {path} were truncated to "
            f"max_seq_length={cfg.max_seq_length}"
        )
    if dropped:
        log.warning(
            f"warning: {dropped} examples in {path} have no response tokens (or only ones "
            f"of loss weight 0) within max_seq_length={cfg.max_seq_length} and were skipped"
        )
    if not examples:
        raise UserError(f"{path}: no example has a response token left to train on")
    return TokenizedSet(examples, str(path), truncated)


def resolve_paths(cfg: DataConfig) -> tuple[Path, Path | None]:
    """(train, valid) from `data.train` (a file, or a directory with train.jsonl/valid.jsonl)."""
    if not cfg.train:
        raise UserError("data.train is not set (a .jsonl file or a directory with train.jsonl)")
    train = Path(cfg.train).expanduser()
    valid = Path(cfg.valid).expanduser() if cfg.valid else None
    if train.is_dir() and (train / "train.jsonl").is_file():
        valid = valid or (train / "valid.jsonl" if (train / "valid.jsonl").is_file() else None)
        train = train / "train.jsonl"
    elif train.is_dir() and (train / "train.jsonl").exists():
        raise UserError(f"data.train={cfg.train}: {train / 'train.jsonl'} is not a file")
    elif train.is_dir() and any(train.glob("*.jsonl")):  # not a datasets directory either
        found = ", ".join(sorted(p.name for p in train.glob("*.jsonl"))[:4])
        raise UserError(
            f"data.train={cfg.train}: no train.jsonl in that directory (it has {found})"
        )
    elif valid is None and train.suffix == ".jsonl" and (train.parent / "valid.jsonl").is_file():
        valid = train.parent / "valid.jsonl"
    return train, valid
