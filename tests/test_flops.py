"""The training step's FLOP count (train/flops.py) against a hand count, and its MFU figures."""

from __future__ import annotations

import json

import pytest

import mlxlab  # noqa: F401
from mlxlab.config import LoraConfig
from mlxlab.train import flops


def test_attended_pairs_causal_and_windowed():
    assert flops.attended_pairs(5, None) == 15  # 1+2+3+4+5
    assert flops.attended_pairs(5, 3) == 1 + 2 + 3 + 3 + 3
    assert flops.attended_pairs(3, 8) == 6  # a window longer than the sequence: plain causal


def test_a_tiny_llama_step_matches_a_hand_count(tiny_dir):
    from mlxlab.lora import apply as lora
    from mlxlab.models.zoo import load

    model, _ = load(str(tiny_dir("llama")))
    # tiny-llama: hidden 64, 4 layers, MLP 128, 4 heads of 16, 2 KV heads, vocab 512.
    h, layers, inter, heads, hd, kv, vocab = 64, 4, 128, 4, 16, 2, 512
    per_layer = h * heads * hd + 2 * h * kv * hd + heads * hd * h + 3 * h * inter
    lora.apply(model, lora.plan(model, LoraConfig(targets=["q", "v"], rank=4)), seed=0)
    shapes = flops.model_shapes(model)
    assert shapes.linear_weights == layers * per_layer
    assert shapes.lora_weights == layers * (4 * (h + heads * hd) + 4 * (h + kv * hd))
    assert (shapes.hidden, shapes.vocab, shapes.windows) == (h, vocab, [None] * layers)

    lengths, trained = [10, 7], 5
    tokens = sum(lengths)
    lin = 2 * layers * per_layer * tokens
    lo = 2 * shapes.lora_weights * tokens
    att = layers * 2 * 2 * heads * hd * (55 + 28)  # causal pairs of 10 and 7 tokens
    head = 2 * h * vocab * trained
    full = flops.step_flops(shapes, lengths, trained, "full")
    assert full["forward"] == lin + lo + att + head
    assert full["backward"] == lin + 2 * lo + 2 * att + head
    assert full["recompute"] == 0
    seg = flops.step_flops(shapes, lengths, trained, "segmented")
    assert seg["total"] == full["total"] + lin + lo + att


def test_sliding_window_layers_count_only_their_window(tiny_dir):
    from mlxlab.models.zoo import load

    model, _ = load(str(tiny_dir("gemma3")))
    shapes = flops.model_shapes(model)
    window = next(w for w in shapes.windows if w is not None)
    long = window * 3
    a = flops.step_flops(shapes, [long], 1, "full")["forward"]
    full_windows = flops.Shapes(**{**shapes.__dict__, "windows": [None] * len(shapes.windows)})
    assert a < flops.step_flops(full_windows, [long], 1, "full")["forward"]


def test_training_logs_model_flops_and_mfu(tmp_path, tiny_dir):
    from mlxlab.train.cli import run
    from tests.test_train import _cfg

    tiny_dir("llama")
    summary = run(_cfg(tmp_path / "r", iters=4, log_every=2, save_every=0, val_every=0))
    run_dir = tmp_path / "r"
    run_dir = next(p.parent for p in run_dir.rglob("metrics.jsonl"))
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in records if "mfu" in r]
    assert len(logged) == 2 and all(0 < r["mfu"] < 1 and r["gflops"] > 0 for r in logged)
    assert summary["model_tflop"] > 0 and 0 < summary["mfu"] < 1
    saved = json.loads((run_dir / "summary.json").read_text())
    assert saved["mfu"] == pytest.approx(summary["mfu"])
