"""The served model's adapter registry: mount, unmount, path confinement, per-adapter counters.

The per-row LoRA arithmetic is `lora/multi.py` (`MultiLoRA` wrappers and their shared
`Selection`); this module decides what may be mounted. Mounting and unmounting run on the engine
thread between jobs (`Gateway.call`), never in the middle of a forward pass. Files are read with
`lora.io.read_plan` (safetensors + JSON only; every problem reported at once, nothing mounted on
any problem). Runtime paths are confined to the adapter root (`resolve_root`: `serve.adapter_root`,
or by default a directory of mlxlab's) after resolving symlinks.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field
from pathlib import Path

from mlxlab import runtime
from mlxlab.errors import UserError
from mlxlab.lora import io as lora_io
from mlxlab.lora import multi
from mlxlab.serve.engine.jobs import AdapterSpec


class NotStackable(KeyError):
    """A mounted adapter asked for in a stack it cannot join (DoRA applies alone)."""


def adapter_error_code(e: KeyError) -> str:
    """The API error code of `AdapterRegistry.check`'s KeyError."""
    return "adapter_not_stackable" if isinstance(e, NotStackable) else "unknown_adapter"


@dataclass
class Mounted:
    id: str
    path: str
    rank: int
    scale: float
    size_bytes: int
    modules: list[str]
    layers: list[int]
    requests: int = 0
    meta: dict = field(default_factory=dict)
    kind: str = "lora"  # lora | dora
    # This mount's token, unique in the process (`MOUNT_TOKENS`): the prompt cache keys on it,
    # so an id mounted again (another directory, or after its model's eviction) never reuses
    # KV computed with the weights it named before.
    token: int = 0

    def card(self) -> dict:
        return {
            "id": self.id,
            "type": self.kind,
            "path": self.path,
            "rank": self.rank,
            "scale": self.scale,
            "size_bytes": self.size_bytes,
            "mounted_layers": self.layers,
            "modules": len(self.modules),
            "requests": self.requests,
        }


MOUNT_TOKENS = itertools.count(1)  # one per mount, across every model's registry

RUNS_DIR = "outputs"  # where `train` writes its runs, under the working directory


def _owned(path: Path) -> bool:
    getuid = getattr(os, "getuid", None)
    return getuid is None or path.stat().st_uid == getuid()


def resolve_root(root: str | Path | None) -> Path:
    """The adapter root, absolute: `root` when given (`serve.adapter_root`), else a directory
    that belongs to mlxlab, never the bare working directory (started from a shared temporary
    directory it would list and mount whatever other programs left there): the runs directory
    `outputs/` under the working directory if there is one, else `MLXLAB_HOME/adapters`,
    created if needed."""
    if root is not None:
        return Path(root).expanduser().resolve()
    runs = Path(RUNS_DIR)
    # Only a real directory of this user's (in a shared directory, another program's
    # outputs/ or a link to elsewhere is not ours to serve from).
    if runs.is_dir() and not runs.is_symlink() and _owned(runs):
        return runs.resolve()
    home = runtime.home() / "adapters"
    try:
        home.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(
            f"cannot create the adapter root {home} ({e.strerror or e}); set "
            "serve.adapter_root=DIR or MLXLAB_HOME"
        ) from None
    return home.resolve()


class Adapters:
    """The registry of one served model (each loaded model has its own; an adapter belongs to
    the base it was trained on); its methods that touch the model run on the engine thread.
    `root`: `serve.adapter_root` (None: the default `resolve_root` picks); `name`: the model's,
    for the messages."""

    def __init__(self, model, root: str | Path | None, name: str | None = None):
        self.model = model
        self.name = name
        self.root = resolve_root(root)
        self.selection = multi.Selection()
        self.mounted: dict[str, Mounted] = {}
        self.mounts = self.unmounts = 0  # since start
        # runtime mounts of an earlier load that this load could not mount again (id, path, error)
        self.not_remounted: list[dict] = []

    # --- paths (HTTP side) ----------------------------------------------------------------------

    def confine(self, path: str) -> Path:
        """`path` (relative to the root, or absolute) resolved with symlinks; outside the root -> PermissionError."""
        raw = Path(path).expanduser()
        resolved = Path(os.path.realpath(raw if raw.is_absolute() else self.root / raw))
        if resolved != self.root and self.root not in resolved.parents:
            raise PermissionError(f"{path!r} resolves outside the adapter root {self.root}")
        return resolved

    def available(self, max_depth: int = 5) -> list[dict]:
        out = []
        for dirpath, dirnames, filenames in os.walk(self.root):
            depth = len(Path(dirpath).relative_to(self.root).parts)
            dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and depth < max_depth)
            if "adapter_config.json" in filenames and "adapters.safetensors" in filenames:
                rel = str(Path(dirpath).relative_to(self.root))
                size = os.path.getsize(Path(dirpath) / "adapters.safetensors")
                out.append(
                    {
                        "path": rel,
                        "size_bytes": size,
                        "mounted_as": [
                            m.id for m in self.mounted.values() if m.path == str(Path(dirpath))
                        ],
                    }
                )
        return out

    # --- engine side ------------------------------------------------------------------------------

    def mount(self, adapter_id: str, path: str | Path) -> Mounted:
        if adapter_id in self.mounted:
            raise UserError(f"an adapter is already mounted as {adapter_id!r}; unmount it first")
        if not adapter_id or "+" in adapter_id or adapter_id in ("none", "base"):
            raise UserError(f"invalid adapter id {adapter_id!r} (no '+', not 'none')")
        path = lora_io.resolve_dir(path)
        if lora_io.kind_of(path) == "full":
            raise UserError(
                f"adapter {adapter_id!r} is a full fine-tune (its own weights, not an adapter): "
                "serve it fused (python -m mlxlab lora fuse adapter=... out=DIR, then model=DIR)"
            )
        plan, weights = lora_io.read_plan(
            path, self.model
        )  # raises with every problem; touches nothing
        modules = multi.attach(self.model, adapter_id, plan, weights, self.selection)
        size = os.path.getsize(Path(path) / lora_io.WEIGHTS)
        m = Mounted(
            adapter_id,
            str(Path(path).resolve()),
            plan.rank,
            plan.scale,
            size,
            modules,
            sorted(plan.layers),
            kind=plan.kind,
            token=next(MOUNT_TOKENS),
        )
        self.mounted[adapter_id] = m
        self.mounts += 1
        return m

    def unmount(self, adapter_id: str) -> None:
        if adapter_id not in self.mounted:
            raise KeyError(adapter_id)
        multi.detach(self.model, adapter_id)
        del self.mounted[adapter_id]
        self.unmounts += 1

    def check(self, ids: AdapterSpec) -> None:
        """KeyError naming every id in `ids` that is not mounted."""
        unknown = [i for i in ids if i not in self.mounted]
        if unknown:
            have = ", ".join(sorted(self.mounted)) or "none"
            on = f" on model {self.name!r}" if self.name else ""
            raise KeyError(
                f"adapter {', '.join(map(repr, unknown))} is not mounted{on} (mounted: {have})"
            )
        dora = [i for i in ids if self.mounted[i].kind == "dora"]
        if dora and len(ids) > 1:  # it rescales the whole output: not a delta to stack
            raise NotStackable(
                f"adapter {dora[0]!r} is a DoRA adapter: it applies alone, not in a stack "
                f"({'+'.join(ids)})"
            )

    def stats(self) -> dict:
        return {
            "mounted": [m.card() for m in self.mounted.values()],
            "root": str(self.root),
            "mounts": self.mounts,
            "unmounts": self.unmounts,
            "not_remounted": list(self.not_remounted),
        }
