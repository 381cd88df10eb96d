"""What crosses into the engine and back: a `Job` (token prompt, resolved sampling, stops, tools,
parsed adapter spec, sink) and its events, `Delta`s then exactly one `Done` or `Failed`.

A job is built once at the edge of a protocol (`serve/pipeline.py`); nothing below re-parses a
request. Setting `job.cancelled` (client gone) stops its generation before the next token;
`job.abort(reason)` (the server shutting down) does too, and its client is told why.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from mlxlab.grammar import Grammar

AdapterSpec = tuple[str, ...]  # () is the base model; ("a", "b") stacks a then b


@dataclass
class Sampling:
    """Resolved sampling settings (request > serve flag > generation_config.json > fallback)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[int, float] | None = None


@dataclass
class Delta:
    kind: str  # content | reasoning (| markup: no text, the logprobs of tokens that are neither)
    text: str
    logprobs: list[dict] | None = None


@dataclass
class Done:
    finish_reason: str  # stop | length | tool_calls | cancelled
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    tool_calls: list[dict] = field(default_factory=list)
    stop_sequence: str | None = None
    seconds: float = 0.0
    ttft: float = 0.0
    tokens: list[int] = field(default_factory=list)  # the generated token ids
    speculation: dict | None = None
    """Its drafted and accepted tokens (`speculative.Counts.as_dict`), when speculative."""


@dataclass
class Failed:
    message: str
    status: int = 500  # the HTTP status of a response that has not started
    code: str | None = None


Event = Delta | Done | Failed


@dataclass
class Job:
    prompt: list[int]
    max_tokens: int
    sink: Callable[[Event], None] | None
    sampling: Sampling = field(default_factory=Sampling)
    stops: list[str] = field(default_factory=list)
    tools: list | None = None
    reasoning: bool = False  # the prompt ends inside a reasoning block
    logprobs: bool = False
    top_logprobs: int = 0
    adapter: AdapterSpec = ()
    checkpoint: int = (
        0  # store a prompt-cache checkpoint at this prefix length (end of the system prompt)
    )
    grammar: Grammar | None = (
        None  # the output must match it (structured output, forced tool calls)
    )
    id: str = ""
    cached_tokens: int = (
        0  # prompt tokens the prompt cache supplied: set by the lane before any event
    )
    cancelled: threading.Event = field(default_factory=threading.Event)
    aborted: str | None = None  # why the server cut it (a shutdown), when it did
    # A prompt with images (mlxlab.vision.model.Inputs, `prompt` is its token ids): it runs
    # through mlx-vlm on the serial lane (engine/vision.py), without the prompt cache.
    vision: object | None = None
    preamble: str = ""  # text the answer begins with, before the model's (the image table)
    # max_tokens was not given: the server's default (serve.max_tokens, clamped to what fits)
    default_limit: bool = False
    # Log once when the answer is still generating after this many seconds (serve.read_timeout_s:
    # a client with a timeout of that order is giving up); 0: never.
    slow_s: float = 0.0
    # The request's hold on its model (engine/models.py `Lease`): the lanes it runs on; the
    # engine releases it when the job leaves. None: the default model's lanes.
    lease: object | None = None

    def abort(self, reason: str) -> None:
        """Stop the job before its next token for a reason of the server's: its client gets
        `reason` as a 503 (or a stream's error event), not a cut answer."""
        self.aborted = reason
        self.cancelled.set()


class QueueFull(Exception):
    pass


class NotReady(Exception):
    pass


class ShuttingDown(NotReady):
    """The server is shutting down: no new job starts."""


class JobError(Exception):
    """A job that cannot run as asked (e.g. its adapter was unmounted while it waited): a 400
    with `code`."""

    def __init__(self, message: str, code: str | None = None):
        super().__init__(message)
        self.code = code


def parse_adapter_spec(spec: str | None) -> AdapterSpec:
    """ "none" / "base" / None -> (); "a+b" -> ("a", "b"); ValueError when malformed."""
    if spec is None or spec in ("", "none", "base"):
        return ()
    ids = tuple(s.strip() for s in spec.split("+"))
    if not all(ids):
        raise ValueError(f"malformed adapter spec {spec!r} (use an id, 'a+b', or 'none')")
    return ids


def spec_name(ids: AdapterSpec) -> str:
    """The spec as clients write it: "none", "a" or "a+b"."""
    return "+".join(ids) or "none"
