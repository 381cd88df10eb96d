"""Forced tool calls in each family's markup: calls sampled at random from the grammar parse with
mlx-lm's own parser for that family and their arguments validate against the tool's schema."""

from __future__ import annotations

import importlib
import json

import jsonschema
import numpy as np
import pytest

from mlxlab import grammar as G
from mlxlab.serve import structured, tool_grammar
from mlxlab.serve.engine.output import ToolSyntax, _as_parsed
from mlxlab.serve.http import APIError

TOOLS = [
    (
        "get_weather",
        {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "days": {"type": "integer", "minimum": 1, "maximum": 5},
                "units": {"enum": ["metric", "imperial"]},
                "hours": {
                    "type": "array",
                    "items": {"type": "integer", "minimum": 0, "maximum": 23},
                    "maxItems": 3,
                },
                "detail": {"type": "boolean"},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    ),
    (
        "set_alarm",
        {
            "type": "object",
            "properties": {
                "at": {
                    "type": "object",
                    "properties": {
                        "h": {"type": "integer", "minimum": 0, "maximum": 23},
                        "m": {"type": "integer", "minimum": 0, "maximum": 59},
                    },
                    "required": ["h", "m"],
                    "additionalProperties": False,
                },
                "label": {"type": "string", "maxLength": 8},
            },
            "required": ["at"],
            "additionalProperties": False,
        },
    ),
]
MARKERS = {
    "json_tools": ("<tool_call>", "</tool_call>"),
    "gemma4": ("<|tool_call>", "<tool_call|>"),
    "minicpm5": ("<function name=", "</function>"),
}


@pytest.fixture(scope="module")
def tokenizer(tiny_dir):
    from mlx_lm import load

    return load(str(tiny_dir("qwen3")))[1]


def sample(grammar: G.Grammar, tokenizer, seed: int, max_steps: int = 600) -> str:
    """A random text the grammar allows (uniform over allowed tokens, ending as soon as it may)."""
    n_vocab = len(tokenizer._tokenizer)
    c = G.constrain(grammar, tokenizer, n_vocab)
    rng, eos, out = np.random.default_rng(seed), set(tokenizer.eos_token_ids), []
    for _ in range(max_steps):
        allowed = np.nonzero(c.allowed())[0]
        ends = [t for t in allowed if t in eos]
        if ends and (len(allowed) == len(ends) or rng.random() < 0.5):
            return tokenizer.decode(out)
        t = int(rng.choice([t for t in allowed if t not in eos]))
        assert c.matcher.consume_token(t), c.matcher.get_error()
        out.append(t)
    raise AssertionError(f"no end after {max_steps} tokens: {tokenizer.decode(out)!r}")


@pytest.mark.parametrize("family", sorted(tool_grammar.BUILDERS))
def test_sampled_calls_parse_with_mlx_lm_and_validate(tokenizer, family):
    start, end = MARKERS[family]
    parser = importlib.import_module(f"mlx_lm.tool_parsers.{family}")
    assert (parser.tool_call_start, parser.tool_call_end) == (start, end)
    syntax = ToolSyntax(start, end, parser.parse_tool_call, family)
    tools = [{"type": "function", "function": {"name": n, "parameters": p}} for n, p in TOOLS]
    rules = tool_grammar.Rules()
    tool_grammar.BUILDERS[family](rules, syntax, TOOLS, tokenizer)
    grammar = G.lark("start: call\n" + "\n".join(rules.lines) + "\n", family)
    schemas = dict(TOOLS)
    names = set()
    for seed in range(12):
        text = sample(grammar, tokenizer, seed)
        assert text.startswith(start) and text.endswith(end), text
        call = parser.parse_tool_call(text[len(start) : len(text) - len(end)], tools)
        jsonschema.validate(call["arguments"], schemas[call["name"]])
        names.add(call["name"])
    assert names == set(schemas)  # both tools come up


# A pydantic-style schema: local references into $defs, definitions and properties (found by a
# bad-input probe: nested under the call's `arguments`, `#/$defs/...` pointed at nothing, 400).
REFS = {
    "type": "object",
    "properties": {
        "home": {"$ref": "#/$defs/Place", "description": "where"},
        "away": {"$ref": "#/definitions/Place2"},
        "again": {"$ref": "#/properties/home"},
    },
    "required": ["home", "away"],
    "$defs": {
        "Place": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}},
            "required": ["city"],
        }
    },
    "definitions": {"Place2": {"$ref": "#/$defs/Place"}},
}


@pytest.mark.parametrize("family", sorted(tool_grammar.BUILDERS))
def test_a_schema_with_local_refs_is_inlined_for_every_family(tokenizer, family):
    start, end = MARKERS[family]
    parser = importlib.import_module(f"mlx_lm.tool_parsers.{family}")
    syntax = ToolSyntax(start, end, parser.parse_tool_call, family)
    tools = [{"type": "function", "function": {"name": "trip", "parameters": REFS}}]
    specs = structured._tool_specs(tools)
    assert "$ref" not in json.dumps(specs) and "$defs" not in json.dumps(specs)
    rules = tool_grammar.Rules()
    tool_grammar.BUILDERS[family](rules, syntax, specs, tokenizer)
    grammar = G.lark("start: call\n" + "\n".join(rules.lines) + "\n", family)
    for seed in range(6):
        text = sample(grammar, tokenizer, seed)
        # read as the server reads it (OutputParser hands the parser the inlined tools)
        call = parser.parse_tool_call(text[len(start) : len(text) - len(end)], _as_parsed(tools))
        jsonschema.validate(call["arguments"], REFS)
        assert set(call["arguments"]["home"]) == {"city"}  # closed once inlined


def test_inline_refs_merges_allofs_and_refuses_recursion():
    flat = G.inline_refs(REFS)
    place = REFS["$defs"]["Place"]
    assert flat["properties"]["home"] == {**place, "description": "where"}
    assert flat["properties"]["again"] == flat["properties"]["home"]
    assert flat["properties"]["away"] == place and "$defs" not in flat and "definitions" not in flat
    overlap = {"$defs": {"s": {"type": "string"}}, "$ref": "#/$defs/s", "type": "integer"}
    assert G.inline_refs(overlap) == {"allOf": [{"type": "string"}, {"type": "integer"}]}
    assert G.inline_refs({"type": "string"}) == {"type": "string"}  # nothing to do: as it was
    for recursive in (
        {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
        {"type": "object", "properties": {"a": {"$ref": "#"}}},
    ):
        with pytest.raises(G.RecursiveRef, match="recursive"):
            G.inline_refs(recursive)
    with pytest.raises(G.GrammarError, match="points at nothing"):
        G.inline_refs({"properties": {"a": {"$ref": "#/$defs/missing"}}})
    tools = [
        {
            "type": "function",
            "function": {
                "name": "tree",
                "parameters": {
                    "type": "object",
                    "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}},
                },
            },
        }
    ]
    with pytest.raises(APIError, match="recursive") as e:
        structured._tool_specs(tools)
    assert e.value.status == 400 and e.value.param == "tools[0]"


def test_a_recursive_schema_with_a_way_out_compiles_and_one_without_is_refused():
    tree = {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}}
    chain = {
        "$defs": {"n": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/node"}]}},
        "$ref": "#/$defs/node",
    }
    chain["$defs"]["node"] = {
        "type": "object",
        "properties": {"next": {"$ref": "#/$defs/n"}},
        "required": ["next"],
    }
    for ok in (tree, {**tree, "required": ["kids"]}, chain):
        assert G.has_finite_value(ok)
        G.json_schema(ok)
    endless = {**tree, "required": ["kids"]}
    endless["properties"] = {"kids": {"type": "array", "minItems": 1, "items": {"$ref": "#"}}}
    assert not G.has_finite_value(endless)
    with pytest.raises(G.GrammarError, match="recurse without end"):
        G.json_schema(endless)


def test_names_that_look_like_keywords_stay_names():
    """From review: properties named `definitions`, `$ref`, `enum` are names, not keywords (the
    first walk dropped one and left another's reference dangling)."""
    place = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    schema = {
        "type": "object",
        "properties": {
            "definitions": {"type": "string"},
            "$ref": {"$ref": "#/$defs/P"},
            "enum": {"$ref": "#/$defs/P"},
        },
        "required": ["definitions", "$ref", "enum"],
        "$defs": {"P": place},
    }
    flat = G.inline_refs(schema)
    assert flat["properties"] == {"definitions": {"type": "string"}, "$ref": place, "enum": place}
    G.json_schema(schema)
    # an anchor is left to llguidance; a malformed recursive schema is a GrammarError, not a crash
    assert G.inline_refs({"$ref": "#foo"}) == {"$ref": "#foo"}
    bad = {"$defs": {"n": {"type": "array", "items": {"$ref": "#/$defs/n"}, "minItems": "x"}}}
    with pytest.raises(G.GrammarError):
        G.json_schema({**bad, "$ref": "#/$defs/n"})
