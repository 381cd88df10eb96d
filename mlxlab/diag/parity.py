"""mlxlab vs mlx-lm's own code on identical inputs: logits, loss, gradients, segmented backward.

    python -m mlxlab diag parity model=gemma3-270m dtype=bfloat16 segment_sizes=[1,2,4]

Both sides load the same directory and cast to the same dtype. mlx-lm's side is its model's
`__call__`, `load_adapters`, `default_loss` and `nn.value_and_grad`; mlxlab's side is its layer
runner, adapter loader, response-only loss and backward modes. Each check gets a verdict
(BIT-EXACT, within N ulp, or the relative norm) and passes the gates `max_ulp` / `max_rel`.

In float32 on the CPU mlxlab trains on compiled kernels (the loss head's cross-entropy, Gemma
3's attention softmax and activation: mlxlab/kernels), which sum in other orders than MLX's ops:
the checks against mlx-lm run with them off (`kernels.off("train")`), so they can be bit for bit,
and `kernel_checks` then hold the kernels' loss and gradients to MLX's ops (max_rel 1e-4).

With `objective=dpo|orpo` the checks are on one preference pair instead (`_pair_parity`):
mlxlab's pair loss, metrics and LoRA gradients against a straightforward implementation on
mlx-lm's model (per-token log-probs from its `__call__`, the reference from a second mlx-lm copy
without the adapter, the published formulas, `nn.value_and_grad`), and the segmented and
checkpointed backward against the full one.

Losses are compared on unpadded single sequences: there mlx-lm's `default_loss` trains the
same tokens as ours. On padded batches it also counts one padding position per sequence (its
mask is `steps <= length`); the report shows that count beside ours.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlxlab.diag.compare import Comparison, compare
from mlxlab.diag.config import DiagConfig
from mlxlab.diag.workload import attach_lora, text_ids

log = logging.getLogger(__name__)


def _random_adapter(model, out: Path, seed: int = 0, kind: str = "lora") -> Path:
    """A seeded adapter of `kind` with every trained array moved off its start (LoRA: B),
    saved in mlx-lm's layout; the model is left as it was."""
    from mlxlab.lora import apply as lora
    from mlxlab.lora import io as lora_io

    before = {k: v for k, v in tree_flatten(model.parameters())}
    plan = attach_lora(model, seed, kind)
    mx.random.seed(seed + 1)
    if kind == "lora":
        for _, m in lora.lora_modules(model):
            m.lora_b = (0.02 * mx.random.normal(m.lora_b.shape)).astype(m.lora_b.dtype)
    else:  # DoRA's A, B and magnitudes; a full fine-tune's weights: each moved by 2%
        moved = [
            (k, v * (1 + 0.02 * mx.random.normal(v.shape)).astype(v.dtype))
            for k, v in lora.adapter_parameters(model).items()
        ]
        model.load_weights(moved, strict=False)
    lora_io.save(model, plan, out)
    lora.remove(model)
    if kind == "full":  # its weights are the model's own: put the base's back
        model.load_weights([(k, before[k]) for k in lora.adapter_parameters(model)], strict=False)
        model.freeze()
    return out


def _theirs_trainable(theirs, adapter: Path) -> None:
    """mlx-lm's `load_adapters` leaves a full fine-tune's weights frozen (mlx_lm.lora unfreezes
    the layers before training): unfreeze the adapter's arrays so their gradients exist."""
    from mlxlab.lora import io as lora_io

    if lora_io.kind_of(adapter) != "full":
        return
    names = mx.load(str(lora_io.resolve_dir(adapter) / lora_io.WEIGHTS))
    modules = dict(theirs.named_modules())
    for name in names:
        module, leaf = name.rsplit(".", 1)
        modules[module].unfreeze(keys=[leaf], recurse=False)


def run(cfg: DiagConfig, verbose: bool = True) -> dict:
    from mlxlab import kernels

    if cfg.objective != "sft":
        with kernels.off("train"):
            report = _pair_parity(cfg)
        if verbose:
            print_table(report)
        return report
    with kernels.off("train"):
        report, batch, ours, grads = _against_mlx_lm(cfg)
    report["kernel_checks"] = [c.to_dict() for c in _kernel_checks(cfg, ours, batch, grads)]
    report["passed"] = report["passed"] and all(c["passed"] for c in report["kernel_checks"])
    if verbose:
        print_table(report)
    return report


KERNEL_MAX_REL = 1e-4  # the kernels sum in other orders: float rounding, through every layer


def _kernel_checks(cfg: DiagConfig, ours, batch, exact_grads) -> list[Comparison]:
    """The loss and gradients on mlxlab's training kernels (the CE kernel; Gemma 3's fast
    layers) against the same on MLX's ops. Only where they run: float32 on the CPU."""
    from mlxlab import kernels
    from mlxlab.runtime import resolve_dtype
    from mlxlab.train.losses import response_ce
    from mlxlab.train.trainer import full_backward

    if (
        kernels.train() is None
        or mx.default_device() != mx.cpu
        or resolve_dtype(cfg.dtype) != mx.float32
    ):
        return []
    gate = {"max_ulp": cfg.max_ulp, "max_rel": max(cfg.max_rel, KERNEL_MAX_REL)}
    ours.train(False)
    loss, _ = response_ce(ours, *batch.arrays())
    with kernels.off("train"):
        ref, _ = response_ce(ours, *batch.arrays())
    ours.train(True)
    _, _, grads = full_backward(ours, compile=False)(ours, batch)
    return [
        compare("loss: train kernels vs MLX", loss, ref, **gate),
        compare(
            "gradients: train kernels vs MLX",
            dict(tree_flatten(grads)),
            dict(tree_flatten(exact_grads)),
            **gate,
        ),
    ]


def _against_mlx_lm(cfg: DiagConfig):
    from mlx_lm.tuner.trainer import default_loss, iterate_batches
    from mlx_lm.utils import load as mlx_lm_load
    from mlx_lm.utils import load_adapters

    from mlxlab.data.batches import collate
    from mlxlab.data.datasets import Example
    from mlxlab.lora import io as lora_io
    from mlxlab.models import runners
    from mlxlab.models.zoo import load, resolve
    from mlxlab.runtime import resolve_dtype
    from mlxlab.train import backward as bw
    from mlxlab.train.losses import lm_head, response_ce
    from mlxlab.train.trainer import full_backward

    gate = {"max_ulp": cfg.max_ulp, "max_rel": cfg.max_rel}
    path = resolve(cfg.model)
    dtype = resolve_dtype(cfg.dtype)
    ours, tokenizer = load(str(path), cfg.dtype, decode_head="exact")
    theirs, _ = mlx_lm_load(str(path))
    theirs.set_dtype(dtype)
    ids = text_ids(tokenizer, cfg.length)
    inputs = mx.array(ids)[None]
    checks: list[Comparison] = []

    runner = runners.runner_for(ours)
    checks.append(
        compare(
            "logits (base)",
            lm_head(ours, runners.forward_hidden(runner, inputs)),
            theirs(inputs),
            **gate,
        )
    )

    with tempfile.TemporaryDirectory() as tmp:
        adapter = (
            Path(cfg.adapter)
            if cfg.adapter
            else _random_adapter(ours, Path(tmp) / "adapter", kind=cfg.lora_type)
        )
        lora_io.load(ours, adapter)
        theirs.freeze()  # as mlx_lm.lora's train_model does before adding LoRA layers
        load_adapters(theirs, str(adapter))
        _theirs_trainable(theirs, adapter)
        ours.set_dtype(dtype)
        theirs.set_dtype(dtype)
        mx.eval(ours.parameters(), theirs.parameters())
    ours.train(False)
    theirs.train(False)
    checks.append(
        compare(
            "logits (adapter)",
            lm_head(ours, runners.forward_hidden(runner, inputs)),
            theirs(inputs),
            **gate,
        )
    )

    n = len(ids)
    splits = {"prompt 0": 0, "prompt 1": 1, "half": n // 2, "response 1": n - 1}
    counts = {}
    for label, offset in splits.items():
        batch = collate([Example(ids, offset)])
        loss, ntoks = response_ce(ours, *batch.arrays())
        their_loss, their_ntoks = default_loss(theirs, inputs, mx.array([[offset, n]]))
        c = compare(f"loss ({label})", loss, their_loss, **gate)
        if int(ntoks.item()) != int(their_ntoks.item()):
            c.passed, c.note = (
                False,
                f"token counts {int(ntoks.item())} vs {int(their_ntoks.item())}",
            )
        else:
            c.note = f"{int(ntoks.item())} tokens both"
        padded = next(iterate_batches([(ids, offset)], 1, 1 << 20))
        counts[label] = {
            "ours": int(ntoks.item()),
            "mlx_lm_unpadded": int(their_ntoks.item()),
            "mlx_lm_padded_batch": int(default_loss(theirs, *padded)[1].item()),
        }
        checks.append(c)

    offset = n // 2
    batch = collate([Example(ids, offset)])
    ours.train(True)
    theirs.train(True)
    _, _, grads = full_backward(ours, compile=False)(ours, batch)
    (_, _), their_grads = nn.value_and_grad(theirs, default_loss)(
        theirs, inputs, mx.array([[offset, n]])
    )
    flat = dict(tree_flatten(grads))
    if cfg.perturb_grads:
        mx.random.seed(123)
        flat = {k: v * (1 + cfg.perturb_grads * mx.random.normal(v.shape)) for k, v in flat.items()}
    checks.append(
        compare("LoRA gradients vs mlx-lm", flat, dict(tree_flatten(their_grads)), **gate)
    )
    for size in cfg.segment_sizes:
        plan = bw.plan_by_size(len(ours.layers), size)
        _, _, seg = bw.segmented_backward(ours, plan)(ours, batch)
        checks.append(
            compare(
                f"segmented size {size} vs full",
                dict(tree_flatten(seg)),
                dict(tree_flatten(grads)),
                **gate,
            )
        )
    _, _, ck = bw.checkpointed_backward(ours)(ours, batch)
    checks.append(
        compare("checkpointed vs full", dict(tree_flatten(ck)), dict(tree_flatten(grads)), **gate)
    )

    report = {
        "model": cfg.model,
        "dtype": str(dtype),
        "lora_type": cfg.lora_type,
        "length": n,
        "gates": gate,
        "passed": all(c.passed for c in checks),
        "checks": [c.to_dict() for c in checks],
        "token_counts": counts,
    }
    return report, batch, ours, grads


def print_table(report: dict) -> None:
    print(
        f"parity{' ' + report['objective'] if report.get('objective') else ''}: "
        f"{report['model']} ({report['dtype']}), {report['length']} tokens, "
        f"gates max_ulp={report['gates']['max_ulp']} max_rel={report['gates']['max_rel']:g}"
    )
    print(f"{'check':<30}{'verdict':<22}{'max abs':>11}{'rel norm':>11}  gate  note")
    for c in report["checks"] + report.get("kernel_checks", []):
        print(
            f"{c['name']:<30}{c['verdict']:<22}{c['max_abs']:>11.2e}{c['rel_norm']:>11.2e}  "
            f"{'pass' if c['passed'] else 'FAIL'}  {c['note']}"
        )
    tc = report.get("token_counts")
    if tc is None:
        print("metrics: " + ", ".join(f"{k} {v:.6g}" for k, v in report["metrics"].items()))
        log.info("PASS" if report["passed"] else "FAIL")
        return
    print(
        "trained tokens (ours / mlx-lm unpadded / mlx-lm padded batch): "
        + ", ".join(
            f"{k}: {v['ours']}/{v['mlx_lm_unpadded']}/{v['mlx_lm_padded_batch']}"
            for k, v in tc.items()
        )
    )
    log.info("PASS" if report["passed"] else "FAIL")


PAIR_MAX_REL = 1e-4  # ours vs the straightforward pair loss: float rounding, other orders


def _straight_logp(model, ids, offset: int):
    """(summed log-prob of ids[offset:], their count) from the model's own __call__: the
    log-softmax of the whole sequence's full logits, gathered at the next tokens."""
    x = mx.array(ids)[None]
    logits = model(x[:, :-1]).astype(mx.float32)[0]
    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    targets = mx.array(ids[1:])
    picked = mx.take_along_axis(lp, targets[:, None], axis=-1)[:, 0]
    return picked[offset - 1 :].sum(), float(len(ids) - offset)


def _straight_pair_loss(policy, reference, ids_c, ids_r, offset: int, cfg: DiagConfig):
    """The pair loss written out plainly on mlx-lm models (`_straight_logp`, the paper's
    formula)."""

    def logp(model, ids):
        return _straight_logp(model, ids, offset)

    (pc, nc), (pr, nr) = logp(policy, ids_c), logp(policy, ids_r)
    if cfg.objective == "orpo":
        mc, mr = pc / nc, pr / nr
        odds = (mc - mx.log(1 - mx.exp(mc))) - (mr - mx.log(1 - mx.exp(mr)))
        return -pc / nc - cfg.orpo.lam * nn.log_sigmoid(odds)
    (rc, _), (rr, _) = logp(reference, ids_c), logp(reference, ids_r)
    rc, rr = mx.stop_gradient(rc), mx.stop_gradient(rr)
    beta = cfg.dpo.beta
    if cfg.dpo.loss == "ipo":
        h = (pc / nc - pr / nr) - (rc / nc - rr / nr)
        return (h - 1 / (2 * beta)) ** 2
    h = beta * ((pc - pr) - (rc - rr))
    eps = cfg.dpo.label_smoothing
    return -(1 - eps) * nn.log_sigmoid(h) - eps * nn.log_sigmoid(-h)


def _pair_parity(cfg: DiagConfig) -> dict:
    """DPO / ORPO on one pair (chosen = real text, rejected = the same prompt and the chosen
    response's tokens reversed, the same length): mlxlab's trainer path vs `_straight_pair_loss`."""
    import dataclasses

    from mlx_lm.utils import load as mlx_lm_load
    from mlx_lm.utils import load_adapters

    from mlxlab.data.batches import BatchSampler
    from mlxlab.data.datasets import Example
    from mlxlab.lora import io as lora_io
    from mlxlab.models.zoo import load, resolve
    from mlxlab.runtime import resolve_dtype
    from mlxlab.train import backward as bw
    from mlxlab.train.objectives import PairObjective, reference_logps
    from mlxlab.train.trainer import full_backward

    gate = {"max_ulp": cfg.max_ulp, "max_rel": cfg.max_rel}
    path = resolve(cfg.model)
    dtype = resolve_dtype(cfg.dtype)
    ours, tokenizer = load(str(path), cfg.dtype, decode_head="exact")
    policy, _ = mlx_lm_load(str(path))
    reference, _ = mlx_lm_load(str(path))
    ids_c = text_ids(tokenizer, cfg.length)
    offset = len(ids_c) // 2
    ids_r = ids_c[:offset] + ids_c[offset:][::-1]
    with tempfile.TemporaryDirectory() as tmp:
        adapter = (
            Path(cfg.adapter)
            if cfg.adapter
            else _random_adapter(ours, Path(tmp) / "adapter", kind=cfg.lora_type)
        )
        lora_io.load(ours, adapter)
        kind = lora_io.kind_of(adapter)
        policy.freeze()
        load_adapters(policy, str(adapter))
        _theirs_trainable(policy, adapter)
    for m in (ours, policy, reference):
        m.set_dtype(dtype)
        mx.eval(m.parameters())
    objective = PairObjective(
        cfg.objective, cfg.dpo.beta, cfg.dpo.loss, cfg.dpo.label_smoothing, cfg.orpo.lam
    )
    sampler = BatchSampler(
        [Example(ids_c, offset), Example(ids_r, offset)], 1, 0, shuffle=False, pairs=True
    )
    batch = next(sampler.one_pass())
    if objective.needs_reference:
        if kind == "lora":  # the adapter's scale at 0: the base exactly
            batch = dataclasses.replace(batch, ref=reference_logps(ours, batch))
        else:  # DoRA's magnitudes, full weights: the base model itself, loaded again
            base, _ = load(str(path), cfg.dtype, decode_head="exact")
            batch = dataclasses.replace(batch, ref=reference_logps(base, batch))
            del base
    for m in (ours, policy, reference):
        m.train(False)  # no dropout on either side
    loss, _, grads, metrics = full_backward(ours, objective.loss, compile=False)(ours, batch)

    def straight(model):
        return _straight_pair_loss(model, reference, ids_c, ids_r, offset, cfg)

    their_loss, their_grads = nn.value_and_grad(policy, straight)(policy)
    # The straightforward side differentiates a log-softmax over every position's full logits;
    # ours, the response positions' cross-entropy: the same sums in other orders. Each
    # sequence's log-prob agrees to float rounding (max_rel 1e-6); DPO's loss subtracts four
    # such sums of similar size, which scales their rounding up (PAIR_MAX_REL).
    loose = {"max_ulp": cfg.max_ulp, "max_rel": max(cfg.max_rel, PAIR_MAX_REL)}
    index = {k: i for i, k in enumerate(objective.metrics)}
    ours_logp = mx.stack([metrics[index["logp_chosen"]], metrics[index["logp_rejected"]]])
    if objective.kind == "orpo":  # ORPO's metrics are per-token means
        ours_logp = ours_logp * (len(ids_c) - offset)
    plain = mx.stack([_straight_logp(policy, ids, offset)[0] for ids in (ids_c, ids_r)])
    checks = [
        compare(
            "response log-probs vs plain", ours_logp, plain, cfg.max_ulp, max(cfg.max_rel, 1e-6)
        ),
        compare(f"{cfg.objective} loss vs plain", loss, their_loss, **loose),
        compare(
            f"{cfg.objective} grads vs plain",
            dict(tree_flatten(grads)),
            dict(tree_flatten(their_grads)),
            **loose,
        ),
    ]
    for size in cfg.segment_sizes:
        plan = bw.plan_by_size(len(ours.layers), size)
        _, _, seg, seg_metrics = bw.segmented_backward(ours, plan, objective=objective)(ours, batch)
        c = compare(
            f"segmented size {size} vs full",
            dict(tree_flatten(seg)),
            dict(tree_flatten(grads)),
            **gate,
        )
        if not bool(mx.array_equal(seg_metrics, metrics).item()):
            c.passed, c.note = False, "metrics differ"
        checks.append(c)
    _, _, ck, _ = bw.checkpointed_backward(ours, objective=objective)(ours, batch)
    checks.append(
        compare("checkpointed vs full", dict(tree_flatten(ck)), dict(tree_flatten(grads)), **gate)
    )
    return {
        "model": cfg.model,
        "dtype": str(dtype),
        "length": len(ids_c),
        "objective": cfg.objective,
        "gates": gate,
        "passed": all(c.passed for c in checks),
        "checks": [c.to_dict() for c in checks],
        "metrics": dict(zip(objective.metrics, metrics.tolist(), strict=True)),
    }
