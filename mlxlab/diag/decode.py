"""Where one decode step's time goes, against this machine's memory bandwidth.

    python -m mlxlab diag decode [model=gemma3-270m] [length=256] [decode_steps=16]

A decode step reads every weight once (and each layer's K/V cache), so its floor is
bytes read / memory bandwidth. The profile times a step by op group: the embedding, the layers'
projections (attention and MLP), attention over the cache (RoPE, the cache update, SDPA: what a
layer's attention does besides its projections and norms), norms, the rest of each layer
(residual adds, activations), the LM head, and sampling; each with the bytes it reads and the
GB/s that makes. Groups are timed by wrapping the model's own modules for the profiled steps
(each wrapper evaluates its input before starting the clock and its output before stopping it),
so the sum of the groups carries some synchronization overhead; the step's plain time (no
wrappers) is measured separately and is the figure the bound is held against.

The bandwidth is measured here, not assumed: numpy's sum over a 512 MB float64 array (which
its vector units sum faster than the memory delivers it), on one thread and on all cores.
"""

from __future__ import annotations

import logging
import os
import statistics
import threading
import time
from collections import defaultdict

log = logging.getLogger(__name__)

GROUPS = (
    "embedding",
    "attn projections",
    "attention (cache, sdpa)",
    "mlp projections",
    "mlp activation",
    "norms",
    "residual / other",
    "lm head",
    "sampling",
)
ATTN_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "wqkv")


def measure_bandwidth(mb: int = 512, rounds: int = 5) -> dict:
    """Read bandwidth in GB/s: numpy sums a `mb` MB array (as float64, which its vector units
    sum faster than the memory delivers it) on one thread and on every core at once."""
    import numpy as np

    a = np.ones(mb * 2**20 // 8, dtype=np.float64)
    a.sum()
    best1 = min(_timed(a.sum) for _ in range(rounds))
    n = os.cpu_count() or 1
    parts = np.array_split(a, n)

    def all_threads():  # numpy releases the GIL while it sums
        threads = [threading.Thread(target=p.sum) for p in parts]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    bestn = min(_timed(all_threads) for _ in range(rounds))
    return {
        "one_thread_gbps": round(a.nbytes / best1 / 1e9, 2),
        "all_threads_gbps": round(a.nbytes / bestn / 1e9, 2),
        "threads": n,
    }


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _nbytes(module) -> int:
    """The bytes a decode step reads from `module`'s parameters: a decode module's weight as it
    reads it (its bf16 copy, when it has one: models/fastdecode.py)."""
    from mlx.utils import tree_flatten

    from mlxlab.models.fastdecode import _DecodeWeight

    n = sum(v.nbytes for _, v in tree_flatten(module.parameters()))
    if isinstance(module, _DecodeWeight):
        n += module._decode_weight().nbytes - module["weight"].nbytes
    return n


class _Clock:
    """Inclusive times of the wrapped calls of one step; exclusive = inclusive - children."""

    def __init__(self):
        self.stack: list[list[float]] = []  # per open call: [children's time]
        self.times: dict[str, float] = defaultdict(float)

    def call(self, group: str | None, fn, *args, **kwargs):
        import mlx.core as mx

        mx.eval([a for a in args if isinstance(a, mx.array)])
        self.stack.append([0.0])
        t = time.perf_counter()
        out = fn(*args, **kwargs)
        mx.eval(out)
        spent = time.perf_counter() - t
        children = self.stack.pop()[0]
        if self.stack:
            self.stack[-1][0] += spent
        if group:
            self.times[group] += spent - children
        return out


def _wrapper_class():
    import mlx.nn as nn

    class Timed(nn.Module):
        """Stands in for one module of the model while it is profiled."""

        def __init__(self, inner, group, clock):
            super().__init__()
            object.__setattr__(self, "_inner", inner)
            object.__setattr__(self, "_group", group)
            object.__setattr__(self, "_clock", clock)

        def __call__(self, *args, **kwargs):
            return self._clock.call(self._group, self._inner, *args, **kwargs)

        def as_linear(self, x):  # a tied embedding used as the LM head
            return self._clock.call("lm head", self._inner.as_linear, x)

        def __getattr__(self, name):
            try:
                return super().__getattr__(name)
            except AttributeError:
                return getattr(self._inner, name)

    return Timed


def _group_of(path: str, module) -> str | None:
    """The op group a module's own (exclusive) time counts towards, or None: not wrapped."""
    import mlx.nn as nn

    name = path.rsplit(".", 1)[-1]
    if "norm" in name.lower() or type(module).__name__.lower().endswith("norm"):
        return "norms"
    if path.endswith("embed_tokens"):
        return "embedding"
    if name == "lm_head":
        return "lm head"
    is_linear = isinstance(module, (nn.Linear, nn.QuantizedLinear)) or hasattr(module, "linear")
    if is_linear:
        return "attn projections" if name in ATTN_PROJECTIONS else "mlp projections"
    if name in ("self_attn", "attn", "attention"):
        return "attention (cache, sdpa)"
    if name in ("mlp", "feed_forward", "ffn"):
        return "mlp activation"
    if name.isdigit() and ".layers" in f".{path}":
        return "residual / other"
    return None


def _instrument(model, clock, undo: list) -> None:
    """Wrap the model's modules in place, recording each in `undo` [(parent, key, module)] as
    it goes (so a failure part-way can still be undone)."""
    Timed = _wrapper_class()
    modules = dict(model.named_modules())  # resolved before any is replaced
    modules[""] = model
    for path, module in list(modules.items()):
        group = _group_of(path, module) if path else None
        if group is None:
            continue
        parent_path, _, key = path.rpartition(".")
        if parent_path in modules:
            container = modules[parent_path]
        else:  # a list of modules, e.g. model.layers
            owner, _, attr = parent_path.rpartition(".")
            container = getattr(modules[owner], attr)
        wrapped = Timed(module, group, clock)
        if isinstance(container, list):
            container[int(key)] = wrapped
        else:
            setattr(container, key, wrapped)
        undo.append((container, key, module))


def _restore(undo) -> None:
    for container, key, module in reversed(undo):
        if isinstance(container, list):
            container[int(key)] = module
        else:
            setattr(container, key, module)


def _group_bytes(model, cache) -> dict[str, int]:
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    from mlxlab.models.fastdecode import lm_head

    out: dict[str, int] = defaultdict(int)
    tied = isinstance(lm_head(model), nn.Embedding)
    for path, module in model.named_modules():
        if not path:
            continue
        group = _group_of(path, module)
        if group in ("attention (cache, sdpa)", "mlp activation", "residual / other", None):
            continue
        if group == "embedding":
            # The lookup reads one row; the tied head reads them all.
            weight = module.parameters().get("weight")
            rows = weight.shape[0] if weight is not None else 1
            out["embedding"] += _nbytes(module) // max(rows, 1)
            if tied:
                out["lm head"] += _nbytes(module)
            continue
        out[group] += _nbytes(module)
    for c in cache:  # K/V as stored (a quantized cache's state nests its parts)
        out["attention (cache, sdpa)"] += sum(
            a.nbytes for _, a in tree_flatten(c.state) if hasattr(a, "nbytes")
        )
    return dict(out)


def profile(model, prompt_ids: list[int], steps: int = 16) -> dict:
    """Time `steps` greedy decode steps after a prefill of `prompt_ids`, plain and by group."""
    import mlx.core as mx
    from mlx_lm.generate import generation_stream
    from mlx_lm.models.cache import make_prompt_cache

    def prefill():
        cache = make_prompt_cache(model)
        with mx.stream(generation_stream):
            logits = model(mx.array(prompt_ids)[None], cache=cache)
            mx.eval(logits, [c.state for c in cache])
        return cache, int(mx.argmax(logits[0, -1]).item())

    def step(token, cache):
        logits = model(mx.array([[token]]), cache=cache)
        nxt = mx.argmax(logits[0, -1])
        mx.eval(nxt)
        return int(nxt.item())

    # Plain steps: the figure the bound is held against.
    cache, token = prefill()
    step(token, cache)  # warm-up
    plain = []
    with mx.stream(generation_stream):
        for _ in range(steps):
            t = time.perf_counter()
            token = step(token, cache)
            plain.append(time.perf_counter() - t)
    group_bytes = _group_bytes(model, cache)

    cache, token = prefill()
    clock = _Clock()
    undo: list = []
    per_step: dict[str, list[float]] = defaultdict(list)
    totals = []
    try:
        _instrument(model, clock, undo)
        with mx.stream(generation_stream):
            for i in range(steps + 1):
                clock.times.clear()
                t = time.perf_counter()
                logits = model(mx.array([[token]]), cache=cache)
                mx.eval(logits)
                s = time.perf_counter()
                nxt = mx.argmax(logits[0, -1])
                mx.eval(nxt)
                clock.times["sampling"] += time.perf_counter() - s
                token = int(nxt.item())
                if i == 0:
                    continue  # warm-up
                totals.append(time.perf_counter() - t)
                for g in GROUPS:
                    per_step[g].append(clock.times.get(g, 0.0))
    finally:
        _restore(undo)
    step_s = statistics.median(plain)
    groups = {}
    for g in GROUPS:
        seconds = statistics.median(per_step[g]) if per_step[g] else 0.0
        nbytes = group_bytes.get(g, 0)
        groups[g] = {
            "ms": round(seconds * 1e3, 3),
            "mb": round(nbytes / 1e6, 2),
            "gbps": round(nbytes / seconds / 1e9, 2) if seconds > 0 and nbytes else None,
        }
    return {
        "context_tokens": len(prompt_ids),
        "steps": steps,
        "step_ms": round(step_s * 1e3, 3),
        "step_ms_min": round(min(plain) * 1e3, 3),
        "tok_per_s": round(1 / step_s, 2),
        "instrumented_step_ms": round(statistics.median(totals) * 1e3, 3),
        "bytes_read_mb": round(sum(group_bytes.values()) / 1e6, 2),
        "groups": groups,
    }


# A fixed English text for the head copy's agreement figures.
TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "developed a system of movable metal type in the German city of Mainz. Before his invention, "
    "books were copied by hand, a slow and expensive process that kept them out of reach of most "
    "people. The new machines spread quickly across Europe, and within fifty years millions of "
    "books had been printed. Cheaper books helped more people learn to read, and ideas travelled "
    "faster than ever before. Scholars could compare the same text in distant cities, errors "
    "could be corrected in later editions, and the price of a book fell to a fraction of what a "
    "hand-copied manuscript had cost. Within a century the printed page had changed religion, "
    "science and politics, and the workshops of the printers had become places where writers, "
    "translators and merchants met to exchange news from every corner of the continent."
)


def head_agreement(model, ids: list[int], chunk: int = 64) -> dict:
    """The decode head's bf16 copy against its weight, teacher-forced over `ids`: mean and
    max KL(exact || approximate) of the next-token distributions, and the share of positions
    whose top-1 token agrees."""
    import mlx.core as mx

    from mlxlab.models.fastdecode import lm_head
    from mlxlab.train.losses import hidden_states

    head = lm_head(model)
    approx = head._decode_weight()
    exact = head["weight"]
    cap = getattr(model, "final_logit_softcapping", None)
    hidden = hidden_states(model, mx.array(ids)[None])[0]
    kls, agree = [], 0
    for at in range(0, hidden.shape[0], chunk):
        h = hidden[at : at + chunk]
        le = h @ exact.T
        la = h @ approx.astype(mx.float32).T
        if cap:
            le, la = mx.tanh(le / cap) * cap, mx.tanh(la / cap) * cap
        pe = le - mx.logsumexp(le, axis=-1, keepdims=True)
        pa = la - mx.logsumexp(la, axis=-1, keepdims=True)
        kl = (mx.exp(pe) * (pe - pa)).sum(axis=-1)
        same = (mx.argmax(le, axis=-1) == mx.argmax(la, axis=-1)).sum()
        mx.eval(kl, same)
        kls += kl.tolist()
        agree += int(same.item())
    return {
        "positions": len(kls),
        "kl_mean": float(sum(kls) / len(kls)),
        "kl_max": float(max(kls)),
        "top1_agreement": agree / len(kls),
    }


def speculative_profile(
    model, prompt_ids: list[int], text_ids: list[int], k_max: int = 8, steps: int = 8
) -> dict:
    """Speculative decoding on this model (decode/speculative.py): the median time of a verify
    step of k + 1 tokens (k = 1, 3, ..., k_max) against a plain step's; the verify step's logits
    against the plain steps' over a greedy continuation fed k_max + 1 tokens at a time (top-1
    agreement, the largest logit difference, and whether each disagreement is a near tie: the
    plain step's top two logits within 1e-4 of each other, relative); and a greedy decode of
    `text_ids` continued (a text that repeats itself), plain and with prompt lookup: tok/s,
    drafted and accepted tokens, and whether the tokens are the same."""
    import copy

    import mlx.core as mx
    from mlx_lm.generate import generation_stream
    from mlx_lm.models.cache import make_prompt_cache

    from mlxlab.decode import speculative as spec
    from mlxlab.decode.batch import Row
    from mlxlab.decode.serial import run_serial
    from mlxlab.decode.settings import DecodeSettings

    out: dict = {}
    with mx.stream(generation_stream):
        base = make_prompt_cache(model)
        logits = model(mx.array(prompt_ids)[None], cache=base)
        mx.eval(logits, [c.state for c in base])
        first = int(mx.argmax(logits[0, -1]).item())
        # a greedy continuation, plain steps, with each step's logits
        cache = copy.deepcopy(base)
        token, plain, seq = first, [], []
        n = max(2 * (k_max + 1), steps + 1)
        for _ in range(n):
            lg = model(mx.array([[token]]), cache=cache)[0, -1]
            mx.eval(lg)
            plain.append(lg)
            seq.append(token)
            token = int(mx.argmax(lg).item())
        ks = sorted({1, 3, 7, k_max} & set(range(1, k_max + 1)) | {k_max})
        times: dict = {0: []}
        for k in [0, *ks]:
            times[k] = []
            for _ in range(steps):
                c = copy.deepcopy(base)
                mx.eval([x.state for x in c])
                t = time.perf_counter()
                lg = spec.forward(model, [seq[: k + 1]], c)
                mx.eval(mx.argmax(lg, axis=-1))
                times[k].append(time.perf_counter() - t)
        plain_ms = statistics.median(times[0]) * 1e3
        out["verify_ms"] = {str(k): round(statistics.median(times[k]) * 1e3, 2) for k in ks}
        out["plain_step_ms"] = round(plain_ms, 2)
        out["verify_over_plain"] = {
            str(k): round(statistics.median(times[k]) * 1e3 / plain_ms, 2) for k in ks
        }
        # the same tokens fed k_max + 1 at a time against the plain steps
        c = copy.deepcopy(base)
        agree = total = ties = 0
        worst = 0.0
        for at in range(0, len(seq) - k_max, k_max + 1):
            lg = spec.forward(model, [seq[at : at + k_max + 1]], c)[0]
            for i in range(lg.shape[0]):
                ref = plain[at + i]
                diff = float(mx.abs(lg[i] - ref).max().item())
                worst = max(worst, diff)
                top2 = mx.sort(ref)[-2:].tolist()
                same = int(mx.argmax(lg[i]).item()) == int(mx.argmax(ref).item())
                agree += same
                total += 1
                if not same and abs(top2[1] - top2[0]) <= 1e-4 * max(abs(top2[1]), 1.0):
                    ties += 1
        out["verify_logits"] = {
            "positions": total,
            "top1_agreement": agree / max(total, 1),
            "disagreements": total - agree,
            "near_ties": ties,
            "max_abs_diff": worst,
        }
    runs = {}
    for mode in ("off", "prompt_lookup"):
        row = Row(list(text_ids), 96, lambda t, lp: None, lambda f, t: None)
        t = time.perf_counter()
        run_serial(model, row, DecodeSettings(speculative=mode, draft_tokens=k_max))
        seconds = time.perf_counter() - t
        runs[mode] = (row.tokens, seconds, row.speculation)
    (plain_t, plain_s, _), (spec_t, spec_s, counts) = runs["off"], runs["prompt_lookup"]
    out["repeat_text"] = {
        "tokens": len(spec_t),
        "plain_tok_per_s": round(len(plain_t) / plain_s, 2),
        "speculative_tok_per_s": round(len(spec_t) / spec_s, 2),
        "same_tokens": plain_t == spec_t,
        **counts.as_dict(),
    }
    return out


def run(cfg) -> dict:
    import mlx.core as mx

    from mlxlab import kernels
    from mlxlab.models.fastdecode import decode_copies, head_reads
    from mlxlab.models.zoo import load
    from mlxlab.runtime import blas_report

    model, tokenizer = load(cfg.model, cfg.dtype, decode_head=cfg.decode_head)
    if cfg.adapter:
        from mlxlab.lora import io as lora_io

        lora_io.load(model, cfg.adapter)
    words = (
        "the quick brown fox jumps over a lazy dog while seven wizards quietly judge "
        "boxing matches near the old river bank "
    ).split()
    ids = tokenizer.encode(" ".join(words * (cfg.length // 4 + 8)))[: cfg.length]
    report = profile(model, ids, steps=cfg.decode_steps)
    report["decode_head"] = head_reads(model)
    copies = decode_copies(model)
    report["bf16_copies"] = copies["copies"]
    report["copy_mb"] = round(copies["copy_bytes"] / 1e6, 1)
    if report["decode_head"] != "exact":
        text_ids = tokenizer.encode(TEXT)[: max(cfg.length, 64)]
        report["head_copy"] = head_agreement(model, text_ids)
    if cfg.speculative != "off":
        text = tokenizer.encode(TEXT)
        report["speculative"] = speculative_profile(
            model, ids, text + text[: len(text) // 3], cfg.draft_tokens
        )
    bw = measure_bandwidth()
    gbps = bw["all_threads_gbps"]
    bound_s = report["bytes_read_mb"] * 1e6 / (gbps * 1e9)
    report.update(
        {
            "model": cfg.model,
            "dtype": ",".join(_dtypes(model)),
            "device": str(mx.default_device()),
            "blas": blas_report(measure=False)["live"],
            "decode_kernel": kernels.status(),
            "bandwidth": bw,
            "bound_ms": round(bound_s * 1e3, 3),
            "bound_tok_per_s": round(1 / bound_s, 2),
            "fraction_of_bound": round(bound_s / (report["step_ms"] / 1e3), 3),
        }
    )
    return report


def _dtypes(model) -> list:
    from mlx.utils import tree_flatten

    return sorted({str(v.dtype) for _, v in tree_flatten(model.parameters())})


def table(report: dict) -> str:
    lines = [
        f"decode step of {report['model']} ({report['dtype']}, {report['device']}, decode "
        f"kernel: {report['decode_kernel']}), {report['context_tokens']} tokens of context, "
        f"median of {report['steps']} steps",
        f"{'group':<26}{'ms':>9}{'share':>8}{'MB read':>10}{'GB/s':>8}",
    ]
    total = sum(g["ms"] for g in report["groups"].values()) or 1.0
    for name, g in report["groups"].items():
        gbps = f"{g['gbps']:.1f}" if g["gbps"] else "-"
        lines.append(f"{name:<26}{g['ms']:>9.2f}{g['ms'] / total:>8.1%}{g['mb']:>10.1f}{gbps:>8}")
    bw = report["bandwidth"]
    lines += [
        f"{'sum of groups':<26}{total:>9.2f}   (instrumented step {report['instrumented_step_ms']:.2f} ms)",
        f"plain step {report['step_ms']:.2f} ms ({report['tok_per_s']:.1f} tok/s), "
        f"{report['bytes_read_mb']:.0f} MB read; {report['bf16_copies']} weights read from bf16 "
        f"copies ({report['copy_mb']:.0f} MB beside the float32 weights)",
        f"bandwidth {bw['all_threads_gbps']:.1f} GB/s on {bw['threads']} threads "
        f"({bw['one_thread_gbps']:.1f} on one): bound {report['bound_ms']:.2f} ms "
        f"({report['bound_tok_per_s']:.1f} tok/s); the step runs at "
        f"{report['fraction_of_bound']:.0%} of the bound",
    ]
    if s := report.get("speculative"):
        v, r = s["verify_logits"], s["repeat_text"]
        lines += [
            "verify step (k draft tokens + 1) over a plain step: "
            + ", ".join(f"k={k} {x:.2f}x" for k, x in s["verify_over_plain"].items()),
            f"verify logits vs plain steps over {v['positions']} positions: top-1 agreement "
            f"{v['top1_agreement']:.1%} ({v['disagreements']} differ, {v['near_ties']} of them "
            f"near ties), max |diff| {v['max_abs_diff']:.2e}",
            f"a text that repeats itself, {r['tokens']} tokens: plain {r['plain_tok_per_s']:.1f} "
            f"tok/s, prompt lookup {r['speculative_tok_per_s']:.1f} tok/s; {r['drafted_tokens']} "
            f"drafted, {r['accepted_tokens']} accepted ({(r['acceptance_rate'] or 0):.0%}) in "
            f"{r['verify_steps']} verify steps; same tokens: {r['same_tokens']}",
        ]
    if approx := report.get("head_copy"):
        lines.append(
            f"LM head read as {report['decode_head']} vs its weight over {approx['positions']} positions of "
            f"a fixed text: KL mean {approx['kl_mean']:.2e}, max {approx['kl_max']:.2e}; top-1 "
            f"agreement {approx['top1_agreement']:.1%}"
        )
    return "\n".join(lines)
