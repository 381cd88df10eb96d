"""Teacher-forced probes: why boundaries fail, read off the model's scores on gold answers
(`eval chunk decisions=true`)."""

from __future__ import annotations

import json

DECISION_CHARS = 4  # a uuid's first characters: enough to tell a window's messages apart


def boundary_places(text: str, chunks: list[dict]) -> list[tuple[int, int, str]]:
    """(first, end, kind) character spans of `text` (`prompt.answer(chunks)`) that place the
    chunks, in order: per chunk the first `DECISION_CHARS` of its start and end uuids ("chunk
    start: the first" / "a later one", "chunk end: another follows" / "the last") and the
    character after its object ("chunks: the list goes on" / "it ends")."""
    out, at, last = [], 0, len(chunks) - 1

    def uuid_at(at: int, value: str, kind: str) -> None:
        out.append((at + 1, at + 1 + min(DECISION_CHARS, len(value) - 2), kind))

    for k, c in enumerate(chunks):
        for key in ("start_message_uuid", "end_message_uuid"):
            value = json.dumps(c[key])
            at = text.index(f'"{key}": {value}', at) + len(f'"{key}": ')
            if key == "start_message_uuid":
                kind = "chunk start: the first" if k == 0 else "chunk start: a later one"
            else:
                kind = "chunk end: the last" if k == last else "chunk end: another follows"
            uuid_at(at, value, kind)
            at += len(value)
        at = text.index("}", at) + 1
        out.append((at, at + 1, "chunks: it ends" if k == last else "chunks: the list goes on"))
    return [(a, b, kind) for a, b, kind in out if b > a]


ALL_RIGHT = "every decision"

GROUPS = ("one chunk", "several chunks")


def _teacher_forced(ex: dict, tokenizer) -> tuple[str, str, list[dict], list[int]]:
    """A chunk-data chat record's (user prompt text, gold answer text, gold chunks, prompt token
    ids as generation starts after them), for the teacher-forced probes."""
    user, text = ex["messages"][0]["content"], ex["messages"][1]["content"]
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": user}], add_generation_prompt=True, return_dict=False
    )
    return user, text, json.loads(text)["chunks"], prompt


def decision_accuracy(model, tokenizer, examples: list[dict]) -> dict[str, dict[str, list[int]]]:
    """Teacher-forced: at each place a gold answer decides where its chunks are
    (`boundary_places`: the first characters of every uuid it writes, the
    character after every list item), whether the model's most likely next token, given the
    prompt and the gold answer before it, is the gold one (the token holding that place's first
    character). `examples` are chat records as the chunk data writes them (<split>.jsonl: one per
    window); the answer is tokenized after the prompt as generation would write it. Returns
    {group: {kind: [right, total]}} for the answers of one chunk and of several (`GROUPS`), with
    `ALL_RIGHT`: the answers whose every such token is right, and "skipped": {"no chunks": [0,
    n]} for n answers with no chunk to place. Free decoding must also get its own earlier
    decisions right; this isolates each one."""
    import mlx.core as mx

    from mlxlab.train.losses import hidden_states, lm_head

    out: dict[str, dict[str, list[int]]] = {g: {} for g in GROUPS}
    skipped = 0
    training = getattr(model, "training", False)
    model.eval()  # no LoRA dropout
    try:
        for ex in examples:
            _, text, chunks, prompt = _teacher_forced(ex, tokenizer)
            if not chunks:
                skipped += 1
                continue
            places = boundary_places(text, chunks)
            enc = tokenizer._tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
            ids, begins = list(enc["input_ids"]), [a for a, _ in enc["offset_mapping"]]
            # the token holding each place's first character: the last one starting at or before
            at = [max(i for i, a in enumerate(begins) if a <= first) for first, _, _ in places]
            h = hidden_states(model, mx.array([prompt + ids]))[0]
            rows = mx.array([len(prompt) + i - 1 for i in at])
            pred = mx.argmax(lm_head(model, h[rows]), axis=-1).tolist()
            group = out[GROUPS[len(chunks) > 1]]
            right = [p == ids[i] for p, i in zip(pred, at, strict=True)]
            for (_, _, kind), ok in zip(places, right, strict=True):
                tally = group.setdefault(kind, [0, 0])
                tally[0] += ok
                tally[1] += 1
            tally = group.setdefault(ALL_RIGHT, [0, 0])
            tally[0] += all(right)
            tally[1] += 1
    finally:
        model.train(training)
    if skipped:
        out["skipped"] = {"no chunks": [0, skipped]}
    return out


def decisions_table(result: dict[str, dict[str, list[int]]]) -> str:
    """`decision_accuracy`'s counts as a markdown table (one row per group and kind)."""
    lines = ["| answers | decision | right | share |", "|---|---|---|---|"]
    for group in (*GROUPS, "skipped"):
        for name, (right, total) in sorted(result.get(group, {}).items()):
            share = f"{right / total:.2f}" if total else "-"
            lines.append(f"| {group} | {name} | {right} / {total} | {share} |")
    return "\n".join(lines)
