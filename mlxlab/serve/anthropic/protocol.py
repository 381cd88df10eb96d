"""Anthropic Messages wire format: request models, the conversion to chat messages, and the
Anthropic error shape.

Bodies become the same chat messages the OpenAI route builds (system -> a leading system message;
tool_use blocks -> assistant tool calls; tool_result blocks -> tool messages, so the model sees
them through its native tool format rather than inlined text).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from mlxlab.serve import vision
from mlxlab.serve.ask import Ask, SamplingAsk, adapter_spec, text_of
from mlxlab.serve.http import APIError, Int, OptInt
from mlxlab.serve.structured import Shape, named

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicError(BaseModel):
    """The body `error_shape` answers (for the OpenAPI schema)."""

    type: Literal["error"]
    error: AnthropicErrorDetail


def error_shape(err: APIError) -> tuple[int, dict]:
    """(status, body) in the Anthropic shape: {"type": "error", "error": {"type", "message"}};
    an overloaded server (503) answers 529, as Anthropic's API does; a 4xx Anthropic has no type
    for (405, 422) is an invalid_request_error, a 5xx an api_error."""
    status = 529 if err.status == 503 else err.status
    return status, {
        "type": "error",
        "error": {
            "type": ERROR_TYPES.get(
                err.status, "invalid_request_error" if err.status < 500 else "api_error"
            ),
            "message": err.message,
        },
    }


class _Base(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class Message(_Base):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class ToolChoice(_Base):
    """auto (the model decides), any (it must call a tool), tool (it must call `name`), none."""

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = Field(None, min_length=1)
    disable_parallel_tool_use: bool = False


class OutputFormat(_Base):
    """A structured answer: `{"type": "json_schema", "schema": {...}}`."""

    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Base):
    """`output_config`: `format` holds the answer to a JSON schema; `effort` (how hard a hosted
    model thinks) has nothing to steer here and is accepted as such."""

    format: OutputFormat | None = None
    effort: str | None = None


class MessagesRequest(_Base):
    model: str = Field(min_length=1)
    messages: list[Message] = Field(min_length=1)
    max_tokens: Int = Field(ge=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice | None = None
    stop_sequences: list[str] | None = Field(None, max_length=16)
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: OptInt = Field(None, ge=0)
    stream: bool = False
    metadata: dict[str, Any] | None = None
    adapter: str | None = None
    thinking: dict[str, Any] | None = None
    output_config: OutputConfig | None = None
    output_format: OutputFormat | None = None  # the structured-outputs beta's name for it


class CountRequest(_Base):
    model: str = Field(min_length=1)
    messages: list[Message] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice | None = None
    thinking: dict[str, Any] | None = None
    output_config: OutputConfig | None = None
    output_format: OutputFormat | None = None


def to_chat(body) -> tuple[list[dict], list[dict] | None, list[str], list[tuple]]:
    """(chat messages for the template, function tools, the request field each chat message
    came from) from a Messages body."""
    messages: list[dict] = []
    if body.system:
        messages.append({"role": "system", "content": text_of(body.system, "system", ("text",))})
    origins = ["system"] * len(messages)
    open_calls: set[str] = set()
    for i, m in enumerate(body.messages):
        where = f"messages[{i}].content"
        if isinstance(m.content, str):
            messages.append({"role": m.role, "content": m.content})
            origins.append(f"messages[{i}]")
            continue
        text, calls = [], []
        for j, block in enumerate(m.content):
            kind = block.get("type")
            if kind == "text":
                if not isinstance(block.get("text"), str):
                    raise APIError(400, f"{where}[{j}]: a text block needs a string 'text'")
                text.append(block["text"])
            elif kind == "image" and m.role == "user":
                text.append(vision.anthropic_part(block, f"{where}[{j}]"))
            elif kind == "tool_use" and m.role == "assistant":
                if (
                    not isinstance(block.get("id"), str)
                    or not isinstance(block.get("name"), str)
                    or not isinstance(block.get("input", {}), dict)
                ):
                    raise APIError(
                        400,
                        f"{where}[{j}]: tool_use needs a string id and name and an object input",
                    )
                calls.append(
                    {
                        "id": block["id"],
                        "type": "function",
                        "function": {"name": block["name"], "arguments": block.get("input", {})},
                    }
                )
                open_calls.add(block["id"])
            elif kind == "tool_result" and m.role == "user":
                tid = block.get("tool_use_id")
                if tid not in open_calls:
                    raise APIError(
                        400,
                        f"{where}[{j}]: tool_result for {tid!r} has no matching tool_use "
                        "in an earlier assistant message",
                    )
                if text:  # keep the order: text before the result stays before it
                    messages.append({"role": "user", "content": vision.joined(text)})
                    text = []
                result = block.get("content", "")
                result = (
                    result
                    if isinstance(result, str)
                    else text_of(result, f"{where}[{j}].content", ("text",))
                )
                if block.get("is_error"):
                    result = f"Error: {result}"
                messages.append({"role": "tool", "tool_call_id": tid, "content": result})
            elif kind in ("thinking", "redacted_thinking") and m.role == "assistant":
                continue  # earlier reasoning is not replayed to the model
            else:
                raise APIError(
                    400, f"{where}[{j}]: unsupported block type {kind!r} in a {m.role} message"
                )
        if calls:
            messages.append({"role": "assistant", "content": "".join(text), "tool_calls": calls})
        elif text or m.role == "assistant":
            messages.append({"role": m.role, "content": vision.joined(text)})
        origins += [f"messages[{i}]"] * (len(messages) - len(origins))
    tools, schemas = [], []
    for i, t in enumerate(body.tools or []):
        if t.get("type") not in (None, "custom"):
            continue  # server tools (web_search, bash, ...) are not ours to run
        if not isinstance(t.get("name"), str) or not isinstance(t.get("input_schema", {}), dict):
            raise APIError(
                400, f"tools[{i}]: a tool needs a string name and an object input_schema"
            )
        schemas.append((t.get("input_schema"), f"tools[{i}].input_schema"))
        tools.append(
            {
                "type": "function",
                "function": {
                    "name": t["name"],
                    "description": t.get("description", ""),
                    "parameters": t.get("input_schema", {}),
                },
            }
        )
    if body.tool_choice is not None and body.tool_choice.type == "none":
        tools = []
    return messages, tools or None, origins, schemas


def template_kwargs(body) -> dict | None:
    if body.thinking and body.thinking.get("type") == "enabled":
        return {"enable_thinking": True}
    return None


def shape_of(body: MessagesRequest | CountRequest) -> Shape:
    """tool_choice any / tool force a call (one unless parallel use is allowed);
    `output_config.format` (or the beta's `output_format`) holds the answer to its JSON schema
    (count_tokens refuses what /v1/messages refuses)."""
    choice, config = body.tool_choice, body.output_config
    shape = Shape(parallel=not (choice and choice.disable_parallel_tool_use))
    if config is not None and config.format is not None:
        if body.output_format is not None:
            raise APIError(
                400,
                "output_format: give the schema once, in output_config.format",
                param="output_format",
            )
        shape.schema, shape.schema_field = config.format.schema_, "output_config.format.schema"
    elif body.output_format is not None:
        shape.schema, shape.schema_field = body.output_format.schema_, "output_format.schema"
    if choice is None or choice.type in ("auto", "none"):
        return shape
    if choice.type == "tool" and not choice.name:
        raise APIError(400, "tool_choice: type tool needs a name", param="tool_choice")
    shape.tool_choice = named(choice.name) if choice.type == "tool" else "required"
    return shape


def to_ask(body: MessagesRequest) -> Ask:
    messages, tools, origins, schemas = to_chat(body)
    return Ask(
        messages=messages,
        origins=origins,
        tools=tools,
        tool_schemas=schemas,
        template_kwargs=template_kwargs(body),
        max_tokens=body.max_tokens,
        stops=list(body.stop_sequences or []),
        sampling=SamplingAsk.of(body),
        adapter=adapter_spec(body.adapter),
        shape=shape_of(body),
    )
