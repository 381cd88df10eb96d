"""Checkpoints of a training run and the run's totals across resumes.

A checkpoint (`<run>/checkpoints/step_NNNNNNN/`, written atomically) holds everything a resumed
run needs to continue exactly where a killed one stopped: the adapter (mlx-lm's layout), the
optimizer state (with its step, hence the LR position), the sampler's position, the world it was
written by (process count, parallel mode) and the run's training seconds and peak memory so far
(`RunTotals`). Used by the SFT/DPO/ORPO loop (train/trainer.py), GRPO's (train/grpo/loop.py) and,
through their `dist.save_checkpoint`, the multi-process runs (train/parallel.py, pipeline.py).
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from mlxlab.errors import UserError
from mlxlab.fsutil import atomic_dir, atomic_write_text
from mlxlab.lora import io as lora_io
from mlxlab.lora.apply import LoraPlan

log = logging.getLogger(__name__)

# --- checkpoints ------------------------------------------------------------------------------

CKPT_DIR = "checkpoints"


def checkpoints(run_dir: Path) -> list[Path]:
    root = run_dir / CKPT_DIR
    return sorted(p for p in root.glob("step_*") if p.is_dir()) if root.is_dir() else []


def save_checkpoint(
    run_dir: Path,
    step: int,
    model,
    plan: LoraPlan,
    optimizer,
    sampler,
    meta: dict,
    keep_last: int,
    world: dict | None = None,
    totals: dict | None = None,
) -> Path:
    """`world` ({size, mode}) records a run on several processes; resume checks it. `totals`
    (RunTotals.so_far: the run's training `seconds` and `peak_mem_gb` up to this step) go to
    trainer_state.json, where a resumed run starts its own from."""
    out = run_dir / CKPT_DIR / f"step_{step:07d}"
    state = {"step": step, "sampler": sampler.state()}
    if world is not None:
        state["world"] = world
    if totals is not None:
        state.update(totals)

    def write(tmp: Path) -> None:
        lora_io.save(model, plan, tmp, meta=meta)
        mx.save_safetensors(str(tmp / "optimizer.safetensors"), dict(tree_flatten(optimizer.state)))
        (tmp / "trainer_state.json").write_text(json.dumps(state))

    atomic_dir(out, write)
    for old in checkpoints(run_dir)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return out


def restore_checkpoint(ckpt: Path, model, optimizer, sampler, world: dict | None = None) -> int:
    """Load a checkpoint into a model that already carries the run's LoRA layers. A checkpoint
    of another world (process count or parallel mode; `world` None: one process) is refused."""
    info = json.loads((ckpt / "trainer_state.json").read_text())
    saved, now = info.get("world") or {"size": 1}, world or {"size": 1}
    if (saved.get("size"), saved.get("mode")) != (now.get("size"), now.get("mode")):
        raise UserError(
            f"{ckpt} was written by {world_words(saved)}; this run is {world_words(now)}: "
            "resume with the same world (each rank's share of every batch, the order in which "
            "gradients are summed and where each layer lives depend on it)"
        )
    weights = mx.load(str(ckpt / lora_io.WEIGHTS))
    model.load_weights(list(weights.items()), strict=False)
    state = mx.load(str(ckpt / "optimizer.safetensors"))
    optimizer.state = tree_unflatten(list(state.items()))
    sampler.restore(info["sampler"])
    mx.eval(model.parameters(), optimizer.state)
    return int(info["step"])


def world_words(world: dict) -> str:
    size = world.get("size", 1)
    if size == 1:
        return "one process"
    how = "a segment pipeline" if world.get("mode") == "pipeline" else "data parallel"
    return f"{how} on {size} processes (mlx.launch -n {size})"


def resume(run_dir: Path, model, optimizer, sampler, world: dict | None = None) -> int:
    """Restore the newest checkpoint of `run_dir` (or none yet: step 0); the step to go on from."""
    found = checkpoints(run_dir)
    if found:
        start = restore_checkpoint(found[-1], model, optimizer, sampler, world)
        truncate_metrics(run_dir / "metrics.jsonl", start)
        log.info(f"resumed from {found[-1]} (step {start})")
        return start
    # killed before its first checkpoint: the same run from its start
    truncate_metrics(run_dir / "metrics.jsonl", -1)
    log.info(f"resume=true: {run_dir} has no checkpoint yet; training from step 0")
    return 0


def truncate_metrics(path: Path, last_step: int) -> None:
    """Drop records a killed run wrote after its last checkpoint; they are about to be redone."""
    if not path.exists():
        return
    keep = [
        line
        for line in path.read_text().splitlines()
        if line.strip() and json.loads(line)["step"] <= last_step
    ]
    atomic_write_text(path, "".join(line + "\n" for line in keep))


# --- the whole run's training time and peak memory, across resumes ----------------------------


@dataclass
class RunTotals:
    """A run's training seconds and peak memory, over every attempt of it. A checkpoint records
    them up to its step (trainer_state.json `seconds`, `peak_mem_gb`); a resumed run starts from
    its checkpoint's, adds its own seconds and keeps the larger peak, so the summary holds the
    whole run's figures (and says where this attempt began: `resumed_from_step`, with its own
    `resumed_seconds` and `resumed_peak_mem_gb`). None: unknown (a checkpoint from before these
    were recorded whose run's metrics.jsonl does not tell either)."""

    seconds: float | None = 0.0  # before this attempt
    peak_mem_gb: float | None = 0.0
    resumed_from: int = 0
    t0: float = field(default_factory=time.perf_counter)  # this attempt's start
    seen_gb: float = 0.0  # the largest peak this attempt logged (several processes: any rank's)

    @classmethod
    def load(cls, run_dir: Path, start: int) -> RunTotals:
        """The totals of the checkpoint at step `start` of `run_dir` (0: a fresh run). One
        written before they were recorded: what the run's metrics.jsonl logged (`logged_totals`)."""
        if not start:
            return cls()
        try:
            info = json.loads(
                (run_dir / CKPT_DIR / f"step_{start:07d}" / "trainer_state.json").read_text()
            )
        except (OSError, ValueError):
            info = {}
        if "seconds" in info:
            return cls(info["seconds"], info.get("peak_mem_gb"), start)
        seconds, peak = logged_totals(run_dir / "metrics.jsonl", start)
        log.info(
            "the checkpoint predates recorded training totals; from metrics.jsonl: "
            f"{'unknown' if seconds is None else f'{seconds:.0f} s'} of training, peak memory "
            f"{'unknown' if peak is None else f'{peak:.2f} GB'} before step {start}"
        )
        return cls(seconds, peak, start)

    def own_seconds(self) -> float:
        return time.perf_counter() - self.t0

    def saw(self, peak_gb: float) -> None:
        self.seen_gb = max(self.seen_gb, peak_gb)

    def so_far(self) -> dict:
        """The run's `seconds` and `peak_mem_gb` up to now (a checkpoint's)."""
        now = max(self.seen_gb, mx.get_peak_memory() / 1e9)
        return {
            "seconds": None if self.seconds is None else self.seconds + self.own_seconds(),
            "peak_mem_gb": None if self.peak_mem_gb is None else max(self.peak_mem_gb, now),
        }

    def summary(self, peak_gb: float) -> dict:
        """The summary's `seconds` and `peak_mem_gb` (the whole run's), `peak_gb` this attempt's
        peak; a resumed run's also say where it began and what this attempt alone took."""
        own_s, peak_gb = self.own_seconds(), max(self.seen_gb, peak_gb)
        out = {
            "seconds": None if self.seconds is None else self.seconds + own_s,
            "peak_mem_gb": None if self.peak_mem_gb is None else max(self.peak_mem_gb, peak_gb),
        }
        if self.resumed_from:
            out.update(
                resumed_from_step=self.resumed_from,
                resumed_seconds=own_s,
                resumed_peak_mem_gb=peak_gb,
            )
        return out


def logged_totals(path: Path, last_step: int) -> tuple[float | None, float | None]:
    """(training seconds, peak GB) of a run's records up to `last_step` in metrics.jsonl, each
    None where nothing says. `elapsed_s` counts from its process's start: a drop marks a resumed
    attempt, whose seconds add to those its predecessor reached."""
    seconds, last, peak, any_elapsed = 0.0, 0.0, None, False
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None, None
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if not isinstance(rec, dict) or not isinstance(rec.get("step"), int):
            continue
        if rec["step"] > last_step:
            continue
        e, p = rec.get("elapsed_s"), rec.get("peak_mem_gb")
        if isinstance(e, int | float):
            if e < last:  # a new attempt's clock
                seconds += last
            last, any_elapsed = e, True
        if isinstance(p, int | float):
            peak = p if peak is None else max(peak, p)
    return (seconds + last if any_elapsed else None), peak
