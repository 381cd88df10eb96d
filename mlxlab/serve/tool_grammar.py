"""Lark rules for one tool call in a model family's own markup, whose arguments follow the tool's
JSON schema (llguidance dialect; `grammar.embedded_json` embeds a schema where the family writes
plain JSON). Each builder returns rules defining `call`; the text they allow is what mlx-lm's
parser for that family reads back (tests/test_serve_tool_grammar.py parses sampled calls with it).

- `json_tools` (Hermes; Gemma 3 through mlxlab's template, Qwen, ...):
  `<tool_call>{"name": "f", "arguments": {...}}</tool_call>`
- `gemma4`: `<|tool_call>call:f{city:<|"|>Paris<|"|>,days:3}<tool_call|>` (bare keys, strings
  between `<|"|>` delimiters, other values as JSON)
- `minicpm5`: `<function name="f"><param name="city">Paris</param></function>`
"""

from __future__ import annotations

import json
import re

from mlxlab import grammar as G

MAX_UNROLLED_ITEMS = 16


class Rules:
    """Numbered helper rules and the `call` rule."""

    def __init__(self):
        self.lines: list[str] = []

    def add(self, body: str) -> str:
        name = f"r{len(self.lines)}"
        self.lines.append(f"{name}: {body}")
        return name


def _fields(schema: dict) -> tuple[list[tuple[str, dict]], list[tuple[str, dict]]]:
    """(required, optional) properties in declared order."""
    props = schema.get("properties") or {}
    required = [k for k in props if k in set(schema.get("required") or [])]
    return [(k, props[k]) for k in required], [(k, props[k]) for k in props if k not in required]


def _sequence(rules: Rules, required: list[str], optional: list[str], sep: str = '","') -> str:
    """Required items in order, then each optional one optional (in order), `sep` between."""
    join = f" {sep} " if sep else " "
    if required:
        return join.join(required) + "".join(f" ({sep} {o})?" for o in optional)
    if not optional:
        return ""
    # Nothing required: any number of the optional items (a key may repeat; the last one wins).
    one = rules.add(" | ".join(optional))
    return f"({one} ({sep} {one})*)?"


def _repeat(rules: Rules, item: str, lo: int, hi: int | None, sep: str = '","') -> str:
    """`lo`..`hi` items separated by `sep` (unrolled up to MAX_UNROLLED_ITEMS)."""
    lo = max(lo, 0)
    if hi is not None and hi <= MAX_UNROLLED_ITEMS:
        tail = ""
        for _ in range(max(hi - max(lo, 1), 0)):
            tail = f"({sep} {item} {tail})?"
        if lo == 0:
            return f"({item} {tail})?" if hi else ""
        return f" {sep} ".join([item] * lo) + f" {tail}"
    head = f" {sep} ".join([item] * max(lo, 1))
    body = f"{head} ({sep} {item})*"
    return body if lo else f"({body})?"


def _text(schema: dict) -> str:
    """A string value with no '<' (the delimiters and markup of these families start with it)."""
    lo, hi = int(schema.get("minLength", 0)), schema.get("maxLength")
    if hi is not None:
        return f"/[^<]{{{lo},{int(hi)}}}/"
    return f"/[^<]{{{lo},}}/" if lo else "/[^<]*/"


def _string_choice(values: list) -> str | None:
    return (
        " | ".join(json.dumps(v) for v in values)
        if values and all(isinstance(v, str) for v in values)
        else None
    )


# --- Gemma 4 ---------------------------------------------------------------------------------


def _gemma4_value(rules: Rules, schema: dict, q: str) -> str:
    if not isinstance(schema, dict):
        return G.embedded_json({})
    if "const" in schema and isinstance(schema["const"], str):
        return rules.add(f"{q} {json.dumps(schema['const'])} {q}")
    if "enum" in schema:
        choice = _string_choice(schema["enum"])
        return rules.add(f"{q} ({choice}) {q}") if choice else rules.add(G.embedded_json(schema))
    kind = schema.get("type")
    if kind == "string" and "pattern" not in schema and "format" not in schema:
        return rules.add(f"{q} {_text(schema)} {q}")
    if kind == "object" and schema.get("properties"):
        return _gemma4_object(rules, schema, q)
    if (
        kind == "array"
        and isinstance(schema.get("items"), dict)
        and int(schema.get("minItems", 0)) <= MAX_UNROLLED_ITEMS
    ):
        item = _gemma4_value(rules, schema["items"], q)
        inner = _repeat(rules, item, int(schema.get("minItems", 0)), schema.get("maxItems"))
        return rules.add(f'"[" {inner} "]"')
    # numbers, booleans, null, patterned strings, unions: as JSON, which the parser reads as is
    return rules.add(G.embedded_json(schema))


def _gemma4_object(rules: Rules, schema: dict, q: str) -> str:
    def item(key: str, sub: dict) -> str:
        bare = re.fullmatch(r"\w+", key)  # the parser quotes bare \w+ keys; others stay JSON
        return rules.add(
            f"{json.dumps(key + ':' if bare else json.dumps(key) + ':')} {_gemma4_value(rules, sub, q)}"
        )

    required, optional = _fields(schema)
    seq = _sequence(rules, [item(k, s) for k, s in required], [item(k, s) for k, s in optional])
    return rules.add(f'"{{" {seq} "}}"')


def gemma4_call(rules: Rules, syntax, specs: list[tuple[str, dict]], tokenizer) -> None:
    q = G.literal('<|"|>', tokenizer)
    alts = []
    for name, params in specs:
        args = (
            _gemma4_object(rules, params, q) if params.get("properties") else rules.add('"{" "}"')
        )
        alts.append(rules.add(f"{json.dumps('call:' + name)} {args}"))
    start, end = G.literal(syntax.start, tokenizer), G.literal(syntax.end, tokenizer)
    rules.lines.append(f"call: {start} ({' | '.join(alts)}) {end}")


# --- MiniCPM ---------------------------------------------------------------------------------


def _minicpm_value(rules: Rules, schema: dict) -> str:
    if isinstance(schema, dict) and "enum" in schema and _string_choice(schema["enum"]):
        return rules.add(_string_choice(schema["enum"]))
    if isinstance(schema, dict) and schema.get("type") == "string" and "pattern" not in schema:
        return rules.add(_text(schema))
    return rules.add(G.embedded_json(schema if isinstance(schema, dict) else {}))


def minicpm5_call(rules: Rules, syntax, specs: list[tuple[str, dict]], tokenizer) -> None:
    def param(key: str, sub: dict) -> str:
        return rules.add(
            f'{json.dumps(f"<param name={json.dumps(key)}>")} {_minicpm_value(rules, sub)} "</param>"'
        )

    alts = []
    for name, params in specs:
        required, optional = _fields(params)
        seq = _sequence(
            rules, [param(k, s) for k, s in required], [param(k, s) for k, s in optional], sep=""
        )
        alts.append(rules.add(f"{json.dumps(json.dumps(name) + '>')} {seq}"))
    start, end = G.literal(syntax.start, tokenizer), G.literal(syntax.end, tokenizer)
    rules.lines.append(f"call: {start} ({' | '.join(alts)}) {end}")


# --- Hermes JSON ----------------------------------------------------------------------------


def json_tools_call(rules: Rules, syntax, specs: list[tuple[str, dict]], tokenizer) -> None:
    bodies = [
        {
            "type": "object",
            "properties": {"name": {"const": n}, "arguments": p},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for n, p in specs
    ]
    body = rules.add(G.embedded_json(bodies[0] if len(bodies) == 1 else {"anyOf": bodies}))
    start, end = G.literal(syntax.start, tokenizer), G.literal(syntax.end, tokenizer)
    rules.lines.append(f'call: {start} "\\n"? {body} "\\n"? {end}')


BUILDERS = {"json_tools": json_tools_call, "gemma4": gemma4_call, "minicpm5": minicpm5_call}
