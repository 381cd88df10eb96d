"""OpenAI Responses wire format: the request model and the conversion of `input` items and
`instructions` into chat messages.

`input` (a string, or items: message, function_call, function_call_output) and `instructions`
become chat messages (instructions and system/developer items merged into one leading system
message); `previous_response_id` splices the stored conversation and its output back in, the
instructions carrying forward when the new request gives none.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from mlxlab.serve import vision
from mlxlab.serve.ask import Ask, SamplingAsk, adapter_spec, normalize_messages, text_of
from mlxlab.serve.http import APIError, OptInt
from mlxlab.serve.structured import Shape, named


class TextFormat(BaseModel):
    """`text.format`: text, json_object, or json_schema with its name, schema and strict flag."""

    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, min_length=1, max_length=64)
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None

    def echo(self) -> dict:
        return self.model_dump(by_alias=True, exclude_none=True)


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    format: TextFormat | None = None


# What `include` may name (OpenAI's list): only the logprobs change an answer here, the rest
# name outputs of tools this server does not run (or, for images and encrypted reasoning, add
# nothing), so they are accepted as OpenAI accepts them; anything else is a 400.
INCLUDABLE = Literal[
    "file_search_call.results",
    "web_search_call.results",
    "web_search_call.action.sources",
    "message.input_image.image_url",
    "computer_call_output.output.image_url",
    "code_interpreter_call.outputs",
    "reasoning.encrypted_content",
    "message.output_text.logprobs",
]


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: OptInt = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: OptInt = Field(None, ge=0)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    stream: bool = False
    store: bool = True
    metadata: dict[str, Any] | None = None
    adapter: str | None = None
    reasoning: dict[str, Any] | None = None
    include: list[INCLUDABLE] | None = None
    top_logprobs: OptInt = Field(None, ge=0, le=20)

    @property
    def logprobs(self) -> bool:
        """Whether the output_text parts carry their tokens' logprobs: `include` asks for
        message.output_text.logprobs, or top_logprobs asks for alternatives."""
        return LOGPROBS_INCLUDE in (self.include or []) or bool(self.top_logprobs)


LOGPROBS_INCLUDE = "message.output_text.logprobs"


def _item_text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}: content must be a string or a list of parts", param=where)
    return text_of(content, where)


def to_chat(
    body: ResponsesRequest, previous: dict | None
) -> tuple[list[dict], str | None, list[str]]:
    """(conversation messages without the system message, instructions in force, the request
    field each message came from)."""
    messages = list(previous["messages"]) if previous else []
    origins = ["previous_response_id"] * len(messages)
    instructions = (
        body.instructions if body.instructions is not None else (previous or {}).get("instructions")
    )
    known_calls = {c["id"] for m in messages for c in m.get("tool_calls", [])}
    items = (
        [{"type": "message", "role": "user", "content": body.input}]
        if isinstance(body.input, str)
        else body.input
    )
    system_extra = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise APIError(400, f"{where}: an item must be an object", param=where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise APIError(400, f"{where}: unknown role {role!r}", param=where)
            content = item.get("content", "")
            images = vision.user_content(content, f"{where}.content") if role == "user" else None
            text = images or _item_text(content, f"{where}.content")
            if role in ("system", "developer"):
                system_extra.append(text)
            else:
                messages.append({"role": role, "content": text})
        elif kind == "function_call":
            call_id, name = item.get("call_id"), item.get("name")
            if not isinstance(call_id, str) or not isinstance(name, str):
                raise APIError(
                    400, f"{where}: function_call needs string call_id and name", param=where
                )
            try:
                args = json.loads(item.get("arguments") or "{}")
            except (TypeError, json.JSONDecodeError):
                args = None
            if not isinstance(args, dict):
                raise APIError(
                    400, f"{where}: function_call arguments must be a JSON object", param=where
                )
            call = {
                "id": call_id,
                "type": "function",
                "function": {"name": name, "arguments": args},
            }
            if (
                messages
                and messages[-1]["role"] == "assistant"
                and messages[-1].get("tool_calls") is not None
            ):
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
            known_calls.add(call_id)
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if call_id not in known_calls:
                raise APIError(
                    400,
                    f"{where}: function_call_output for {call_id!r} has no matching function_call",
                    param=where,
                )
            output = item.get("output", "")
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": call_id,
                    "content": output if isinstance(output, str) else json.dumps(output),
                }
            )
        elif kind == "reasoning":
            continue
        else:
            raise APIError(400, f"{where}: unsupported item type {kind!r}", param=where)
        origins += [where] * (len(messages) - len(origins))
    if system_extra:
        instructions = "\n\n".join([*([instructions] if instructions else []), *system_extra])
    return messages, instructions, origins


def tool_schemas(body: ResponsesRequest) -> list[tuple]:
    """(parameter schema, field) of every function tool, offered this time or not (checked by
    `make_job` after the ceilings)."""
    return [
        (t.get("parameters"), f"tools[{i}].parameters")
        for i, t in enumerate(body.tools or [])
        if t.get("type") == "function"
    ]


def function_tools(body: ResponsesRequest) -> list[dict] | None:
    """The function tools offered to the model (those tool_choice allowed_tools lists, if it does)."""
    if body.tool_choice == "none":
        return None
    allowed = None
    if isinstance(body.tool_choice, dict) and body.tool_choice.get("type") == "allowed_tools":
        listed = body.tool_choice.get("tools") or []
        if not isinstance(listed, list):
            raise APIError(
                400, "tool_choice.tools: must be a list of tools", param="tool_choice.tools"
            )
        allowed = {t.get("name") for t in listed if isinstance(t, dict)}
    out = []
    for i, t in enumerate(body.tools or []):
        if t.get("type") != "function" or (allowed is not None and t.get("name") not in allowed):
            continue  # built-in tools (web_search, file_search, ...) are not run here
        if not isinstance(t.get("name"), str):
            raise APIError(
                400, f"tools[{i}]: a function tool needs a string name", param=f"tools[{i}]"
            )
        out.append(
            {
                "type": "function",
                "function": {
                    "name": t["name"],
                    "description": t.get("description", ""),
                    "parameters": t.get("parameters") or {},
                },
            }
        )
    return out or None


def shape_of(body: ResponsesRequest) -> Shape:
    """`text.format` and `tool_choice` ("required" or {"type": "function", "name"}) as a Shape."""
    fmt = body.text.format if body.text else None
    shape = Shape(
        schema_field="text.format.schema",
        choice_field="tool_choice",
        parallel=body.parallel_tool_calls,
    )
    if fmt is not None and fmt.type == "json_object":
        shape.schema = {"type": "object"}
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.schema_ is None:
            raise APIError(
                400,
                "text.format.schema is required when type is json_schema",
                param="text.format.schema",
            )
        shape.schema = fmt.schema_
    choice = body.tool_choice
    if choice == "required":
        shape.tool_choice = "required"
    elif isinstance(choice, dict) and choice.get("type") == "function":
        if not isinstance(choice.get("name"), str) or not choice["name"]:
            raise APIError(400, "tool_choice: {type: function} needs a name", param="tool_choice")
        shape.tool_choice = named(choice["name"])
    elif isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        shape.tool_choice = (
            "required" if choice.get("mode") == "required" else "auto"
        )  # see function_tools
    elif isinstance(choice, dict) and isinstance(choice.get("type"), str):
        pass  # a built-in tool kind (web_search_preview, file_search, ...) this server does not run
    elif choice not in (None, "auto", "none"):
        raise APIError(
            400,
            "tool_choice must be none, auto, required or {type: function, name}",
            param="tool_choice",
        )
    return shape


def to_ask(
    body: ResponsesRequest, messages: list[dict], instructions: str | None, origins: list[str]
) -> Ask:
    """The generation request: the instructions as a leading system message, then the conversation."""
    chat = ([{"role": "system", "content": instructions}] if instructions else []) + messages
    return Ask(
        messages=normalize_messages(chat),
        messages_field="input",
        origins=(["instructions"] if instructions else []) + origins,
        tools=function_tools(body),
        tool_schemas=tool_schemas(body),
        max_tokens=body.max_output_tokens,
        logprobs=body.logprobs,
        top_logprobs=body.top_logprobs or 0,
        sampling=SamplingAsk.of(body),
        adapter=adapter_spec(body.adapter),
        shape=shape_of(body),
    )
