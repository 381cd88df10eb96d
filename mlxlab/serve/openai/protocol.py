"""OpenAI wire format: request models (validated strictly, unknown fields ignored) and errors.

Where the predecessors' specs and OpenAI's API differ, this follows what OpenAI clients expect:
`stop` takes up to 4 strings, `max_completion_tokens` wins over `max_tokens`, `n` must be 1,
the streamed usage arrives in its own chunk with empty `choices` after the finish chunk (as
`stream_options.include_usage` does on OpenAI), and errors carry `message/type/param/code`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from mlxlab.audio.decode import FORMATS
from mlxlab.serve.ask import Ask, SamplingAsk, adapter_spec, normalize_messages
from mlxlab.serve.http import APIError, Int, OptInt
from mlxlab.serve.structured import Shape, named


class OpenAIErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class OpenAIError(BaseModel):
    """The body `error_shape` answers (for the OpenAPI schema)."""

    error: OpenAIErrorDetail


def error_shape(err: APIError) -> tuple[int, dict]:
    """(status, body) in the OpenAI shape: {"error": {"message", "type", "param", "code"}}."""
    return err.status, {
        "error": {"message": err.message, "type": err.type, "param": err.param, "code": err.code}
    }


MAX_CHOICES = 8  # n: more is a batch of requests, not one

Unit = Annotated[float, Field(ge=0.0, le=1.0)]

# What the OpenAPI schema says of fields whose checks are code (`WithJsonSchema`: the checks and
# their messages stay as they are), so that a request the schema allows is refused only for what
# a schema cannot say: the model (its vocabulary, context, vision), the server's state, or a rule
# across fields or messages (tests/test_serve_fuzz.py lists those).
STOP_SCHEMA = {
    "anyOf": [
        {"type": "string"},
        {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": 4},
        {"type": "null"},
    ],
    "default": None,
    "description": "A stop sequence, or up to 4 non-empty ones",
}
LOGIT_BIAS_SCHEMA = {
    "anyOf": [
        {
            "type": "object",
            "propertyNames": {"pattern": "^[0-9]+$"},
            "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
        },
        {"type": "null"},
    ],
    "default": None,
    "description": "Token id (below the model's vocabulary size) -> bias in [-100, 100]",
}
_TEXT_PART = {
    "type": "object",
    "properties": {
        "type": {"enum": ["text", "input_text", "output_text"]},
        "text": {"type": "string"},
    },
    "required": ["type", "text"],
}
_URL = {"type": "string", "minLength": 1}
_IMAGE_PARTS = [
    {
        "type": "object",
        "properties": {
            "type": {"const": "image_url"},
            "image_url": {
                "anyOf": [
                    {"type": "object", "properties": {"url": _URL}, "required": ["url"]},
                    _URL,
                ]
            },
        },
        "required": ["type", "image_url"],
        "description": "An image (a data: URL, or http(s) if allowed), in a user message, for "
        "a model that reads images",
    },
    {
        "type": "object",
        "properties": {"type": {"const": "input_image"}, "image_url": _URL},
        "required": ["type", "image_url"],
    },
]
_AUDIO_PART = {
    "type": "object",
    "properties": {
        "type": {"const": "input_audio"},
        "input_audio": {
            "type": "object",
            "properties": {
                "data": {"type": "string", "contentEncoding": "base64"},
                "format": {"enum": list(FORMATS)},
            },
            "required": ["data"],
        },
    },
    "required": ["type", "input_audio"],
    "description": "Audio (serve.stt_model transcribes it)",
}
CONTENT_SCHEMA = {
    "anyOf": [
        {"type": "string"},
        {"type": "array", "items": {"anyOf": [_TEXT_PART, *_IMAGE_PARTS, _AUDIO_PART]}},
        {"type": "null"},
    ],
    "default": None,
}
RESPONSE_FORMAT_SCHEMA = {
    "anyOf": [
        {
            "type": "object",
            "properties": {"type": {"enum": ["text", "json_object"]}},
            "required": ["type"],
        },
        {
            "type": "object",
            "properties": {
                "type": {"const": "json_schema"},
                "json_schema": {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "minLength": 1, "maxLength": 64},
                        "description": {"type": ["string", "null"]},
                        "schema": {"type": ["object", "null"]},
                        "strict": {"type": ["boolean", "null"]},
                    },
                },
            },
            "required": ["type", "json_schema"],
        },
        {"type": "null"},
    ],
    "default": None,
    "description": "text, json_object, or json_schema with a JSON schema the grammar engine "
    "compiles",
}
TOOL_CHOICE_SCHEMA = {
    "anyOf": [
        {"enum": ["auto", "none", "required"]},
        {
            "type": "object",
            "properties": {
                "type": {"const": "function"},
                "function": {
                    "type": "object",
                    "properties": {"name": {"type": "string", "minLength": 1}},
                    "required": ["name"],
                },
            },
            "required": ["type", "function"],
        },
        {
            "type": "object",
            "properties": {"type": {"type": "string", "not": {"const": "function"}}},
            "required": ["type"],
            "description": "allowed_tools, or a kind of tool this server does not run (auto)",
        },
        {"type": "null"},
    ],
    "default": None,
}


class _Base(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class Sampled(_Base):
    """Fields shared by every generation request."""

    model: str | None = None
    max_tokens: OptInt = Field(
        None,
        ge=1,
        description="Absent: the server's max_tokens setting (1024 unless configured), cut to "
        "what the context leaves (not OpenAI's 16 of the legacy completions endpoint)",
    )
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: OptInt = Field(None, ge=0)
    min_p: Unit | None = None
    seed: OptInt = Field(None, ge=-(2**63), le=2**64 - 1)  # int64 or uint64
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: Annotated[
        dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None,
        WithJsonSchema(LOGIT_BIAS_SCHEMA),
    ] = None
    stop: Annotated[str | list[str] | None, WithJsonSchema(STOP_SCHEMA)] = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: OptInt = Field(1, ge=1, le=MAX_CHOICES)  # choices, each its own job (openai/choices.py)
    user: str | None = None
    adapter: str | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        if isinstance(v, list) and len(v) > 4:
            raise ValueError("at most 4 stop sequences")
        if isinstance(v, list) and not all(v):
            raise ValueError("stop sequences must be non-empty strings")
        return v

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) and self.stop else list(self.stop or [])

    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class FunctionCall(_Base):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(_Base):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Base):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[str | list[dict[str, Any]] | None, WithJsonSchema(CONTENT_SCHEMA)] = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class FunctionDef(_Base):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(_Base):
    type: Literal["function"]
    function: FunctionDef


class JSONSchemaFormat(_Base):
    name: str = Field("response", min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Base):
    """`{"type": "text"}`, `{"type": "json_object"}` or `{"type": "json_schema", "json_schema": {...}}`."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    def shape(self, field: str = "response_format") -> Shape:
        if self.type == "text":
            return Shape()
        if self.type == "json_object":
            return Shape(schema={"type": "object"}, schema_field=field)
        if self.json_schema is None:
            raise APIError(
                400,
                f"{field}.json_schema is required when type is json_schema",
                param=f"{field}.json_schema",
            )
        schema = (
            self.json_schema.schema_ if self.json_schema.schema_ is not None else {"type": "object"}
        )
        return Shape(schema=schema, schema_field=f"{field}.json_schema.schema")


class NamedFunction(_Base):
    name: str = Field(min_length=1)


class ToolChoiceFunction(_Base):
    type: Literal["function"]
    function: NamedFunction


def choice_shape(choice, parallel: bool, shape: Shape) -> Shape:
    """`tool_choice` ("auto", "required", or a named function) onto `shape`."""
    if isinstance(choice, ToolChoiceFunction):
        shape.tool_choice = named(choice.function.name)
    elif choice == "required":
        shape.tool_choice = "required"
    shape.parallel = parallel
    return shape


def check_tool_messages(messages: list[ChatMessage]) -> None:
    """As OpenAI: a `tool` message answers a call of the assistant message it follows (directly or
    after other tool messages); its tool_call_id, when both sides have ids, is one of that
    message's calls. A 400 naming the message otherwise."""
    calls: ChatMessage | None = None  # the assistant message the tool messages answer
    for i, m in enumerate(messages):
        if m.role != "tool":
            calls = m if m.role == "assistant" and m.tool_calls else None
            continue
        where = f"messages[{i}]"
        if calls is None:
            raise APIError(
                400,
                f"{where}: a 'tool' message must follow an assistant message with 'tool_calls' "
                "(or another tool message answering one)",
                param=where,
            )
        ids = {c.id for c in calls.tool_calls if c.id}
        if m.tool_call_id is not None and ids and m.tool_call_id not in ids:
            raise APIError(
                400,
                f"{where}.tool_call_id: {m.tool_call_id!r} is not among the tool_calls of the "
                f"assistant message before it ({', '.join(sorted(ids))})",
                param=f"{where}.tool_call_id",
            )


class ChatRequest(Sampled):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: OptInt = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: OptInt = Field(None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Annotated[str | dict[str, Any] | None, WithJsonSchema(TOOL_CHOICE_SCHEMA)] = None
    parallel_tool_calls: bool = True
    response_format: Annotated[ResponseFormat | None, WithJsonSchema(RESPONSE_FORMAT_SCHEMA)] = None
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("tool_choice")
    @classmethod
    def _choice(cls, v):
        if isinstance(v, dict) and v.get("type") == "function":
            try:
                return ToolChoiceFunction.model_validate(v)
            except ValueError:
                pass
        elif isinstance(v, dict) and v.get("type") == "allowed_tools":
            return v  # {"type": "allowed_tools", "allowed_tools": {"mode", "tools": [...]}}: see to_ask
        elif isinstance(v, dict) and isinstance(v.get("type"), str):
            return "auto"  # a choice among tool kinds this server does not run (custom, built-in)
        elif v is None or v in ("auto", "none", "required"):
            return v
        raise ValueError(
            "tool_choice must be auto, none, required or {type: function, function: {name}}"
        )

    def to_ask(self) -> Ask:
        schemas = [
            (t.function.parameters, f"tools[{i}].function.parameters")
            for i, t in enumerate(self.tools or [])
        ]
        check_tool_messages(self.messages)
        tools = [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None
        shape = self.response_format.shape() if self.response_format else Shape()
        choice = self.tool_choice
        if isinstance(choice, dict):  # allowed_tools: only the listed functions are offered
            spec = choice.get("allowed_tools") or choice
            allowed = {
                (t.get("function") or t).get("name")
                for t in spec.get("tools") or []
                if isinstance(t, dict)
            }
            tools = [t for t in tools or [] if t["function"]["name"] in allowed] or None
            choice = "required" if spec.get("mode") == "required" else "auto"
        return Ask(
            tool_schemas=schemas,
            messages=normalize_messages([m.model_dump(exclude_none=True) for m in self.messages]),
            tools=None if self.tool_choice == "none" else tools,
            template_kwargs=self.chat_template_kwargs,
            max_tokens=self.max_completion_tokens or self.max_tokens,
            stops=self.stop_list(),
            sampling=SamplingAsk.of(self),
            logprobs=bool(self.logprobs),
            top_logprobs=self.top_logprobs or 0,
            adapter=adapter_spec(self.adapter),
            shape=choice_shape(choice, self.parallel_tool_calls, shape),
        )


TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
PROMPT_SCHEMA = {
    "anyOf": [
        {"type": "string"},  # "" too: the model reads its BOS
        {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": MAX_CHOICES},
        TOKEN_IDS,
        {"type": "array", "items": TOKEN_IDS, "minItems": 1, "maxItems": MAX_CHOICES},
    ],
    "description": "A text, a list of texts, token ids (below the vocabulary size) or a list of "
    f"token-id lists; at most {MAX_CHOICES} prompts, and prompts x n at most {MAX_CHOICES}",
}


class CompletionRequest(Sampled):
    model_config = ConfigDict(  # (merged with _Base's)
        json_schema_extra={  # echo with logprobs: refused below
            "not": {
                "required": ["echo", "logprobs"],
                "properties": {"echo": {"const": True}, "logprobs": {"type": "integer"}},
            }
        }
    )
    prompt: Annotated[str | list[str] | list[Int] | list[list[Int]], WithJsonSchema(PROMPT_SCHEMA)]
    logprobs: OptInt = Field(None, ge=0, le=20)
    echo: bool = Field(False, description="Answer the prompt, then the completion, as one text")
    suffix: str | None = Field(
        None, json_schema_extra={"anyOf": [{"const": ""}, {"type": "null"}]}
    )  # not supported
    response_format: Annotated[ResponseFormat | None, WithJsonSchema(RESPONSE_FORMAT_SCHEMA)] = None

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("prompt is empty")
        if isinstance(v, list) and isinstance(v[0], list) and not all(v):
            raise ValueError("a token-id prompt is empty")
        return v

    @model_validator(mode="after")
    def _jobs(self):
        if len(self.prompts()) * (self.n or 1) > MAX_CHOICES:
            raise ValueError(
                f"{len(self.prompts())} prompts x n={self.n} choices: at most {MAX_CHOICES} "
                "answers in one request"
            )
        if self.echo and self.logprobs is not None:
            raise ValueError(
                "echo with logprobs (the prompt tokens' log-probabilities) is not supported"
            )
        return self

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: a text or token ids is one, a list of either several."""
        v = self.prompt
        if isinstance(v, list) and isinstance(v[0], str | list):
            return list(v)
        return [v]

    def to_ask(self, prompt: str | list[int]) -> Ask:
        """The Ask for one of `prompts()`."""
        if self.suffix:
            raise APIError(400, "suffix is not supported by this server", param="suffix")
        return Ask(
            prompt=prompt,
            max_tokens=self.max_tokens,
            stops=self.stop_list(),
            sampling=SamplingAsk.of(self),
            logprobs=self.logprobs is not None,
            top_logprobs=self.logprobs or 0,
            adapter=adapter_spec(self.adapter),
            shape=self.response_format.shape() if self.response_format else Shape(),
        )
