"""The chunk task's GRPO reward, and the prompt records it reads (`train +exp=chunk_grpo`).

A prompt record is one training window as the SFT data renders it, with the gold beside:

    {"messages": [{"role": "user", "content": <prompt.py `prompt` of the window>}],
     "uuids": [the window's shown message uuids, in order],
     "conversation_uuid": <the uuid the prompt gives the conversation>,
     "chunks": [the window's gold chunks], "case": <the case id>}

`messages` is the SFT example's user message, so mlxlab/data/prompts.py renders it with the
chat template and its generation prompt into exactly the prompt part the SFT adapter trained on.

The reward of one completion (scoring.py `score_case`, whose `ref` is ref.py's score):

    reward = ref / 100 * (FLOOR + (1 - FLOOR) * f1)   for a non-empty answer whose anchors all
                                                       resolve (`CaseScore.ref_resolved`)
    reward = 0                                         otherwise

- ref / 100 (0..1): the answer's validity by the reference scorer: JSON with a `chunks` array,
  chunks of string start, end and label, anchors that resolve to the window's messages, specific
  labels; an unparsable answer scores 0, so its reward is 0;
- the gate: the reference validator must resolve every anchor to one of the window's messages,
  and the answer must have a chunk. An empty `{"chunks": []}` or an answer with made-up uuids
  earns nothing (not even FLOOR), so it never ties with a valid answer;
- f1: the boundary F1 against the gold (as evaluation scores a window), from the strict
  validator's spans (scoring.py `validate`, which snaps an unknown uuid to a neighbour; the
  reference validator is only the gate);
- FLOOR (0.1): a valid answer with the wrong boundaries still earns a little more than a broken
  one, so a group that finds no boundary right still learns the answer's form.

The gold answer (specific labels) scores 1.0; one boundary of two moved, 0.1.
"""

from __future__ import annotations

from mlxlab.tasks.chunk.prompt import conversation_uuid, prompt, shown
from mlxlab.tasks.chunk.scoring import score_case

FLOOR = 0.1
"""The share of the reward a valid answer earns with every boundary wrong."""


def prompt_record(case: dict, messages: list[dict], gold: list[dict]) -> dict:
    """The prompt record of one training window (`messages`, `gold`: windows.py
    `training_windows`) of `case`."""
    return {
        "messages": [{"role": "user", "content": prompt(case, messages)}],
        "uuids": [m["uuid"] for m in shown(messages)],
        "conversation_uuid": conversation_uuid(case),
        "chunks": gold,
        "case": case.get("id"),
    }


def reward_parts(text: str, record: dict) -> tuple[float, float, bool]:
    """(ref / 100, boundary F1, whether it earns a reward: a non-empty answer whose anchors the
    reference validator all resolves) of one completion."""
    s = score_case(text, record["uuids"], record["chunks"], record["conversation_uuid"])
    return s.ref / 100, s.boundary_f1 or 0.0, bool(s.ref_resolved and s.nonempty)


def chunk_reward(completions: list[str], records: list[dict]) -> list[float]:
    """Per completion: ref / 100 * (FLOOR + (1 - FLOOR) * boundary F1) when it passes the gate,
    else 0 (the module's doc)."""
    out = []
    for text, record in zip(completions, records, strict=True):
        ref, f1, gated = reward_parts(text, record)
        out.append(ref * (FLOOR + (1 - FLOOR) * f1) if gated else 0.0)
    return out


def check_records(records: list[dict]) -> str | None:
    """Why a record cannot be scored (the first such), or None: it needs `uuids` (distinct
    strings), `conversation_uuid` (a string) and gold `chunks` anchored on those uuids."""
    for i, r in enumerate(records):
        where = f"record {i + 1}"
        uuids = r.get("uuids")
        if not (
            isinstance(uuids, list)
            and uuids
            and all(isinstance(u, str) for u in uuids)
            and len(set(uuids)) == len(uuids)
        ):
            return f"{where} has no 'uuids' (the window's message uuids, distinct strings)"
        if not isinstance(r.get("conversation_uuid"), str):
            return f"{where} has no 'conversation_uuid' string"
        gold = r.get("chunks")
        if not (
            isinstance(gold, list)
            and gold
            and all(
                isinstance(c, dict)
                and c.get("start_message_uuid") in uuids
                and c.get("end_message_uuid") in uuids
                and isinstance(c.get("label"), str)
                for c in gold
            )
        ):
            return (
                f"{where} has no gold 'chunks' (objects with a label and start/end message "
                "uuids among its 'uuids')"
            )
    return None


chunk_reward.check = check_records
