"""The normalized request and its rendering: the part of the request path (pipeline.py) that
knows what a request says.

- `Ask` (with `SamplingAsk`) is one generation request normalized at the edge of its protocol
  (chat messages in the chat-template form, or a completion prompt; the sampling fields the client
  gave; stops, tools, limits; the adapter spec already parsed). Nothing below re-parses a request.
  `adapter_spec`, `text_of` and `normalize_messages` are the helpers the protocols' `to_ask` use.
- `render_chat` / `render_text` turn it into prompt tokens (a template's refusal is a 400 naming
  the message, `template_refusal`); `resolve_sampling` fills the sampling defaults (request >
  serve flag > the model's generation_config.json > fallback); `completion_limit` is the job's
  max_tokens under memory admission. `pipeline.make_job` calls them on the render thread.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

from mlxlab.serve import vision
from mlxlab.serve.config import ServeConfig
from mlxlab.serve.engine.jobs import AdapterSpec, Sampling, parse_adapter_spec
from mlxlab.serve.engine.loaded import Loaded
from mlxlab.serve.http import APIError
from mlxlab.serve.structured import Shape

FALLBACK = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0}


# --- the normalized request ------------------------------------------------------------------


@dataclass
class SamplingAsk:
    """The sampling fields as the client sent them (None: not given)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    @classmethod
    def of(cls, body) -> SamplingAsk:
        """The fields a request model has (each protocol offers a subset)."""
        return cls(
            **{
                f.name: getattr(body, f.name)
                for f in dataclasses.fields(cls)
                if hasattr(body, f.name)
            }
        )


@dataclass
class Ask:
    """One generation request, normalized at the edge of its protocol."""

    messages: list[dict] | None = None  # chat, in the chat-template form (normalize_messages)
    messages_field: str = "messages"  # the request field they came from, for errors
    origins: list[str] | None = None  # the request field of each message (None: messages[i])
    prompt: str | list[int] | None = None  # a completion prompt: text or token ids
    tools: list[dict] | None = None  # function tools offered to the model
    tool_schemas: list[tuple] = field(default_factory=list)  # (schema, field) of every tool sent
    template_kwargs: dict | None = None
    max_tokens: int | None = None  # None: the serve default, clamped to what fits
    stops: list[str] = field(default_factory=list)
    sampling: SamplingAsk = field(default_factory=SamplingAsk)
    logprobs: bool = False
    top_logprobs: int = 0
    adapter: AdapterSpec = ()
    shape: Shape = field(default_factory=Shape)  # structured output, forced tool calls


def adapter_spec(spec: str | None) -> AdapterSpec:
    """The request's `adapter` field parsed ("none", "a", "a+b"); 400 when malformed."""
    try:
        return parse_adapter_spec(spec)
    except ValueError as e:
        raise APIError(400, str(e), param="adapter", code="unknown_adapter") from None


def text_of(content, where: str, text_kinds=("text", "input_text", "output_text")) -> str:
    """A message's content as text: a string, or text parts joined; images are refused (they
    belong in user messages: `vision.user_content`). `text_kinds`: the part types that carry
    text in the caller's protocol."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}: must be a string or a list of content parts", param=where)
    parts = []
    for part in content:
        if not isinstance(part, dict):
            raise APIError(400, f"{where}: each content part must be an object", param=where)
        kind = part.get("type")
        if kind in text_kinds:
            if not isinstance(part.get("text"), str):
                raise APIError(400, f"{where}: a text part needs a string 'text'", param=where)
            parts.append(part["text"])
        elif kind in ("image_url", "input_image", "image"):
            raise APIError(
                400,
                f"{where}: images are accepted in user messages only",
                param=where,
                code="vision_not_supported",
            )
        else:
            raise APIError(400, f"{where}: unsupported content part type {kind!r}", param=where)
    return "".join(parts)


def normalize_messages(messages: list[dict]) -> list[dict]:
    """OpenAI chat messages -> what chat templates take (text content, tool-call arguments as objects)."""
    out = []
    for i, m in enumerate(messages):
        role = "system" if m["role"] == "developer" else m["role"]
        where = f"messages[{i}].content"
        images = vision.user_content(m.get("content"), where) if role == "user" else None
        msg = {"role": role, "content": images or text_of(m.get("content"), where)}
        if m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                fn = dict(c["function"])
                if isinstance(fn.get("arguments"), str):
                    try:
                        fn["arguments"] = json.loads(fn["arguments"] or "{}")
                    except json.JSONDecodeError as e:
                        raise APIError(
                            400,
                            f"messages[{i}].tool_calls: arguments are not JSON ({e})",
                            param=f"messages[{i}].tool_calls",
                        ) from None
                calls.append({"id": c.get("id"), "type": "function", "function": fn})
            msg["tool_calls"] = calls
        for key in ("name", "tool_call_id", "reasoning_content"):
            if m.get(key) is not None:
                msg[key] = m[key]
        out.append(msg)
    return out


# --- rendering and sampling ---------------------------------------------------------------------


def template_refusal(e: Exception, messages: list[dict], origins: list[str] | None) -> APIError:
    """The 400 for messages the chat template rejected: naming the first message that repeats
    the role before it (what templates that insist on alternating turns reject), if one does.
    Templates that render such turns (mlxlab's own, most others) get them as they are."""
    for i in range(1, len(messages)):
        role = messages[i]["role"]
        if role in ("user", "assistant") and messages[i - 1]["role"] == role:
            where = origins[i] if origins else f"messages[{i}]"
            return APIError(
                400,
                f"{where}: this model's chat template does not take two {role} messages in a "
                f"row (merge them into one): {e}",
                param=where,
            )
    return APIError(400, f"the chat template rejected these messages: {e}", param="messages")


def render_chat(
    loaded: Loaded,
    messages: list[dict],
    tools: list[dict] | None = None,
    template_kwargs: dict | None = None,
    origins: list[str] | None = None,
) -> tuple[list[int], int, bool]:
    """(prompt tokens, end of the system prompt in tokens or 0, starts inside a reasoning block);
    `origins`: the request field of each message, for errors."""
    tok = loaded.tokenizer
    if not getattr(tok, "chat_template", None):
        raise APIError(400, "the model has no chat template; use /v1/completions")
    kwargs = dict(template_kwargs or {})
    if tools:
        kwargs["tools"] = tools
    try:
        prompt = tok.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, **kwargs
        )
    except Exception as e:  # jinja's TemplateError and friends: the messages do not fit it
        raise template_refusal(e, messages, origins) from None
    prompt = list(prompt)
    checkpoint = 0
    n_system = next((i for i, m in enumerate(messages) if m["role"] != "system"), len(messages))
    if 0 < n_system < len(messages):
        try:
            head = tok.apply_chat_template(
                messages[:n_system] + [{"role": "user", "content": ""}], tokenize=True, **kwargs
            )
            checkpoint = next(
                (i for i, (a, b) in enumerate(zip(head, prompt, strict=False)) if a != b), 0
            )
        except Exception:
            checkpoint = 0
    reasoning = False
    if loaded.think:
        start = tok.rfind_think_start(prompt) if hasattr(tok, "rfind_think_start") else -1
        end = tok.rfind_think_end(prompt) if hasattr(tok, "rfind_think_end") else -1
        reasoning = start > end
    return prompt, checkpoint if checkpoint >= 16 else 0, reasoning


def render_text(loaded: Loaded, prompt: str | list[int]) -> list[int]:
    if isinstance(prompt, list):
        vocab = loaded.tokenizer.vocab_size
        if any(t < 0 or t >= vocab for t in prompt):
            raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
        return list(prompt)
    tokens = list(loaded.tokenizer.encode(prompt))
    if not tokens:
        raise APIError(400, "prompt is empty", param="prompt")
    return tokens


def resolve_sampling(ask: SamplingAsk, cfg: ServeConfig, loaded: Loaded) -> Sampling:
    """Request > serve flag > the model's generation_config.json > built-in fallback."""
    values = {}
    for key in ("temperature", "top_p", "top_k", "min_p"):
        for source in (getattr(ask, key), getattr(cfg, key), loaded.generation_config.get(key)):
            if source is not None:
                values[key] = source
                break
        else:
            values[key] = FALLBACK[key]
    rep = ask.repetition_penalty
    if rep is None:
        rep = loaded.generation_config.get("repetition_penalty")
    bias = None
    if ask.logit_bias:
        bias = {}
        for k, v in ask.logit_bias.items():
            vocab = loaded.tokenizer.vocab_size
            if not (k.isascii() and k.isdigit()) or len(k) > 12 or int(k) >= vocab:
                raise APIError(
                    400,
                    f"logit_bias key {k[:24]!r}{'...' if len(k) > 24 else ''} is not a token id "
                    "of this model",
                    param="logit_bias",
                )
            bias[int(k)] = v
    return Sampling(
        temperature=float(values["temperature"]),
        top_p=float(values["top_p"]),
        top_k=int(values["top_k"]),
        min_p=float(values["min_p"]),
        seed=None if ask.seed is None else ask.seed % 2**64,  # MLX seeds are uint64
        repetition_penalty=rep if rep and rep != 1.0 else None,
        presence_penalty=ask.presence_penalty or None,
        frequency_penalty=ask.frequency_penalty or None,
        logit_bias=bias,
    )


def completion_limit(
    loaded: Loaded, cfg: ServeConfig, prompt_len: int, requested: int | None
) -> int:
    """max_tokens for the job; raises the memory-admission 400 when the request cannot fit."""
    ceiling = loaded.admission.max_safe_context
    if requested is None:
        room = ceiling - prompt_len
        if room >= 1:
            return min(cfg.max_tokens, room)
        requested = cfg.max_tokens
    reason = loaded.admission.check(prompt_len, requested)
    if reason:
        raise APIError(
            400, reason, type="memory_admission", param="max_tokens", code="context_over_budget"
        )
    return requested
