"""Typed configs for every entry point, and the one place that touches Hydra/OmegaConf.

Defaults live in these dataclasses (one place); the YAML files in `configs/` compose them and hold
experiment deltas. Library code takes the dataclasses, so tests and notebooks call it directly.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

DEFAULT_MODEL = "gemma3-270m"


def config_dir() -> Path:
    """Absolute path of the Hydra configs (`configs/` in a checkout, `mlxlab/configs` installed)."""
    return Path(str(resources.files("mlxlab.configs"))).resolve()


class UserError(Exception):
    """A problem with what the user asked for: reported as one line, exit code 1."""


@dataclass
class GenerateConfig:
    """`python -m mlxlab generate`: stream a completion from a model."""

    model: str = DEFAULT_MODEL
    """Zoo name, mlx-lm model directory, or .gguf file."""
    dtype: str = "auto"
    """Compute dtype: auto (float32 on CPU, bfloat16 on GPU), float32, bfloat16, float16."""
    prompt: str = "def fibonacci(n):"
    """The prompt text (a user message when chat=true)."""
    chat: bool = False
    """Apply the model's chat template to the prompt (and `system`)."""
    system: str | None = None
    """Optional system message in chat mode."""
    max_tokens: int = 64
    """Most tokens to generate."""
    temperature: float = 0.0
    """0 means greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass; 1.0 turns it off."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 turns it off."""
    seed: int = 0
    """Seed for sampling."""

    def __post_init__(self):
        if self.max_tokens < 1:
            raise UserError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise UserError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise UserError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise UserError(f"top_k must be >= 0, got {self.top_k}")


@dataclass
class ModelsConfig:
    """`python -m mlxlab models list|pull|convert|info`: the model zoo."""

    action: str = "list"
    """list | pull | convert | info (BLAS and device report)."""
    target: str | None = None
    """Zoo name for pull, .gguf path for convert."""
    out: str | None = None
    """Output directory for convert (default: the cache)."""
    dtype: str = "bfloat16"
    """dtype of the converted safetensors."""
    force: bool = False
    """Reconvert even if the model is already in the cache."""


SCHEMAS = {"generate": GenerateConfig, "models": ModelsConfig}


def register_schemas() -> None:
    """Put the dataclasses in Hydra's ConfigStore, for `defaults: [<name>_schema, _self_]`."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    for name, cls in SCHEMAS.items():
        cs.store(name=f"{name}_schema", node=cls)


def to_dataclass(cfg, cls):
    """Resolved OmegaConf node -> the typed dataclass (runs its __post_init__ checks)."""
    from omegaconf import OmegaConf

    data = OmegaConf.to_container(cfg, resolve=True)
    data = {k: v for k, v in data.items() if k != "hydra"}
    return cls(**data)


def compose(name: str, overrides: list[str] | None = None):
    """Compose a config without the CLI (tests, notebooks) and return its dataclass."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    register_schemas()
    with initialize_config_dir(config_dir=str(config_dir()), version_base=None):
        cfg = hydra_compose(config_name=name, overrides=overrides or [])
    return to_dataclass(cfg, SCHEMAS[name])


def run_hydra(name: str, argv: list[str], task) -> None:
    """Run `task(dataclass)` under Hydra's CLI (overrides, --cfg job, --help, multirun)."""
    import hydra

    register_schemas()
    sys.argv = [f"mlxlab {name}", *argv]

    @hydra.main(config_path=str(config_dir()), config_name=name, version_base=None)
    def _main(cfg):
        try:
            return task(to_dataclass(cfg, SCHEMAS[name]))
        except UserError as e:
            print(f"mlxlab {name}: error: {e}", file=sys.stderr)
            sys.exit(1)

    _main()
