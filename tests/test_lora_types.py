"""lora.type=dora|full: mlx-lm's DoRA and full fine-tuning of chosen modules, with LoRA's
guarantees: every backward mode bit for bit the full backward, gradients equal to mlx-lm's own
on its DoRALinear (or unfrozen weights), adapters that mlx-lm loads with equal logits, training,
resume, DPO/ORPO, lora.init, fusing and serving."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

import mlxlab  # noqa: F401
from mlxlab import kernels
from mlxlab.config import BackwardConfig, DataConfig, LoraConfig, OptimConfig, UserError
from mlxlab.data import batches as B
from mlxlab.lora import apply as lora
from mlxlab.lora import io as lora_io
from mlxlab.models import tiny
from mlxlab.train import backward as bw
from mlxlab.train import objectives as obj
from mlxlab.train import trainer
from mlxlab.train.config import TrainConfig
from tests.helpers.training import QUICKSTART, assert_same, examples, run_losses

KINDS = ["dora", "full"]


def _targets(kind):
    return ["all"] if kind == "full" else ["q", "v", "down"]


def _adapted(path, kind, layers="all", seed=0):
    """mlx-lm's model from `path` with `kind` applied and every trained array moved off its
    start (so the adapter changes the output and gradients reach everything)."""
    from mlx_lm.utils import load

    model, tok = load(str(path))
    plan = lora.plan(model, LoraConfig(type=kind, targets=_targets(kind), rank=4, layers=layers))
    lora.apply(model, plan, seed=seed)
    mx.random.seed(seed + 1)
    moved = [
        (k, v + 0.05 * mx.random.normal(v.shape)) for k, v in lora.adapter_parameters(model).items()
    ]
    model.load_weights(moved, strict=False)
    mx.eval(model.parameters())
    return model, tok, plan


def test_what_each_kind_trains(tiny_dir):
    dora, _, _ = _adapted(tiny_dir("gemma3"), "dora", layers=[1])
    names = sorted(lora.adapter_parameters(dora))
    assert names == sorted(
        f"model.layers.1.{m}.{leaf}"
        for m in ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")
        for leaf in ("lora_a", "lora_b", "m")
    )
    full, _, _ = _adapted(tiny_dir("gemma3"), "full", layers=[1])
    names = lora.adapter_parameters(full)
    assert "model.layers.1.self_attn.q_proj.weight" in names
    assert "model.layers.1.input_layernorm.weight" in names  # `all`: norms too, as mlx-lm full
    assert all(k.startswith("model.layers.1.") for k in names)
    with pytest.raises(UserError, match="lora.type"):
        LoraConfig(type="qlora")


@pytest.mark.parametrize("family", tiny.FAMILIES)
@pytest.mark.parametrize("kind", KINDS)
def test_gradients_are_bit_exact_in_every_mode(tiny_dir, family, kind):
    model, _, _ = _adapted(tiny_dir(family), kind)
    batch = B.collate(examples([(40, 10), (30, 3), (12, 0)]))
    ref = trainer.full_backward(model, compile=False)(model, batch)
    assert_same(trainer.full_backward(model, compile=True)(model, batch), ref)
    assert_same(bw.checkpointed_backward(model)(model, batch), ref)
    for size in (1, 2, 5):
        assert_same(
            bw.segmented_backward(model, bw.plan_by_size(len(model.layers), size))(model, batch),
            ref,
        )
    packed = B.collate_rows([examples([(20, 5), (14, 2)]), examples([(30, 8)], seed=1)])
    pref = trainer.full_backward(model, compile=False)(model, packed)
    assert_same(
        bw.segmented_backward(model, bw.plan_by_size(len(model.layers), 2))(model, packed), pref
    )


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3", "gemma4"])
@pytest.mark.parametrize("kind", KINDS)
def test_gradients_equal_mlx_lms_own(tiny_dir, family, kind, tmp_path):
    """Ours (response-only loss, layer runner) against mlx-lm's `default_loss` and
    `nn.value_and_grad` on its own model carrying the same adapter (mlx-lm's load_adapters:
    DoRALinear, or the full weights loaded and unfrozen), one unpadded sequence."""
    import mlx.nn as nn
    from mlx_lm.tuner.trainer import default_loss
    from mlx_lm.utils import load, load_adapters

    ours, _, plan = _adapted(tiny_dir(family), kind)
    lora_io.save(ours, plan, tmp_path / "a")
    theirs, _ = load(str(tiny_dir(family)))
    theirs.freeze()
    load_adapters(theirs, str(tmp_path / "a"))
    if kind == "full":  # mlx-lm's load_adapters loads; mlx_lm.lora's full unfreezes the layers
        for name in lora.adapter_parameters(ours):
            module, leaf = name.rsplit(".", 1)
            dict(theirs.named_modules())[module].unfreeze(keys=[leaf], recurse=False)
    (example,) = examples([(50, 25)])
    batch = B.collate([example])
    n = len(example.ids)
    with kernels.off("train"):
        loss, ntoks, grads = trainer.full_backward(ours, compile=False)(ours, batch)
        (their_loss, their_ntoks), their_grads = nn.value_and_grad(theirs, default_loss)(
            theirs, mx.array([example.ids]), mx.array([[example.offset, n]])
        )
    assert ntoks.item() == their_ntoks.item()
    np.testing.assert_allclose(loss.item(), their_loss.item(), rtol=1e-6)
    g, r = dict(tree_flatten(grads)), dict(tree_flatten(their_grads))
    assert g.keys() == r.keys() and r
    num = sum(float(((g[k] - r[k]) ** 2).sum()) for k in r) ** 0.5
    den = sum(float((r[k] ** 2).sum()) for k in r) ** 0.5
    # Not bit for bit: their loss is a mean over masked full logits, ours the response
    # positions' CE summed (diag parity's gate for LoRA is a relative norm too). LoRA itself
    # measures up to 5e-5 here on the ill-conditioned random gemma4; a wrong or missing
    # gradient (DoRA's m, a norm's weight) is of order 1.
    assert den > 0 and num / den < 2e-4, num / den


@pytest.mark.parametrize("family", tiny.FAMILIES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("layers", ["all", [1, 2]])
def test_adapter_loads_in_mlx_lm_with_the_same_logits(tiny_dir, tmp_path, family, kind, layers):
    from mlx_lm.utils import load

    if (family, kind, layers) == ("qwen2", "dora", [1, 2]):
        # mlx-lm gives the unlisted layers an identity DoRA, which adds qwen2's bias after the
        # product (nn.Linear adds it inside addmm): equal to float rounding, not bit for bit.
        layers = "all"
    model, tok, plan = _adapted(tiny_dir(family), kind, layers)
    lora_io.save(model, plan, tmp_path / "a", meta={"base_model": f"tiny-{family}"})
    config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert config["fine_tune_type"] == kind
    assert (config["lora_parameters"] is None) == (kind == "full")
    ids = mx.array(tok.encode("Errors should never pass silently."))[None]
    ours = model(ids)
    theirs, _ = load(str(tiny_dir(family)), adapter_path=str(tmp_path / "a"))
    assert mx.array_equal(theirs(ids), ours).item()
    again, _ = load(str(tiny_dir(family)))
    back = lora_io.load(again, tmp_path / "a")
    assert (back.kind, back.layers, back.keys) == (plan.kind, plan.layers, plan.keys)
    assert mx.array_equal(again(ids), ours).item()
    base, _ = load(str(tiny_dir(family)))
    assert not mx.array_equal(base(ids), ours).item()


def test_mlx_lm_full_and_dora_adapters_load_in_mlxlab(tiny_dir, tmp_path):
    """Adapters as mlx_lm.lora writes them: DoRA with its default keys (every linear), and full
    with whole layers unfrozen (norms, Gemma 4's layer scalar)."""
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx_lm.utils import load

    for kind, family in (("dora", "qwen3"), ("full", "gemma4")):
        theirs, tok = load(str(tiny_dir(family)))
        theirs.freeze()
        if kind == "dora":
            cfg = {"rank": 4, "scale": 10.0, "dropout": 0.0}
            linear_to_lora_layers(theirs, 2, cfg, use_dora=True)
        else:
            cfg = None
            for layer in theirs.layers[-2:]:
                layer.unfreeze()
        mx.random.seed(7)
        moved = [
            (k, v + 0.05 * mx.random.normal(v.shape))
            for k, v in tree_flatten(theirs.trainable_parameters())
        ]
        theirs.load_weights(moved, strict=False)
        out = tmp_path / kind
        out.mkdir()
        mx.save_safetensors(str(out / "adapters.safetensors"), dict(moved))
        config = {"fine_tune_type": kind, "num_layers": 2, "lora_parameters": cfg}
        (out / "adapter_config.json").write_text(json.dumps(config))
        ours, _ = load(str(tiny_dir(family)))
        plan = lora_io.load(ours, out)
        n = len(ours.layers)
        assert plan.kind == kind and plan.layers == (n - 2, n - 1)
        ids = mx.array(tok.encode("Simple is better than complex."))[None]
        assert mx.array_equal(ours(ids), theirs(ids)).item()


def test_dora_on_a_quantized_base(quant_dir, tmp_path):
    """DoRA dequantizes the base weight (as mlx-lm's DoRALinear does): modes bit-exact, mlx-lm
    loads it with equal logits. Full fine-tuning of quantized weights is refused."""
    from mlx_lm.utils import load

    qdir = quant_dir("llama", 4, 32)
    model, tok, plan = _adapted(qdir, "dora")
    batch = B.collate(examples([(30, 10), (20, 3)]))
    ref = trainer.full_backward(model, compile=False)(model, batch)
    assert_same(
        bw.segmented_backward(model, bw.plan_by_size(len(model.layers), 2))(model, batch), ref
    )
    assert_same(bw.checkpointed_backward(model)(model, batch), ref)
    lora_io.save(model, plan, tmp_path / "a")
    ids = mx.array(tok.encode("Now is better than never."))[None]
    theirs, _ = load(str(qdir), adapter_path=str(tmp_path / "a"))
    assert mx.array_equal(theirs(ids), model(ids)).item()
    fresh, _ = load(str(qdir))
    with pytest.raises(UserError, match="lora.type=full on quantized modules"):
        lora.plan(fresh, LoraConfig(type="full", targets=["q"]))


def _cfg(tmp_path: Path, kind: str, **kw) -> TrainConfig:
    base = dict(
        model="tiny-gemma3",
        out_dir=str(tmp_path / "run"),
        iters=4,
        batch_size=4,
        val_every=0,
        save_every=0,
        log_every=1,
        wandb="disabled",
        compile=False,
        seed=2,
        data=DataConfig(train=str(QUICKSTART), max_seq_length=96),
        lora=LoraConfig(type=kind, targets=["q", "v", "down"], layers=4, rank=4),
        optim=OptimConfig(lr=3e-3 if kind == "dora" else 1e-3, schedule="constant"),
    )
    base.update(kw)
    return TrainConfig(**base)


@pytest.mark.parametrize("kind", KINDS)
def test_training_modes_resume_and_mlx_lm(tiny_dir, tmp_path, kind):
    """The full and segmented backward give the same losses and adapter bytes; a run resumed from its
    step-2 checkpoint ends on the same adapter; mlx-lm loads the adapter with equal logits."""
    from mlx_lm.utils import load

    from mlxlab.train.cli import run

    tiny_dir("gemma3")
    runs = {
        mode: run(_cfg(tmp_path / mode, kind, backward=BackwardConfig(mode=mode, segment_size=2)))
        for mode in ("full", "segmented")  # checkpoint: the gradient tests above
    }
    losses = {m: run_losses(Path(s["adapter"]).parent) for m, s in runs.items()}
    assert losses["full"] == losses["segmented"]
    assert losses["full"][4] < losses["full"][1]
    blobs = {m: (Path(s["adapter"]) / "adapters.safetensors").read_bytes() for m, s in runs.items()}
    assert blobs["full"] == blobs["segmented"]

    part = run(_cfg(tmp_path / "resumed", kind, iters=3, save_every=2))
    run_dir = Path(part["adapter"]).parent
    again = run(_cfg(tmp_path / "resumed", kind, iters=4, save_every=2, resume=True))
    assert again["start_step"] == 2
    assert run_losses(run_dir) == losses["full"]
    assert (run_dir / "adapter" / "adapters.safetensors").read_bytes() == blobs["full"]

    adapter = runs["full"]["adapter"]
    theirs, tok = load(str(tiny_dir("gemma3")), adapter_path=adapter)
    ours, _ = load(str(tiny_dir("gemma3")))
    lora_io.load(ours, adapter)
    ids = mx.array(tok.encode("What does `json.dumps` do?"))[None]
    assert mx.array_equal(theirs(ids), ours(ids)).item()


# --- DPO / ORPO on each kind ------------------------------------------------------------------

PAIR_SHAPES = [(40, 10), (30, 10), (24, 5), (36, 5)]


@pytest.mark.parametrize("family", ["llama", "gemma3", "gemma4"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("objective", ["dpo", "orpo"])
def test_pair_gradients_are_bit_exact_across_modes(tiny_dir, family, kind, objective):
    model, _, _ = _adapted(tiny_dir(family), kind)
    start = None
    if objective == "dpo":  # the reference: a copy of the model at its start (base weights)
        fresh, _, _ = _adapted(tiny_dir(family), kind)
        start = {
            k: v for k, v in tree_flatten(fresh.parameters()) if k in lora.adapter_parameters(fresh)
        }
    objective = obj.PairObjective(objective, beta=0.2, lam=0.3, start=start)
    sampler = B.BatchSampler(examples(PAIR_SHAPES), 2, 0, shuffle=False, pairs=True)
    batch = next(sampler.one_pass())
    if objective.needs_reference:
        batch = dataclasses.replace(batch, ref=obj.reference_logps(model, batch, start))
    full = trainer.full_backward(model, objective.loss, compile=False)(model, batch)
    for size in (1, 4):
        plan = bw.plan_by_size(len(model.layers), size)
        got = bw.segmented_backward(model, plan, objective=objective)(model, batch)
        assert_same(got, full)
        assert np.array_equal(np.array(got[3]), np.array(full[3]))
    assert_same(bw.checkpointed_backward(model, objective=objective)(model, batch), full)
    assert np.isfinite(full[0].item())


def test_adapters_off_refuses_what_a_scale_cannot_switch_off(tiny_dir):
    model, _, _ = _adapted(tiny_dir("llama"), "dora")
    with pytest.raises(ValueError, match="adapters_off needs LoRA adapters"):
        with obj.adapters_off(model):
            pass


@pytest.mark.parametrize("kind", KINDS)
def test_dpo_starts_from_the_base_as_its_reference(tiny_dir, tmp_path, kind):
    """DPO with lora.type=dora|full: the reference is the model the run starts from (its
    starting arrays kept and swapped in), so the first step's policy equals it: margin 0, loss
    log 2; later steps move; every backward mode agrees."""
    import math

    from mlxlab.train.cli import run
    from tests.test_preference_train import write_pairs

    tiny_dir("llama")
    pairs = write_pairs(tmp_path / "pairs", n_train=8, n_valid=2)
    records = {}
    for mode in ("full", "segmented"):
        s = run(
            _cfg(
                tmp_path / mode,
                kind,
                model="tiny-llama",
                objective="dpo",
                batch_size=2,
                iters=3,
                data=DataConfig(train=str(pairs), max_seq_length=128),
                backward=BackwardConfig(mode=mode, segment_size=2),
            )
        )
        run_dir = Path(s["adapter"]).parent
        records[mode] = [
            json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()
        ]
    first = records["full"][0]
    assert first["reward_margin"] == 0.0 and first["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert records["full"][-1]["loss"] != first["loss"]
    assert [r["loss"] for r in records["full"]] == [r["loss"] for r in records["segmented"]]


@pytest.mark.parametrize("kind", KINDS)
def test_orpo_trains_each_kind(tiny_dir, tmp_path, kind):
    from mlxlab.train.cli import run
    from tests.test_preference_train import write_pairs

    tiny_dir("qwen3")
    pairs = write_pairs(tmp_path / "pairs", n_train=8, n_valid=2)
    s = run(
        _cfg(
            tmp_path,
            kind,
            model="tiny-qwen3",
            objective="orpo",
            batch_size=2,
            iters=3,
            data=DataConfig(train=str(pairs), max_seq_length=128),
        )
    )
    recs = [
        json.loads(x)
        for x in (Path(s["adapter"]).parent / "metrics.jsonl").read_text().splitlines()
    ]
    assert all(np.isfinite(r["loss"]) and "log_odds_ratio" in r for r in recs)


@pytest.mark.parametrize("kind", KINDS)
def test_lora_init_starts_from_an_adapter_of_its_kind(tiny_dir, tmp_path, kind):
    """lora.init with a DoRA or full adapter: the run starts from its arrays (one step at a
    negligible rate leaves them where they were); another lora.type is refused by name."""
    from mlxlab.train.cli import run

    tiny_dir("gemma3")
    first = run(_cfg(tmp_path / "a", kind, iters=2))
    init = dataclasses.replace(_cfg(tmp_path, kind).lora, init=first["adapter"])
    second = run(_cfg(tmp_path / "b", kind, iters=1, lora=init, optim=OptimConfig(lr=1e-12)))
    a = mx.load(str(Path(first["adapter"]) / "adapters.safetensors"))
    b = mx.load(str(Path(second["adapter"]) / "adapters.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_allclose(np.array(b[k]), np.array(a[k]), atol=1e-6)
    fresh = mx.load(
        str(Path(run(_cfg(tmp_path / "c", kind, iters=1))["adapter"]) / "adapters.safetensors")
    )
    assert any(not np.allclose(np.array(fresh[k]), np.array(a[k]), atol=1e-4) for k in a)
    other = "lora" if kind == "dora" else "dora"
    with pytest.raises(UserError, match=f"kind '{kind}' here '{other}'"):
        run(
            _cfg(
                tmp_path / "d",
                other,
                lora=LoraConfig(
                    type=other, targets=["q", "v", "down"], layers=4, rank=4, init=first["adapter"]
                ),
            )
        )


@pytest.mark.parametrize("kind", KINDS)
def test_fuse_bakes_each_kind(tiny_dir, tmp_path, kind):
    from mlx_lm.utils import load

    from mlxlab.config import LoraToolConfig
    from mlxlab.lora.cli import fuse_to_dir

    model, tok, plan = _adapted(tiny_dir("qwen3"), kind, layers=2)
    lora_io.save(model, plan, tmp_path / "a")
    out = fuse_to_dir(
        LoraToolConfig(
            action="fuse",
            model=str(tiny_dir("qwen3")),
            adapter=str(tmp_path / "a"),
            out=str(tmp_path / "fused"),
            dtype="float32",
        )
    )
    fused, _ = load(str(out))
    ids = mx.array(tok.encode("Sparse is better than dense."))[None]
    np.testing.assert_allclose(np.array(fused(ids)), np.array(model(ids)), atol=1e-4)


def test_serving_dora_per_row_and_refusals(tiny_dir, tmp_path):
    """A DoRA adapter served per row beside a LoRA one: each row's tokens those it gets alone,
    a row alone equal to mlx-lm's greedy decode with DoRALinear; a stack with DoRA is a 400;
    a full fine-tune does not mount (served fused instead)."""
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load

    from mlxlab.serve.engine.jobs import Job, Sampling, parse_adapter_spec
    from tests.helpers.serve import make_adapter, make_client
    from tests.test_serve_batch import prompts, submit_all

    model_dir = tiny_dir("gemma3")
    dora, _, plan = _adapted(model_dir, "dora", layers=3)
    lora_io.save(dora, plan, tmp_path / "d")
    full, _, fplan = _adapted(model_dir, "full", layers=1)
    lora_io.save(full, fplan, tmp_path / "f")
    make_adapter(model_dir, tmp_path / "a", seed=1)
    client, gateway = make_client(
        batch=4,
        adapter_root=str(tmp_path),
        prompt_cache_gb=0,
        adapters={"a": str(tmp_path / "a"), "d": str(tmp_path / "d")},
    )
    try:
        specs = ["d", "a", "none", "d"]
        ps = prompts((30, 12, 45, 7), seed=4)

        def jobs():
            out = [
                Job(ps[i], 16, None, Sampling(temperature=0.0), adapter=parse_adapter_spec(s))
                for i, s in enumerate(specs)
            ]
            for i, j in enumerate(out):
                j.id = f"{i}:{specs[i]}"
            return out

        alone = {}
        for j in jobs():
            alone.update(submit_all(gateway, [j])[0])
        together, _ = submit_all(gateway, jobs())
        assert {k: d.tokens for k, d in together.items()} == {k: d.tokens for k, d in alone.items()}
        assert gateway.batch.peak_rows == 4
        r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "adapter": "a+d"})
        assert r.status_code == 400 and "DoRA adapter" in r.text
        assert r.json()["error"]["code"] == "adapter_not_stackable"
        r = client.post("/v1/adapters", json={"id": "f", "path": "f"})
        assert r.status_code == 400 and "full fine-tune" in r.text
        cards = {c["id"]: c for c in client.get("/v1/adapters").json()["adapters"]}
        assert cards["d"]["type"] == "dora" and cards["a"]["type"] == "lora"
    finally:
        gateway.stop()
    theirs, _ = load(str(model_dir), adapter_path=str(tmp_path / "d"))
    expected = []
    for tok, _ in generate_step(mx.array(ps[0]), theirs, max_tokens=16):
        expected.append(int(tok))
        if tok in (1, 5):
            break
    assert alone["0:d"].tokens == expected


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("objective", ["sft", "dpo"])
def test_diag_parity_takes_each_kind(tiny_dir, kind, objective):
    """`diag parity lora_type=dora|full`: a random adapter of that kind, loaded by mlx-lm (its
    DoRALinear; the full weights) with bit-identical logits, gradients within the gate LoRA is
    held to under this BLAS, every backward mode bit for bit the full one; DPO's reference is
    the base model."""
    from mlxlab.diag import parity
    from mlxlab.diag.config import DiagConfig

    tiny_dir("gemma3")
    gate = {"max_ulp": 64, "max_rel": 1e-4} if objective == "sft" else {}
    report = parity.run(
        DiagConfig(
            model="tiny-gemma3",
            lora_type=kind,
            objective=objective,
            segment_sizes=[1, 3],
            **gate,
        ),
        verbose=False,
    )
    assert report["passed"], [c for c in report["checks"] if not c["passed"]]
    by_name = {c["name"]: c for c in report["checks"]}
    if objective == "sft":
        assert by_name["logits (adapter)"]["verdict"] == "BIT-EXACT"
    for name in ("segmented size 1 vs full", "segmented size 3 vs full", "checkpointed vs full"):
        assert by_name[name]["verdict"] == "BIT-EXACT", name
