"""Structured output on every protocol: what a request asks of the shape of its answer (`Shape`,
filled in at the edge of its protocol) and the grammar that enforces it (`grammar_for`, built
when the job is made, so a schema that cannot compile is a 400 before any generation).

- A JSON answer (OpenAI `response_format` json_object / json_schema, Responses `text.format`):
  the output is produced under the schema, so it always parses and validates (unless max_tokens
  or a stop sequence cuts it: then the text is a valid prefix).
- A forced tool call (OpenAI `tool_choice` "required" or a named function, Anthropic `any` /
  `tool`, Responses likewise): the output is the family's tool-call markup around JSON whose
  `arguments` follow the tool's parameter schema, so the call parses and its arguments validate;
  `parallel` false allows exactly one call.
- Both together with tool_choice "auto": the model may call a tool or answer with the JSON.

Tool calls are written in the family's own markup (`tool_grammar.py`): the Hermes JSON form
(Gemma 3 through mlxlab's template, Qwen, ...), Gemma 4's native calls, MiniCPM's XML.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlxlab import grammar as G
from mlxlab.serve import tool_grammar
from mlxlab.serve.engine.loaded import Loaded
from mlxlab.serve.http import APIError

ENFORCEABLE_TOOL_FAMILIES = tuple(tool_grammar.BUILDERS)


@dataclass
class Shape:
    """The answer's required shape; the defaults ask for nothing."""

    schema: dict | None = None
    """The answer is JSON valid against this schema (json_object: `{"type": "object"}`)."""
    schema_field: str = "response_format"
    """The request field that asked for it, for error messages."""
    tool_choice: str = "auto"
    """auto | required (some offered tool must be called) | the one tool's name (prefixed "=")."""
    parallel: bool = True
    """More than one call allowed (when a call is forced)."""
    choice_field: str = "tool_choice"

    @property
    def forced_tool(self) -> str | None:
        return self.tool_choice[1:] if self.tool_choice.startswith("=") else None

    @property
    def constrained(self) -> bool:
        return self.schema is not None or self.tool_choice != "auto"


def named(name: str) -> str:
    """The tool_choice value that forces tool `name`."""
    return "=" + name


def check_tool_schema(params, where: str) -> None:
    """A 400 naming `where` (the request field) when a function tool's parameter schema is not a
    JSON schema: checked at each protocol's edge for every tool offered, forced or not, as
    OpenAI does (a forced call also needs the schema to compile: `_tool_specs`)."""
    if params is None:
        return
    problem = G.schema_problem(params, where)
    if problem:
        raise APIError(400, problem, param=where, code="invalid_schema")


def _tool_specs(tools: list[dict]) -> list[tuple[str, dict]]:
    """(name, parameter schema) per offered function tool; a 400 naming the tool when its schema
    is not one (checked by compiling it, so the markup builders only see valid schemas)."""
    out = []
    for i, t in enumerate(tools):
        fn = t.get("function", t)
        params = fn.get("parameters") or {"type": "object"}
        if not isinstance(params, dict):
            raise APIError(
                400,
                f"tools[{i}] ({fn['name']}): parameters must be a JSON schema object",
                param=f"tools[{i}]",
                code="invalid_schema",
            )
        what = f"tools[{i}] ({fn['name']}): parameters"
        try:
            G.json_schema(params, what)
            # The markup builders embed the parameters (or parts of them) inside the call's
            # grammar, where `#/...` would point into the call: references are inlined first.
            params = G.inline_refs(params, what)
        except G.RecursiveRef as e:
            raise APIError(
                400,
                f"{e}; a tool call's grammar cannot embed a recursive parameter schema",
                param=f"tools[{i}]",
                code="invalid_schema",
            ) from None
        except G.GrammarError as e:
            raise APIError(400, str(e), param=f"tools[{i}]", code="invalid_schema") from None
        out.append((fn["name"], G.closed(params)))
    return out


def _schema_only(shape: Shape) -> G.Grammar:
    try:
        return G.json_schema(shape.schema, f"{shape.schema_field}: the JSON schema")
    except G.GrammarError as e:
        raise APIError(400, str(e), param=shape.schema_field, code="invalid_schema") from None


def grammar_for(
    shape: Shape, tools: list[dict] | None, loaded: Loaded, reasoning: bool = False
) -> G.Grammar | None:
    """The grammar for `shape` given the offered `tools`; None when nothing is asked. A 400
    naming the field for anything that cannot be enforced. `reasoning`: the prompt opens a
    reasoning block, which a grammar from the first token would fill with the answer."""
    if not shape.constrained:
        return None
    if reasoning:
        field = shape.schema_field if shape.schema is not None else shape.choice_field
        raise APIError(
            400,
            f"{field}: structured output and forced tool calls cannot start inside the model's "
            "reasoning; turn thinking off (chat_template_kwargs enable_thinking false)",
            param=field,
            code="constraint_with_reasoning",
        )
    forcing = shape.tool_choice != "auto"
    if not forcing and not tools:
        return _schema_only(shape)
    syntax = loaded.tool
    if not forcing and (syntax is None or syntax.family not in ENFORCEABLE_TOOL_FAMILIES):
        return _schema_only(
            shape
        )  # calls cannot be grammar-shaped here: the answer is held to the schema
    return _with_tools(shape, tools or [], loaded)


def _with_tools(shape: Shape, tools: list[dict], loaded: Loaded) -> G.Grammar:
    where = shape.choice_field
    forcing = shape.tool_choice != "auto"
    if forcing and not tools:
        raise APIError(
            400,
            f"{where}: a forced tool call needs at least one offered function tool",
            param=where,
        )
    specs = _tool_specs(tools)
    if shape.forced_tool is not None:
        specs = [s for s in specs if s[0] == shape.forced_tool]
        if not specs:
            offered = ", ".join(n for n, _ in _tool_specs(tools)) or "none"
            raise APIError(
                400,
                f"{where}: no offered tool is named {shape.forced_tool!r} (offered: {offered})",
                param=where,
            )
    syntax = loaded.tool
    if syntax is None or syntax.family not in ENFORCEABLE_TOOL_FAMILIES:
        family = syntax.family if syntax else "none"
        raise APIError(
            400,
            f"{where}: this model's tool-call format ({family}) cannot be enforced by a grammar",
            param=where,
            code="tool_choice_not_enforceable",
        )
    rules = tool_grammar.Rules()
    tool_grammar.BUILDERS[syntax.family](rules, syntax, specs, loaded.tokenizer)
    calls = "call (NL? call)*" if shape.parallel else "call"
    rules = [f"calls: {calls}", *rules.lines, 'NL: "\\n"']
    if shape.schema is not None and not forcing:  # auto: a call or the JSON answer
        _schema_only(shape)  # names the schema field when the answer's schema is at fault
        rules = ["start: calls | answer", f"answer: {G.embedded_json(shape.schema)}", *rules]
    else:
        rules = ["start: calls", *rules]
    try:
        return G.lark("\n".join(rules) + "\n", f"{where}: the tool-call grammar")
    except G.GrammarError as e:
        raise APIError(400, str(e), param=where, code="invalid_schema") from None
