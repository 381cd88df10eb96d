"""Forced tool calls in each family's markup: calls sampled at random from the grammar parse with
mlx-lm's own parser for that family and their arguments validate against the tool's schema."""

from __future__ import annotations

import importlib

import jsonschema
import numpy as np
import pytest

from mlxlab import grammar as G
from mlxlab.serve import tool_grammar
from mlxlab.serve.engine.output import ToolSyntax

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
