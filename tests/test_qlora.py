"""QLoRA: LoRA on MLX-quantized bases (4- and 8-bit, groups of 32 and 64, written by mlx-lm's own
converter as `mlx_lm.convert -q` writes them): every backward mode bit for bit the full
backward, packing, training and resume, mlx-lm loading the adapter with equal logits, and
generation and serving (per-row adapters in a batch) on the quantized base."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import mlxlab  # noqa: F401
from mlxlab.config import BackwardConfig, DataConfig, LoraConfig, OptimConfig
from mlxlab.data import batches as B
from mlxlab.lora import apply as lora
from mlxlab.lora import io as lora_io
from mlxlab.models import tiny
from mlxlab.train import backward as bw
from mlxlab.train import trainer
from mlxlab.train.config import TrainConfig
from tests.helpers.training import QUICKSTART, assert_same, examples, run_losses

QUANTS = [(4, 32), (8, 64)]


def _quantized_lora_model(path, seed=0, targets=("q", "k", "v", "o", "down")):
    """A quantized model with LoRA (B non-zero, so gradients reach A) on `targets`."""
    import mlx.core as mx
    import mlx.nn as nn

    from mlxlab.models.zoo import load

    model, _ = load(str(path), dtype="float32", decode_head="exact")
    plan = lora.plan(model, LoraConfig(targets=list(targets), rank=4))
    lora.apply(model, plan, seed=seed)
    wrapped = [m.linear for _, m in lora.lora_modules(model)]
    assert wrapped and all(isinstance(m, nn.QuantizedLinear) for m in wrapped)
    mx.random.seed(seed)
    for _, m in lora.lora_modules(model):
        m.lora_b = 0.05 * mx.random.normal(m.lora_b.shape)
    return model, plan


def test_quantize_writes_what_mlx_lm_convert_writes(quant_dir):
    config = json.loads((quant_dir("llama", 4, 32) / "config.json").read_text())
    assert config["quantization"] == {"group_size": 32, "bits": 4, "mode": "affine"}
    from mlx_lm.utils import load

    model, _ = load(str(quant_dir("llama", 8, 64)))
    q = model.layers[0].self_attn.q_proj
    assert (type(q).__name__, q.bits, q.group_size) == ("QuantizedLinear", 8, 64)


@pytest.mark.parametrize("family", tiny.FAMILIES)
@pytest.mark.parametrize("bits,group", QUANTS)
def test_quantized_gradients_are_bit_exact_in_every_mode(quant_dir, family, bits, group):
    model, _ = _quantized_lora_model(quant_dir(family, bits, group))
    batch = B.collate(examples([(40, 10), (30, 3), (12, 0)]))
    ref = trainer.full_backward(model, compile=False)(model, batch)
    assert np.isfinite(ref[0].item()) and ref[1].item() == 31 + 28 + 12  # len - max(offset, 1) each
    assert_same(trainer.full_backward(model, compile=True)(model, batch), ref)
    assert_same(bw.checkpointed_backward(model)(model, batch), ref)
    for size in (1, 2, 5):
        plan = bw.plan_by_size(len(model.layers), size)
        assert_same(bw.segmented_backward(model, plan)(model, batch), ref)


@pytest.mark.parametrize("family", ["gemma3", "qwen2"])
def test_quantized_packed_rows_agree_across_modes(quant_dir, family):
    """Packed rows on a quantized base: each mode bit for bit the full backward, and the loss
    that of the same examples unpacked (to float rounding)."""
    model, _ = _quantized_lora_model(quant_dir(family, 4, 32))
    exs = examples([(20, 5), (14, 2), (9, 0), (30, 8)])
    packed = B.collate_rows([exs[:2], exs[2:]])
    ref = trainer.full_backward(model, compile=False)(model, packed)
    assert_same(bw.checkpointed_backward(model)(model, packed), ref)
    assert_same(
        bw.segmented_backward(model, bw.plan_by_size(len(model.layers), 2))(model, packed), ref
    )
    unpacked = trainer.full_backward(model, compile=False)(model, B.collate(exs))
    np.testing.assert_allclose(ref[0].item(), unpacked[0].item(), rtol=1e-5)


def _cfg(tmp_path: Path, model: str, **kw) -> TrainConfig:
    base = dict(
        model=model,
        out_dir=str(tmp_path / "run"),
        iters=4,
        batch_size=4,
        val_every=0,
        save_every=0,
        log_every=1,
        wandb="disabled",
        compile=False,
        seed=1,
        data=DataConfig(train=str(QUICKSTART), max_seq_length=96),
        lora=LoraConfig(targets=["q", "v", "down"], rank=4),
        optim=OptimConfig(lr=3e-3, schedule="constant"),
    )
    base.update(kw)
    return TrainConfig(**base)


def test_quantized_training_modes_resume_and_mlx_lm_parity(quant_dir, tmp_path):
    """Training on a 4-bit base: the full and segmented backward give the same losses and adapter
    bytes; a run resumed from its step-2 checkpoint ends on the same adapter; mlx-lm loads the
    adapter onto the same quantized model with equal logits."""
    import mlx.core as mx
    from mlx_lm.utils import load

    from mlxlab.train.cli import run

    qdir = str(quant_dir("gemma3", 4, 32))
    runs = {
        mode: run(_cfg(tmp_path / mode, qdir, backward=BackwardConfig(mode=mode, segment_size=2)))
        for mode in ("full", "segmented")  # checkpoint: the gradient tests above
    }
    losses = {m: run_losses(Path(s["adapter"]).parent) for m, s in runs.items()}
    assert losses["full"] == losses["segmented"]
    assert losses["full"][4] < losses["full"][1]
    blobs = {m: (Path(s["adapter"]) / "adapters.safetensors").read_bytes() for m, s in runs.items()}
    assert blobs["full"] == blobs["segmented"]

    # killed after its step-2 checkpoint (a run of 3 steps stands for it), then resumed to 4
    part = run(_cfg(tmp_path / "resumed", qdir, iters=3, save_every=2))
    run_dir = Path(part["adapter"]).parent
    again = run(_cfg(tmp_path / "resumed", qdir, iters=4, save_every=2, resume=True))
    assert again["start_step"] == 2
    assert run_losses(run_dir) == losses["full"]
    assert (run_dir / "adapter" / "adapters.safetensors").read_bytes() == blobs["full"]

    adapter = runs["full"]["adapter"]
    theirs, tok = load(qdir, adapter_path=adapter)
    ours, _ = load(qdir)
    lora_io.load(ours, adapter)
    ids = mx.array(tok.encode("What does `json.dumps` do?"))[None]
    assert mx.array_equal(theirs(ids), ours(ids)).item()
    base, _ = load(qdir)
    assert not mx.array_equal(base(ids), ours(ids)).item()  # the adapter matters


def test_generate_on_a_quantized_base_with_an_adapter_equals_mlx_lm(quant_dir, tmp_path):
    import io

    from mlx_lm import generate as mlx_generate
    from mlx_lm.utils import load

    from mlxlab import generate
    from mlxlab.config import GenerateConfig
    from tests.helpers.serve import make_adapter

    qdir = quant_dir("llama", 8, 64)
    make_adapter(qdir, tmp_path / "a", seed=3, targets=("q", "v", "down"))
    out = io.StringIO()
    stats = generate.run(
        GenerateConfig(
            model=str(qdir), adapter=str(tmp_path / "a"), prompt="def f(x):", max_tokens=12
        ),
        out=out,
    )
    assert stats["generation_tokens"] >= 1
    theirs, tok = load(str(qdir), adapter_path=str(tmp_path / "a"))
    expected = mlx_generate(theirs, tok, "def f(x):", max_tokens=12)
    assert out.getvalue() == expected + "\n"


def test_serving_a_quantized_base_with_per_row_adapters(quant_dir, tmp_path):
    """The batched lane on a 4-bit base: rows with different adapters (and stacks, and none)
    decode together with the tokens each gets alone, and a row alone equals mlx-lm greedy
    with that adapter loaded."""
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load

    from mlxlab.serve.engine.jobs import Job, Sampling, parse_adapter_spec
    from tests.helpers.serve import make_adapter, make_client
    from tests.test_serve_batch import prompts, submit_all

    qdir = quant_dir("gemma3", 4, 32)
    make_adapter(qdir, tmp_path / "a", seed=1)
    make_adapter(qdir, tmp_path / "b", seed=2, targets=("q", "o", "down"), layers=3)
    _, gateway = make_client(
        model=str(qdir),
        batch=4,
        adapter_root=str(tmp_path),
        prompt_cache_gb=0,
        adapters={"a": str(tmp_path / "a"), "b": str(tmp_path / "b")},
    )
    try:
        specs = ["a", "b", "none", "a+b", "a"]
        ps = prompts((30, 12, 45, 30, 7), seed=3)

        def jobs():
            return [
                Job(ps[i], 16, None, Sampling(temperature=0.0), adapter=parse_adapter_spec(s))
                for i, s in enumerate(specs)
            ]

        for i, j in enumerate(jobs_list := jobs()):
            j.id = f"{i}:{specs[i]}"
        alone = {}
        for j in jobs_list:
            alone.update(submit_all(gateway, [j])[0])
        together = jobs()
        for i, j in enumerate(together):
            j.id = f"{i}:{specs[i]}"
        got, _ = submit_all(gateway, together)
        assert {k: d.tokens for k, d in got.items()} == {k: d.tokens for k, d in alone.items()}
        assert gateway.batch.peak_rows == 4
        assert alone["0:a"].tokens != alone["3:a+b"].tokens
    finally:
        gateway.stop()
    import mlx.core as mx

    theirs, _ = load(str(qdir), adapter_path=str(tmp_path / "a"))
    expected = []
    for tok, _ in generate_step(mx.array(ps[0]), theirs, max_tokens=16):
        expected.append(int(tok))
        if tok in (1, 5):  # the tiny tokenizer's end tokens
            break
    assert alone["0:a"].tokens == expected


@pytest.mark.parametrize("mode", ["seg2", "checkpoint", "mlx_lm_gc"])
def test_memory_harness_takes_a_quantized_model(quant_dir, mode):
    """`diag memory` (and scripts/bench_backward.py, the same harness) on a quantized base."""
    from mlxlab.diag import memory

    r = memory.worker(str(quant_dir("gemma3", 4, 32)), mode, 64, 1, "auto", 1.6)
    assert r["s_per_step"] > 0 and r["peak_gb"] > 0


@pytest.mark.slow  # subprocesses: data chunk, then eval chunk on the quantized base + adapter
def test_eval_chunk_on_a_quantized_base_with_an_adapter(quant_dir, tmp_path):
    from tests.helpers.cli import run_cli
    from tests.helpers.serve import make_adapter

    qdir = quant_dir("gemma3", 4, 32)
    make_adapter(qdir, tmp_path / "a", seed=5, targets=("q", "v"))
    data = tmp_path / "chunk"
    built = run_cli("data", "chunk", f"out={data}", "train=2", "valid=1", "test=2")
    assert built.returncode == 0, built.stderr
    res = tmp_path / "res.jsonl"
    args = ("eval", "chunk", f"model={qdir}", f"data={data}", "max_tokens=6", "batch_size=2")
    plain = run_cli(*args, f"out={res}")
    tuned = run_cli(*args, f"adapter={tmp_path / 'a'}", f"out={tmp_path / 'tuned.jsonl'}")
    assert plain.returncode == 0 and tuned.returncode == 0, plain.stderr + tuned.stderr
    outputs = [
        [json.loads(x)["output"] for x in p.read_text().splitlines()]
        for p in (res, tmp_path / "tuned.jsonl")
    ]
    assert len(outputs[0]) == len(outputs[1]) == 2 and outputs[0] != outputs[1]


@pytest.mark.slow  # one process, then two ranks
def test_pipeline_on_a_quantized_base_equals_one_process(quant_dir, session_home, tmp_path):
    """The segment pipeline on 4-bit tiny-gemma4 (KV-shared layers' donors on rank 0): losses,
    gradient norms and the adapter's bytes equal one process's segmented backward."""
    from tests.helpers.dist import start_ranks, wait_all
    from tests.test_distributed import ENV, _records, _single

    qdir = quant_dir("gemma4", 4, 32)
    env = {**ENV, "MLXLAB_HOME": str(session_home)}

    def args(out, *extra):
        return [
            "train",
            f"model={qdir}",
            "dtype=float32",
            f"out_dir={out}",
            "iters=3",
            "batch_size=2",
            "grad_accum=2",
            "val_every=0",
            "save_every=0",
            "log_every=1",
            "wandb=disabled",
            "seed=5",
            f"data.train={QUICKSTART}",
            "data.max_seq_length=96",
            "lora.targets=[q,k,v,o,down]",
            "lora.rank=4",
            "optim.lr=1e-3",
            "backward.mode=segmented",
            "backward.segment_size=2",
            *extra,
        ]

    one = _single(args(tmp_path / "one"), env)
    assert one.returncode == 0, one.stderr[-2000:]
    pp = tmp_path / "pp"
    ranks = wait_all(start_ranks(args(pp, "backward.pipeline=true"), 2, tmp_path, env))
    assert [code for code, _, _ in ranks] == [0, 0], ranks[0][2][-3000:] + ranks[1][2][-3000:]
    single, piped = _records(tmp_path / "one"), _records(pp)
    assert len(single) == 3
    for step, rec in single.items():
        assert (piped[step]["loss"], piped[step]["grad_norm"]) == (rec["loss"], rec["grad_norm"])
    assert (pp / "adapter" / "adapters.safetensors").read_bytes() == (
        tmp_path / "one" / "adapter" / "adapters.safetensors"
    ).read_bytes()
