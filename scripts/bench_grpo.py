"""GRPO's costs, measured in one run: rollout throughput and the update's peak memory.

    python scripts/bench_grpo.py rollout [--model gemma3-270m] [--group 8] [--max-tokens 128]
                                         [--rounds 3] [--mlx-lm-lora PYTHON] [--no-mlx-lm]
                                         [--out FILE]
    python scripts/bench_grpo.py memory  [--model gemma3-270m] [--group 8] [--length 1024]
                                         [--completion 512] [--modes full,seg1,...]
                                         [--mlx-lm-lora PYTHON] [--out FILE]

rollout: one prompt's group of `--group` completions (sampled at temperature 1, at most
`--max-tokens` each, no stop string) drawn as GRPO draws them and one completion at a time:
- `batched`: mlxlab's rollout (train/grpo/rollout.py): the group's rows together on the batched
  decoder, the prompt prefilled once and shared;
- `batched-noshare`: the same, each row prefilling its own prompt;
- `serial`: mlxlab's `generate` path (decode/serial.py `run_serial`), one row after another;
- `mlx-lm-f32`: mlx-lm's `generate_step`, one row after another, on the same loaded model
  (float32, mlxlab's BLAS and decode kernel): mlx-lm's loop with mlxlab's weights;
- `mlx-lm`: plain mlx-lm in its own process as a user runs it (`mlx_lm.load`, weights as stored,
  MLX's bundled BLAS), `stream_generate` one row after another;
- `mlx-lm-lora` (with --mlx-lm-lora, the python of a venv where `pip install mlx-lm-lora`
  went): its GRPO rollout `generate_grpo` (mlx-lm's BatchGenerator with a forked prompt cache),
  in its own process, as a user runs it.
Throughput is generated tokens over wall seconds (prefill included), the median of `--rounds`
rounds; the sides alternate within each round so machine noise hits all of them.

memory: the update of one rollout batch, `--group` completions of one prompt, each row
`--length` tokens of which the last `--completion` are the completion (trained), in a process of
its own per mode (peak memory is per process): mlxlab's GRPO objective (loss grpo, the KL term
on) through `full` (compiled, as a run uses it), `checkpoint`, `segN` (segments of N layers),
`segNhC` (and the loss head in chunks of C positions), `fullaccA` (full, the rows in A
micro-batches); the reference pass (the adapter off, forward only) is timed beside; and with
--mlx-lm-lora its GRPO step (`grpo_loss` through its row-chunked value-and-grad, one prompt per
chunk as its trainer does, with and without its grad checkpoint; its KL reference is a second
model, loaded beside). Peak memory is `mx.get_peak_memory()` over the step, after a first step
that compiles and warms.

Both print a table and write JSON (default experiments/grpo/bench_<part>.json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import mlxlab  # noqa: F401  (its BLAS before MLX: the workers import MLX)

REPO = Path(__file__).resolve().parents[1]

PROMPT = (
    'Write a JSON object with the key "name".\n{"name": "Ada"}\n\n'
    'Write a JSON object with the key "city".\n{"city": "Paris"}\n\n'
    'Write a JSON object with the key "color".\n'
)

# --- workers run in their own processes (mlx-lm, mlx-lm-lora: no mlxlab import) --------------

MLX_LM_ROLLOUT = r"""
import json, sys, time
model_dir, prompt, group, max_tokens, rounds = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
from mlx_lm import load
from mlx_lm.generate import stream_generate
from mlx_lm.sample_utils import make_sampler
import mlx.core as mx
model, tok = load(model_dir)
ids = tok.encode(prompt)
out = []
for r in range(rounds + 1):  # the first round warms up
    mx.random.seed(r)
    t0, n = time.perf_counter(), 0
    for _ in range(group):
        for resp in stream_generate(model, tok, mx.array(ids), max_tokens=max_tokens,
                                    sampler=make_sampler(temp=1.0)):
            pass
        n += resp.generation_tokens
    if r:
        out.append({"tokens": n, "seconds": time.perf_counter() - t0})
print(json.dumps(out))
"""

MLX_LM_LORA_ROLLOUT = r"""
import json, sys, time
model_dir, prompt, group, max_tokens, rounds = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
from mlx_lm import load
import mlx.core as mx
from mlx_lm_lora.trainer.grpo_trainer import generate_grpo
model, tok = load(model_dir)
ids = tok.encode(prompt)
out = []
for r in range(rounds + 1):
    mx.random.seed(r)
    t0 = time.perf_counter()
    completions, texts, _ = generate_grpo(model, tok, [ids], max_tokens, group, group, "",
                                          1.0, 1.0, 0, 0.0)
    if r:
        out.append({"tokens": sum(c.size for c in completions),
                    "seconds": time.perf_counter() - t0})
print(json.dumps(out))
"""

MLX_LM_LORA_MEMORY = r"""
import json, sys, time
model_dir, group, length, completion, checkpoint = sys.argv[1], *map(int, sys.argv[2:6])
from mlx_lm import load
import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx_lm.tuner.utils import linear_to_lora_layers
from mlx_lm.tuner.trainer import grad_checkpoint
from mlx_lm_lora.trainer.grpo_trainer import grpo_loss, _grpo_value_and_grad
model, tok = load(model_dir)
ref, _ = load(model_dir)  # its KL reference: a second model
model.freeze()
linear_to_lora_layers(model, len(model.layers), {"rank": 8, "scale": 20.0, "dropout": 0.0,
    "keys": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
             "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]})
if checkpoint:
    grad_checkpoint(model.layers[0])
mx.random.seed(0)
top = min(20000, model.model.embed_tokens.weight.shape[0])
prompt = mx.random.randint(10, top, (length - completion,)).tolist()
completions = [mx.random.randint(10, top, (completion,)) for _ in range(group)]
advantages = mx.array([1.0, -1.0] * (group // 2))
value_and_grad = nn.value_and_grad(model, grpo_loss)
def step():
    (loss, toks, metrics), grads = _grpo_value_and_grad(
        value_and_grad, model, 1, batch=([prompt], [[]], [""], [""], None),
        completions=completions, completion_texts=[""] * group,
        batch_indices=[0] * group, advantages=advantages, reward_metrics={}, beta=0.04,
        epsilon=0.2, epsilon_high=0.2, ref_model=ref, grpo_loss_type="grpo",
        importance_sampling_level="token", max_tokens=completion)
    mx.eval(loss, grads)
    return loss.item()
model.train()
step()
mx.synchronize(); mx.clear_cache(); mx.reset_peak_memory()
t0 = time.perf_counter()
loss = step()
print(json.dumps({"mode": "mlx-lm-lora" + ("-gc" if checkpoint else ""), "loss": loss,
                  "seconds": time.perf_counter() - t0, "peak_gb": mx.get_peak_memory() / 1e9}))
"""


def _blas_env() -> dict:
    """mlx-lm and mlx-lm-lora run as a user runs them: their own (bundled) BLAS."""
    return {k: v for k, v in os.environ.items() if k != "MLXLAB_BLAS"}


def _json_run(args: list[str], timeout: float = 3600, env=None):
    out = subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(args[:3])} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# --- rollout ---------------------------------------------------------------------------------


def rollout_bench(a) -> dict:
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    from mlxlab.decode.batch import Row
    from mlxlab.decode.serial import run_serial
    from mlxlab.decode.settings import DecodeSettings
    from mlxlab.models.zoo import load, resolve
    from mlxlab.train.grpo.rollout import KeyedSampler, RolloutStats, rollout

    model, tok = load(a.model, "float32")
    ids = tok.encode(PROMPT)
    eos = set(tok.eos_token_ids)

    def batched(r, share):
        stats = RolloutStats()
        rollout(model, tok, [ids], a.group, a.max_tokens, KeyedSampler(mx.random.key(r), 1.0),
                (), share, stats=stats)  # fmt: skip
        return stats.completion_tokens, stats.prefill_tokens

    def serial(r):
        sampler = KeyedSampler(mx.random.key(r), 1.0)
        n = 0
        for _ in range(a.group):
            row = Row(list(ids), a.max_tokens, lambda t, _: "stop" if t in eos else None,
                      lambda f, t: None, sampler=sampler)  # fmt: skip
            run_serial(model, row, DecodeSettings())
            n += len(row.tokens)
        return n, a.group * len(ids)

    def mlx_lm_f32(r):
        mx.random.seed(r)
        sampler, n = make_sampler(temp=1.0), 0
        for _ in range(a.group):
            for tok_id, _ in generate_step(mx.array(ids), model, max_tokens=a.max_tokens,
                                           sampler=sampler):  # fmt: skip
                n += 1
                if int(tok_id) in eos:
                    break
        return n, a.group * len(ids)

    sides = {
        "batched": lambda r: batched(r, True),
        "batched-noshare": lambda r: batched(r, False),
        "serial": serial,
        "mlx-lm-f32": mlx_lm_f32,
    }
    results: dict[str, list] = {k: [] for k in sides}
    model.eval()
    for fn in sides.values():  # warm-up: graphs, kernels, caches
        fn(1000)
    for r in range(a.rounds):
        for side, fn in sides.items():
            t0 = time.perf_counter()
            n, prefilled = fn(r)
            results[side].append(
                {"tokens": n, "prefill_tokens": prefilled, "seconds": time.perf_counter() - t0}
            )
            print(f"round {r + 1} {side}: {json.dumps(results[side][-1])}", flush=True)
    model_dir = str(resolve(a.model))
    argv = [model_dir, PROMPT, str(a.group), str(a.max_tokens), str(a.rounds)]
    if not a.no_mlx_lm:
        results["mlx-lm"] = _json_run(
            [sys.executable, "-c", MLX_LM_ROLLOUT, *argv], env=_blas_env()
        )
        print(f"mlx-lm: {json.dumps(results['mlx-lm'])}", flush=True)
    if a.mlx_lm_lora:
        results["mlx-lm-lora"] = _json_run(
            [a.mlx_lm_lora, "-c", MLX_LM_LORA_ROLLOUT, *argv], env=_blas_env()
        )
    table = {}
    for side, runs in results.items():
        tps = [x["tokens"] / x["seconds"] for x in runs]
        table[side] = {
            "tok_per_s": statistics.median(tps),
            "tokens": statistics.median(x["tokens"] for x in runs),
            "seconds": statistics.median(x["seconds"] for x in runs),
            "prefill_tokens": runs[0].get("prefill_tokens"),
            "runs": runs,
        }
    base = table["serial"]["tok_per_s"]
    for side in table:
        table[side]["vs_serial"] = table[side]["tok_per_s"] / base
    print(f"group {a.group} x at most {a.max_tokens} tokens, prompt {len(ids)} tokens, "
          f"{a.rounds} rounds (median)")  # fmt: skip
    print(f"{'side':<18}{'tok/s':>9}{'tokens':>8}{'s':>8}{'prefill':>9}{'x serial':>10}")
    for side, t in table.items():
        pre = "" if t["prefill_tokens"] is None else t["prefill_tokens"]
        print(f"{side:<18}{t['tok_per_s']:>9.1f}{t['tokens']:>8.0f}{t['seconds']:>8.1f}"
              f"{pre:>9}{t['vs_serial']:>10.2f}")  # fmt: skip
    return {"group": a.group, "max_tokens": a.max_tokens, "prompt_tokens": len(ids),
            "sides": table}  # fmt: skip


# --- memory ----------------------------------------------------------------------------------


def memory_worker(a) -> dict:
    """One mode's update step (in its own process)."""
    import dataclasses

    import mlx.core as mx
    import numpy as np

    from mlxlab.config import BackwardConfig, LoraConfig
    from mlxlab.data.prompts import Prompt
    from mlxlab.lora import apply as lora
    from mlxlab.models.zoo import load
    from mlxlab.train.backward import make_grad_fn
    from mlxlab.train.config import GRPOConfig, TrainConfig
    from mlxlab.train.grpo import loop
    from mlxlab.train.grpo import losses as L
    from mlxlab.train.grpo.rollout import Completion

    mode = a.mode
    accum, head_chunk, cfg_b = 1, 0, BackwardConfig(mode="full")
    if mode.startswith("fullacc"):
        accum = int(mode[len("fullacc") :])
    elif mode == "checkpoint":
        cfg_b = BackwardConfig(mode="checkpoint")
    elif mode.startswith("seg"):
        size, _, chunk = mode[3:].partition("h")
        head_chunk = int(chunk or 0)
        cfg_b = BackwardConfig(mode="segmented", segment_size=int(size), head_chunk=head_chunk)
    model, tok = load(a.model, "float32", decode_head="exact")
    plan = lora.plan(model, LoraConfig(targets=["q", "k", "v", "o", "gate", "up", "down"]))
    lora.apply(model, plan, seed=0)
    rng = np.random.default_rng(0)
    top = min(20000, model.model.embed_tokens.weight.shape[0])  # token ids the model has
    prompt = Prompt([2] + rng.integers(10, top, a.length - a.completion - 1).tolist(), {})
    comps = [
        Completion(rng.integers(10, top, a.completion).tolist(), "", "length")
        for _ in range(a.group)
    ]
    rewards = [float(i % 2) for i in range(a.group)]
    cfg = TrainConfig(
        objective="grpo",
        batch_size=1,
        grad_accum=accum,
        backward=cfg_b,
        data=dataclasses.replace(TrainConfig().data, max_seq_length=a.length + 32),
        grpo=GRPOConfig(group_size=a.group, max_tokens=a.completion, beta=0.04),
    )
    adv = L.group_advantages(rewards, a.group)
    ro = loop.Rollout([prompt], comps, rewards, {}, adv, np.ones(a.group, bool))
    timer: dict = {}
    batches = loop.update_batches(ro, cfg, accum, None, model, timer)
    ref_s = timer["ref_s"]
    mx.synchronize()
    ref_peak = mx.get_peak_memory() / 1e9
    grad_fn, how = make_grad_fn(
        model, cfg_b, (a.group // accum, a.length), compile=True,
        objective=L.GRPOObjective.from_config(cfg),
    )  # fmt: skip
    model.train()

    def step():
        loss = None
        for b in batches:
            out = grad_fn(model, b)
            mx.eval(out[0], out[2])
            loss = out[0].item()
            del out
        return loss

    step()  # compile, warm
    mx.synchronize()
    mx.clear_cache()
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    loss = step()
    seconds = time.perf_counter() - t0
    return {
        "mode": mode,
        "how": how,
        "loss": loss,
        "seconds": seconds,
        "peak_gb": mx.get_peak_memory() / 1e9,
        "ref_seconds": ref_s,
        "ref_peak_gb_with_load": ref_peak,
    }


def memory_bench(a) -> dict:
    rows = []
    for mode in a.modes.split(","):
        args = [sys.executable, __file__, "_memory_worker", "--mode", mode, "--model", a.model,
                "--group", str(a.group), "--length", str(a.length),
                "--completion", str(a.completion)]  # fmt: skip
        rows.append(_json_run(args))
        print(json.dumps(rows[-1]), flush=True)
    if a.mlx_lm_lora:
        from mlxlab.models.zoo import resolve

        for gc in (0, 1):
            argv = [str(resolve(a.model)), str(a.group), str(a.length), str(a.completion), str(gc)]
            rows.append(
                _json_run([a.mlx_lm_lora, "-c", MLX_LM_LORA_MEMORY, *argv], env=_blas_env())
            )
            print(json.dumps(rows[-1]), flush=True)
    full = next((r["peak_gb"] for r in rows if r["mode"] == "full"), None)
    print(f"\ngroup {a.group} x {a.length} tokens ({a.completion} trained each)")
    print(f"{'mode':<16}{'peak GB':>9}{'x full':>8}{'s':>8}")
    for r in rows:
        ratio = r["peak_gb"] / full if full else float("nan")
        r["vs_full"] = ratio
        print(f"{r['mode']:<16}{r['peak_gb']:>9.2f}{ratio:>8.2f}{r['seconds']:>8.1f}")
    ref = next((r for r in rows if "ref_seconds" in r), None)
    if ref:
        print(f"reference pass (adapter off, forward only): {ref['ref_seconds']:.1f} s")
    return {"group": a.group, "length": a.length, "completion": a.completion, "rows": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("part", choices=["rollout", "memory", "_memory_worker"])
    p.add_argument("--model", default="gemma3-270m")
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--completion", type=int, default=512)
    p.add_argument("--modes", default="full,checkpoint,seg1,seg4,seg1h256,fullacc8")
    p.add_argument("--mode", default="full")
    p.add_argument("--mlx-lm-lora", default=None, help="python of a venv with mlx-lm-lora")
    p.add_argument(
        "--no-mlx-lm", action="store_true", help="rollout: leave out plain mlx-lm (bf16, slow)"
    )
    p.add_argument("--out", default=None)
    a = p.parse_args()
    if a.part == "_memory_worker":
        print(json.dumps(memory_worker(a)))
        return
    result = rollout_bench(a) if a.part == "rollout" else memory_bench(a)
    out = Path(a.out or REPO / "experiments" / "grpo" / f"bench_{a.part}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"-> {out}")


if __name__ == "__main__":
    main()
