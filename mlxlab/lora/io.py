"""Adapters on disk in mlx-lm's layout, read and written both ways.

    <dir>/adapters.safetensors   tensors by full parameter name (`...q_proj.lora_a`, DoRA's
                                 `...q_proj.m`; a full fine-tune's `...q_proj.weight`)
    <dir>/adapter_config.json    mlx-lm's fields: fine_tune_type (lora | dora | full),
                                 num_layers, lora_parameters (null for full, as mlx_lm.lora)
    <dir>/mlxlab_adapter.json    ours, optional: the exact layer list and the base model

mlx-lm adapts the last `num_layers` layers. An mlxlab adapter on a layer list writes
`num_layers` down to its first layer and stores tensors for the listed layers only; mlx-lm then
gives the unlisted layers a zero update (its B starts at zero; a DoRA magnitude starts at the
weight's norm), so its logits match ours. A full fine-tune's layers and modules are read from
its tensor names.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from mlxlab.errors import UserError
from mlxlab.fsutil import atomic_dir, atomic_write, atomic_write_text
from mlxlab.lora import apply as lora_apply

WEIGHTS = "adapters.safetensors"
CONFIG = "adapter_config.json"
META = "mlxlab_adapter.json"


def adapter_config(plan: lora_apply.LoraPlan, num_model_layers: int) -> dict:
    if plan.kind == "full":  # as mlx_lm.lora writes it: the weights say what was trained
        return {
            "fine_tune_type": "full",
            "num_layers": num_model_layers - min(plan.layers),
            "lora_parameters": None,
        }
    return {
        "fine_tune_type": plan.kind,
        "num_layers": num_model_layers - min(plan.layers),
        "lora_parameters": {
            "rank": plan.rank,
            "scale": plan.scale,
            "dropout": plan.dropout,
            "keys": list(plan.keys),
        },
    }


def base_fingerprint(model) -> dict:
    """What identifies the base architecture an adapter belongs to (not its weights)."""
    args = getattr(model, "args", None)
    keys = ("model_type", "num_hidden_layers", "hidden_size", "vocab_size")
    return {k: getattr(args, k) for k in keys if getattr(args, k, None) is not None}


def save(model, plan: lora_apply.LoraPlan, out_dir: str | Path, meta: dict | None = None) -> Path:
    """Write the adapter so that a crash never leaves a truncated one where a good one was.

    A new directory appears whole (temp sibling + rename); in an existing one each file is
    replaced atomically, weights first (the config of one run does not change between saves).
    """
    out_dir = Path(out_dir)
    weights = lora_apply.adapter_parameters(model)
    config = json.dumps(adapter_config(plan, len(model.layers)), indent=2) + "\n"
    meta_text = (
        json.dumps(
            {"layers": list(plan.layers), "base": base_fingerprint(model), **(meta or {})}, indent=2
        )
        + "\n"
    )

    def write_weights(path: Path) -> None:
        mx.save_safetensors(str(path), weights, metadata={"format": "mlx"})

    if not out_dir.exists():

        def write_all(tmp: Path) -> None:
            write_weights(tmp / WEIGHTS)
            (tmp / CONFIG).write_text(config)
            (tmp / META).write_text(meta_text)

        return atomic_dir(out_dir, write_all)
    atomic_write(out_dir / WEIGHTS, write_weights)
    atomic_write_text(out_dir / CONFIG, config)
    atomic_write_text(out_dir / META, meta_text)
    return out_dir


def _read_json(path: Path, problems: list[str]) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        problems.append(f"missing {path.name}")
        return None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        problems.append(f"{path.name} is not readable JSON ({e})")
        return None
    if not isinstance(data, dict):
        problems.append(f"{path.name} must hold a JSON object")
        return None
    return data


def resolve_dir(path: str | Path) -> Path:
    """An adapter directory, or a training run directory -> its final adapter (`<run>/adapter`).

    A run directory resolves only to the adapter written at the end of training, never to an
    intermediate checkpoint; a run that has not finished has none and is refused.
    """
    path = Path(path).expanduser()
    if (path / CONFIG).is_file() or not path.is_dir():
        return path
    if (path / "adapter" / CONFIG).is_file():
        return path / "adapter"
    if (path / "checkpoints").is_dir():
        raise UserError(
            f"{path} is a training run without a final adapter (still running or "
            "killed?); pass one of its checkpoints/ explicitly or resume the run"
        )
    return path


def kind_of(path: str | Path) -> str:
    """An adapter's fine_tune_type (lora | dora | full; lora when unreadable: `read_plan` then
    names the problem)."""
    try:
        config = json.loads((resolve_dir(path) / CONFIG).read_text())
        return str(config.get("fine_tune_type", "lora"))
    except (OSError, ValueError, AttributeError):
        return "lora"


class BaseMismatch(UserError):
    """`read_plan`: the adapter was trained on another base model (its recorded base
    fingerprint differs from the model's, or its num_layers exceeds the model's layers); the
    message lists every problem found."""


def read_plan(path: str | Path, model) -> tuple[lora_apply.LoraPlan, dict[str, mx.array]]:
    """Read and check an adapter against `model` without touching the model.

    Every problem (missing files, bad JSON, unknown or missing tensors, wrong shapes) is
    collected and raised as one UserError: a `BaseMismatch` when one of them says the adapter
    was trained on another base model.
    """
    path = resolve_dir(path)
    if not path.is_dir():
        raise UserError(f"adapter path {path} is not a directory")
    problems: list[str] = []
    other_base = False  # a problem that says another base model: BaseMismatch
    config = _read_json(path / CONFIG, problems)
    meta = _read_json(path / META, problems) if (path / META).exists() else {}
    if meta is None:  # not JSON, or not an object: said in `problems`
        meta = {}
    weights: dict[str, mx.array] = {}
    if not (path / WEIGHTS).is_file():
        problems.append(f"missing {WEIGHTS}")
    else:
        try:
            weights = mx.load(str(path / WEIGHTS))
        except Exception as e:  # mlx raises RuntimeError/ValueError on bad files
            problems.append(f"{WEIGHTS} is not a readable safetensors file ({e})")
    if config is None:
        raise UserError(f"adapter {path}: " + "; ".join(problems))
    kind = config.get("fine_tune_type", "lora")
    params = config.get("lora_parameters") or {}
    if kind not in lora_apply.KINDS:
        problems.append(f"fine_tune_type {kind!r} is not supported ({', '.join(lora_apply.KINDS)})")
    for key in ("rank", "scale") if kind != "full" else ():
        if key not in params:
            problems.append(f"lora_parameters.{key} missing from {CONFIG}")
    n = len(model.layers)
    num_layers = config.get("num_layers", n)
    if not isinstance(num_layers, int) or num_layers < 0:
        problems.append(f"num_layers must be a non-negative int, got {num_layers!r}")
        num_layers = 0
    elif num_layers > n:
        problems.append(f"num_layers={num_layers} but the model has {n} layers (wrong base model?)")
        other_base = True
    if problems:
        raise (BaseMismatch if other_base else UserError)(f"adapter {path}: " + "; ".join(problems))

    trained_on, this = meta.get("base") or {}, base_fingerprint(model)
    mismatch = [
        f"{k} {trained_on[k]!r} vs {this[k]!r}"
        for k in trained_on
        if k in this and trained_on[k] != this[k]
    ]
    if mismatch:
        problems.append("trained on another base model (" + ", ".join(mismatch) + ")")
        other_base = True
    layers = tuple(meta.get("layers") or range(n - min(num_layers, n), n))
    keys = params.get("keys")
    if kind == "full":  # the tensors name the layers and modules trained
        prefix = lora_apply.layers_prefix(model)
        found = [_full_name(name, prefix) for name in weights]
        bad = [name for name, f in zip(weights, found, strict=True) if f is None]
        problems += [f"{name}: not a parameter of a layer's module" for name in bad]
        layers = tuple(sorted({f[0] for f in found if f is not None}))
        keys = sorted({f[1] for f in found if f is not None})
        if not weights:
            problems.append(f"{WEIGHTS} holds no tensors")
        if problems:
            raise (BaseMismatch if other_base else UserError)(
                f"adapter {path}: " + "; ".join(problems)
            )
    elif keys is None:  # mlx-lm's default: every linear in the adapted layers
        keys = sorted({k for i in layers for k in lora_apply.layer_keys(model.layers[i])})
    plan = lora_apply.LoraPlan(
        layers=tuple(layers),
        keys=tuple(keys),
        rank=int(params.get("rank", 0)),
        scale=float(params.get("scale", 0.0)),
        dropout=float(params.get("dropout", 0.0)),
        kind=kind,
    )
    expected = _expected_shapes(model, plan, problems)
    for name, w in weights.items():
        if name not in expected:
            problems.append(f"{name}: not an adapter parameter of this model")
        elif tuple(w.shape) != expected[name]:
            problems.append(f"{name}: shape {tuple(w.shape)}, model expects {expected[name]}")
    if problems:
        raise (BaseMismatch if other_base else UserError)(
            f"adapter {path} does not fit the model:\n  " + "\n  ".join(problems)
        )
    return plan, weights


def _full_name(name: str, prefix: str) -> tuple[int, str] | None:
    """(layer, module path) of a full fine-tune's tensor `<prefix>.<i>.<module>.<leaf>`."""
    head = prefix + "."
    if not name.startswith(head):
        return None
    i, _, rest = name[len(head) :].partition(".")
    module = rest.rpartition(".")[0]  # "": an array of the layer itself
    return (int(i), module) if i.isdigit() and rest else None


def _expected_shapes(model, plan: lora_apply.LoraPlan, problems: list[str]) -> dict[str, tuple]:
    prefix = lora_apply.layers_prefix(model)
    shapes = {}
    for i in plan.layers:
        if not 0 <= i < len(model.layers):
            problems.append(f"layer {i} does not exist (the model has {len(model.layers)})")
            continue
        present = dict(model.layers[i].named_modules())
        for key in plan.keys:
            module = present.get(key)
            if module is None:
                continue
            if plan.kind == "full":
                if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
                    problems.append(
                        f"{prefix}.{i}.{key}: a full fine-tune's weights on a quantized module "
                        "(load it on the float model it was trained on)"
                    )
                    continue
                for leaf, v in module.items():
                    if isinstance(v, mx.array) and not leaf.startswith("_"):
                        name = f"{prefix}.{i}.{key}.{leaf}" if key else f"{prefix}.{i}.{leaf}"
                        shapes[name] = tuple(v.shape)
                continue
            base = getattr(module, "linear", module)
            out_dims, in_dims = base.weight.shape
            if isinstance(base, nn.QuantizedLinear):
                in_dims = in_dims * 32 // base.bits
            shapes[f"{prefix}.{i}.{key}.lora_a"] = (in_dims, plan.rank)
            shapes[f"{prefix}.{i}.{key}.lora_b"] = (plan.rank, out_dims)
            if plan.kind == "dora":
                shapes[f"{prefix}.{i}.{key}.m"] = (out_dims,)
    return shapes


def read_init(path: str | Path, model, plan: lora_apply.LoraPlan) -> dict[str, mx.array]:
    """The weights of the adapter at `path` to start training from: checked against `model` as
    `read_plan` does, and its layers, projections, rank and scale must be `plan`'s (every
    difference named)."""
    kind = kind_of(path)
    if kind != plan.kind:  # before reading: its tensors name another kind's modules
        raise UserError(
            f"lora.init={path}: the adapter does not match lora.* (kind {kind!r} here "
            f"{plan.kind!r}); set lora.type={kind} as it was trained"
        )
    saved, weights = read_plan(path, model)
    differ = [
        f"{key} {getattr(saved, key)!r} here {getattr(plan, key)!r}"
        for key in ("kind", "layers", "keys", "rank", "scale")
        if getattr(saved, key) != getattr(plan, key)
        and not (plan.kind == "full" and key in ("rank", "scale"))
    ]
    if differ:
        raise UserError(
            f"lora.init={path}: the adapter does not match lora.* ({'; '.join(differ)}); "
            "set lora.type / rank / scale / targets / layers as it was trained"
        )
    missing = sorted(set(lora_apply.adapter_parameters(model)) - set(weights))
    if missing:
        raise UserError(f"lora.init={path}: the adapter lacks {', '.join(missing[:4])} ...")
    return weights


def load(model, path: str | Path) -> lora_apply.LoraPlan:
    """Check, then attach the adapter at `path` to `model` (mlxlab's or mlx-lm's)."""
    plan, weights = read_plan(path, model)
    lora_apply.apply(model, plan)
    model.load_weights(list(weights.items()), strict=False)
    mx.eval(model.parameters())
    return plan
