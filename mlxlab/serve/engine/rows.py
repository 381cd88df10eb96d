"""What both lanes do per job, the same way: its adapters, its sampler, its prompt-cache
namespace, and its output side (`RowOutput`: tokens -> Delta events -> one Done)."""

from __future__ import annotations

import logging
import time

from mlxlab.grammar import constrain
from mlxlab.serve.engine.adapters import adapter_error_code
from mlxlab.serve.engine.jobs import AdapterSpec, Delta, Done, Job, JobError, spec_name
from mlxlab.serve.engine.loaded import Loaded
from mlxlab.serve.engine.output import OutputParser

log = logging.getLogger(__name__)


def claim_adapters(m: Loaded, job: Job) -> AdapterSpec:
    """The job's adapters, checked still mounted (one may have been unmounted while the job
    waited: JobError) and counted as used."""
    try:
        m.adapters.check(job.adapter)
    except KeyError as e:
        raise JobError(str(e).strip("'\""), adapter_error_code(e)) from None
    for i in job.adapter:
        m.adapters.mounted[i].requests += 1
    return job.adapter


def cache_namespace(m: Loaded, ids: AdapterSpec) -> tuple:
    """Prompt-cache entries are kept apart per (model, adapter spec): the model by its name and
    files (`Loaded.cache_id`: one prompt cache serves every model of the server), each adapter
    by its mount token (`Mounted.token`: the cache outlives an unmount and an eviction, and an
    id mounted again may name other weights). Call after `claim_adapters` (all mounted)."""
    tokens = tuple(m.adapters.mounted[i].token for i in ids)
    return (m.cache_id, spec_name(ids), tokens)


def heal_random_state() -> bool:
    """Reseed MLX's global random state (from os.urandom) if it is broken; whether it was.

    mlx-lm's samplers are compiled with the random state as input and output: one that raises
    while being traced (any bug or unchecked input in a sampler) leaves `mx.random.state`
    holding a tracer, and every later sample fails ("eval an array without a primitive"). The
    engine calls this after a failed generation, so one bad request cannot break the server."""
    import os

    import mlx.core as mx

    try:
        mx.eval(mx.random.state)
        return False
    except Exception:  # noqa: BLE001 - the state is unusable, whatever the error says
        mx.random.seed(int.from_bytes(os.urandom(8), "little") >> 1)
        log.warning("mlxlab serve: MLX's random state was broken by a failed generation; reseeded")
        return True


def make_sampling(m: Loaded, job: Job):
    """(sampler, logits processors) for one row: mlx-lm's, then the job's grammar constraint
    (its own matcher state) last, so it masks what the others produced."""
    from mlx_lm.sample_utils import make_logits_processors, make_sampler

    s = job.sampling
    # top_k at or above the vocabulary keeps every token: off (mlx-lm refuses it, and its
    # compiled sampler raising mid-trace would poison the random state: heal_random_state).
    top_k = s.top_k if 0 < s.top_k < m.n_vocab else 0
    sampler = make_sampler(
        temp=s.temperature, top_p=s.top_p if s.top_p < 1.0 else 0.0, min_p=s.min_p, top_k=top_k
    )
    processors = make_logits_processors(
        s.logit_bias, s.repetition_penalty, 64, s.presence_penalty, 64, s.frequency_penalty, 64
    )
    if job.grammar is not None:
        processors.append(constrain(job.grammar, m.tokenizer, m.n_vocab))
    return sampler, processors


class RowOutput:
    """One job's output side, the same in both lanes: token -> (eos, hidden tokens, streaming
    detokenizer, stop strings, tool/reasoning parser) -> Delta events; `close` sends the last
    Deltas and makes the Done, which the gateway sends once it has counted the job
    (`Gateway._finish`)."""

    def __init__(self, m: Loaded, job: Job):
        self.m, self.job = m, job
        self.parser = OutputParser(job.stops, m.tool, job.tools, m.think, job.reasoning)
        self.detok = m.tokenizer.detokenizer  # a fresh copy per call
        self.detok.reset()
        self.tokens: list[int] = []
        self.t0 = time.perf_counter()
        self.ttft = 0.0
        # the logprobs of tokens not yet known to be text or markup (`_send`)
        self.held: list[dict] = []
        self.slow_logged = False
        self.speculation = None  # the row's speculative.Counts, set by the lane

    def _send(self, deltas, lp=None, before: str = "content", final: bool = False) -> None:
        """Sink the parser's (kind, text) deltas with the logprobs of the tokens that made them.

        A token that shows no text still sends its logprobs, in a Delta of no text whose kind
        says what the token was: "reasoning" (a think marker, reasoning held back), "markup"
        (tool-call markup, a matched stop sequence, a special token never shown, whitespace
        dropped after a call) or "content" (part of a character). While that is not yet known
        (the parser holds back text that may start a marker, or is inside a call) the logprobs
        wait in `held`, and go with the text when it is released, or as markup when it turns
        out to be a marker, so an encoder that keeps the answer text's own logprobs (Responses'
        output_text) gets exactly those. `before`: the parser's state before the token;
        `final`: the answer is over, nothing held can become text any more."""
        sink, parser = self.job.sink, self.parser
        held, self.held = self.held + (lp or []), []
        if parser.stopped is not None:  # the stop text is not the answer's, nor its logprobs
            for kind, text in deltas:
                sink(Delta(kind, text))
            if held:
                sink(Delta("markup", "", held))
            return
        for i, (kind, text) in enumerate(deltas):
            sink(Delta(kind, text, (held or None) if i == len(deltas) - 1 else None))
        if deltas or not held:
            return
        after = parser.state
        if before != after:  # a marker: into or out of a call or the reasoning
            sink(Delta("markup" if "tool" in (before, after) else "reasoning", "", held))
        elif after == "reasoning":
            sink(Delta("reasoning", "", held))
        elif final:
            sink(Delta("markup", "", held))
        elif after == "tool" or parser.pending:
            self.held = held  # a call's markup, or text that may yet start a marker
        else:
            sink(Delta("content", "", held))

    def feed(self, token: int, logprobs) -> str | None:
        """Take one generated token; the finish reason when the row must stop here, else None."""
        job = self.job
        if not self.tokens:
            self.ttft = time.perf_counter() - self.t0
        self.tokens.append(token)
        if job.slow_s and not self.slow_logged and time.perf_counter() - self.t0 > job.slow_s:
            self.log_slow()
        if job.cancelled.is_set():
            return "cancelled"
        if token in self.m.eos:
            return "stop"
        lp = (
            token_logprobs(self.m.tokenizer, token, logprobs, job.top_logprobs)
            if job.logprobs
            else None
        )
        before = self.parser.state
        if token in self.m.hidden:  # never shown: markup, in its place among any held tokens
            if self.held:
                self.held += lp or []
            elif lp:
                job.sink(Delta("markup", "", lp))
            return None
        self.detok.add_token(token)
        self._send(self.parser.feed(self.detok.last_segment), lp, before)
        return "stop" if self.parser.stopped is not None else None

    def log_slow(self) -> None:
        """One warning for an answer still generating after `job.slow_s` (serve.read_timeout_s),
        saying whether its max_tokens was the server's default: a client that sent none (OpenAI's
        legacy /v1/completions stops at 16) may give up long before it ends."""
        self.slow_logged = True
        job = self.job
        default = (
            "; the request gave no max_tokens, so the server's default applies (serve.max_tokens, "
            "clamped to what fits)"
            if job.default_limit
            else ""
        )
        log.warning(
            "mlxlab serve: %s has generated for %.1f s (past serve.read_timeout_s=%g), "
            "%d of max_tokens=%d tokens so far%s",
            job.id or "a request",
            time.perf_counter() - self.t0,
            job.slow_s,
            len(self.tokens),
            job.max_tokens,
            default,
        )

    def close(self, finish: str) -> Done:
        """Send what the parser still holds; the job's Done (not sent: `Gateway._finish` sends
        it after counting the job and releasing its lease, so a client that reads /stats right
        after its answer sees it counted)."""
        parser = self.parser
        self.detok.finalize()
        if parser.stopped is None and finish != "cancelled":
            tail = parser.feed(self.detok.last_segment) + parser.finish()
            self._send(tail, None, parser.state, final=True)
        if parser.calls and finish != "cancelled":
            # Also when max_tokens cut a later call: that call is dropped and the complete ones
            # are the whole answer (a small model forced to call repeats its call until cut;
            # "length" would make SDK helpers such as chat.completions.parse raise).
            finish = "tool_calls"
        return Done(
            finish,
            len(self.job.prompt),
            len(self.tokens),
            self.job.cached_tokens,
            parser.calls,
            parser.stopped,
            time.perf_counter() - self.t0,
            self.ttft,
            list(self.tokens),
            self.speculation.as_dict() if self.speculation is not None else None,
        )


def token_logprobs(tok, token: int, logprobs, top: int) -> list[dict]:
    """The chosen token's logprob and the `top` most likely alternatives; tokens a grammar ruled
    out (-inf) are not alternatives (JSON has no infinity)."""
    import math

    import mlx.core as mx

    def entry(tid: int, lp: float) -> dict:
        text = tok.decode([tid])
        return {
            "token": text,
            "logprob": lp if math.isfinite(lp) else -9999.0,
            "bytes": list(text.encode("utf-8")),
        }

    e = entry(token, logprobs[token].item())
    if top:
        ids = mx.argpartition(-logprobs, top - 1)[:top]
        vals = logprobs[ids]
        pairs = sorted(zip(ids.tolist(), vals.tolist(), strict=True), key=lambda p: -p[1])
        e["top_logprobs"] = [entry(i, v) for i, v in pairs if math.isfinite(v)]
    else:
        e["top_logprobs"] = []
    return [e]
