"""One LoRA training step by phase: where its time goes, and at what rate of model FLOPs.

    python -m mlxlab diag profile model=gemma3-270m length=1152 batch_size=2 trained=0.26 \
        mode=segmented segment_size=4

The step is the trainer's own (`make_grad_fn` for the backward `mode`, then the optimizer
update), on
`batch_size` rows of `length` tokens of real text with the last `trained` fraction of each row
trained (a response). Three views, each measured (the median of `steps_timed` runs after a
warm-up):

- the step: its wall time, model FLOPs (train/flops.py) and MFU against the float32 matmul rate
  measured now;
- its phases, as the segmented backward runs them (embedding, each segment's forward, each
  segment's vjp, which recomputes that segment's forward and counts 3x its forward FLOPs; the loss head, timed alone, is split
  out of the last segment's vjp), then the optimizer; the full and checkpointed modes have one
  forward-and-backward phase;
- inside a layer (the first sliding-window and the first global layer): attention (its
  projections, norms, RoPE and the attention itself), the MLP, and the rest (the layer's norms and
  residual adds: the layer's time minus the two), forward and vjp, each at its achieved GFLOPS.

Phases are timed at the step's own evaluation points, so their sum is the step (less the
timing's own synchronisation); the sub-layer rows come from running each module alone on the
inputs it sees in the step.
"""

from __future__ import annotations

import statistics
import time

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from mlxlab.diag.config import DiagConfig


def _median_time(fn, runs: int) -> float:
    out = fn()  # warm-up
    mx.eval(out)
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _batch(tokenizer, length: int, rows: int, trained: float):
    from mlxlab.data.batches import collate
    from mlxlab.data.datasets import Example
    from mlxlab.diag.workload import text_ids

    ids = text_ids(tokenizer, (length + 1) * rows)
    examples = []
    for r in range(rows):
        row = ids[r * (length + 1) : (r + 1) * (length + 1)]
        examples.append(Example(row, max(1, round(len(row) * (1 - trained)))))
    return collate(examples)


class _Phases:
    """Wall time between consecutive marks."""

    def __init__(self):
        self.times: dict[str, list[float]] = {}
        self.last = time.perf_counter()

    def start(self) -> None:
        self.last = time.perf_counter()

    def __call__(self, phase: str) -> None:
        now = time.perf_counter()
        self.times.setdefault(phase, []).append(now - self.last)
        self.last = now

    def medians(self) -> dict[str, float]:
        return {k: statistics.median(v) for k, v in self.times.items()}


class _Recorder:
    """Stands in for a module while the layer runs once: keeps its calls' inputs and outputs;
    anything else (its weights, submodules) is the module's own."""

    def __init__(self, inner):
        self.inner, self.calls, self.outputs = inner, [], []

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        out = self.inner(*args, **kwargs)
        self.outputs.append(out)
        return out

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _module_vjp(module, args, kwargs, call=None):
    """A closure running the vjp of call(*args) (default: the module's own call) in its first
    input and the module's trainable weights."""
    call = call or module
    flat = tree_flatten(module.trainable_parameters())
    names, values = [k for k, _ in flat], [v for _, v in flat]
    x, rest = args[0], args[1:]

    def f(x, *vals):
        module.update(tree_unflatten(list(zip(names, vals, strict=True))))
        out = call(x, *rest, **kwargs)
        return out[0] if isinstance(out, tuple) else out

    out = f(x, *values)
    module.update(tree_unflatten(list(zip(names, values, strict=True))))
    cot = mx.ones_like(out)

    def run():
        try:
            return mx.vjp(f, [x, *values], [cot])
        finally:
            module.update(tree_unflatten(list(zip(names, values, strict=True))))

    return run


def _inside_layer(runner, i: int, h, ctx, shapes, lengths, runs: int) -> list[dict]:
    """Attention, MLP and the rest of layer i, forward and vjp, from the inputs it sees."""
    from mlxlab.models import fastlayers
    from mlxlab.train.flops import attention_flops, module_weights

    layer = runner.layers[i]
    attn, mlp = layer.self_attn, layer.mlp
    # What feeds attention and the MLP: the outputs of the norms before them (Gemma has a
    # pre-feedforward norm; llama-style layers feed the MLP from the post-attention norm).
    mlp_norm = (
        "pre_feedforward_layernorm"
        if "pre_feedforward_layernorm" in layer
        else "post_attention_layernorm"
    )
    wrapped = {
        name: _Recorder(layer[name]) for name in ("self_attn", "mlp", "input_layernorm", mlp_norm)
    }
    for name, rec in wrapped.items():
        object.__setattr__(layer, name, rec)  # instance attributes, removed below
    try:
        runner.layer(i, h, ctx)
    finally:
        for name in wrapped:
            object.__delattr__(layer, name)
    if ctx.fast is not None:  # the fast layer calls the parts' submodules, not the parts
        kern, window = ctx.fast, runner.window(i)
        a_args, a_kw = (wrapped["input_layernorm"].outputs[0],), {}
        m_args, m_kw = (wrapped[mlp_norm].outputs[0],), {}
        attn_fn = lambda x: fastlayers.attention(kern, attn, x, window, ctx.starts)  # noqa: E731
        mlp_fn = lambda y: fastlayers.mlp(kern, mlp, y)  # noqa: E731
    else:
        (a_args, a_kw), (m_args, m_kw) = wrapped["self_attn"].calls[0], wrapped["mlp"].calls[0]
        attn_fn, mlp_fn = attn, mlp
    tokens = sum(lengths)
    a_lin, a_lora = module_weights(attn)
    m_lin, m_lora = module_weights(mlp)
    a_flops = 2 * (a_lin + a_lora) * tokens + attention_flops(
        shapes.heads[i], shapes.head_dim[i], shapes.windows[i], lengths
    )
    m_flops = 2 * (m_lin + m_lora) * tokens
    # backward, frozen base weights: the input gradient (one forward's worth of the projections),
    # LoRA's two, attention's two
    a_bwd = 2 * a_lin * tokens + 4 * a_lora * tokens + 2 * (a_flops - 2 * (a_lin + a_lora) * tokens)
    m_bwd = 2 * m_lin * tokens + 4 * m_lora * tokens

    def layer_fwd():
        return runner.layer(i, h, ctx)[0]

    timings = {
        "attention": (
            _median_time(lambda: attn_fn(*a_args, **a_kw), runs),
            _median_time(_module_vjp(attn, a_args, a_kw, attn_fn), runs),
            a_flops,
            a_bwd,
        ),
        "MLP": (
            _median_time(lambda: mlp_fn(*m_args, **m_kw), runs),
            _median_time(_module_vjp(mlp, m_args, m_kw, mlp_fn), runs),
            m_flops,
            m_bwd,
        ),
    }
    layer_f = _median_time(layer_fwd, runs)
    layer_b = _median_time(_module_vjp(_LayerCall(runner, i, ctx), (h,), {}), runs)
    rest_f = max(0.0, layer_f - sum(t[0] for t in timings.values()))
    rest_b = max(0.0, layer_b - sum(t[1] for t in timings.values()))
    timings["norms, residual, other"] = (rest_f, rest_b, 0, 0)
    rows = []
    for name, (tf, tb, ff, fb) in timings.items():
        rows.append(
            {
                "part": name,
                "forward_s": tf,
                "vjp_s": tb,
                "forward_gflops": ff / tf / 1e9 if tf and ff else None,
                "vjp_gflops": (ff + fb) / tb / 1e9 if tb and fb else None,
            }
        )
    rows.append({"part": "layer", "forward_s": layer_f, "vjp_s": layer_b})
    return rows


class _LayerCall:
    """Layer i as a module-like callable for _module_vjp (its trainable weights are the layer's)."""

    def __init__(self, runner, i, ctx):
        self.runner, self.i, self.ctx = runner, i, ctx
        self.layer = runner.layers[i]

    def trainable_parameters(self):
        return self.layer.trainable_parameters()

    def update(self, params):
        self.layer.update(params)

    def __call__(self, x):
        return self.runner.layer(self.i, x, self.ctx)[0]


def run(cfg: DiagConfig) -> dict:
    from mlxlab.diag.workload import attach_lora
    from mlxlab.models.runners import runner_for
    from mlxlab.models.zoo import load
    from mlxlab.runtime import measure_matmul_gflops
    from mlxlab.train import backward as bw
    from mlxlab.train.flops import layer_flops, model_shapes, step_flops
    from mlxlab.train.trainer import make_optimizer

    model, tokenizer = load(cfg.model, cfg.dtype, decode_head="exact")  # as training loads it
    attach_lora(model)
    model.train()
    batch = _batch(tokenizer, cfg.length, cfg.batch_size, cfg.trained)
    lengths = list(batch.lengths)
    shapes = model_shapes(model)
    runner = runner_for(model)
    from mlxlab.config import BackwardConfig, OptimConfig

    backward = BackwardConfig(mode=cfg.mode, segment_size=cfg.segment_size)
    phases = _Phases()
    if backward.mode == "segmented":
        plan = bw.make_plan(model, backward, tuple(batch.inputs.shape))
        grad_fn = bw.segmented_backward(model, plan, timer=phases)
        description = "segmented backward: " + plan.describe(runner)
    else:
        grad_fn, description = bw.make_grad_fn(model, backward, tuple(batch.inputs.shape))
        plan = None
    optimizer = make_optimizer(OptimConfig(), 10)
    optimizer.init(model.trainable_parameters())

    def step():
        phases.start()
        loss, _, grads = grad_fn(model, batch)
        mx.eval(loss, grads)
        if plan is None:
            phases("forward + backward")
        optimizer.update(model, grads)
        mx.eval(model.parameters(), optimizer.state)
        phases("optimizer")

    mx.reset_peak_memory()
    step()  # warm-up
    phases.times.clear()
    times = []
    for _ in range(cfg.steps_timed):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    step_s = statistics.median(times)
    peak = mx.get_peak_memory()
    measured = phases.medians()

    # The loss head alone, forward and vjp, on the last hidden state.
    h, ctx = runner.embed(batch.inputs)
    for i in range(len(runner.layers)):
        h = runner.layer(i, h, ctx)[0]
    mx.eval(h)
    inputs, positions, labels, weights = batch.arrays()
    head_s = _median_time(
        lambda: mx.vjp(
            lambda x: bw.head_loss(runner, x, positions, labels, weights)[0], [h], [mx.array(1.0)]
        ),
        cfg.steps_timed,
    )
    head_f = 2 * shapes.hidden * shapes.vocab * batch.ntoks

    rows = []
    if plan is not None:
        last = len(plan.segments) - 1
        for name, secs in measured.items():
            kind, _, s = name.partition(" ")
            flops = None
            if kind in ("forward", "backward"):
                seg = plan.segments[int(s)]
                fwd = sum(layer_flops(shapes, i, lengths) for i in seg)
                # a segment's vjp: the recomputed forward plus a backward of ~2x (frozen weights)
                flops = fwd if kind == "forward" else 3 * fwd
                label = f"segment {s} [{seg[0]}-{seg[-1]}] " + (
                    "forward" if kind == "forward" else "vjp"
                )
                if kind == "backward" and int(s) == last:
                    secs = max(0.0, secs - head_s)
                    label += " (less the head)"
            else:
                label = name
            rows.append({"phase": label, "seconds": secs, "flops": flops})
        rows.insert(
            -1, {"phase": "loss head (forward + vjp)", "seconds": head_s, "flops": 2 * head_f}
        )
    else:
        for name, secs in measured.items():
            rows.append({"phase": name, "seconds": secs, "flops": None})
        rows.insert(
            -1,
            {
                "phase": "  of which the loss head",
                "seconds": head_s,
                "flops": 2 * head_f,
                "part_of_above": True,
            },
        )
    total = sum(r["seconds"] for r in rows if not r.get("part_of_above"))
    for r in rows:
        r["share"] = r["seconds"] / total if total else 0.0
        r["gflops"] = r["flops"] / r["seconds"] / 1e9 if r["flops"] and r["seconds"] else None

    h0, ctx0 = runner.embed(batch.inputs)
    mx.eval(h0)
    inside = {}
    seen = set()
    hi = h0
    for i in range(len(runner.layers)):
        kind = "global" if runner.is_global(i) else "sliding"
        if kind not in seen and i not in runner.kv_donors():
            seen.add(kind)
            inside[f"layer {i} ({kind})"] = _inside_layer(
                runner, i, hi, ctx0, shapes, lengths, cfg.steps_timed
            )
        hi = runner.layer(i, hi, ctx0)[0]
        mx.eval(hi)
        if len(seen) == 2:
            break

    flops = step_flops(shapes, lengths, batch.ntoks, backward.mode)["total"]
    rate = measure_matmul_gflops()
    return {
        "model": cfg.model,
        "backward": description,
        "batch": {"rows": len(lengths), "lengths": lengths, "trained_tokens": batch.ntoks},
        "step_s": step_s,
        "step_tflop": flops / 1e12,
        "gflops": flops / step_s / 1e9,
        "matmul_gflops": rate,
        "mfu": flops / step_s / 1e9 / rate,
        "tok_per_s": sum(lengths) / step_s,
        "peak_mem_gb": peak / 1e9,
        "phases": rows,
        "inside_layer": inside,
    }


def table(report: dict) -> str:
    b = report["batch"]
    lines = [
        f"profile: {report['model']}, {report['backward']}",
        f"batch {b['rows']} x {max(b['lengths'])} tokens ({sum(b['lengths'])} real, "
        f"{b['trained_tokens']} trained): step {report['step_s']:.2f} s, "
        f"{report['step_tflop']:.2f} TFLOP, {report['gflops']:.1f} GFLOPS, MFU "
        f"{report['mfu']:.1%} of {report['matmul_gflops']:.0f}, {report['tok_per_s']:.0f} tok/s, "
        f"peak {report['peak_mem_gb']:.2f} GB",
        "",
        f"{'phase':<52}{'s':>8}{'share':>8}{'GFLOPS':>9}",
    ]
    for r in report["phases"]:
        g = f"{r['gflops']:.1f}" if r["gflops"] else "-"
        lines.append(f"{r['phase']:<52}{r['seconds']:>8.3f}{r['share']:>8.1%}{g:>9}")
    for name, rows in report["inside_layer"].items():
        lines += [
            "",
            f"inside {name}",
            f"{'part':<28}{'fwd s':>8}{'GFLOPS':>8}{'vjp s':>8}{'GFLOPS':>8}",
        ]
        for r in rows:
            gf = f"{r['forward_gflops']:.1f}" if r.get("forward_gflops") else "-"
            gb = f"{r['vjp_gflops']:.1f}" if r.get("vjp_gflops") else "-"
            lines.append(f"{r['part']:<28}{r['forward_s']:>8.3f}{gf:>8}{r['vjp_s']:>8.3f}{gb:>8}")
    return "\n".join(lines)


def plot(report: dict, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = [r for r in report["phases"] if not r.get("part_of_above")]
    fig, ax = plt.subplots(figsize=(8, 0.35 * len(rows) + 1.5))
    names = [r["phase"] for r in rows][::-1]
    secs = [r["seconds"] for r in rows][::-1]
    ax.barh(names, secs, color="tab:blue")
    for y, r in enumerate(rows[::-1]):
        ax.text(r["seconds"], y, f" {r['share']:.0%}", va="center", fontsize=8)
    ax.set(
        xlabel="seconds",
        title=f"{report['model']}: step {report['step_s']:.1f} s, MFU {report['mfu']:.0%}",
    )
    ax.tick_params(axis="y", labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
