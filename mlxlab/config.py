"""Typed configs for every entry point: dataclasses and pure helpers (no Hydra, no OmegaConf).

Defaults live in these dataclasses (one place, a docstring per field, checks in `__post_init__`);
the YAML files in `configs/` compose them and hold experiment deltas. Library code takes the
dataclasses, so tests and notebooks call it directly. The Hydra glue that builds them from a
command line is `mlxlab/cli.py`.

Here: `generate`'s, `models`' and `lora`'s configs, and the parts of training's that other
commands and layers take too (LoraConfig, DataConfig, OptimConfig, BackwardConfig, DistConfig,
DPOConfig, ORPOConfig). `train`'s own (TrainConfig, with GRPO's settings) is
mlxlab/train/config.py; `diag`'s, `transcribe`'s and the server's are in their packages.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from mlxlab import registry
from mlxlab.errors import UserError  # also re-exported: `from mlxlab.config import UserError` works
from mlxlab.schema import check_choice, from_dict, to_dict  # noqa: F401  (re-exported)

DEFAULT_MODEL = "gemma3-270m"

DTYPES = ("auto", "float32", "bfloat16", "float16")
"""Compute dtypes (`auto`: float32 on a CPU, bfloat16 on an Apple GPU)."""
DECODE_HEADS = ("auto", "exact", "bfloat16")
"""What the LM head reads at decode on the CPU (models/fastdecode.py: use_head_dtype)."""
SAVE_DTYPES = ("float32", "bfloat16", "float16")
"""dtypes a converted model's weights are stored in."""


def config_dir() -> Path:
    """Absolute path of the Hydra configs (`configs/` in a checkout, `mlxlab/configs` installed)."""
    return Path(str(resources.files("mlxlab.configs"))).resolve()


def optimizer_names() -> list[str]:
    """Lower-case names of the optimizers in mlx.optimizers (imported on first use only)."""
    import mlx.optimizers as optim

    return sorted(
        name.lower()
        for name, cls in vars(optim).items()
        if isinstance(cls, type)
        and issubclass(cls, optim.Optimizer)
        and cls not in (optim.Optimizer, optim.MultiOptimizer)
    )


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
    adapter: str | None = None
    """LoRA adapter directory (mlxlab's or mlx-lm's layout) to apply."""
    decode_head: str = "auto"
    """What decode steps read on the CPU: auto (bf16 copies of the LM head and every other
    linear, read with float32 sums, where that is lossless, as for zoo models: half the bytes of
    a step, for half the weights' size in memory), exact (the float32 weights), or bfloat16 (the
    head's copy even where it rounds: opt-in, approximate; `diag decode decode_head=bfloat16`
    measures it)."""
    speculative: str = "off"
    """off | prompt_lookup | draft_model: draft tokens (copied from the prompt and the text so
    far, or from `draft_model`) and verify them k at a time in one forward pass; greedy text is
    the plain decode's, sampled text keeps its distribution."""
    draft_tokens: int = 8
    """Draft tokens verified in one forward pass at most (1..15)."""
    draft_model: str | None = None
    """speculative=draft_model's drafts: a model with the same tokenizer, or self:N (the
    model's own first N layers and its head)."""
    image: Any = None
    """Image file(s) for a vision-language model (JPEG, PNG, GIF, WebP): `image=photo.jpg` or
    `image=[a.png,b.png]`; the prompt becomes a user message with them (as `chat=true`)."""

    def __post_init__(self):
        check_choice("dtype", self.dtype, DTYPES)
        check_choice("decode_head", self.decode_head, DECODE_HEADS)
        from mlxlab.decode.speculative import check_mode

        check_mode(self.speculative, self.draft_model)
        if not 1 <= self.draft_tokens <= 15:
            raise UserError(f"draft_tokens must be in [1, 15], got {self.draft_tokens}")
        if self.image is not None:
            files = [self.image] if isinstance(self.image, str) else list(self.image)
            if not files or not all(isinstance(f, str) and f for f in files):
                raise UserError(f"image: give a file path or a list of them, got {self.image!r}")
            self.image = files
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
    """list | pull | convert | quantize | info (BLAS and device report)."""
    target: str | None = None
    """Zoo name for pull, .gguf path for convert, any model spec for quantize."""
    out: str | None = None
    """Output directory for convert and quantize (default: the cache)."""
    dtype: str = "bfloat16"
    """dtype of the converted safetensors."""
    force: bool = False
    """Reconvert even if the model is already in the cache."""
    bits: int = 4
    """quantize: bits per weight (2, 3, 4, 5, 6, 8; MLX's affine quantization, as mlx_lm.convert -q)."""
    group_size: int = 64
    """quantize: weights per scale and bias (32, 64, 128)."""

    def __post_init__(self):
        check_choice(
            "action", self.action, ("list", "pull", "convert", "quantize", "info"), "models action"
        )
        check_choice("dtype", self.dtype, SAVE_DTYPES)


@dataclass
class LoraToolConfig:
    """`python -m mlxlab lora check|fuse|export|import`: adapters outside training."""

    action: str = "check"
    """check (validate an adapter against a model) | fuse (merge it and save a model dir) |
    export (to another format) | import (a PEFT adapter into mlx-lm's layout)."""
    model: str = DEFAULT_MODEL
    """The base model the adapter was trained on."""
    adapter: str | None = None
    """Adapter directory (import: the PEFT adapter directory)."""
    out: str | None = None
    """fuse: the model directory; export: the PEFT directory or the .gguf file; import: the
    adapter directory."""
    dtype: str = "bfloat16"
    """dtype of the fused model's saved weights (auto: the compute dtype, float32 on a CPU)."""
    format: str = "peft"
    """export: peft (transformers + peft: adapter_config.json, adapter_model.safetensors) | gguf
    (a llama.cpp LoRA adapter, `--lora`)."""
    force: bool = False
    """Replace what is already at `out` (refused otherwise, before any work)."""

    def __post_init__(self):
        check_choice("action", self.action, ("check", "fuse", "export", "import"), "lora action")
        check_choice("dtype", self.dtype, DTYPES)
        check_choice("format", self.format, ("peft", "gguf"))


@dataclass
class LoraConfig:
    """Where and how LoRA adapters are attached."""

    type: str = "lora"
    """lora | dora (mlx-lm's DoRA: LoRA plus a trained magnitude per output row) | full (the
    targets' own weights trained, saved as mlx_lm.lora's `full` saves them; rank, scale and
    dropout unused)."""
    targets: list[str] = field(default_factory=lambda: ["q", "k", "v", "o"])
    """Projections by short name (q k v o gate up down) or module path (self_attn.q_proj);
    `all`: every linear of the chosen layers (full: every module with parameters, norms too)."""
    layers: Any = "all"
    """"all", an int N (the last N layers), or a list of layer indices."""
    rank: int = 8
    """LoRA rank r."""
    scale: float = 20.0
    """Multiplier of the low-rank update (mlx-lm's `scale`, not alpha)."""
    dropout: float = 0.0
    """Dropout on the LoRA input."""
    init: str | None = None
    """Start from this adapter's weights (an adapter directory, or a training run's final
    adapter) instead of a fresh init: e.g. preference training on top of an SFT adapter. Its
    rank, scale, targets and layers must be this config's. With objective=dpo it is also the
    reference policy (the model the run starts from)."""

    def __post_init__(self):
        check_choice("lora.type", self.type, ("lora", "dora", "full"))
        if self.rank < 1:
            raise UserError(f"lora.rank must be >= 1, got {self.rank}")
        if not 0.0 <= self.dropout < 1.0:
            raise UserError(f"lora.dropout must be in [0, 1), got {self.dropout}")
        if not self.targets:
            raise UserError("lora.targets is empty; name at least one projection")
        if isinstance(self.layers, str) and self.layers != "all":
            raise UserError(f"lora.layers must be 'all', an int or a list, got {self.layers!r}")


@dataclass
class DataConfig:
    """Training data: local JSONL in mlx-lm's formats (chat, completions, text)."""

    train: str | None = None
    """train.jsonl, or a directory holding train.jsonl (and valid.jsonl)."""
    valid: str | None = None
    """valid.jsonl; default: valid.jsonl beside the training file, if any."""
    max_seq_length: int = 2048
    """Longer examples are truncated (or rejected, see `on_too_long`)."""
    on_too_long: str = "truncate"
    """truncate (with a counted warning) | error."""
    mask_prompt: bool = True
    """Train on the response only (the prompt part gets no loss)."""
    pack: bool = False
    """Pack several training examples into each row of up to max_seq_length tokens, each
    attending only to itself (block-diagonal masks): less padding, and more examples per step
    (batch_size counts rows). Validation stays one example per row."""

    def __post_init__(self):
        check_choice("data.on_too_long", self.on_too_long, ("truncate", "error"))
        if self.max_seq_length < 2:
            raise UserError(f"data.max_seq_length must be >= 2, got {self.max_seq_length}")


@dataclass
class OptimConfig:
    """Optimizer and learning-rate schedule."""

    name: str = "adamw"
    """Any optimizer in mlx.optimizers by lower-case name: adamw, adam, sgd, adafactor, lion, ..."""
    lr: float = 1e-4
    """Peak learning rate."""
    weight_decay: float = 0.0
    """Decoupled weight decay (optimizers that take it)."""
    warmup: int = 0
    """Linear warm-up steps from 0 to lr."""
    schedule: str = "cosine"
    """cosine (decays to min_lr over the remaining steps) | constant."""
    min_lr: float = 0.0
    """Floor of the cosine schedule."""
    grad_clip: float | None = 1.0
    """Clip the global gradient norm to this; 0 or null turns it off."""

    def __post_init__(self):
        if self.lr <= 0:
            raise UserError(f"optim.lr must be > 0, got {self.lr}")
        if self.warmup < 0:
            raise UserError(f"optim.warmup must be >= 0 steps, got {self.warmup}")
        if self.schedule == "cosine" and not 0 <= self.min_lr <= self.lr:
            raise UserError(f"optim.min_lr must be in [0, lr={self.lr}], got {self.min_lr}")
        if self.weight_decay < 0:
            raise UserError(f"optim.weight_decay must be >= 0, got {self.weight_decay}")
        if self.grad_clip is not None and self.grad_clip < 0:
            raise UserError(
                f"optim.grad_clip must be >= 0 (0 or null turns clipping off), got {self.grad_clip}"
            )
        check_choice("optim.schedule", self.schedule, ("cosine", "constant"))
        names = optimizer_names()
        if str(self.name).lower() not in names:
            check_choice("optim.name", self.name, names, "optimizer")


BACKWARD_MODES = ("full", "checkpoint", "segmented")


@dataclass
class BackwardConfig:
    """How gradients are computed (all give the same gradients; they differ in memory and time)."""

    mode: str = "full"
    """full | checkpoint (per-layer recompute, like mlx_lm.lora --grad-checkpoint) | segmented."""
    segment_size: int = 4
    """Layers per segment (segmented, plan=size)."""
    plan: str = "size"
    """size (segments of segment_size) | auto (global layers alone, sized to memory_target_gb)."""
    memory_target_gb: float | None = None
    """Peak memory the auto plan aims for."""
    head_chunk: int = 0
    """Loss head over this many response positions at a time, each chunk's logits recomputed in
    the backward (0: all at once). Saves ~vocabulary x 4 bytes per position of peak memory (1 GB
    per 1024 positions on Gemma) for one more head matmul: for long responses."""
    pipeline: bool = False
    """Segment pipeline (mode=segmented, started with `mlx.launch -n K`): consecutive segments on
    K ranks, each holding only its layers' weights and LoRA arrays; the grad_accum micro-batches
    of a step flow through them (mlxlab/train/pipeline.py). A single process ignores it."""

    def __post_init__(self):
        check_choice("backward.mode", self.mode, BACKWARD_MODES)
        if self.pipeline and self.mode != "segmented":
            raise UserError(
                f"backward.pipeline=true needs backward.mode=segmented (got {self.mode}): the "
                "pipeline places the segmented backward's segments on the ranks"
            )
        if self.head_chunk < 0:
            raise UserError(f"backward.head_chunk must be >= 0, got {self.head_chunk}")
        check_choice("backward.plan", self.plan, ("size", "auto"))
        if self.segment_size < 1:
            raise UserError(f"backward.segment_size must be >= 1, got {self.segment_size}")
        if self.plan == "auto" and not self.memory_target_gb:
            raise UserError("backward.plan=auto needs backward.memory_target_gb")


MAX_LOSS_WEIGHT = 1e6  # a loss weight's bound (`loss_weights`): float32 sums of weighted losses
# stay finite


DIST_BACKENDS = ("any", "ring", "mpi", "jaccl", "nccl")


@dataclass
class DistConfig:
    """A run on several processes (mx.distributed, started by `mlx.launch`; mlxlab/train/world.py).
    A process started alone trains alone and ignores these."""

    backend: str = "any"
    """any (the backend the launcher set up: ring, mpi, jaccl or nccl) | ring | mpi | jaccl | nccl."""
    timeout_s: float = 300.0
    """Seconds a rank waits for the others in a collective, a pipeline transfer or the start-up
    before it stops with an error naming what it waited for: a rank that died or hangs. Must exceed
    the longest step of the slowest rank (and, at the start, the others' model loading)."""

    def __post_init__(self):
        check_choice("dist.backend", self.backend, DIST_BACKENDS)
        if not self.timeout_s > 0:
            raise UserError(f"dist.timeout_s must be > 0, got {self.timeout_s}")


@dataclass
class DPOConfig:
    """DPO (`objective=dpo`): the policy against a reference: the base model with the adapter
    switched off, or with `lora.init` the adapter the run started from."""

    beta: float = 0.1
    """Strength of the preference margin (the KL penalty's inverse temperature)."""
    loss: str = "sigmoid"
    """sigmoid (DPO) | ipo (IPO, on per-token mean log-probs)."""
    label_smoothing: float = 0.0
    """Assumed share of flipped preferences (conservative DPO); sigmoid only."""
    precompute_ref: bool = True
    """Compute the reference log-probs once per example before training (saved in the run
    directory, reused on resume); false recomputes them with each batch."""

    def __post_init__(self):
        check_choice("dpo.loss", self.loss, ("sigmoid", "ipo"))
        if self.beta <= 0:
            raise UserError(f"dpo.beta must be > 0, got {self.beta}")
        if not 0 <= self.label_smoothing < 0.5:
            raise UserError(f"dpo.label_smoothing must be in [0, 0.5), got {self.label_smoothing}")
        if self.label_smoothing and self.loss != "sigmoid":
            raise UserError("dpo.label_smoothing applies to dpo.loss=sigmoid only")


@dataclass
class ORPOConfig:
    """ORPO (`objective=orpo`): SFT on the chosen response plus the odds-ratio term."""

    lam: float = 0.1
    """Weight of the odds-ratio term (the paper's lambda; on the command line `orpo.lambda=`
    sets it too)."""

    def __post_init__(self):
        if self.lam < 0:
            raise UserError(f"orpo.lam must be >= 0, got {self.lam}")


SCHEMAS = {
    "generate": GenerateConfig,
    "models": ModelsConfig,
    "lora": LoraToolConfig,
}


for _name, _schema in SCHEMAS.items():
    registry.command(_name, _schema)
