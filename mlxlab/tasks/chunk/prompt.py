"""The chunk task's prompt and answer, and the conversations it reads.

A conversation (a case) is what an exported chat looks like: `{id, name, uuid?, messages:
[{uuid, sender, text}], chunks?}` (gold chunks: `{start_message_uuid, end_message_uuid,
label}`, covering the messages in order). The prompt is one user message, as the predecessor's
chunk task: the instructions, then `Conversation: <title> (uuid: <conversation uuid>)`, a blank
line, and each message as `[sender] (uuid: U)\\n<text>\\n`, joined with `\\n---\\n`; messages
with empty text are not shown (and are not anchors). The answer is JSON: `{"chunks": [{"label",
"start_message_uuid", "end_message_uuid"}, ...]}`, the label first (`KEYS`).
"""

from __future__ import annotations

import json
from pathlib import Path

from mlxlab.errors import UserError

INSTRUCTIONS = (
    "Split the conversation below into contiguous chunks, one per topic, covering every message "
    "in order. For each chunk give a short, specific label (2-12 words) that says what it is "
    "about, then the uuids of its first and last message. "
    'Answer with JSON only: {"chunks":[{"label":"...","start_message_uuid":"...",'
    '"end_message_uuid":"..."}]}'
)

# The answer's keys in the order the model writes them: the label first, so the topic is named
# before the model picks the message where it ends (JSON readers, and both scorers, ignore order).
KEYS = ("label", "start_message_uuid", "end_message_uuid")

TRUNCATED = "\n[...]"


def message_block(m: dict) -> str:
    return f"[{m['sender']}] (uuid: {m['uuid']})\n{m['text']}\n"


def shown(messages: list[dict]) -> list[dict]:
    """The messages a prompt shows (and the only valid anchors): those with non-empty text."""
    return [m for m in messages if isinstance(m.get("text"), str) and m["text"].strip()]


def conversation_uuid(case: dict):
    """The uuid the prompt gives the whole conversation (its `uuid`, else its `id`)."""
    return case.get("uuid") or case.get("id")


def header(case: dict) -> str:
    return f"Conversation: {case.get('name') or ''} (uuid: {conversation_uuid(case)})"


def prompt(case: dict, messages: list[dict] | None = None) -> str:
    """The user message for `case` (or for one window of its messages)."""
    msgs = shown(case["messages"] if messages is None else messages)
    return f"{INSTRUCTIONS}\n\n{header(case)}\n\n" + "\n---\n".join(message_block(m) for m in msgs)


def is_user(m: dict) -> bool:
    """Whether a message is the user's: any sender but the assistant (exports call the user
    `user` or `human`). A topic starts at a user message (windows.merge_local)."""
    return m.get("sender") != "assistant"


def answer(chunks: list[dict]) -> str:
    """The answer's JSON text, keys in `KEYS` order (what training teaches the model to write)."""
    return json.dumps({"chunks": [{k: c[k] for k in KEYS} for c in chunks]})


def read_cases(path) -> list[dict]:
    """Cases from a JSON file `[{id, name, messages: [{uuid, sender, text}], chunks?}]` (or a
    dataset directory's test.cases.json), checked with `file: case N: what` errors."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read {path}: {e}") from None
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: not JSON ({e.msg} at line {e.lineno})") from None
    if isinstance(data, dict) and isinstance(data.get("cases"), list):
        data = data["cases"]
    if not isinstance(data, list) or not data:
        raise UserError(f"{path}: expected a non-empty JSON list of cases")
    for i, case in enumerate(data):
        where = f"{path}: case {i}"
        if not isinstance(case, dict):
            raise UserError(f"{where}: not an object")
        if "messages" not in case and isinstance(case.get("chat_messages"), list):
            case["messages"] = case["chat_messages"]  # a claude.ai export's conversation
        msgs = case.get("messages")
        if not isinstance(msgs, list):
            raise UserError(f"{where}: no messages list")
        for j, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("uuid"), str) or not m["uuid"]:
                raise UserError(f"{where}: message {j} has no uuid string")
            if not isinstance(m.get("sender", ""), str) or not isinstance(m.get("text", ""), str):
                raise UserError(f"{where}: message {j}: sender and text must be strings")
            m.setdefault("sender", "user")
            m.setdefault("text", "")
        if not shown(msgs):
            raise UserError(f"{where}: no message has text")
        uuids = [m["uuid"] for m in shown(msgs)]
        if len(set(uuids)) != len(uuids):
            raise UserError(f"{where}: duplicate message uuids")
        case.setdefault("id", case.get("uuid") or str(i))
        gold = case.get("chunks")
        if gold is not None:
            ok = isinstance(gold, list) and all(
                isinstance(c, dict)
                and c.get("start_message_uuid") in uuids
                and c.get("end_message_uuid") in uuids
                and isinstance(c.get("label"), str)
                for c in gold
            )
            if not ok:
                raise UserError(
                    f"{where}: gold chunks must be objects with start_message_uuid and "
                    "end_message_uuid (uuids of its shown messages) and a label string"
                )
    return data
