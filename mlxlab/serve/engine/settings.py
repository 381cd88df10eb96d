"""What the engine needs to know to load and run a model: a small settings type of its own, so
that nothing under serve/engine reads the server's whole config (`serve.config.ServeConfig`
builds one: `ServeConfig.engine()`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from mlxlab.decode.settings import DecodeSettings


@dataclass
class EngineSettings:
    model: str
    """The default model: zoo name, mlx-lm model directory, .gguf file or repo id."""
    dtype: str = "auto"
    decode_head: str = "auto"
    memory_budget_gb: float | None = None
    """None: 75% of the machine's memory."""
    kv_quant: str = "off"
    prompt_cache_gb: float = 2.0
    adapters: dict[str, str] = field(default_factory=dict)
    """Adapters mounted at start, id -> directory."""
    adapter_root: str | None = None
    stt_model: str | None = None
    stt_language: str | None = None
    embeddings_model: str | None = None
    draft_model: str | None = None
    """The draft model of speculative=draft_model (a model spec, or self:N)."""
    max_queue: int = 16
    """Jobs waiting for the engine beyond which new ones are refused (QueueFull)."""
    models: dict[str, str] = field(default_factory=dict)
    """Further models requests may name, name -> spec (engine/entries.py)."""
    model_adapters: dict[str, dict[str, str]] = field(default_factory=dict)
    """Adapters mounted on each load of a model of `models`, name -> (id -> directory)."""
    models_from_cache: bool = False
    """Every model of the Hugging Face cache may be named by its repo id."""
    model_idle_s: float = 0.0
    """Unload a model other than the default after this long without a request; 0: never."""
    load_share: float = 1.0
    """The share of the time a load may take while other models generate (engine/pacer.py)."""
    decode: DecodeSettings = field(default_factory=DecodeSettings)
