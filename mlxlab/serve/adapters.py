"""LoRA adapters mounted into a running server and chosen per request.

Every projection any mounted adapter targets is wrapped once in a `MultiLoRA` that holds the
base linear and one (A, B, scale) slot per adapter. Which slots apply is one shared selection the
lane sets before a job runs (`"none"`, `"a"`, or stacked `"a+b"`: the deltas summed in that
order, each with its own scale). With nothing selected a wrapper returns `base(x)` itself, so a
mounted-but-unused adapter leaves base outputs byte-identical; a single selected adapter computes
exactly what mlx-lm's `LoRALinear` computes, so tokens match an in-process load. Wrappers whose
last adapter is unmounted are replaced by their base linear again.

Mounting and unmounting run on the engine thread between jobs (`Gateway.call`), never in the
middle of a forward pass. Files are read with `lora.io.read_plan` (safetensors + JSON only;
every problem reported at once, nothing mounted on any problem). Runtime paths are confined to
`serve.adapter_root` after resolving symlinks.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten
from pydantic import BaseModel, ConfigDict, Field

from mlxlab.config import UserError


class MountRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    id: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")
    path: str = Field(min_length=1)


class Selection:
    """The adapters the current forward pass uses (shared by every wrapper).

    Either one spec for the whole batch (`ids`), or one per batch row (`set_rows`, the batched
    lane): then each wrapper adds, for stack position k and each adapter at that position, that
    adapter's delta times a 0/1 row mask. A row gets its own adapters' deltas in its own order and
    `+ 0 * delta` elsewhere, which leaves a row's values exactly what its spec alone computes.
    """

    def __init__(self):
        self.ids: tuple[str, ...] = ()
        self.masked: list[tuple[str, mx.array]] | None = None

    def set_rows(self, rows: list[tuple[str, ...]]) -> None:
        if len(set(rows)) <= 1:  # one spec for every row: the plain path, no masks
            self.ids, self.masked = (rows[0] if rows else ()), None
            return
        self.ids, self.masked = (), []
        for k in range(max(len(r) for r in rows)):
            names = dict.fromkeys(r[k] for r in rows if len(r) > k)
            for name in names:
                mask = [1.0 if len(r) > k and r[k] == name else 0.0 for r in rows]
                self.masked.append((name, mx.array(mask)[:, None, None]))

    def clear(self) -> None:
        self.ids, self.masked = (), None


class MultiLoRA(nn.Module):
    def __init__(self, linear: nn.Module, selection: Selection):
        super().__init__()
        self.linear = linear
        self._selection = selection
        object.__setattr__(self, "_slots", {})  # a plain attribute: not parameters of the model

    def __call__(self, x):
        y = self.linear(x)
        sel = self._selection
        for name, mask in [(name, None) for name in sel.ids] + (sel.masked or []):
            slot = self._slots.get(name)
            if slot is not None:
                a, b, scale = slot
                delta = scale * ((x @ a) @ b)
                y = y + (delta if mask is None else mask * delta).astype(x.dtype)
        return y


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

    def card(self) -> dict:
        return {"id": self.id, "path": self.path, "rank": self.rank, "scale": self.scale,
                "size_bytes": self.size_bytes, "mounted_layers": self.layers, "modules": len(self.modules),
                "requests": self.requests}


def parse_spec(spec: str | None) -> tuple[str, ...]:
    """"none" / None -> (); "a+b" -> ("a", "b")."""
    if spec is None or spec in ("", "none", "base"):
        return ()
    ids = tuple(s.strip() for s in spec.split("+"))
    if not all(ids):
        raise ValueError(f"malformed adapter spec {spec!r} (use an id, 'a+b', or 'none')")
    return ids


class Adapters:
    """The registry; its methods that touch the model run on the engine thread."""

    def __init__(self, model, root: str | Path):
        self.model = model
        self.root = Path(root).expanduser().resolve()
        self.selection = Selection()
        self.mounted: dict[str, Mounted] = {}

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
                out.append({"path": rel, "size_bytes": size,
                            "mounted_as": [m.id for m in self.mounted.values() if m.path == str(Path(dirpath))]})
        return out

    # --- engine side ------------------------------------------------------------------------------

    def mount(self, adapter_id: str, path: str | Path) -> Mounted:
        from mlxlab.lora import apply as lora_apply
        from mlxlab.lora import io as lora_io

        if adapter_id in self.mounted:
            raise UserError(f"an adapter is already mounted as {adapter_id!r}; unmount it first")
        if not adapter_id or "+" in adapter_id or adapter_id in ("none", "base"):
            raise UserError(f"invalid adapter id {adapter_id!r} (no '+', not 'none')")
        path = lora_io.resolve_dir(path)
        plan, weights = lora_io.read_plan(path, self.model)  # raises with every problem; touches nothing
        prefix = lora_apply.layers_prefix(self.model)
        modules, new_arrays = [], []
        for i in plan.layers:
            layer = self.model.layers[i]
            present = dict(layer.named_modules())
            wraps = []
            for key in plan.keys:
                a = weights.get(f"{prefix}.{i}.{key}.lora_a")
                b = weights.get(f"{prefix}.{i}.{key}.lora_b")
                module = present.get(key)
                if module is None or a is None or b is None:
                    continue
                if not isinstance(module, MultiLoRA):
                    module = MultiLoRA(module, self.selection)
                    wraps.append((key, module))
                dtype = module.linear.weight.dtype if module.linear.weight.dtype in (
                    mx.float32, mx.float16, mx.bfloat16) else mx.float32
                module._slots[adapter_id] = (a.astype(dtype), b.astype(dtype), plan.scale)
                new_arrays += module._slots[adapter_id][:2]
                modules.append(f"{prefix}.{i}.{key}")
            if wraps:
                layer.update_modules(tree_unflatten(wraps))
        mx.eval(new_arrays)
        size = os.path.getsize(Path(path) / lora_io.WEIGHTS)
        m = Mounted(adapter_id, str(Path(path).resolve()), plan.rank, plan.scale, size, modules,
                    sorted(plan.layers))
        self.mounted[adapter_id] = m
        return m

    def unmount(self, adapter_id: str) -> None:
        if adapter_id not in self.mounted:
            raise KeyError(adapter_id)
        for layer in self.model.layers:
            restore = []
            for path, module in layer.named_modules():
                if isinstance(module, MultiLoRA):
                    module._slots.pop(adapter_id, None)
                    if not module._slots:
                        restore.append((path, module.linear))
            if restore:
                layer.update_modules(tree_unflatten(restore))
        del self.mounted[adapter_id]

    def check(self, ids: tuple[str, ...]) -> None:
        unknown = [i for i in ids if i not in self.mounted]
        if unknown:
            have = ", ".join(sorted(self.mounted)) or "none"
            raise KeyError(f"adapter {', '.join(map(repr, unknown))} is not mounted (mounted: {have})")

    def stats(self) -> dict:
        return {"mounted": [m.card() for m in self.mounted.values()], "root": str(self.root)}


def register(app, cfg, gateway) -> None:
    """The admin API: GET/POST /v1/adapters, DELETE /v1/adapters/{id}, GET /v1/adapters/available."""
    from mlxlab.serve.pipeline import ready_loaded
    from mlxlab.serve.protocol import APIError

    def registry(mutating: bool = False) -> Adapters:
        if mutating and not cfg.allow_adapter_mount:
            raise APIError(403, "runtime adapter mounting is switched off (serve.allow_adapter_mount=false)",
                           type="permission_error", code="mount_disabled")
        return ready_loaded(gateway).adapters

    @app.get("/v1/adapters")
    async def listing():
        return {"adapters": [m.card() for m in registry().mounted.values()]}

    @app.get("/v1/adapters/available")
    async def available():
        reg = registry()
        return {"root": str(reg.root), "adapters": reg.available()}

    @app.post("/v1/adapters")
    async def mount(body: MountRequest):
        reg = registry(mutating=True)
        try:
            path = reg.confine(body.path)
        except PermissionError as e:
            raise APIError(403, str(e), type="permission_error", param="path", code="outside_adapter_root") from None
        try:
            mounted = await gateway.call(lambda: reg.mount(body.id, path))
        except UserError as e:
            raise APIError(400, str(e), param="path", code="invalid_adapter") from None
        return mounted.card()

    @app.delete("/v1/adapters/{adapter_id}")
    async def unmount(adapter_id: str):
        reg = registry(mutating=True)
        try:
            await gateway.call(lambda: reg.unmount(adapter_id))
        except KeyError:
            raise APIError(404, f"no adapter {adapter_id!r} is mounted", type="not_found_error",
                           code="adapter_not_found") from None
        return {"id": adapter_id, "object": "adapter.deleted", "deleted": True}
