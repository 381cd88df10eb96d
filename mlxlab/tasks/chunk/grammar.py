"""The answer's grammar: what a constrained decode of one window may write (Lark, for
`mlxlab.grammar.lark`, llguidance's)."""

from __future__ import annotations

import json

from mlxlab.tasks.chunk.prompt import KEYS

# A label word as the grammar allows it: characters that are not a quote, backslash, control
# character or whitespace (`str.split`'s, which the scorers count words by: `\u1680`, `\u3000`,
# ...), or a JSON escape as json.dumps writes it of a character that is not a control character
# or whitespace: `\"`, `\\`, or `\u` and four lower-case hex digits of a character past
# `\u00a0` (training answers write "\u2014" for a dash). So a label the grammar allows has the
# 2-12 words the scorers count (an escaped `\r` or `\u00a0` would split a word where the grammar
# saw none).
_ESCAPED = (
    r"00(?:a[1-9a-f]|[b-f][0-9a-f])|0[1-9a-f][0-9a-f]{2}"  # \u00a1-\u0fff
    r"|1(?:[0-57-9a-f][0-9a-f]{2}|6(?:[0-79a-f][0-9a-f]|8[1-9a-f]))"  # \u1000-\u1fff but \u1680
    # \u2000-\u2fff but its whitespace (\u2000-\u200a, \u2028, \u2029, \u202f, \u205f)
    r"|2(?:[1-9a-f][0-9a-f]{2}|0(?:0[b-f]|[1346-9a-f][0-9a-f]|2[0-7a-e]|5[0-9a-e]))"
    r"|3(?:0(?:0[1-9a-f]|[1-9a-f][0-9a-f])|[1-9a-f][0-9a-f]{2})|[4-9a-f][0-9a-f]{3}"  # \u3001-
)
_RAW = r'[^"\\\x00-\x20\x7f-\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]'
LABEL_WORD = rf'(?:{_RAW}|\\["\\]|\\u(?:{_ESCAPED})){{1,40}}'


def answer_grammar(uuids: list[str], fixed: list[int] | None = None) -> str:
    """The JSON the instructions ask for, `{"chunks": [{"label": ..., "start_message_uuid": ...,
    "end_message_uuid": ...}, ...]}` in the training answers' layout (prompt.py `answer`), whose
    chunks follow `uuids` in order: the first starts at the first message, each next one at the
    message after the one before it ends; each label is 2-12 words. The answer may close after
    any chunk (a trailing gap, which both scorers repair at a cost, and which `merge_local`
    reads as a topic starting after it), so the model's wish to stop is not turned into one
    more chunk: the model chooses where chunks end and what they are called, nothing else.
    Without messages the only answer is an empty chunk list. With `fixed` (indices into `uuids`
    where chunks start, 0 first, ascending: a topic-shift detector's, shifts.py) the chunks are
    exactly those, to the last message: the model writes only their labels."""
    assert KEYS == ("label", "start_message_uuid", "end_message_uuid"), KEYS

    def lit(text: str) -> str:  # a Lark string literal matching `text`
        return json.dumps(text)

    if not uuids:
        return f"start: {lit(json.dumps({'chunks': []}))}"
    assert len(set(uuids)) == len(uuids), "a conversation's shown uuids are distinct"
    n = len(uuids)
    quoted = [lit(json.dumps(u)) for u in uuids]
    opening, closing = lit('{"chunks": ['), lit("]}")
    label, start, end = (lit(f'{", " if k != "label" else "{"}"{k}": ') for k in KEYS)
    word = LABEL_WORD
    rules = [f"start: {opening} c0 {closing}", f'LABEL: /"{word}( {word}){{1,11}}"/']
    if fixed is not None:
        assert fixed[:1] == [0] and fixed == sorted(set(fixed)) and fixed[-1] < n, fixed
        bounds = [*fixed, n]
        body = f" {lit(', ')} ".join(
            f"{label} LABEL {start} {quoted[a]} {end} {quoted[b - 1]} {lit('}')}"
            for a, b in zip(bounds, bounds[1:], strict=False)
        )
        rules[0] = f"start: {opening} {body} {closing}"
        return "\n".join(rules)
    # c{i}: a chunk that starts at message i; e{i}: its end, at message i or a later one (one
    # rule per message, not per pair, so the grammar grows linearly with the window)
    for i in range(n):
        rules.append(f"c{i}: {label} LABEL {start} {quoted[i]} {end} e{i}")
        ends = [f"{quoted[i]} {lit('}, ')} c{i + 1}", f"e{i + 1}"] if i < n - 1 else []
        ends.append(f"{quoted[i]} {lit('}')}")  # the answer may close here
        rules.append(f"e{i}: " + " | ".join(ends))
    return "\n".join(rules)
