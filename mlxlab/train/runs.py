"""Training runs read back: what `train` leaves in a run directory, for the runs page.

A run directory (train/job.py) holds `config.yaml` (written before the first step),
`metrics.jsonl` (one JSON object a line, appended as the run trains: `step`, `loss`, `lr`,
`grad_norm`, `tok_per_s`, `peak_mem_gb`, `val_loss`, a preference objective's terms...),
`summary.json` (written at the end), `adapter/` (the final adapter) and `checkpoints/`.

Everything here is confined to one root directory: run ids are POSIX paths relative to it, and a
path that resolves outside it (`..`, an absolute path, a symlink pointing out) is refused, as are
files inside a run that are symlinks to elsewhere. Reading is incremental: `read_metrics` starts
at a byte offset and returns only complete lines, so a page polling a run that is still training
gets each new record once, and a file rewritten in place (a resumed run drops the records after
its checkpoint: `checkpoint.truncate_metrics`) is noticed by its changed identity and read again.
Nothing here imports MLX: `python -m mlxlab runs` starts in a moment.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

METRICS = "metrics.jsonl"
CONFIG = "config.yaml"
SUMMARY = "summary.json"
ADAPTER = "adapter"
ADAPTER_FILES = ("adapter_config.json", "adapters.safetensors")
NOT_RUNS = frozenset({"adapter", "checkpoints", "data", "wandb"})
"""Folders inside a run directory, never searched for runs."""
ACTIVE_S = 300.0
"""A run without summary.json whose metrics changed this recently counts as running."""
MAX_CHUNK = 4 << 20
"""Bytes of metrics.jsonl one read returns at most (the reader asks again from its offset)."""


class RunError(Exception):
    """A run id that names no run (`status` 404) or resolves outside the root (403)."""

    def __init__(self, status: int, message: str, code: str):
        super().__init__(message)
        self.status, self.code = status, code


def is_run(path: Path) -> bool:
    return (path / METRICS).is_file() or (path / CONFIG).is_file()


def inside(root: Path, path: Path) -> bool:
    return path == root or root in path.parents


def confined(root: Path, path: Path) -> Path:
    """`path` with symlinks resolved, which must lie inside `root` (already resolved)."""
    resolved = Path(os.path.realpath(path))
    if not inside(root, resolved):
        raise RunError(403, f"{path.name} resolves outside the runs directory", "outside_runs_dir")
    return resolved


def run_dir(root: Path, run_id: str) -> Path:
    """The run directory `run_id` names under `root` (resolved): RunError if it is not a
    relative path inside `root` (symlinks followed) or holds no run."""
    if not isinstance(run_id, str) or not run_id or "\x00" in run_id or "\\" in run_id:
        raise RunError(404, f"no run {run_id!r}", "run_not_found")
    if run_id.startswith("/") or ".." in run_id.split("/"):
        raise RunError(
            403, f"run {run_id!r} is not a path inside the runs directory", "outside_runs_dir"
        )
    try:
        path = confined(root, root / run_id)
        found = path.is_dir() and is_run(path)
    except OSError:  # a name too long for the file system, say
        found = False
    if not found:
        raise RunError(404, f"no run {run_id!r} under {root}", "run_not_found")
    return path


def run_file(root: Path, run: Path, name: str) -> Path | None:
    """`run/name` if it is a regular file whose real path is inside `root`, else None."""
    path = run / name
    if not path.is_file():
        return None
    try:
        return confined(root, path)
    except RunError:
        return None


def find(root: Path, max_depth: int = 4) -> list[Path]:
    """Run directories under `root` (resolved), `root` itself included, newest first; hidden
    folders, a run's own subfolders and symlinked folders are not searched."""
    runs = []
    for dirpath, dirnames, _ in os.walk(root):  # followlinks=False: no symlinked folders
        here = Path(dirpath)
        depth = len(here.relative_to(root).parts)
        if is_run(here):
            runs.append(here)
            dirnames[:] = []
            continue
        dirnames[:] = sorted(
            d for d in dirnames if not d.startswith(".") and d not in NOT_RUNS and depth < max_depth
        )
    return sorted(runs, key=lambda p: (-mtime(p), str(p)))


def cards(root: Path, now: float | None = None) -> list[dict]:
    """`describe` of every run `find` finds (a run removed meanwhile is left out)."""
    out = []
    for run in find(root) if root.is_dir() else []:
        try:
            out.append(describe(root, run, now))
        except OSError:
            continue
    return out


def mtime(run: Path) -> float:
    times = [(run / n).stat().st_mtime for n in (METRICS, SUMMARY, CONFIG) if (run / n).is_file()]
    return max(times, default=0.0)


def finite(value):
    """JSON-safe, recursively: non-finite floats (NaN, inf) become None, keys strings, anything
    else JSON has no type for (a YAML date) its text."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if value is None or isinstance(value, (str, int, float)):
        return value
    if isinstance(value, dict):
        return {str(k): finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return str(value)


def file_id(st: os.stat_result) -> str:
    """Changes when the file is replaced (atomic rewrite: a new inode)."""
    return f"{st.st_dev}-{st.st_ino}"


def read_metrics(path: Path, offset: int = 0, file: str | None = None) -> dict:
    """The records of a metrics.jsonl from byte `offset` on (complete lines only; lines that are
    not JSON objects with a step are skipped and counted): {records, offset (where the next read
    starts), file (its identity), reset (read from 0 because `file` names another file or the
    file is now shorter than `offset`), more (stopped at MAX_CHUNK), bad_lines}."""
    with open(path, "rb") as f:
        st = os.fstat(f.fileno())
        ident = file_id(st)
        reset = offset < 0 or (file is not None and file != ident) or offset > st.st_size
        start = 0 if reset else offset
        f.seek(start)
        data = f.read(MAX_CHUNK)
    end = data.rfind(b"\n") + 1  # up to the last complete line; a line being written waits
    more = start + len(data) < st.st_size and len(data) == MAX_CHUNK
    records, bad = [], 0
    if end == 0 and more:  # one line longer than a chunk: skipped, so the reader moves on
        end = len(data)
    for line in data[:end].splitlines():
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            bad += 1
            continue
        if isinstance(rec, dict) and isinstance(rec.get("step"), int):
            records.append(finite(rec))
        else:
            bad += 1
    return {
        "records": records,
        "offset": start + end,
        "file": ident,
        "reset": reset and offset != 0,
        "more": more,
        "bad_lines": bad,
    }


def read_json(path: Path | None) -> dict | None:
    if path is None:
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return finite(data) if isinstance(data, dict) else None


def read_config(path: Path | None) -> dict | None:
    if path is None:
        return None
    import yaml

    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, yaml.YAMLError):
        return None
    return finite(data) if isinstance(data, dict) else None


_tails: dict[Path, tuple[tuple, dict]] = {}
"""metrics.jsonl -> (its stat signature, what `tail` found): unchanged files are not reread."""


def tail(path: Path | None) -> dict:
    """What a run's metrics say so far: steps logged, the last step, last loss and val_loss,
    the metric names present."""
    if path is None:
        return {"records": 0, "step": None, "loss": None, "val_loss": None, "keys": []}
    st = path.stat()
    sig = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    hit = _tails.get(path)
    if hit is not None and hit[0] == sig:
        return hit[1]
    out = {"records": 0, "step": None, "loss": None, "val_loss": None, "keys": []}
    keys: dict[str, None] = {}
    offset, ident = 0, None
    while True:
        got = read_metrics(path, offset, ident)
        for rec in got["records"]:
            out["records"] += 1
            out["step"] = rec["step"]
            for k, v in rec.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    keys[k] = None
            for k in ("loss", "val_loss"):
                if rec.get(k) is not None:
                    out[k] = rec[k]
        offset, ident = got["offset"], got["file"]
        if not got["more"]:
            break
    out["keys"] = [k for k in keys if k != "step"]
    if len(_tails) > 256:
        _tails.clear()
    _tails[path] = (sig, out)
    return out


def describe(root: Path, run: Path, now: float | None = None) -> dict:
    """A run's card: id (relative to root), model, objective, iters, progress, status (finished:
    summary.json is newer than the metrics; running: metrics changed in the last ACTIVE_S
    seconds; else stopped), last loss and val_loss, metric names, the final adapter if any."""
    now = time.time() if now is None else now
    metrics = run_file(root, run, METRICS)
    summary_path = run_file(root, run, SUMMARY)
    config = read_config(run_file(root, run, CONFIG)) or {}
    summary = read_json(summary_path)
    seen = tail(metrics)
    updated = mtime(run)
    finished = summary is not None and (
        metrics is None or summary_path.stat().st_mtime >= metrics.stat().st_mtime
    )
    status = "finished" if finished else ("running" if now - updated < ACTIVE_S else "stopped")
    adapter = run / ADAPTER
    has_adapter = all(run_file(root, adapter, n) is not None for n in ADAPTER_FILES)
    rel = run.relative_to(root).as_posix()
    return {
        "id": rel,
        "name": run.name if rel != "." else root.name,
        "model": config.get("model"),
        "objective": config.get("objective", "sft"),
        "iters": config.get("iters"),
        "step": seen["step"],
        "records": seen["records"],
        "loss": seen["loss"],
        "val_loss": seen["val_loss"],
        "keys": seen["keys"],
        "status": status,
        "updated": updated,
        "adapter": str(adapter) if has_adapter else None,
    }


def trained_from(adapter: Path) -> str | None:
    """The `model` of the run an adapter directory belongs to (its config.yaml, in the
    directory or the one above it: `run/adapter/`), or None."""
    for run in (adapter, adapter.parent):
        path = run / CONFIG
        if path.is_file():
            model = (read_config(path) or {}).get("model")
            return str(model) if model else None
    return None


def info(root: Path, run: Path) -> dict:
    """A run's config.yaml and summary.json (None where missing or unreadable)."""
    return {
        "config": read_config(run_file(root, run, CONFIG)),
        "summary": read_json(run_file(root, run, SUMMARY)),
    }
