"""Tiny models, model specs and generation, in-process."""

from __future__ import annotations

import numpy as np
import pytest

import mlxlab  # noqa: F401
from mlxlab.config import GenerateConfig, UserError
from mlxlab.models import tiny, zoo


@pytest.mark.parametrize("family", tiny.FAMILIES)
def test_tiny_model_saves_and_loads_identically(family, tiny_dir):
    import mlx.core as mx
    from mlx_lm.utils import load

    built, tokenizer, _ = tiny.build(family)
    loaded, loaded_tok = load(str(tiny_dir(family)))
    ids = tokenizer.encode("Simple is better than complex.")
    assert loaded_tok.encode("Simple is better than complex.") == ids
    assert ids[0] == 2  # BOS
    np.testing.assert_array_equal(
        np.array(built(mx.array(ids)[None])), np.array(loaded(mx.array(ids)[None]))
    )


def test_tiny_models_are_seeded():
    import mlx.core as mx

    a, tok, _ = tiny.build("gemma3", seed=1)
    b, _, _ = tiny.build("gemma3", seed=1)
    c, _, _ = tiny.build("gemma3", seed=2)
    ids = mx.array(tok.encode("abc"))[None]
    assert mx.array_equal(a(ids), b(ids)).item()
    assert not mx.array_equal(a(ids), c(ids)).item()


def test_gemma4_tiny_has_kv_shared_layers_and_per_layer_inputs():
    model, _, config = tiny.build("gemma4")
    layers = model.model.layers
    assert (
        sum(1 for layer in layers if not layer.self_attn.has_kv) == config["num_kv_shared_layers"]
    )
    assert model.model.embed_tokens_per_layer is not None


def test_tiny_tokenizer_is_deterministic_and_has_a_chat_template():
    a, b = tiny.build_tiny(), tiny.build_tiny()
    text = "Readability counts, even in tests."
    assert a.encode(text) == b.encode(text)
    assert a.decode(a.encode(text), skip_special_tokens=True) == text
    rendered = a.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert rendered == "<bos><start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n"


def test_resolve_rejects_unknown_specs(tmp_path):
    with pytest.raises(UserError, match="unknown model 'nope'"):
        zoo.resolve("nope")
    with pytest.raises(UserError, match="not an mlx-lm model directory"):
        zoo.resolve(str(tmp_path))
    with pytest.raises(UserError, match="no such GGUF file"):
        zoo.resolve(str(tmp_path / "x.gguf"))


def test_resolve_accepts_a_model_directory(tiny_dir):
    path = tiny_dir("qwen3")
    assert zoo.resolve(str(path)) == path


def test_load_casts_to_the_compute_dtype(tiny_dir):
    import mlx.core as mx
    from mlx.utils import tree_flatten

    tiny_dir("llama")
    model, _ = zoo.load("tiny-llama", dtype="bfloat16")
    assert {v.dtype for _, v in tree_flatten(model.parameters())} == {mx.bfloat16}


def test_generate_stream_honours_max_tokens_and_chat(tiny_dir):
    import io

    import mlx.core as mx

    from mlxlab import generate

    tiny_dir("gemma3")
    out = io.StringIO()
    stats = generate.run(
        GenerateConfig(
            model="tiny-gemma3", max_tokens=5, chat=True, system="Be brief.", prompt="hello"
        ),
        out=out,
    )
    assert stats["generation_tokens"] <= 5 and stats["prompt_tokens"] > 5
    assert stats["prompt_tps"] > 0
    # the peak reported is the one MLX measured over the run (reset at its start), not a stand-in
    peak = mx.get_peak_memory()
    assert peak > 0 and stats["peak_memory_gb"] == round(peak / 1e9, 3)
    model, tokenizer = zoo.load("tiny-gemma3")
    prompt = generate.build_prompt(tokenizer, GenerateConfig(chat=True, system="S", prompt="P"))
    assert prompt == "<bos><start_of_turn>user\nS\n\nP<end_of_turn>\n<start_of_turn>model\n"
