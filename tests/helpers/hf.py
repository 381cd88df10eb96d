"""transformers' view of a tiny model: the same directory with every setting mlx-lm read spelled
out in config.json (transformers' defaults differ for some, e.g. Gemma 4's double-wide MLP of its
KV-shared layers and its layer types), so both libraries build the same model from the same
weights."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path


def hf_model_dir(src: Path, out: Path) -> Path:
    from mlx_lm.utils import load

    model, _ = load(str(src))
    shutil.copytree(src, out)
    config = json.loads((out / "config.json").read_text())
    args = {k: v for k, v in dataclasses.asdict(model.args).items() if not k.startswith("_")}
    config = {**args, **config}
    if all(hasattr(layer, "layer_type") for layer in model.layers):
        config["layer_types"] = [layer.layer_type for layer in model.layers]
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out
