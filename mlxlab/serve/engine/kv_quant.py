"""KV-cache quantization for serving: `serve.kv_quant=off|4|8|config|PATH.json`.

- `off`: the model's own caches (float).
- `4` / `8`: every layer whose cache can be quantized, at that many bits, group size 64, from the
  first token on.
- `config`: the per-layer plan in the model directory's `kv_config.json`; `PATH.json`: the same
  from a file. A plan is a JSON list of `{"layer_idx": i, "bits": 2|3|4|5|6|8, "group_size":
  32|64|128}`; layers not listed stay in float.

A quantized layer gets mlx-lm's `QuantizedKVCache`, and attention runs through mlx-lm's quantized
SDPA. mlx-lm has no quantized form of the sliding-window `RotatingKVCache`, so those layers
(Gemma 3: five of every six) stay in float under a uniform setting, and a plan that names one
is refused at start; `/stats.kv_quant` says which layers are quantized. Quantized caches cannot
be merged into a batch, so with kv_quant on every request runs on the serial lane.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from mlxlab.errors import UserError

BITS = (2, 3, 4, 5, 6, 8)
GROUP_SIZES = (32, 64, 128)


@dataclass
class KVQuant:
    mode: str = "off"  # off | uniform-kv4 | uniform-kv8 | config
    plan: dict[int, tuple[int, int]] = field(default_factory=dict)  # layer -> (bits, group_size)
    source: str | None = None
    float_layers: list[int] = field(default_factory=list)  # layers that could not be quantized

    @property
    def enabled(self) -> bool:
        return bool(self.plan)

    def make_cache(self, model) -> list:
        """mlx-lm's cache for `model` with the planned layers quantized (empty, so from token 0)."""
        from mlx_lm.models.cache import make_prompt_cache

        cache = make_prompt_cache(model)
        for i, (bits, group) in self.plan.items():
            cache[i] = cache[i].to_quantized(group_size=group, bits=bits)
        return cache

    def stats(self) -> dict:
        by_bits: dict[str, int] = {}
        for bits, _ in self.plan.values():
            by_bits[str(bits)] = by_bits.get(str(bits), 0) + 1
        return {
            "mode": self.mode,
            "source": self.source,
            "quantized_layers": sorted(self.plan),
            "bits_histogram": by_bits,
            "float_layers": self.float_layers,
            "note": (
                "layers whose cache mlx-lm cannot quantize (sliding windows) stay in float"
                if self.float_layers and self.mode.startswith("uniform")
                else None
            ),
        }


def _layers(model) -> tuple[list[str | None], list[tuple[int, ...]]]:
    """Per cache layer: why it cannot be quantized (None when it can), and its key and value head
    dims."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

    cache = make_prompt_cache(model)
    model(mx.array([[0]]), cache=cache)
    dims = [
        (c.keys.shape[-1], c.values.shape[-1]) if getattr(c, "keys", None) is not None else ()
        for c in cache
    ]
    why = [
        None
        if type(c) is KVCache
        else "a sliding-window cache, which mlx-lm cannot quantize"
        if isinstance(c, RotatingKVCache)
        else f"a {type(c).__name__}, which mlx-lm cannot quantize"
        for c in cache
    ]
    return why, dims


def _check_groups(plan: dict[int, tuple[int, int]], dims: list[tuple[int, ...]], what: str) -> None:
    bad = sorted({(d, g) for i, (_, g) in plan.items() for d in dims[i] if d % g})
    if bad:
        raise UserError(
            f"{what}: head dim {bad[0][0]} is not divisible by the group size {bad[0][1]}; "
            "this model's KV cache cannot be quantized with it"
        )


def parse(setting: str | int, model, model_dir: Path) -> KVQuant:
    """The plan for `setting`; UserError (one line) when it cannot apply to this model."""
    setting = str(setting).strip().lower() if not str(setting).endswith(".json") else str(setting)
    if setting in ("off", "none", "0", "false"):
        return KVQuant()
    why, dims = _layers(model)
    ok = [w is None for w in why]
    if setting in ("4", "8"):
        bits = int(setting)
        plan = {i: (bits, 64) for i, q in enumerate(ok) if q}
        if not plan:
            raise UserError(
                f"serve.kv_quant={setting}: no layer of this model has a quantizable KV cache"
            )
        _check_groups(plan, dims, f"serve.kv_quant={setting}")
        return KVQuant(f"uniform-kv{bits}", plan, None, [i for i, q in enumerate(ok) if not q])
    if setting == "config" or setting.endswith(".json"):
        path = (
            Path(model_dir) / "kv_config.json"
            if setting == "config"
            else Path(setting).expanduser()
        )
        try:
            entries = json.loads(path.read_text())
        except OSError:
            raise UserError(f"serve.kv_quant={setting}: cannot read {path}") from None
        except ValueError as e:
            raise UserError(f"serve.kv_quant={setting}: {path} is not JSON ({e})") from None
        plan = _plan(entries, why, path)
        _check_groups(plan, dims, str(path))
        return KVQuant("config", plan, str(path), [i for i, q in enumerate(ok) if i not in plan])
    raise UserError(f"serve.kv_quant={setting!r}: use off, 4, 8, config, or a kv_config.json path")


def _plan(entries, why: list[str | None], path: Path) -> dict[int, tuple[int, int]]:
    if isinstance(entries, dict) and isinstance(entries.get("layers"), list):
        entries = entries["layers"]
    if not isinstance(entries, list):
        raise UserError(f"{path}: expected a list of {{layer_idx, bits, group_size}}")
    plan, seen, problems = {}, set(), []
    for n, e in enumerate(entries):
        if not isinstance(e, dict):
            problems.append(f"entry {n} is not an object")
            continue
        i, bits, group = e.get("layer_idx"), e.get("bits"), e.get("group_size", 64)
        if type(i) is not int or not 0 <= i < len(why):
            problems.append(f"entry {n}: layer_idx {i!r} is not a layer (0..{len(why) - 1})")
        elif i in seen:
            problems.append(f"entry {n}: layer {i} is listed twice")
        elif bits is None:
            seen.add(i)  # an explicit float layer
        elif type(bits) is not int or bits not in BITS:
            problems.append(f"entry {n}: bits {bits!r} not one of {BITS}")
        elif type(group) is not int or group not in GROUP_SIZES:
            problems.append(f"entry {n}: group_size {group!r} not one of {GROUP_SIZES}")
        elif why[i] is not None:
            problems.append(f"entry {n}: layer {i} has {why[i]}")
        else:
            seen.add(i)
            plan[i] = (bits, group)
    if problems:
        raise UserError(f"{path}: " + "; ".join(problems))
    return plan
