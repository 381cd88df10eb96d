"""GGUF -> mlx-lm conversion on synthetic files written like llama.cpp writes them."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

import mlxlab  # noqa: F401
from mlxlab.config import UserError
from mlxlab.models import gguf as conv
from mlxlab.models import tiny
from tests.helpers.gguf import roundtrip, write_gguf

PROMPT = "Beautiful is better than ugly. Explicit is better than implicit."


def _source(family, tmp_path):
    """A tiny model's float32 weights (HF names), config and tokenizer dir."""
    from mlx.utils import tree_flatten

    model, tokenizer, config = tiny.build(family, seed=3)
    tok_dir = tmp_path / f"tok-{family}"
    tokenizer.save_pretrained(str(tok_dir))
    weights = {k: np.array(v) for k, v in tree_flatten(model.parameters())}
    return model, tokenizer, config, weights, tok_dir


def _logits(model_or_dir, tokenizer, weights=None, config=None):
    import mlx.core as mx
    from mlx_lm.utils import _get_classes, load_model

    if weights is not None:  # a fresh model of `config` holding exactly `weights`
        model_class, args_class = _get_classes(config)
        model = model_class(args_class.from_dict(config))
        model.load_weights([(k, mx.array(v)) for k, v in weights.items()])
    elif not hasattr(model_or_dir, "parameters"):
        model, _ = load_model(model_or_dir)
    else:
        model = model_or_dir
    ids = mx.array(tokenizer.encode(PROMPT))[None]
    return np.array(model(ids).astype(mx.float32))


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gemma3"])
def test_each_architecture_round_trips_exactly_in_f32(family, tmp_path):
    model, tokenizer, config, weights, tok_dir = _source(family, tmp_path)
    path = write_gguf(tmp_path / f"{family}.gguf", weights, config, tok_dir)
    out = conv.convert(path, tmp_path / "out", dtype="float32")

    from mlx_lm.utils import load_tokenizer

    tok = load_tokenizer(out)
    assert tok.encode(PROMPT) == tokenizer.encode(PROMPT)  # same ids, BOS included
    expected = _logits(model, tokenizer)
    got = _logits(out, tokenizer)
    # Only Gemma's (1 + w) - 1 norm round trip rounds; everything else is bit-exact.
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5 if family == "gemma3" else 0)


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1])
def test_each_quant_type_gives_the_dequantized_model(qtype, tmp_path):
    # Llama: the permuted q/k rows must come back in order through the quantizer too.
    model, tokenizer, config, weights, tok_dir = _source("llama", tmp_path)
    path = write_gguf(tmp_path / "m.gguf", weights, config, tok_dir, qtype=qtype)
    out = conv.convert(path, tmp_path / "out", dtype="float32")
    reference = {k: roundtrip(v, qtype) for k, v in weights.items()}
    np.testing.assert_allclose(
        _logits(out, tokenizer), _logits(None, tokenizer, reference, config), rtol=0, atol=1e-4
    )


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q2_K, Q.Q3_K])
def test_k_quants_are_dequantized(qtype, tmp_path):
    """gguf-py has no K-quant writer: store random valid blocks and check we read them as gguf does."""
    import gguf
    from gguf.quants import dequantize

    rng = np.random.default_rng(0)
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = 8, 512
    raw = rng.integers(0, 256, size=(rows, cols // block_size * type_size), dtype=np.uint8)
    # Keep the fp16 scales finite and small: patch every half-float in the block to 0.01.
    raw = raw.reshape(rows, cols // block_size, type_size)
    half = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    offsets = {
        Q.Q4_K: [0, 2],
        Q.Q5_K: [0, 2],
        Q.Q6_K: [type_size - 2],
        Q.Q2_K: [type_size - 4, type_size - 2],
        Q.Q3_K: [type_size - 2],
    }[qtype]
    for off in offsets:
        raw[..., off : off + 2] = half
    raw = raw.reshape(rows, -1)
    expected = dequantize(raw, qtype)
    assert np.isfinite(expected).all()

    class _T:  # the two fields read_tensors needs from a GGUF tensor
        name, tensor_type, shape, data = "blk.0.ffn_down.weight", qtype, [cols, rows], raw

    class _Reader:
        tensors = [_T()]

    got = conv.read_tensors(_Reader(), "qwen3", {})
    np.testing.assert_array_equal(got["model.layers.0.mlp.down_proj.weight"], expected)


def test_wrong_norm_offset_would_be_caught(tmp_path):
    """The f32 round trip is a real check: skipping Gemma's -1 changes the logits a lot."""
    model, tokenizer, config, weights, tok_dir = _source("gemma3", tmp_path)
    shifted = {k: (v + 1.0 if k.endswith("norm.weight") else v) for k, v in weights.items()}
    diff = np.abs(_logits(None, tokenizer, shifted, config) - _logits(model, tokenizer)).max()
    assert diff > 1e-2


def test_conversion_is_idempotent_and_leaves_no_temp(tmp_path):
    _, _, config, weights, tok_dir = _source("qwen3", tmp_path)
    path = write_gguf(tmp_path / "q.gguf", weights, config, tok_dir)
    out = conv.convert(path, tmp_path / "models" / "q")
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert conv.convert(path, out) == out
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp  # not redone
    conv.convert(path, out, force=True)
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["q"]


def test_truncated_file_is_a_clean_error(tmp_path):
    _, _, config, weights, tok_dir = _source("qwen3", tmp_path)
    path = write_gguf(tmp_path / "q.gguf", weights, config, tok_dir)
    data = path.read_bytes()
    bad = tmp_path / "truncated.gguf"
    bad.write_bytes(data[: len(data) // 2])
    with pytest.raises(UserError, match="not a readable GGUF"):
        conv.convert(bad, tmp_path / "models" / "t")
    assert not (tmp_path / "models").exists() or not any((tmp_path / "models").iterdir())


def test_garbage_file_is_a_clean_error(tmp_path):
    bad = tmp_path / "garbage.gguf"
    bad.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    with pytest.raises(UserError, match="not a readable GGUF"):
        conv.convert(bad, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_unsupported_architecture_is_named(tmp_path):
    import gguf

    path = tmp_path / "mamba.gguf"
    w = gguf.GGUFWriter(str(path), "mamba")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UserError, match="unsupported GGUF architecture 'mamba'.*gemma3"):
        conv.convert(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_unwritable_destination_is_a_clean_error(tmp_path):
    # A regular file where a directory must go fails for root too (chmod would not).
    _, _, config, weights, tok_dir = _source("qwen3", tmp_path)
    path = write_gguf(tmp_path / "q.gguf", weights, config, tok_dir)
    blocker = tmp_path / "blocker"
    blocker.write_text("not a directory")
    with pytest.raises(UserError, match="cannot write"):
        conv.convert(path, blocker / "sub" / "out")


def test_unsupported_tensor_type_is_named():
    import gguf

    class _T:
        name, tensor_type, shape = "blk.0.ffn_down.weight", Q.Q8_1, [32, 1]
        data = np.zeros((1, gguf.GGML_QUANT_SIZES[Q.Q8_1][1]), np.uint8)

    class _Reader:
        tensors = [_T()]

    with pytest.raises(UserError, match="blk.0.ffn_down.weight: unsupported GGUF type Q8_1"):
        conv.read_tensors(_Reader(), "llama", {"num_attention_heads": 1, "num_key_value_heads": 1})
