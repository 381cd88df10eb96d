"""From decoded text increments to what a client may see: content and reasoning deltas, stop
sequences, tool calls.

One `OutputParser` per request. It is fed the text the streaming detokenizer releases (so
incomplete UTF-8 never reaches it) and returns `(kind, text)` deltas, kind "content" or
"reasoning". It never releases:

- any part of a stop sequence: text that could be the start of one is held back until the
  next increment decides; a match ends the output (`stopped`), the stop text excluded;
- tool-call markup: from the family's start marker to its end marker the text is buffered and
  parsed into `calls` by mlx-lm's parser for that family (Gemma 4 `<|tool_call>call:f{...}
  <tool_call|>`, Qwen/Hermes `<tool_call>{json}</tool_call>`, MiniCPM `<function name=...>`).
  Markup that does not parse, or names a tool the request did not offer, is released as plain
  content instead, so a malformed call is never an error; whitespace between or after calls
  is not content; a call cut by the end of generation (max_tokens) after complete calls, even
  inside its start marker, is dropped (`cut_call`), the complete ones being the answer (finish
  reason `tool_calls`);
- the reasoning markers: text between think-start and think-end is "reasoning".

Stop sequences are matched on decoded text (so one spanning tokens fires) in content and
reasoning, not inside tool markup.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from mlxlab import grammar as G


@dataclass(frozen=True)
class ToolSyntax:
    """A model family's tool-call markup and mlx-lm's parser for the text between the markers."""

    start: str
    end: str
    parse: Callable  # (text between markers, tools) -> {name, arguments} or a list of them
    family: str = ""


def tool_syntax(tokenizer) -> ToolSyntax | None:
    """The tokenizer's tool-call syntax, as mlx-lm infers it from the chat template or vocab."""
    start = getattr(tokenizer, "tool_call_start", None)
    parse = getattr(tokenizer, "tool_parser", None)
    if not start or parse is None:
        return None
    family = getattr(parse, "__module__", "").rsplit(".", 1)[-1]
    return ToolSyntax(start, tokenizer.tool_call_end or "", parse, family)


def think_markers(tokenizer) -> tuple[str, str] | None:
    if getattr(tokenizer, "has_thinking", False):
        return tokenizer.think_start, tokenizer.think_end
    return None


def _holdback(text: str, markers: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some marker."""
    best = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:n]):
                best = n
                break
    return best


def _as_parsed(tools):
    """The offered tools as a family's parser reads them: parameters with their local `$ref`s
    inlined, as the call's grammar has them (MiniCPM's parser converts each value by its
    property's declared `type`, which a `$ref` hides). A schema that cannot be inlined stays."""
    out = []
    for t in tools or []:
        fn = t.get("function", t) if isinstance(t, dict) else None
        params = fn.get("parameters") if isinstance(fn, dict) else None
        if isinstance(params, dict):
            try:
                fn = {**fn, "parameters": G.inline_refs(params)}
                t = {**t, "function": fn} if "function" in t else fn
            except G.GrammarError:
                pass
        out.append(t)
    return out


def _tool_names(tools) -> set[str]:
    names = set()
    for t in tools or []:
        fn = t.get("function", t) if isinstance(t, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            names.add(fn["name"])
    return names


class OutputParser:
    def __init__(
        self,
        stops: list[str] | None = None,
        tool: ToolSyntax | None = None,
        tools=None,
        think: tuple[str, str] | None = None,
        reasoning: bool = False,
    ):
        self.stops = [s for s in (stops or []) if s]
        self.tool = tool if tools else None  # markup is parsed only when tools were offered
        self.tools = _as_parsed(tools)
        self.names = _tool_names(tools)
        self.think = think
        self.state = "reasoning" if (reasoning and think) else "content"
        self.pending = ""
        self.stopped: str | None = None
        self.calls: list[dict] = []
        self.cut_call: str | None = None  # the markup of a call cut by the end of generation

    def _markers(self) -> list[tuple[str, str]]:
        """(marker, what it does) active in the current state."""
        if self.state == "tool":
            return [(self.tool.end, "tool_end")] if self.tool.end else []
        out = [(s, "stop") for s in self.stops]
        if self.state == "content":
            if self.tool:
                out.append((self.tool.start, "tool_start"))
            if self.think:
                out.append((self.think[0], "think_start"))
        elif self.state == "reasoning" and self.think:
            out.append((self.think[1], "think_end"))
        return out

    def feed(self, text: str) -> list[tuple[str, str]]:
        if self.stopped is not None:
            return []
        self.pending += text
        out: list[tuple[str, str]] = []
        while True:
            markers = self._markers()
            hits = [
                (self.pending.find(m), -len(m), m, action)
                for m, action in markers
                if m in self.pending
            ]
            if not hits:
                if self.state == "tool":
                    return out  # markup is withheld until its end marker (or the end)
                keep = _holdback(self.pending, [m for m, _ in markers])
                if self.calls and not self.pending[: len(self.pending) - keep].strip():
                    keep = len(self.pending)  # whitespace after a call waits: a call may follow
                emit = self.pending[: len(self.pending) - keep]
                self.pending = self.pending[len(emit) :]
                if emit:
                    out.append((self.state, emit))
                return out
            at, _, marker, action = min(hits)
            before, self.pending = self.pending[:at], self.pending[at + len(marker) :]
            if action == "tool_end":
                self._close_tool(before, out, marker)
                continue
            if before and not (action == "tool_start" and self.calls and not before.strip()):
                out.append((self.state, before))  # (whitespace between two calls is not content)
            if action == "stop":
                self.stopped, self.pending = marker, ""
                return out
            self.state = {"tool_start": "tool", "think_start": "reasoning", "think_end": "content"}[
                action
            ]

    def _close_tool(self, body: str, out: list, end_marker: str) -> None:
        self.state = "content"
        if not end_marker and self.calls:
            # Generation ended inside a call after complete ones (max_tokens while the model
            # wrote another): the complete calls are the answer; the cut one is not text.
            try:
                self.calls.extend(self._parsed(body))
            except Exception:
                self.cut_call = body
            return
        try:
            self.calls.extend(self._parsed(body))
        except Exception:
            # Not a well-formed call: the markup is plain text after all.
            out.append(("content", self.tool.start + body + end_marker))

    def _parsed(self, body: str) -> list[dict]:
        """The calls in one markup body (mlx-lm's parser), checked against the offered tools."""
        parsed = self.tool.parse(body, self.tools)
        new = []
        for c in parsed if isinstance(parsed, list) else [parsed]:
            name, args = c["name"], c.get("arguments", {})
            if self.names and name not in self.names:
                raise ValueError(f"unknown tool {name!r}")
            if isinstance(args, str):
                args = json.loads(args)
            if not isinstance(args, dict):
                raise ValueError("arguments must be an object")
            new.append(
                {
                    "id": "call_" + uuid.uuid4().hex[:24],
                    "name": name,
                    "arguments": json.dumps(args, ensure_ascii=False),
                }
            )
        return new

    def finish(self) -> list[tuple[str, str]]:
        """Release what is left at the end of generation (held-back text, unterminated markup)."""
        out: list[tuple[str, str]] = []
        if self.stopped is not None:
            return out
        if self.state == "tool":
            self._close_tool(self.pending, out, "")
        elif self.calls and self.tool.start.startswith(self.pending.strip()):
            # After complete calls: whitespace, or the start marker of a further call that
            # the end of generation cut before it was whole (`\n<` of `<tool_call>`).
            if self.pending.strip():
                self.cut_call = ""
        elif self.pending:
            out.append((self.state, self.pending))
        self.pending = ""
        return out
