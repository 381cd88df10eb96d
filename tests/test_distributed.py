"""Training on several processes: data parallel and the segment pipeline (mx.distributed, ring).

Fast tier: the pipeline's order (a rendezvous simulation: blocking sends and receives), the
placement of segments, the sampler's shares, the watchdog, the launcher environment, refusals.
Slow tier (each starts 2 ranks on loopback, as `mlx.launch --backend ring -n 2` does; tiny
random-init models): data-parallel gradients against one process, a data-parallel run against
one process and killed-then-resumed, the pipeline against the single-process segmented backward
bit for bit (Gemma 4, its donor K/V across the rank boundary), DPO on top of an adapter (lora.init:
that adapter the reference on every rank), and a hung rank.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import mlxlab  # noqa: F401  (BLAS before MLX)
from mlxlab.errors import UserError
from tests.helpers.cli import REPO
from tests.helpers.dist import free_ports, start_ranks, wait_all
from tests.helpers.training import QUICKSTART

# One BLAS thread per process: two ranks share the 2-core machine, and the single-process
# references run the same BLAS code paths as the ranks.
ENV = {"OPENBLAS_NUM_THREADS": "1"}


# --- fast tier: order, placement, shares, watchdog --------------------------------------------


def _rendezvous(programs) -> bool:
    """Run every rank's program with blocking transfers (a send completes only when its peer
    receives it): True if all finish, False on a deadlock."""
    pc = [0] * len(programs)
    match = {"send_f": ("recv_f", 1), "recv_f": ("send_f", -1), "send_b": ("recv_b", -1)}
    match["recv_b"] = ("send_b", 1)

    def current(k):
        return programs[k][pc[k]] if pc[k] < len(programs[k]) else None

    while any(current(k) is not None for k in range(len(programs))):
        progress = False
        for k in range(len(programs)):
            op = current(k)
            if op is None:
                continue
            if op[0] in ("F", "B"):
                pc[k] += 1
                progress = True
                continue
            want, step = match[op[0]]
            if current(k + step) == (want, op[1]):
                pc[k] += 1
                pc[k + step] += 1
                progress = True
        if not progress:
            return False
    return True


def test_pipeline_order_never_deadlocks_where_plain_1f1b_does():
    from mlxlab.train.pipeline_plan import schedule

    for n in range(2, 7):
        for micro in range(1, 9):
            programs = [schedule(k, n, micro) for k in range(n)]
            assert _rendezvous(programs), (n, micro)
            for prog in programs:  # each micro-batch: one forward, one backward, in order
                assert [m for op, m in prog if op == "F"] == list(range(micro))
                assert sorted(m for op, m in prog if op == "B") == list(range(micro))
    # the same 1F1B without "receive the next input before sending a cotangent" deadlocks
    plain = []
    for k in range(2):
        prog = schedule(k, 2, 4)
        for a in range(len(prog) - 1):
            if prog[a][0] == "recv_f" and prog[a + 1][0] == "send_b":
                prog[a], prog[a + 1] = prog[a + 1], prog[a]
        plain.append(prog)
    assert not _rendezvous(plain)


def test_segments_are_placed_in_balanced_runs():
    from mlxlab.train.pipeline_plan import assign_stages

    assert assign_stages([4, 4, 4, 4, 2], 2) == [(0, 1), (2, 4)]  # 8 + 10 layers
    assert assign_stages([4, 4, 4, 4, 2], 2, tail=6) == [(0, 2), (3, 4)]  # 12 | 6 + the head
    assert assign_stages([1] * 6, 3) == [(0, 1), (2, 3), (4, 5)]
    assert assign_stages([2, 2, 2], 2) == [(0, 1), (2, 2)]
    with pytest.raises(UserError, match="needs at least 3 segments"):
        assign_stages([4, 4], 3)


def test_shares_partition_every_batch_at_its_width():
    from mlxlab.data.batches import BatchSampler
    from mlxlab.data.datasets import Example

    examples = [Example(ids=list(range(5 + (i * 7) % 40)), offset=2) for i in range(30)]
    for n in (2, 3):
        whole = BatchSampler(examples, 6, seed=1)
        ranks = [BatchSampler(examples, 6, seed=1, shard=(r, n)) for r in range(n)]
        for _ in range(8):  # across an epoch boundary
            batch = whole.next()
            shares = [s.next() for s in ranks]
            rows = sorted(tuple(row) for s in shares for row in s.inputs.tolist())
            assert rows == sorted(tuple(row) for row in batch.inputs.tolist())
            assert {s.inputs.shape[1] for s in shares} == {batch.inputs.shape[1]}
            assert sum(s.ntoks for s in shares) == batch.ntoks
            assert all(s.state() == whole.state() for s in ranks)
    small = BatchSampler(examples, 1, seed=1, shuffle=False, shard=(1, 2))
    assert next(small.one_pass()) is None  # a one-unit batch has nothing for rank 1


def test_the_launcher_environment_says_which_backend():
    from mlxlab.train.world import detect_backend

    assert detect_backend({}) is None
    assert detect_backend({"MLX_RANK": "0", "MLX_HOSTFILE": "/tmp/h.json"}) == "ring"
    assert detect_backend({"MLX_RANK": "0", "MLX_HOSTFILE": ""}) is None  # mlx.launch -n 1
    assert detect_backend({"OMPI_COMM_WORLD_SIZE": "2"}) == "mpi"
    assert detect_backend({"PMI_SIZE": "2", "PMI_RANK": "1"}) == "mpi"
    assert detect_backend({"MLX_JACCL_COORDINATOR": "10.0.0.1:32323"}) == "jaccl"


def test_the_watchdog_stops_a_wait_past_its_deadline(capsys):
    from mlxlab.train.world import Watchdog

    exits = []
    dog = Watchdog(0.3, rank=1, exit=exits.append)
    with dog.guard("summing gradients", timeout_s=5):
        time.sleep(0.5)  # in time
    assert exits == []
    with dog.guard("summing gradients"):
        deadline = time.time() + 3
        while not exits and time.time() < deadline:
            time.sleep(0.05)
    assert exits == [1]
    err = capsys.readouterr().err
    assert "rank 1: no answer from the other ranks for 0 s while summing gradients" in err


def test_headers_carry_shapes_and_dtypes():
    import mlx.core as mx

    from mlxlab.train.world import decode, encode

    arrays = [mx.zeros((2, 3, 4)), mx.zeros((5,), mx.bfloat16), mx.zeros((), mx.int32)]
    assert decode(encode(arrays)) == [(a.shape, a.dtype) for a in arrays]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["backward.pipeline=true"], "backward.pipeline=true needs backward.mode=segmented"),
        (["dist.timeout_s=0"], "dist.timeout_s must be > 0"),
        (["dist.backend=tcp"], "dist.backend"),
    ],
)
def test_distributed_config_errors(overrides, message):
    from mlxlab.cli import compose

    with pytest.raises(UserError, match=message):
        compose("train", overrides)


def test_resume_refuses_a_checkpoint_of_another_world(tiny_dir, tmp_path):
    from mlxlab.config import DataConfig, LoraConfig
    from mlxlab.train.cli import run
    from mlxlab.train.config import TrainConfig

    tiny_dir("llama")
    cfg = dict(
        model="tiny-llama",
        dtype="float32",
        out_dir=str(tmp_path / "run"),
        iters=2,
        batch_size=2,
        save_every=1,
        val_every=0,
        wandb="disabled",
        data=DataConfig(train=str(QUICKSTART), max_seq_length=64),
        lora=LoraConfig(targets=["q", "v"], rank=2),
    )
    run(TrainConfig(**cfg))
    state = tmp_path / "run" / "checkpoints" / "step_0000001" / "trainer_state.json"
    saved = json.loads(state.read_text())
    state.write_text(json.dumps({**saved, "world": {"size": 2, "mode": "data"}}))
    with pytest.raises(UserError, match=r"written by data parallel on 2 processes .*one process"):
        run(TrainConfig(**cfg, resume=True))


# --- slow tier: processes ---------------------------------------------------------------------


def _train_args(out: Path, *extra: str) -> list[str]:
    return [
        "train",
        "model=tiny-llama",
        "dtype=float32",
        f"out_dir={out}",
        "iters=6",
        "batch_size=4",
        "val_every=3",
        "val_batches=2",
        "save_every=2",
        "log_every=1",
        "wandb=disabled",
        "seed=3",
        f"data.train={QUICKSTART}",
        "data.max_seq_length=96",
        "lora.targets=[q,v,down]",
        "lora.rank=4",
        "optim.lr=1e-3",
        *extra,
    ]


def _records(run_dir: Path) -> dict[int, dict]:
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        out.setdefault(rec["step"], {}).update(rec)  # a resumed run's later record wins
    return out


def _single(args: list[str], env: dict, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mlxlab", *args],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=timeout,
    )


@pytest.mark.slow  # two ranks and two single processes, one step each
def test_data_parallel_gradient_is_the_ranks_shares_summed(tiny_dir, session_home, tmp_path):
    """Bit for bit what one process computes for the two shares, added; against the whole batch
    in one go, within the rounding of computing it in two parts (measured bound)."""
    tiny_dir("llama")
    env = {**ENV, "MLXLAB_HOME": str(session_home)}
    args = [
        "model=tiny-llama",
        "dtype=float32",
        "seed=1",
        "batch_size=4",
        "wandb=disabled",
        f"data.train={QUICKSTART}",
        "data.max_seq_length=96",
        "lora.targets=[q,v,down]",
        "lora.rank=4",
    ]
    ranks = start_ranks(
        [str(tmp_path / "dp.npz"), *args], 2, tmp_path, env, "tests.helpers.dist_step"
    )
    for rank, (code, _, err) in enumerate(wait_all(ranks)):
        assert code == 0, (rank, err[-2000:])
    done = subprocess.run(
        [sys.executable, "-m", "tests.helpers.dist_step", str(tmp_path / "whole.npz"), "shares=2"]
        + args,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    dp, shares, whole = (np.load(tmp_path / f"{n}.npz") for n in ("dp", "whole_shares", "whole"))
    assert sorted(dp.files) == sorted(whole.files) and len(dp.files) == 2 + 24
    for k in dp.files:
        assert np.array_equal(dp[k], shares[k]), k
    assert abs(float(dp["loss"]) - float(whole["loss"])) <= 1e-6 * abs(float(whole["loss"]))
    for k in dp.files:
        scale = np.abs(whole[k]).max()
        assert np.abs(dp[k] - whole[k]).max() <= 2e-6 * scale, k  # measured 6.6e-7


@pytest.mark.slow  # mlx.launch, one process, a killed pair of ranks, two resumes
def test_data_parallel_run_matches_one_process_and_resumes_after_a_kill(
    tiny_dir, session_home, tmp_path
):
    tiny_dir("llama")
    env = {**ENV, "MLXLAB_HOME": str(session_home)}
    ref = tmp_path / "dp"
    launch = shutil_which("mlx.launch")
    port = free_ports(1)[0]
    done = subprocess.run(
        [launch, "--backend", "ring", "-n", "2", "--starting-port", str(port), "--"]
        + [sys.executable, "-m", "mlxlab", *_train_args(ref)],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert "world: ring backend, 2 processes: rank 0 on" in done.stderr, done.stderr[-3000:]
    assert (ref / "adapter" / "adapters.safetensors").is_file(), done.stderr[-3000:]
    assert done.stdout.count("adapter: ") == 1  # rank 0 reports
    one = _single(_train_args(tmp_path / "one"), env)
    assert one.returncode == 0, one.stderr[-2000:]
    dp, single = _records(ref), _records(tmp_path / "one")
    assert sorted(dp) == sorted(single) == list(range(7))
    for step, rec in single.items():
        for key in ("loss", "val_loss"):
            if key in rec:  # the logged loss is the global one
                assert rec[key] == pytest.approx(dp[step][key], rel=1e-6), (step, key)
        if step:
            assert dp[step]["trained_tokens"] == rec["trained_tokens"]
            assert len(dp[step]["peak_mem_gb_ranks"]) == 2

    killed = tmp_path / "killed"
    ranks = start_ranks(_train_args(killed), 2, tmp_path, env)
    deadline = time.time() + 240
    while time.time() < deadline and not (killed / "checkpoints" / "step_0000004").is_dir():
        time.sleep(0.05)
    ranks[1].send_signal(signal.SIGKILL)
    t0 = time.time()
    (code0, _, err0), _ = wait_all(ranks, timeout=120)
    assert code0 == 1 and time.time() - t0 < 60
    assert "rank 0:" in err0 and "connection to a peer was lost" in err0, err0[-2000:]
    assert not (killed / "adapter").exists()

    resumed = wait_all(start_ranks(_train_args(killed, "resume=true"), 2, tmp_path, env))
    assert [code for code, _, _ in resumed] == [0, 0], resumed[0][2][-2000:]
    assert "resumed from" in resumed[0][2]
    assert {s: r["loss"] for s, r in _records(killed).items() if "loss" in r} == {
        s: r["loss"] for s, r in dp.items() if "loss" in r
    }
    assert (killed / "adapter" / "adapters.safetensors").read_bytes() == (
        ref / "adapter" / "adapters.safetensors"
    ).read_bytes()


def shutil_which(name: str) -> str:
    path = Path(sys.executable).parent / name
    assert path.exists(), f"{name} is installed with mlx next to {sys.executable}"
    return str(path)


@pytest.mark.slow  # one process, two ranks twice
def test_pipeline_equals_one_process_segmented_bit_for_bit(tiny_dir, session_home, tmp_path):
    """Gemma 4 in segments of 2 on 2 ranks: layers 0-3 | 4-5, and both of its KV-shared
    layers' donors (2 and 3) on rank 0, so their K/V cross the boundary; LoRA dropout and two
    micro-batches per step. Losses, validation, gradient norms and the adapter's bytes equal
    one process's segmented backward; so do they after resuming from the checkpoint."""
    tiny_dir("gemma4")
    env = {**ENV, "MLXLAB_HOME": str(session_home)}

    def args(out, *extra):
        return [
            "train",
            "model=tiny-gemma4",
            "dtype=float32",
            f"out_dir={out}",
            "iters=4",
            "batch_size=2",
            "grad_accum=2",
            "val_every=2",
            "val_batches=1",
            "save_every=2",
            "log_every=1",
            "wandb=disabled",
            "seed=5",
            f"data.train={QUICKSTART}",
            "data.max_seq_length=128",
            "lora.targets=[q,k,v,o,down]",
            "lora.rank=4",
            "lora.dropout=0.1",
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
    assert "rank 0 segments 0-1 (layers 0-3), rank 1 segments 2-2 (layers 4-5)" in ranks[0][2]
    single, piped = _records(tmp_path / "one"), _records(pp)
    for step, rec in single.items():
        for key in ("loss", "val_loss", "grad_norm"):
            if key in rec:
                assert piped[step][key] == rec[key], (step, key)  # bit for bit
    adapter = (tmp_path / "one" / "adapter" / "adapters.safetensors").read_bytes()
    assert (pp / "adapter" / "adapters.safetensors").read_bytes() == adapter
    summary = json.loads((pp / "summary.json").read_text())
    peak = json.loads((tmp_path / "one" / "summary.json").read_text())["peak_mem_gb"]
    assert all(p < peak for p in summary["peak_mem_gb_ranks"]), (summary, peak)
    assert all(w < summary["weights_gb_model"] for w in summary["weights_gb_ranks"])
    assert 0 <= summary["bubble"] < 1 and len(summary["bubble_ranks"]) == 2

    # resume from the step-2 checkpoint (gathered on rank 0, handed back to each stage)
    (pp / "adapter" / "adapters.safetensors").unlink()
    again = wait_all(
        start_ranks(args(pp, "backward.pipeline=true", "resume=true"), 2, tmp_path, env)
    )
    assert [code for code, _, _ in again] == [0, 0], again[0][2][-3000:]
    assert "resumed from" in again[0][2]
    assert (pp / "adapter" / "adapters.safetensors").read_bytes() == adapter


@pytest.mark.slow  # one process twice, two ranks twice
def test_dpo_on_top_of_an_adapter_keeps_that_adapter_as_reference_on_ranks(
    tiny_dir, session_home, tmp_path
):
    """lora.init under DPO on several processes: the reference is the starting adapter on every
    rank (first step: margin 0, loss log 2), in the pipeline (its own reference pass, bit for
    bit one process's segmented run) and data parallel (each rank its share)."""
    from tests.test_preference_train import write_pairs

    tiny_dir("gemma4")
    env = {**ENV, "MLXLAB_HOME": str(session_home)}
    pairs = write_pairs(tmp_path / "pairs", n_train=8, n_valid=2)

    def args(out, *extra):
        return [
            "train",
            "model=tiny-gemma4",
            "dtype=float32",
            f"out_dir={out}",
            "iters=2",
            "batch_size=2",
            "val_every=0",
            "save_every=0",
            "log_every=1",
            "wandb=disabled",
            "seed=5",
            f"data.train={pairs}",
            "data.max_seq_length=128",
            "lora.targets=[q,v,down]",
            "lora.rank=4",
            "optim.lr=1e-3",
            "backward.mode=segmented",
            "backward.segment_size=2",
            *extra,
        ]

    first = _single(args(tmp_path / "sft", "objective=orpo"), env)
    assert first.returncode == 0, first.stderr[-2000:]
    on_top = ["objective=dpo", f"lora.init={tmp_path / 'sft' / 'adapter'}"]
    one = _single(args(tmp_path / "one", *on_top), env)
    assert one.returncode == 0, one.stderr[-2000:]
    single = _records(tmp_path / "one")
    assert single[1]["reward_margin"] == 0.0 and single[1]["loss"] == pytest.approx(0.693147)
    for name, extra in (("pp", ["backward.pipeline=true"]), ("dp", [])):
        ranks = wait_all(start_ranks(args(tmp_path / name, *on_top, *extra), 2, tmp_path, env))
        assert [code for code, _, _ in ranks] == [0, 0], (name, ranks[0][2][-3000:])
        got = _records(tmp_path / name)
        assert got[1]["reward_margin"] == 0.0, name
        if name == "pp":
            for step, rec in single.items():
                assert got[step]["loss"] == rec["loss"], step  # bit for bit
                assert got[step]["grad_norm"] == rec["grad_norm"], step
        else:  # two shares summed: rounding (measured 3e-6), which Adam's first update (each
            # element's step is its gradient's sign) turns into a small change (measured 2.5e-4)
            assert got[1]["grad_norm"] == pytest.approx(single[1]["grad_norm"], rel=2e-5)
            assert got[2]["loss"] == pytest.approx(single[2]["loss"], rel=2e-3)


@pytest.mark.slow  # two ranks, one stopped
def test_a_hung_rank_stops_the_others_within_the_timeout(tiny_dir, session_home, tmp_path):
    tiny_dir("llama")
    env = {**ENV, "MLXLAB_HOME": str(session_home)}
    out = tmp_path / "hung"
    ranks = start_ranks(
        _train_args(out, "iters=500", "val_every=0", "dist.timeout_s=4"), 2, tmp_path, env
    )
    deadline = time.time() + 240
    while time.time() < deadline:
        metrics = out / "metrics.jsonl"
        if metrics.exists() and '"loss"' in metrics.read_text():
            break
        time.sleep(0.05)
    ranks[1].send_signal(signal.SIGSTOP)  # alive, holding its connection, never answering
    t0 = time.time()
    try:
        _, err = ranks[0].communicate(timeout=60)
        waited = time.time() - t0
    finally:
        ranks[1].kill()
        ranks[1].wait()
    assert ranks[0].returncode == 1
    assert "rank 0: no answer from the other ranks for 4 s while" in err, err[-2000:]
    assert waited < 30
