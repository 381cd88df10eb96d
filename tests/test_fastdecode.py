"""The CPU decode kernel (mlxlab/kernels) and the decode-step routing (models/fastdecode.py):
products within float32 rounding of BLAS's, rows independent of each other, gradients, the
many-row paths untouched bit for bit, and greedy decoding equal to mlx-lm's own."""

from __future__ import annotations

import sys

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten, tree_map

from mlxlab import kernels
from mlxlab.models import fastdecode
from mlxlab.models.tiny import FAMILIES
from tests.helpers.kernel import HAS_COMPILER, REASON, UNBUILDABLE

pytestmark = [
    pytest.mark.skipif(mx.default_device() != mx.cpu, reason="the kernel is the CPU's decode path"),
    pytest.mark.skipif(UNBUILDABLE, reason=REASON),
]


def matvec():
    fn = kernels.matvec()
    assert fn is not None, kernels.status()
    return fn


def test_the_kernel_is_built_and_matches_the_running_mlx():
    # CI installs with MLXLAB_REQUIRE_KERNEL=1; a user without a compiler gets MLX's matmul and
    # this status line instead (and this module is skipped).
    if sys.platform == "linux" and HAS_COMPILER:
        assert kernels.status() == "loaded"
    else:
        assert kernels.status() == "loaded" or "reinstall" in kernels.status()


@pytest.mark.parametrize("shape", [(1, 1, 64), (3, 1, 64), (2, 2, 1, 64), (1, 64), (5, 64)])
@pytest.mark.parametrize("n,k", [(48, 64), (1000, 64), (40000, 80)])
def test_matvec_equals_the_matmul_within_float32_rounding(shape, n, k):
    shape = (*shape[:-1], k)
    mx.random.seed(0)
    x = mx.random.normal(shape)
    w = mx.random.normal((n, k)) * 0.1
    ours, ref = matvec()(x, w), x @ w.T
    assert ours.shape == ref.shape and ours.dtype == mx.float32
    err = (mx.abs(ours - ref).max() / mx.abs(ref).max()).item()
    assert err < 1e-6


def test_bfloat16_weights_are_read_as_their_float32_values():
    mx.random.seed(1)
    x = mx.random.normal((2, 1, 96))
    w = (mx.random.normal((300, 96)) * 0.1).astype(mx.bfloat16)
    ref = x @ w.astype(mx.float32).T
    err = (mx.abs(matvec()(x, w) - ref).max() / mx.abs(ref).max()).item()
    assert err < 1e-6


def test_strided_inputs_are_gathered():
    mx.random.seed(2)
    x = mx.random.normal((2, 1, 5, 48)).transpose(0, 2, 1, 3)[:, :1]  # a strided view
    w = mx.random.normal((40, 48))
    wt = mx.random.normal((48, 40)).T  # a transposed (column-major) weight
    for weight in (w, wt):
        assert mx.allclose(matvec()(x, weight), x @ weight.T, atol=1e-5).item()


def test_each_row_is_computed_alike_whatever_rows_come_with_it():
    """Batch invariance: a row's products are bit-identical decoded alone or with others."""
    mx.random.seed(3)
    x = mx.random.normal((4, 1, 200))
    w = mx.random.normal((3000, 200))
    together = matvec()(x, w)
    for i in range(4):
        assert mx.array_equal(together[i], matvec()(x[i : i + 1], w)[0]).item()


def test_a_decode_step_of_max_rows_rows_gives_each_row_its_lone_result():
    """Up to MAX_ROWS one-token rows (8 with the kernel's AVX-512 loops: a full batch of GRPO's
    group of 8; else 4) go to the kernel, and each row's output is bit for bit the one it gets
    decoded alone."""
    layer = nn.Linear(200, 3000)
    layer.__class__ = fastdecode.DecodeLinear
    mx.random.seed(5)
    x = mx.random.normal((fastdecode.MAX_ROWS, 1, 200))
    together = layer(x)
    assert not mx.array_equal(together, x @ layer.weight.T + layer.bias).item()  # not BLAS's
    for i in range(fastdecode.MAX_ROWS):
        assert mx.array_equal(together[i], layer(x[i : i + 1])[0]).item()


def test_gradients_equal_the_matmul_ones():
    mx.random.seed(4)
    x, w = mx.random.normal((2, 1, 32)), mx.random.normal((50, 32))
    g = mx.grad(lambda a, b: (matvec()(a, b) ** 2).sum(), argnums=(0, 1))(x, w)
    ref = mx.grad(lambda a, b: ((a @ b.T) ** 2).sum(), argnums=(0, 1))(x, w)
    for a, b in zip(g, ref, strict=True):
        assert mx.allclose(a, b, rtol=1e-5, atol=1e-5).item()


def test_bad_inputs_are_refused_with_a_message():
    with pytest.raises(ValueError, match="in-features"):
        matvec()(mx.ones((1, 1, 8)), mx.ones((4, 9)))
    with pytest.raises(ValueError, match="float32"):
        matvec()(mx.ones((1, 1, 8), dtype=mx.bfloat16), mx.ones((4, 8)))
    with pytest.raises(ValueError, match=r"\[out, in\]"):
        matvec()(mx.ones((1, 8)), mx.ones((8,)))


def _load(tiny_dir, family, decode_kernel):
    from mlxlab.models.zoo import load

    return load(str(tiny_dir(family)), dtype="float32", decode_kernel=decode_kernel)


@pytest.mark.parametrize("family", FAMILIES)
def test_accelerate_changes_classes_only(tiny_dir, family):
    model, _ = _load(tiny_dir, family, True)
    plain, _ = _load(tiny_dir, family, False)
    kinds = {type(m) for _, m in model.named_modules()}
    assert fastdecode.DecodeLinear in kinds
    assert nn.Linear not in kinds  # every plain Linear switched (subclasses keep their own)
    ours = dict(tree_flatten(model.parameters()))
    theirs = dict(tree_flatten(plain.parameters()))
    assert ours.keys() == theirs.keys()
    assert all(mx.array_equal(ours[k], theirs[k]).item() for k in ours)
    assert fastdecode.accelerate(model) == 0  # a second call finds nothing left to switch


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_and_training_products_are_untouched_bit_for_bit(tiny_dir, family):
    model, _ = _load(tiny_dir, family, True)
    plain, _ = _load(tiny_dir, family, False)
    ids = mx.array([[5, 9, 33, 2, 17, 80, 4, 11]])
    assert mx.array_equal(model(ids), plain(ids)).item()
    for m in (model, plain):
        m.freeze()
    loss = lambda m: m(ids).astype(mx.float32).square().mean()  # noqa: E731
    assert mx.array_equal(loss(model), loss(plain)).item()


def _greedy(model, prompt, n):
    from mlx_lm.generate import generate_step

    out = []
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=n):
        out.append(int(token))
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_decoding_equals_mlx_lms(tiny_dir, family):
    model, _ = _load(tiny_dir, family, True)
    plain, _ = _load(tiny_dir, family, False)
    for prompt in ([3, 14, 15, 92, 65], [7] * 12, list(range(20, 60))):
        assert _greedy(model, prompt, 24) == _greedy(plain, prompt, 24)


@pytest.mark.parametrize("family", FAMILIES)
def test_decode_logits_are_within_float32_rounding_of_mlx_lms(tiny_dir, family):
    from mlx_lm.models.cache import make_prompt_cache

    model, _ = _load(tiny_dir, family, True)
    plain, _ = _load(tiny_dir, family, False)
    logits = []
    for m in (model, plain):
        cache = make_prompt_cache(m)
        m(mx.array([[3, 14, 15, 92, 65, 35]]), cache=cache)
        logits.append(m(mx.array([[8]]), cache=cache))
    err = (mx.abs(logits[0] - logits[1]).max() / mx.abs(logits[1]).max()).item()
    assert 0 < err < 1e-5  # not zero: the kernel did run (its sums are ordered differently)


def test_lora_wraps_the_decode_linear_and_stays_on_the_kernel(tiny_dir):
    from mlx_lm.tuner.lora import LoRALinear

    model, _ = _load(tiny_dir, "llama", True)
    base = model.model.layers[0].self_attn.q_proj
    lora = LoRALinear.from_base(base, r=4)
    lora.lora_b = mx.random.normal(lora.lora_b.shape) * 0.1
    x = mx.random.normal((1, 1, base.weight.shape[1]))
    y = lora(x)
    ref = x @ base.weight.T + lora.scale * ((x @ lora.lora_a) @ lora.lora_b)
    assert isinstance(lora.linear, fastdecode.DecodeLinear)
    assert mx.allclose(y, ref, atol=1e-5).item()


def test_more_rows_than_the_kernel_takes_go_to_blas():
    layer = nn.Linear(32, 64)
    layer.__class__ = fastdecode.DecodeLinear
    many = mx.random.normal((fastdecode.MAX_ROWS + 1, 1, 32))
    assert mx.array_equal(layer(many), many @ layer.weight.T + layer.bias).item()
    few = many[:2]
    assert mx.allclose(layer(few), few @ layer.weight.T + layer.bias, atol=1e-5).item()


def _decode_logits(model, prompt=(3, 14, 15, 92, 65, 35), token=8):
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    model(mx.array([list(prompt)]), cache=cache)
    return model(mx.array([[token]]), cache=cache)


def _round_to_bfloat16(model):
    """Make every weight a bf16 value (as for a zoo model stored in bf16, cast up)."""
    model.update(tree_map(lambda a: a.astype(mx.bfloat16).astype(mx.float32), model.parameters()))
    mx.eval(model.parameters())


@pytest.mark.parametrize("family", ["qwen3", "llama"])  # a tied head and an lm_head
def test_auto_head_reads_a_bf16_copy_only_when_lossless_and_then_bit_identically(tiny_dir, family):
    model, _ = _load(tiny_dir, family, True)
    # Random float32 weights are not bf16 values: auto leaves the head on its weight.
    assert fastdecode.use_head_dtype(model, "auto") == "exact"
    _round_to_bfloat16(model)
    assert fastdecode.use_head_dtype(model, "exact") == "exact"
    exact = _decode_logits(model)
    assert fastdecode.use_head_dtype(model, "auto") == "bfloat16 (lossless)"
    assert fastdecode.head_reads(model) == "bfloat16 (lossless)"
    head = fastdecode.lm_head(model)
    assert head._decode_weight().dtype == mx.bfloat16
    assert head._decode_weight().nbytes * 2 == head["weight"].nbytes
    assert mx.array_equal(_decode_logits(model), exact).item()
    # The copy is not a parameter: nothing saved or trained changes.
    assert all(v.dtype == mx.float32 for _, v in tree_flatten(model.parameters()))


def test_a_forced_bf16_head_is_close_and_reported_as_rounded(tiny_dir):
    model, _ = _load(tiny_dir, "llama", True)
    exact = _decode_logits(model)
    assert fastdecode.use_head_dtype(model, "bfloat16") == "bfloat16 (rounded)"
    approx = _decode_logits(model)
    assert not mx.array_equal(approx, exact).item()
    assert (mx.abs(approx - exact).max() / mx.abs(exact).max()).item() < 2e-2
    with pytest.raises(ValueError, match="decode head"):
        fastdecode.use_head_dtype(model, "int4")


@pytest.mark.parametrize("family", ["gemma3", "qwen3"])
def test_a_replaced_head_weight_drops_its_copy(tiny_dir, family):
    model, _ = _load(tiny_dir, family, True)
    fastdecode.use_head_dtype(model, "bfloat16")
    head = fastdecode.lm_head(model)
    name = next(n for n, m in model.named_modules() if m is head) + ".weight"
    new = head["weight"] * 2
    model.load_weights([(name, new)], strict=False)
    assert fastdecode.head_reads(model) == "exact"
    assert head._decode_weight() is new


def test_load_picks_the_head_mode(tiny_dir):
    from mlxlab.models.zoo import load

    model, _ = load(str(tiny_dir("llama")), dtype="float32", decode_head="bfloat16")
    assert fastdecode.head_reads(model) == "bfloat16 (rounded)"
    model, _ = load(str(tiny_dir("llama")), dtype="float32")  # auto: random weights, no copy
    assert fastdecode.head_reads(model) == "exact"


def test_the_kernel_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("MLXLAB_DECODE_KERNEL", "off")
    kernels._load.cache_clear()
    try:
        assert kernels.matvec() is None and "MLXLAB_DECODE_KERNEL" in kernels.status()
        layer = nn.Linear(8, 4)
        assert fastdecode.accelerate(layer) == 0 and type(layer) is nn.Linear
    finally:
        monkeypatch.delenv("MLXLAB_DECODE_KERNEL")
        kernels._load.cache_clear()
    assert kernels.matvec() is not None


def test_a_model_naming_its_head_otherwise_loads_with_the_head_exact():
    class Odd(nn.Module):  # as gpt2's `wte` or gpt_neox's `embed_out`
        def __init__(self):
            super().__init__()
            self.embed_out = nn.Linear(8, 16)

    model = Odd()
    assert fastdecode.accelerate(model) == 1
    assert fastdecode.lm_head(model) is None
    assert fastdecode.use_head_dtype(model, "auto") == "exact"
    assert fastdecode.head_reads(model) == "exact"


def test_empty_products_are_zeros_and_shapeless_compile_works():
    assert matvec()(mx.zeros((1, 1, 0)), mx.zeros((3, 0))).tolist() == [[[0.0, 0.0, 0.0]]]
    f = mx.compile(lambda x, w: matvec()(x, w), shapeless=True)
    assert f(mx.ones((1, 1, 4)), mx.ones((3, 4))).tolist() == [[[4.0, 4.0, 4.0]]]


@pytest.mark.parametrize("family", ["gemma3", "llama"])
def test_auto_reads_every_projection_from_a_lossless_bf16_copy_bit_identically(tiny_dir, family):
    model, _ = _load(tiny_dir, family, True)
    _round_to_bfloat16(model)
    assert fastdecode.use_head_dtype(model, "exact") == "exact"
    assert fastdecode.decode_copies(model)["copies"] == 0
    exact = _decode_logits(model)
    full = fastdecode.decode_copies(model)["step_weight_bytes"]
    fastdecode.use_head_dtype(model, "auto")
    copies = fastdecode.decode_copies(model)
    linears = [m for _, m in model.named_modules() if isinstance(m, fastdecode.DecodeLinear)]
    assert linears and all(m._decode_weight().dtype == mx.bfloat16 for m in linears)
    assert copies["copies"] == len(linears) + (0 if "lm_head" in dict(model.named_modules()) else 1)
    assert copies["step_weight_bytes"] * 2 == full  # the step reads half the bytes
    reading = [
        m
        for _, m in model.named_modules()
        if isinstance(m, fastdecode._DecodeWeight) and m._decode_weight() is not m["weight"]
    ]
    assert copies["copy_bytes"] * 2 == sum(m["weight"].nbytes for m in reading)
    assert mx.array_equal(_decode_logits(model), exact).item()
    # Prefill and training still read the float32 weights: nothing saved or trained changes.
    assert all(v.dtype == mx.float32 for _, v in tree_flatten(model.parameters()))


def test_a_projection_that_is_not_bf16_valued_keeps_its_weight_even_when_forced(tiny_dir):
    model, _ = _load(tiny_dir, "llama", True)  # random float32 weights
    assert fastdecode.use_head_dtype(model, "bfloat16") == "bfloat16 (rounded)"
    linears = [m for _, m in model.named_modules() if type(m) is fastdecode.DecodeLinear]
    head = fastdecode.lm_head(model)
    assert all(m._decode_weight() is m["weight"] for m in linears if m is not head)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("n,k", [(1000, 640), (300, 83), (5, 15)])
def test_avx512_loops_give_the_avx2_loops_results_bit_for_bit(dtype, n, k):
    from mlxlab.kernels import _kernels

    if not _kernels.matvec_avx512():
        pytest.skip("this CPU has no AVX-512: only the AVX2+FMA loops run")
    mx.random.seed(3)
    w = (mx.random.normal((n, k)) * 0.1).astype(dtype)
    for m in (1, 3, 8, 13):
        x = mx.random.normal((m, k))
        wide = matvec()(x, w)
        _kernels.matvec_avx512(0)
        try:
            narrow = matvec()(x, w)
            mx.eval(narrow)
        finally:
            _kernels.matvec_avx512(1)
        alone = mx.concatenate([matvec()(x[i : i + 1], w) for i in range(m)])
        assert mx.array_equal(wide, narrow).item()
        assert mx.array_equal(wide, alone).item()  # a row's result is the same with 13 others


def test_a_verify_steps_tokens_go_to_the_kernel_only_while_verifying():
    layer = nn.Linear(64, 48)
    layer.__class__ = fastdecode.DecodeLinear
    mx.random.seed(4)
    x = mx.random.normal((2, 5, 64))  # two rows of five tokens
    blas = layer(x)
    assert mx.array_equal(blas, x @ layer.weight.T + layer.bias).item()
    with fastdecode.verifying(16):
        verified = layer(x)
        four = mx.concatenate([x, x])
        too_many = layer(four)  # 20 rows: BLAS again
    assert mx.array_equal(too_many, four @ layer.weight.T + layer.bias).item()
    # Each token's product equals its one-token decode step's, bit for bit.
    steps = mx.concatenate([layer(x[:, i : i + 1]) for i in range(5)], axis=1)
    assert mx.array_equal(verified, steps).item()
    assert not mx.array_equal(verified, blas).item()


def _stored_in_bfloat16(src, dst, tied: bool = False):
    """A copy of the model directory `src` with its weights stored in bfloat16 (as a zoo model's);
    `tied`: without its lm_head weight, so the embedding is the LM head (gemma3's mlx-lm model
    ties them then; the tiny models are stored untied)."""
    import shutil

    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors"):
        weights = mx.load(str(f))
        mx.save_safetensors(
            str(f),
            {
                k: v.astype(mx.bfloat16)
                for k, v in weights.items()
                if not (tied and k == "lm_head.weight")
            },
        )
    return dst


@pytest.mark.parametrize("family", ["gemma3", "llama"])  # a tied head and an lm_head
def test_bf16_sources_are_the_weights_that_get_decode_copies(tiny_dir, tmp_path, family):
    """Every nn.Linear and the LM head: not an embedding that is only looked up (its array
    would be kept until the load returns for nothing)."""
    from mlx_lm.utils import load_model

    tied = family == "gemma3"
    path = _stored_in_bfloat16(tiny_dir(family), tmp_path / family, tied)
    model, _ = load_model(path, lazy=True)
    head = fastdecode.lm_head(model)
    assert (type(head) is nn.Embedding) == tied
    want = {n for n, m in model.named_modules() if type(m) is nn.Linear or m is head}
    assert set(fastdecode.bf16_sources(model)) == want
    assert ("model.embed_tokens" in want) == tied  # an untied embedding is only looked up


@pytest.mark.parametrize("family", ["gemma3", "llama"])  # a tied head and an lm_head
@pytest.mark.parametrize("paced", [False, True])
def test_weights_stored_in_bf16_are_their_own_decode_copies(
    tiny_dir, tmp_path, monkeypatch, family, paced
):
    """A float32 model cast up from bf16 files takes the files' arrays as its decode copies (no
    check, no cast back: zoo.load's `bf16_sources`): the same copies and logits as checking
    and casting every weight."""
    from mlxlab.models.zoo import load

    path = str(_stored_in_bfloat16(tiny_dir(family), tmp_path / family, family == "gemma3"))
    slices = []

    def pace(fn=None):
        if fn is not None:
            slices.append(fn)
            return fn()

    def checked_and_cast(w, rounded):
        raise AssertionError(f"a {w.shape} weight stored in bf16 was checked and cast")

    monkeypatch.setattr(fastdecode, "_decode_copy", checked_and_cast)
    model, _ = load(path, dtype="float32", pace=pace if paced else None)
    monkeypatch.undo()
    assert fastdecode.head_reads(model) == "bfloat16 (lossless)"
    assert not paced or slices  # every evaluation went through the pace
    assert all(v.dtype == mx.float32 for _, v in tree_flatten(model.parameters()))
    checked, _ = load(path, dtype="float32", decode_head="exact")
    reference = _decode_logits(checked)
    assert fastdecode.use_head_dtype(checked, "auto") == "bfloat16 (lossless)"  # checked, cast
    mine, theirs = dict(model.named_modules()), dict(checked.named_modules())
    for name, m in mine.items():
        if isinstance(m, fastdecode._DecodeWeight):
            copy, expected = m._decode_weight(), theirs[name]._decode_weight()
            assert copy.dtype == expected.dtype, name
            assert mx.array_equal(copy, expected).item(), name
    assert fastdecode.decode_copies(model) == fastdecode.decode_copies(checked)
    assert fastdecode.decode_copies(model)["copies"] > 0
    assert mx.array_equal(_decode_logits(model), reference).item()
    assert mx.array_equal(_decode_logits(checked), reference).item()
