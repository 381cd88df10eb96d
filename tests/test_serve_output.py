"""The output parser: stop sequences, tool-call markup of three families, reasoning, holdback."""

from __future__ import annotations

import importlib
import json

import pytest

from mlxlab.serve.engine.output import OutputParser, ToolSyntax

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            },
        },
    }
]


def syntax(family: str) -> ToolSyntax:
    mod = importlib.import_module(f"mlx_lm.tool_parsers.{family}")
    return ToolSyntax(mod.tool_call_start, mod.tool_call_end, mod.parse_tool_call, family)


def run(parser: OutputParser, pieces) -> tuple[list, OutputParser]:
    out = []
    for p in pieces:
        out += parser.feed(p)
    out += parser.finish()
    return out, parser


def text(events, kind="content") -> str:
    return "".join(t for k, t in events if k == kind)


def chars(s: str) -> list[str]:
    return list(s)


def test_stop_spanning_pieces_is_never_sent():
    events, p = run(OutputParser(stops=["END"]), ["Hello E", "N", "D and more"])
    assert text(events) == "Hello " and p.stopped == "END"
    # Held back while ambiguous, released when it turns out not to be a stop.
    p = OutputParser(stops=["END"])
    assert p.feed("Hello E") == [("content", "Hello ")]
    assert p.feed("x") == [("content", "Ex")]


def test_every_prefix_split_of_the_stream_gives_the_same_content():
    full = "The answer is 42.\n\nQuestion: more"
    for cut in range(len(full)):
        events, p = run(OutputParser(stops=["\n\nQuestion:", "###"]), [full[:cut], full[cut:]])
        assert text(events) == "The answer is 42." and p.stopped == "\n\nQuestion:"
        assert all("\n\nQ" not in t for _, t in events)


@pytest.mark.parametrize(
    "family,markup",
    [
        (
            "json_tools",
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}</tool_call>',
        ),
        ("gemma4", '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:2}<tool_call|>'),
        (
            "minicpm5",
            '<function name="get_weather"><param name="city"><![CDATA[Paris]]></param>'
            '<param name="days">2</param></function>',
        ),
    ],
)
def test_tool_markup_of_each_family_becomes_a_call(family, markup):
    before = "Let me check. "
    events, p = run(
        OutputParser(tool=syntax(family), tools=TOOLS), chars(before + markup + " Done.")
    )
    assert text(events) == before + " Done."
    assert all("<" not in t for _, t in events)  # the markup itself never streams
    assert len(p.calls) == 1 and p.calls[0]["name"] == "get_weather"
    assert json.loads(p.calls[0]["arguments"]) == {"city": "Paris", "days": 2}
    assert p.calls[0]["id"].startswith("call_")


def test_minicpm_arguments_follow_the_schema():
    tools = [
        {
            "type": "function",
            "function": {
                "name": "f",
                "parameters": {
                    "type": "object",
                    "properties": {"code": {"type": "string"}, "n": {"type": "integer"}},
                },
            },
        }
    ]
    markup = '<function name="f"><param name="code"><![CDATA[if a < b: x = "1"]]></param><param name="n">7</param></function>'
    _, p = run(OutputParser(tool=syntax("minicpm5"), tools=tools), [markup])
    assert json.loads(p.calls[0]["arguments"]) == {"code": 'if a < b: x = "1"', "n": 7}


def test_malformed_or_unknown_calls_fall_back_to_content():
    bad = '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'
    events, p = run(OutputParser(tool=syntax("json_tools"), tools=TOOLS), [bad])
    assert p.calls == [] and text(events) == bad
    unknown = '<tool_call>{"name": "launch", "arguments": {}}</tool_call>'
    events, p = run(OutputParser(tool=syntax("json_tools"), tools=TOOLS), [unknown])
    assert p.calls == [] and text(events) == unknown
    unterminated = '<tool_call>{"name": "get_weather"'
    events, p = run(OutputParser(tool=syntax("json_tools"), tools=TOOLS), [unterminated])
    assert p.calls == [] and text(events) == unterminated


def test_markup_without_tools_is_plain_text():
    markup = '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'
    events, p = run(OutputParser(tool=syntax("json_tools"), tools=None), [markup])
    assert text(events) == markup and p.calls == []


def test_reasoning_is_split_out():
    events, _ = run(
        OutputParser(think=("<think>", "</think>")), chars("<think>hmm, 2+2</think>It is 4.")
    )
    assert text(events, "reasoning") == "hmm, 2+2" and text(events) == "It is 4."
    # The prompt already opened the block (enable_thinking templates): starts in reasoning.
    events, _ = run(
        OutputParser(think=("<think>", "</think>"), reasoning=True), ["a", "b</thi", "nk>c"]
    )
    assert text(events, "reasoning") == "ab" and text(events) == "c"


def test_whitespace_between_and_after_tool_calls_is_not_content():
    tool = ToolSyntax("<tool_call>", "</tool_call>", lambda text, tools: json.loads(text))
    tools = [{"type": "function", "function": {"name": "f"}}]
    p = OutputParser(tool=tool, tools=tools)
    out = p.feed('<tool_call>{"name": "f", "arguments": {}}</tool_call>\n')
    out += p.feed('<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>\n ')
    out += p.finish()
    assert out == [] and [c["arguments"] for c in p.calls] == ["{}", '{"a": 1}']
    q = OutputParser(tool=tool, tools=tools)
    out = q.feed('<tool_call>{"name": "f", "arguments": {}}</tool_call>\nDone.') + q.finish()
    assert out == [("content", "\nDone.")]


def test_a_call_cut_by_max_tokens_after_complete_calls_is_dropped():
    """A small model forced to call repeats the call until max_tokens: the complete call is the
    answer, token by token; neither the newline before the cut call nor its markup is content."""
    first = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    cut = '\n<tool_call>\n{"name": "get_weather", "'
    for split in (chars, lambda s: [s]):
        events, p = run(OutputParser(tool=syntax("json_tools"), tools=TOOLS), split(first + cut))
        assert events == [] and [c["name"] for c in p.calls] == ["get_weather"]
        assert p.cut_call == '\n{"name": "get_weather", "'
    # Cut inside the next call's start marker (found by a client-SDK probe: content "\n<"
    # came with the calls, before them on Anthropic's side): not content either.
    for partial in ("\n<", "\n<tool_", " <tool_call"):
        for split in (chars, lambda s: [s]):
            events, p = run(
                OutputParser(tool=syntax("json_tools"), tools=TOOLS), split(first + partial)
            )
            assert events == [] and [c["name"] for c in p.calls] == ["get_weather"]
            assert p.cut_call == ""
    # Alone, an unterminated call is still released as text (the answer is a cut prefix).
    events, p = run(OutputParser(tool=syntax("json_tools"), tools=TOOLS), chars(cut))
    assert p.calls == [] and text(events) == cut


def test_a_token_that_shows_no_text_sends_its_logprobs_as_the_part_it_belongs_to(tiny_dir):
    """A row sends every token's logprobs once, in order; those of a token that shows no text
    go out as what it turned out to be: reasoning (a think marker), markup (a call's markup, a
    matched stop sequence) or content. A marker that takes several tokens (none of these is one
    token in this tokenizer) is held back until it is one, so the content logprobs spell out
    the answer's text (a token that straddles it and a marker counts with the text)."""
    from types import SimpleNamespace

    import mlx.core as mx
    from mlx_lm.utils import load

    from mlxlab.serve.engine.jobs import Job
    from mlxlab.serve.engine.rows import RowOutput

    _, tokenizer = load(str(tiny_dir("gemma3")))
    m = SimpleNamespace(
        tool=syntax("json_tools"),
        think=("<think>", "</think>"),
        tokenizer=tokenizer,
        hidden=set(),
        eos=set(),
    )
    flat = mx.zeros((len(tokenizer.vocab),))
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'

    def run(text: str, stops=()) -> tuple[list, list[int]]:
        events = []
        job = Job(
            prompt=[1],
            max_tokens=99,
            sink=events.append,
            tools=TOOLS,
            stops=list(stops),
            logprobs=True,
            reasoning=True,
        )
        row = RowOutput(m, job)
        ids = tokenizer.encode(text, add_special_tokens=False)
        for t in ids:
            if row.feed(t, flat):
                break
        row.close("stop")
        return [e for e in events if hasattr(e, "kind")], ids

    def spelled(events, kind: str) -> str:
        return "".join(lp["token"] for e in events if e.kind == kind for lp in e.logprobs or [])

    events, ids = run("Let me see.</think>Sure, here. " + call + "\n")
    texts = {k: "".join(e.text for e in events if e.kind == k) for k in ("reasoning", "content")}
    assert texts == {"reasoning": "Let me see.", "content": "Sure, here. "}
    tokens = [lp["token"] for e in events for lp in e.logprobs or []]
    assert tokens == [tokenizer.decode([t]) for t in ids]  # each once, in order
    # a token that straddles the text and a marker (" <" here) counts with the text
    answer = spelled(events, "content")
    assert answer.startswith(texts["content"]) and answer in texts["content"] + call[:1]
    assert answer + spelled(events, "markup") == texts["content"] + call + "\n"
    assert spelled(events, "reasoning") == "Let me see.</think>"
    # a stop sequence's tokens are markup; the text before it is the answer's
    events, _ = run("Let me see.</think>Sure. STOP here", stops=["STOP"])
    shown = "".join(e.text for e in events if e.kind == "content")
    answer = spelled(events, "content")
    assert shown == "Sure. " and answer.startswith(shown) and answer in shown + "STOP"[:1]
    assert answer + spelled(events, "markup") == "Sure. STOP"  # nothing after the stop


def test_an_answer_cut_inside_a_later_call_finishes_tool_calls(tiny_dir):
    """The finish reason a row reports: complete calls make it `tool_calls`, also when a later
    call was cut by max_tokens (dropped: the complete calls are the whole answer) or by an end of
    sequence; without a complete call the cut markup is text and the reason stays."""
    from types import SimpleNamespace

    from mlx_lm.utils import load

    from mlxlab.serve.engine.jobs import Job
    from mlxlab.serve.engine.rows import RowOutput

    _, tokenizer = load(str(tiny_dir("gemma3")))
    first = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    cut = '\n<tool_call>\n{"name": "get_weather", "'
    m = SimpleNamespace(
        tool=syntax("json_tools"), think=None, tokenizer=tokenizer, hidden=set(), eos=set()
    )

    def finish(text: str, reason: str) -> tuple[str, list]:
        events = []
        row = RowOutput(m, Job(prompt=[1], max_tokens=99, sink=events.append, tools=TOOLS))
        for t in tokenizer.encode(text, add_special_tokens=False):
            row.feed(t, None)
        done = row.close(reason)
        return done.finish_reason, done.tool_calls

    for reason in ("length", "stop"):
        got, calls = finish(first + cut, reason)
        assert got == "tool_calls" and [c["name"] for c in calls] == ["get_weather"]
        assert finish(first, reason)[0] == "tool_calls"
    assert finish(cut, "length") == ("length", [])  # no complete call: a cut answer
