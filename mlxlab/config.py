"""Typed configs for every entry point: dataclasses and pure helpers (no Hydra, no OmegaConf).

Defaults live in these dataclasses (one place, a docstring per field, checks in `__post_init__`);
the YAML files in `configs/` compose them and hold experiment deltas. Library code takes the
dataclasses, so tests and notebooks call it directly. The Hydra glue that builds them from a
command line is `mlxlab/cli.py`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, ClassVar

from mlxlab.errors import UserError  # also re-exported: `from mlxlab.config import UserError` works

DEFAULT_MODEL = "gemma3-270m"

DTYPES = ("auto", "float32", "bfloat16", "float16")
"""Compute dtypes (`auto`: float32 on a CPU, bfloat16 on an Apple GPU)."""
DECODE_HEADS = ("auto", "exact", "bfloat16")
"""What the LM head reads at decode on the CPU (models/fastdecode.py: use_head_dtype)."""
SAVE_DTYPES = ("float32", "bfloat16", "float16")
"""dtypes a converted model's weights are stored in."""
MEMORY_MODES = (
    "full",
    "checkpoint",
    "segN",
    "segNhC",
    "auto",
    "mlx_lm",
    "mlx_lm_gc",
    "dpo-MODE",
    "orpo-MODE",
)
"""`diag memory` modes; segN is seg1, seg2, ... (segments of N layers); dpo-MODE / orpo-MODE:
a preference step (one pair, each side as long as the length) in mlxlab's MODE."""


def config_dir() -> Path:
    """Absolute path of the Hydra configs (`configs/` in a checkout, `mlxlab/configs` installed)."""
    return Path(str(resources.files("mlxlab.configs"))).resolve()


def check_window_messages(value: int, overlap: int, zero: str, source: str = "") -> None:
    """UserError unless `value` is 0 (meaning `zero`) or more messages than `overlap` (and 1):
    a window that holds no more than it shares with the one before cannot move on. `source`:
    where an inherited value came from and what to set instead, added to the message."""
    if value and value <= max(overlap, 1):
        raise UserError(
            f"window_messages must be 0 ({zero}) or more than window_overlap (and 1), "
            f"got {value} with window_overlap {overlap}" + (f" ({source})" if source else "")
        )


def check_choice(name: str, value, choices: Iterable[str], what: str | None = None) -> None:
    """UserError naming the field and the allowed values unless `value` is one of `choices`.

    `what` words the message as "unknown <what> 'x': <name> must be one of ...".
    """
    choices = tuple(choices)
    if value in choices:
        return
    allowed = f"{name} must be one of {', '.join(map(str, choices))}"
    raise UserError(f"unknown {what} {value!r}: {allowed}" if what else f"{allowed}, got {value!r}")


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


def is_memory_mode(mode) -> bool:
    """Whether `mode` is one of MEMORY_MODES (segN: seg1, seg2, ...; segNhC: the loss head in
    chunks of C positions, e.g. seg2h256; dpo-seg4, orpo-full: a preference step)."""
    if isinstance(mode, str) and mode.startswith(("dpo-", "orpo-")):
        mode = mode.split("-", 1)[1]
        if mode.startswith("mlx_lm"):
            return False
    return isinstance(mode, str) and (
        mode in ("full", "checkpoint", "auto", "mlx_lm", "mlx_lm_gc")
        or re.fullmatch(r"seg[1-9]\d*(h[1-9]\d*)?", mode) is not None
    )


def is_kv_quant(setting) -> bool:
    """The format of `serve.kv_quant` (whether it fits the model is checked when it loads)."""
    text = str(setting).strip()
    return text.lower() in ("off", "none", "0", "false", "4", "8", "config") or text.endswith(
        ".json"
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
    """What the LM head reads at decode on the CPU: auto (a bf16 copy, read with float32 sums,
    when that is lossless, as for zoo models: half the bytes of the step's largest read, for
    half the head's size in memory), exact (the weight), or bfloat16 (the copy even where it
    rounds: opt-in, approximate; `diag decode decode_head=bfloat16` measures it)."""
    image: Any = None
    """Image file(s) for a vision-language model (JPEG, PNG, GIF, WebP): `image=photo.jpg` or
    `image=[a.png,b.png]`; the prompt becomes a user message with them (as `chat=true`)."""

    def __post_init__(self):
        check_choice("dtype", self.dtype, DTYPES)
        check_choice("decode_head", self.decode_head, DECODE_HEADS)
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
    """list | pull | convert | info (BLAS and device report)."""
    target: str | None = None
    """Zoo name for pull, .gguf path for convert."""
    out: str | None = None
    """Output directory for convert (default: the cache)."""
    dtype: str = "bfloat16"
    """dtype of the converted safetensors."""
    force: bool = False
    """Reconvert even if the model is already in the cache."""

    def __post_init__(self):
        check_choice("action", self.action, ("list", "pull", "convert", "info"), "models action")
        check_choice("dtype", self.dtype, SAVE_DTYPES)


@dataclass
class LoraToolConfig:
    """`python -m mlxlab lora fuse|check`: adapters outside training."""

    action: str = "check"
    """check (validate an adapter against a model) | fuse (merge it and save a model dir)."""
    model: str = DEFAULT_MODEL
    """The base model the adapter was trained on."""
    adapter: str | None = None
    """Adapter directory."""
    out: str | None = None
    """Output model directory for fuse."""
    dtype: str = "bfloat16"
    """dtype of the fused model's saved weights (auto: the compute dtype, float32 on a CPU)."""

    def __post_init__(self):
        check_choice("action", self.action, ("check", "fuse"), "lora action")
        check_choice("dtype", self.dtype, DTYPES)


@dataclass
class LoraConfig:
    """Where and how LoRA adapters are attached."""

    targets: list[str] = field(default_factory=lambda: ["q", "k", "v", "o"])
    """Projections by short name (q k v o gate up down) or module path (self_attn.q_proj)."""
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
    """Clip the global gradient norm to this; null turns it off."""

    def __post_init__(self):
        if self.lr <= 0:
            raise UserError(f"optim.lr must be > 0, got {self.lr}")
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


MAX_LOSS_WEIGHT = 1e6  # a loss weight's bound (`loss_weights`, boundary_weight): float32
# sums of weighted losses stay finite


@dataclass
class ChunkDataConfig:
    """How the chunk-task dataset is built: user/assistant conversations over documentation topics
    (mlxlab/data/chunk.py)."""

    seed: int = 0
    """Seeds the topic split and every conversation."""
    train: int = 300
    """Training conversations (a long one becomes several windowed examples)."""
    valid: int = 8
    """Validation conversations."""
    test: int = 24
    """Test conversations (topics disjoint from train and valid)."""
    topic_weights: list[float] = field(default_factory=lambda: [0.55, 0.25, 0.1, 0.06, 0.04])
    """Relative odds of 1, 2, 3, ... topics in a conversation (the skew toward one or two)."""
    train_topic_weights: list[float] | None = None
    """The training split's own odds (None: topic_weights). Valid and test keep topic_weights, the
    realistic skew; training can see more topic shifts, the one thing a one-topic example does not
    teach."""
    median_pairs: float = 7.0
    """Median user/assistant pairs per conversation (log-normal spread)."""
    max_messages: int = 75
    """Most messages in a conversation."""
    return_rate: float = 0.15
    """Chance that a later topic is interrupted by a return to an earlier one (a new chunk)."""
    subtle_rate: float = 0.5
    """Chance that a change of topic comes without a marker ("Different question: ...")."""
    thanks_rate: float = 0.2
    """Chance that a conversation ends with a thank-you exchange (part of the last chunk)."""
    train_brief_rate: float = 0.0
    """Share of the training split's conversations whose assistant answers are brief: each section
    cut to its opening sentences (at most `brief_chars`). Such a conversation has many more
    messages, and so more topic shifts, per window: more boundary decisions per training token.
    Valid and test are built as without it. chunk_seg4 at 0.5 closed its chunk list on 3 of 24
    test answers and its boundaries under the grammar fell to F1 0.042 from 0.333
    (experiments/chunk_seg4/brief-answers.md), so it keeps 0."""
    brief_chars: int = 320
    """A brief answer's most characters per section (cut at a line or sentence end where one
    fits; a cut code block gets its closing fence on top)."""
    max_message_chars: int = 12000
    """A message's text is cut to this many characters."""
    window_chars: int = 4000
    """A training example's messages take at most this many characters; a longer conversation
    becomes overlapping windows (mlxlab/data/chunk.py `windows`). Evaluation reads a long
    conversation in windows too, in tokens (EvalSettings.max_prompt_tokens: by default the
    longest training prompt). Characters per token vary with the text (code and uuids take more
    tokens), so check a setting against data.max_seq_length: chunk_seg4's 3600 gives at most
    2,000 Gemma 3 tokens with the answer (2,117 with `turn_topics`, which then needs
    max_seq_length 2176; 2,235 with `turn_quotes`, which needs 2304; 2,280 with train_brief_rate 0.5, which needs 2304; 2,035 with
    `starts`), and it sets on_too_long=error, so a setting that overflows stops at load time
    instead of cutting an answer."""
    window_overlap: int = 2
    """Messages each window shares with the one before."""
    window_messages: int = 0
    """> 0: a training example also holds at most this many messages; a conversation with more
    becomes overlapping windows of at most that many (`window_overlap` shared), so each example
    asks a local question: at 4 with overlap 2, whether the second exchange goes on with the
    first's topic. Evaluation then reads every conversation with more in windows of at most as
    many messages (EvalSettings.window_messages, by default the adapter's training dataset's),
    each boundary one window's own decision (mlxlab/eval/chunk.py `merge_local`). 0: only
    `window_chars` bounds a window. chunk_seg4 uses 4 (experiments/chunk_seg4/local-windows.md)."""
    boundary_weight: float = 1.0
    """Loss weight, in the training split's answers, of the tokens that place each chunk: the
    first characters of every uuid the answer writes (which message) and the character after each
    chunk (another chunk, or the end). Most answer tokens are a label or the rest of a copied
    uuid; these few decide where a topic ends. 1: unweighted (the records carry no
    `loss_weights`; validation and test records never do)."""
    turn_topics: bool = False
    """Answers (all splits' records) open with `"turns": [[uuid prefix, topic], ...]`, each user
    message's first 8 uuid characters and the topic it asks about, before `"chunks"`: the model
    names each question's topic where it reads it, and a chunk starts where the name changes
    (mlxlab/data/chunk.py `turns`). Both scorers read only "chunks"; the prompt is unchanged."""
    turn_quotes: bool = False
    """Answers (all splits' records) open with `"turns"` as one entry per shown message, in
    order: a user message's `[uuid prefix, quote, k]` (its first words, at most 80 characters
    as JSON counts them),
    any other's `[uuid prefix, k]`, k the number of the chunk that holds it (from 1), before
    `"chunks"`. Each decision is then local: the model copies a question's opening words into its
    answer and says at once whether it starts chunk k + 1, and a chunk's first and last message
    are the first and last entries with its number, a few lines up in the answer, not a message
    to find in the prompt (mlxlab/data/chunk.py `turns`). Both scorers read only "chunks"; the
    prompt is unchanged. The answers are longer (chunk_seg4's windows: median 271 tokens against
    188, the longest 789; the test split's longest 494), so it needs data.max_seq_length 2304 and
    room in eval.max_tokens; `boundary_weight` does not weight its chunk numbers and is refused
    beside it. chunk_seg4 with it could not walk the message list unconstrained (14 of 24 test
    answers never reached their chunks, ref 38.1); under the grammar its numbers moved on at 4 of
    8 true shifts and 1 of 34 follow-ups, but its chunks did not follow them (boundary F1 0.288;
    experiments/chunk_seg4/turn-quotes.md), so it stays off."""
    starts: bool = False
    """Answers (all splits' records) open with `"starts": [uuid prefix, ...]`, the first 8 uuid
    characters of each chunk's first message, before `"chunks"`: the model says where each topic
    starts (a user message it can point at where it reads the change) before it writes any chunk,
    so a chunk's end is the message before the next start it has already written, not a message
    it must pick before reading on (mlxlab/data/chunk.py `answer`). Both scorers read only
    "chunks"; the answer grammar allows this opening with eval.starts; not with `turn_topics` or
    `turn_quotes`.
    chunk_seg4 with it wrote one chunk on every test conversation (boundary F1 0.5, what always
    one chunk scores there; 0.333 without it): teacher-forced, the model picks the shifting
    message more often (0.48 against 0.23 for the end before it, in a pair of short runs) but
    never says that another topic starts (experiments/chunk_seg4/starts.md), so it stays off."""

    def __post_init__(self):
        if self.starts + self.turn_topics + self.turn_quotes > 1:
            raise UserError(
                "starts, turn_topics and turn_quotes are openings of the answer: pick one"
            )
        if self.turn_quotes and self.boundary_weight != 1:
            raise UserError(
                "boundary_weight weights the chunks' uuids, not turn_quotes' chunk numbers: "
                "leave it at 1 with turn_quotes"
            )
        if not 0 < self.boundary_weight <= MAX_LOSS_WEIGHT:
            raise UserError(
                f"boundary_weight must be in (0, {MAX_LOSS_WEIGHT:g}], got {self.boundary_weight}"
            )
        for key in ("train", "valid", "test"):
            if getattr(self, key) < 1:
                raise UserError(f"{key} must be >= 1, got {getattr(self, key)}")
        for key in ("topic_weights", "train_topic_weights"):
            weights = getattr(self, key)
            if key == "train_topic_weights" and weights is None:
                continue
            weights = list(weights)
            if not weights or any(w < 0 for w in weights) or sum(weights) <= 0:
                raise UserError(f"{key} must be non-negative with a positive sum, got {weights}")
        if not 4 <= self.max_messages <= 1000 or self.median_pairs < 1:
            raise UserError("need 4 <= max_messages <= 1000 and median_pairs >= 1")
        for key in ("return_rate", "subtle_rate", "thanks_rate", "train_brief_rate"):
            if not 0 <= getattr(self, key) <= 1:
                raise UserError(f"{key} must be in [0, 1], got {getattr(self, key)}")
        if self.max_message_chars < 40 or self.window_chars < 400 or self.window_overlap < 0:
            raise UserError(
                "need max_message_chars >= 40, window_chars >= 400 and window_overlap >= 0"
            )
        if self.brief_chars < 40:
            raise UserError(f"brief_chars must be >= 40, got {self.brief_chars}")
        check_window_messages(self.window_messages, self.window_overlap, "no cap")


@dataclass
class DataBuildConfig:
    """`python -m mlxlab data chunk`: build a task dataset as chat JSONL (train/valid/test)."""

    task: str = "chunk"
    """The dataset to build (chunk: topical segmentation of conversations)."""
    out: str = "data/chunk"
    """Output directory (written atomically); refuses a non-empty one unless force=true."""
    force: bool = False
    """Replace an existing output directory."""
    chunk: ChunkDataConfig = field(default_factory=ChunkDataConfig)

    def __post_init__(self):
        check_choice("task", self.task, ("chunk",), "dataset")


@dataclass
class EvalSettings:
    """How a task is evaluated (greedy decoding over one split)."""

    split: str = "test"
    """Which split of the dataset to evaluate (train | valid | test)."""
    cases: int = 0
    """Evaluate the first N cases only; 0 means all."""
    max_tokens: int = 256
    """Most tokens generated per prompt (a case, or one window of a long one)."""
    batch_size: int = 8
    """Cases decoded together (mlx-lm's batch generation); 1 decodes one at a time."""
    constrained: bool = False
    """Also decode every case under the answer's grammar (the answer's JSON, its chunks covering
    that conversation's messages in order: the model picks where chunks end and their labels;
    mlxlab/eval/chunk.py `answer_grammar`) and report those scores next to the unconstrained
    ones, which stay the headline. Doubles the evaluation time."""
    cover: bool = True
    """Under `constrained`, the chunks must reach the conversation's (or window's) last message:
    every answer is a cover the scorers accept without a repair, and a chunk that ends early is
    followed by another. false lets the answer close after any chunk (a trailing gap, repaired
    by the scorers at a cost)."""
    read_overruled: bool = False
    """Under `constrained`, a conversation read in windows: a window where the grammar overruled
    the model (at some step the model's most likely token was one the grammar refuses: a label
    of one word or more than 12, a character a label may not hold, a uuid of no message in the
    window, a key skipped, ...; with `cover`, also an early close) is merged as the grammar
    wrote it. false: such a window is merged as one whose answer could not be read, as an
    unparsable unconstrained answer is (mlxlab/eval/chunk.py `score_windows`): the grammar keeps
    every answer well formed, but where it chose tokens for the model, what follows is not the
    model's decision."""
    max_prompt_tokens: int = 0
    """A conversation whose prompt is longer is read in windows of consecutive messages of at
    most this many tokens, their answers merged into one cover (mlxlab/eval/chunk.py); 0: in a
    chunk-task run, and in `eval chunk` with an adapter from one, the run's setting or else the
    longest prompt among its training examples (windows as long as it trained on); otherwise
    what the model's context leaves after max_tokens, at most 8192."""
    window_overlap: int = 2
    """Messages each window shares with the one before."""
    window_messages: int = 0
    """> 0: every conversation with more messages is read in windows of this many (the last may
    hold fewer; where they do not fit max_prompt_tokens together, the longest are cut to fit:
    mlxlab/data/chunk.py `filled_windows`), their answers merged by mlxlab/eval/chunk.py `merge_local`: each
    boundary is one window's decision about the messages it owns, a chunk its answer starts at a
    user message or an answer that stops short of its last message (what an answer over two
    exchanges that ends with the first says). 0: in a chunk-task run, and in `eval chunk` with an adapter from one, the run's dataset's
    `window_messages` (build.json; windows like the training examples); otherwise no cap but the
    token budget's."""
    turns: bool | None = None
    """The answers open with a `turns` list (an adapter trained with the chunk data's
    `turn_topics` or `turn_quotes`): a window then also holds at most max_tokens // 30 messages
    (8..180), room for a turns entry per message and the chunks, and the answer grammar allows
    either opening. None: as the dataset the model is judged against was built (its build.json
    `turn_topics` or `turn_quotes`):
    in a chunk-task run the run's own data, for the base and the tuned model alike (same windows);
    in `eval chunk`, the adapter's run's data, and false without an adapter from a run."""
    starts: bool | None = None
    """The answers may open with a `starts` list (an adapter trained with the chunk data's
    `starts`): the answer grammar allows that opening. None: as `turns`, from the dataset's
    build.json `starts`."""
    label_model: str = ""
    """An embedding model (a zoo name, e.g. all-minilm-l6-v2, or an MLX embedding directory) that
    also scores the labels against gold by meaning: the cosine similarity of each gold chunk's
    label with its matched predicted label (`label similarity`); empty: word-overlap F1 only."""
    split_bias: float = 0.0
    """> 0: while writing a chunk's end, the tokens that end it at the window's last message (no
    further chunk) lose this much log-probability, once per chunk end (mlxlab/eval/chunk.py
    `SplitBias`), constrained or not: a one-chunk answer must beat the best earlier end by this
    margin. 0: plain greedy decoding."""
    shifts: str = ""
    """An embedding model (a zoo name, e.g. all-minilm-l6-v2, or an MLX embedding directory) whose
    topic-shift detector (mlxlab/eval/shifts.py: an exchange whose sentence vector is far from
    the one before it starts a chunk) places the chunk boundaries for one more decode of the
    split, under the answer grammar whose chunks start exactly there: the model writes only the
    labels (an adapter trained to open its answer with turns or starts is held to the chunks
    alone). Reported as the row "<name>, shift boundaries", with the detector's own boundary F1;
    the decode's max_tokens grows to fit the chunks. Empty: no such decode."""
    shift_drop: float = 0.15
    shift_cap: float = 0.6
    shift_floor: float = 0.3
    """The detector's cut (mlxlab/eval/shifts.py `Rule`): an exchange starts a chunk when its
    cosine similarity with the one before is below shift_floor, or below both shift_cap and the
    conversation's median similarity less shift_drop (a smaller drop, a higher cap or floor:
    more chunks). Chosen, never on the test split, as the best on an 80-conversation validation
    build (topics disjoint from the training and test splits') that also scores well on 14
    realistic hand-written chats (experiments/chunk_seg4/topic-shifts.md)."""

    auto_max_tokens: ClassVar[bool] = False  # max_tokens=0 may mean "as the adapter's run"

    def __post_init__(self):
        check_choice("split", self.split, ("train", "valid", "test"))
        if self.cases < 0 or self.max_tokens < (0 if self.auto_max_tokens else 1):
            raise UserError(
                "cases must be >= 0, max_tokens >= 1"
                + (" (or 0: the adapter's run's)" if self.auto_max_tokens else "")
            )
        if self.batch_size < 1:
            raise UserError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.max_prompt_tokens < 0 or 0 < self.max_prompt_tokens < 256:
            raise UserError(
                f"max_prompt_tokens must be 0 (auto) or >= 256, got {self.max_prompt_tokens}"
            )
        if self.window_overlap < 0:
            raise UserError(f"window_overlap must be >= 0, got {self.window_overlap}")
        check_window_messages(self.window_messages, self.window_overlap, "auto")
        if not math.isfinite(self.split_bias) or self.split_bias < 0:
            raise UserError(f"split_bias must be a finite number >= 0, got {self.split_bias}")
        for key, low, high in (("drop", 0, 2), ("cap", -1, 1), ("floor", -1, 1)):
            value = getattr(self, f"shift_{key}")
            if not (math.isfinite(value) and low <= value <= high):
                raise UserError(f"shift_{key} must be a number in [{low}, {high}], got {value}")


@dataclass
class EvalConfig(EvalSettings):
    """`python -m mlxlab eval chunk`: score a model (and adapter) on a task's split."""

    task: str = "chunk"
    """The task scorer (chunk: well-formedness, boundary F1, exact chunks)."""
    max_tokens: int = 0
    """Most tokens generated per prompt (a case, or one window of a long one); 0: with an adapter
    from a chunk-task run, the run's own task.eval.max_tokens (its table is then reproduced),
    else 256."""
    auto_max_tokens: ClassVar[bool] = True
    model: str = DEFAULT_MODEL
    """Zoo name, mlx-lm model directory, or .gguf file."""
    dtype: str = "auto"
    """Compute dtype: auto (float32 on CPU, bfloat16 on GPU), float32, bfloat16, float16."""
    adapter: str | None = None
    """LoRA adapter directory (or a training run directory); none evaluates the base model."""
    data: str | None = None
    """A dataset directory (its <split>.cases.json) or a JSON file of cases `[{id, name, uuid?,
    messages: [{uuid, sender, text}], chunks?}]` (without gold chunks only ref and strict are
    scored); default: the chunk dataset built with its defaults."""
    out: str | None = None
    """Per-case results (JSONL) path; default: eval_<task>_<split>.jsonl in the current directory
    (with `decisions`, the counts as JSON; default decisions_<task>_<split>.json). A directory
    means that default name inside it; the path is checked before the model loads."""
    decisions: bool = False
    """Instead of decoding: teacher-forced, at each place the gold answers decide where chunks
    are (every uuid's first characters, the character after every list item), how often the
    model's most likely next token is the gold one, per kind of place, for one-chunk and
    several-chunk answers (mlxlab/eval/chunk.py `decision_accuracy`). Reads the split's examples
    as the chunk data writes them for training, `<data>/<split>.jsonl` of a dataset directory
    (long conversations in the windows of the data's `window_chars`; `cases` takes the first N
    examples); the counts go to `out`, the table to stdout. Decoding settings do not apply."""

    def __post_init__(self):
        super().__post_init__()
        check_choice("task", self.task, ("chunk",), "task")
        check_choice("dtype", self.dtype, DTYPES)


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


@dataclass
class TrainConfig:
    """`python -m mlxlab train`: LoRA SFT, DPO or ORPO."""

    name: str = "run"
    """Run name: outputs go to outputs/<name>/<timestamp> unless out_dir is set."""
    model: str = DEFAULT_MODEL
    """Zoo name, mlx-lm model directory, or .gguf file."""
    dtype: str = "auto"
    """Compute dtype of the frozen base weights: auto (float32 on CPU, bfloat16 on GPU), ..."""
    out_dir: str | None = None
    """Run directory (adapter, checkpoints, metrics, config); resume reads it too."""
    resume: bool = False
    """Continue the run in out_dir from its last checkpoint."""
    seed: int = 0
    """Seeds LoRA init, data order and dropout."""
    iters: int = 100
    """Optimizer steps."""
    batch_size: int = 4
    """Examples per micro-batch."""
    grad_accum: int = 1
    """Micro-batches per optimizer step."""
    val_every: int = 25
    """Validate every N steps (and at the end); 0 turns it off."""
    val_batches: int = 0
    """Validation batches per evaluation; 0 means the whole validation set."""
    save_every: int = 50
    """Checkpoint every N steps; 0 saves only the final adapter."""
    keep_last: int = 2
    """Checkpoints kept (older ones are deleted)."""
    log_every: int = 5
    """Progress line every N steps."""
    compile: bool = True
    """Compile the loss-and-gradient step with mx.compile."""
    wandb: str = "offline"
    """wandb mode: offline | online | disabled."""
    wandb_project: str = "mlxlab"
    """wandb project name."""
    objective: str = "sft"
    """sft (data: chat, completions or text) | dpo | orpo (data: preference pairs,
    mlxlab/data/preference.py; batch_size counts pairs; the prompt is always masked and a
    record's `tools` are not used). The policy keeps lora.dropout (0 by default) in training;
    DPO's reference runs without it."""
    data: DataConfig = field(default_factory=DataConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    backward: BackwardConfig = field(default_factory=BackwardConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    orpo: ORPOConfig = field(default_factory=ORPOConfig)
    dist: DistConfig = field(default_factory=DistConfig)

    def __post_init__(self):
        check_choice("objective", self.objective, ("sft", "dpo", "orpo"))
        if self.objective != "sft" and self.data.pack:
            raise UserError(
                f"data.pack is for SFT; objective={self.objective} keeps one side a row"
            )
        for key in ("iters", "batch_size", "grad_accum", "keep_last", "log_every"):
            if getattr(self, key) < 1:
                raise UserError(f"{key} must be >= 1, got {getattr(self, key)}")
        check_choice("dtype", self.dtype, DTYPES)
        check_choice("wandb", self.wandb, ("offline", "online", "disabled"))
        if self.resume and not self.out_dir:
            raise UserError("resume=true needs out_dir=<the run directory to continue>")


@dataclass
class TrainCommandConfig(TrainConfig):
    """`python -m mlxlab train`: TrainConfig plus the task the run is about, if any.

    `task` is a Hydra config group whose options are the task modules' configs (mlxlab/tasks/:
    `task=chunk`, or an experiment that picks it); the train command hands the node to its task
    module, and the training loop only sees the TrainConfig fields (`train_config()`)."""

    task: Any = None
    """null (plain training) or a task's config node (its `name` says which task)."""

    def train_config(self) -> TrainConfig:
        """The same settings without the task (what the training loop takes)."""
        import dataclasses

        return TrainConfig(
            **{f.name: getattr(self, f.name) for f in dataclasses.fields(TrainConfig)}
        )


@dataclass
class DiagConfig:
    """`python -m mlxlab diag parity|leak|memory|decode|profile`: numerics, memory and speed
    harnesses."""

    action: str = "parity"
    """parity | leak | memory | decode | profile."""
    model: str = DEFAULT_MODEL
    """Zoo name, mlx-lm model directory, or .gguf file."""
    dtype: str = "auto"
    """Compute dtype for both sides: auto, float32, bfloat16, float16."""
    adapter: str | None = None
    """parity: adapter to compare (default: a seeded random one, saved in mlx-lm's layout);
    decode: an adapter to profile the step with."""
    length: int = 64
    """Tokens per test sequence (parity, leak, profile); decode: tokens of context before the
    steps."""
    batch_size: int = 2
    """profile: rows in the profiled training batch."""
    trained: float = 0.25
    """profile: the trained (response) fraction of each row, at its end."""
    steps_timed: int = 2
    """profile: timed runs of the step and of each part (the median is reported)."""
    segment_sizes: list[int] = field(default_factory=lambda: [1, 2, 4])
    """parity: segment sizes checked against the full backward."""
    max_ulp: int = 0
    """parity gate: pass when within this many ulps (0: bit-exact only)."""
    max_rel: float = 1e-6
    """parity gate: or when ||ours - theirs|| / ||theirs|| is at most this."""
    perturb_grads: float = 0.0
    """parity self-test: add this relative noise to our gradients (the gate must then fail)."""
    mode: str = "segmented"
    """leak, profile: backward mode (full | checkpoint | segmented)."""
    segment_size: int = 4
    """leak, profile: layers per segment."""
    steps: int = 120
    """leak: optimizer steps."""
    warmup: int = 20
    """leak: steps ignored before fitting the slope."""
    threshold_mb: float = 1.0
    """leak: fail when active memory grows faster than this (MB/step)."""
    lengths: list[int] = field(default_factory=lambda: [256, 512])
    """memory: sequence lengths to sweep."""
    modes: list[str] = field(
        default_factory=lambda: ["full", "checkpoint", "seg1", "seg4", "mlx_lm", "mlx_lm_gc"]
    )
    """memory: modes (full checkpoint segN auto mlx_lm mlx_lm_gc)."""
    decode_steps: int = 16
    """decode: steps timed (the median is reported)."""
    decode_head: str = "auto"
    """decode: what the LM head reads at decode on the CPU: auto (a bf16 copy, read with float32 sums,
    when that is lossless, as for zoo models: half the bytes of the step's largest read, for
    half the head's size in memory), exact (the weight), or bfloat16 (the copy even where it
    rounds: opt-in, approximate; `diag decode decode_head=bfloat16` measures it)."""
    objective: str = "sft"
    """parity: the loss checked: sft (against mlx-lm's default_loss), dpo or orpo (on one pair,
    against a straightforward implementation on mlx-lm's model: per-token log-probs from its
    __call__, the published formulas, mx.value_and_grad)."""
    dpo: DPOConfig = field(default_factory=DPOConfig)
    orpo: ORPOConfig = field(default_factory=ORPOConfig)
    out: str = "diag"
    """Report path prefix: <out>_<action>.json (and .png); an existing directory:
    <out>/<action>.json. Checked before the run."""

    def __post_init__(self):
        check_choice(
            "action", self.action, ("parity", "leak", "memory", "decode", "profile"), "diag action"
        )
        check_choice("objective", self.objective, ("sft", "dpo", "orpo"))
        if self.batch_size < 1 or self.steps_timed < 1:
            raise UserError("batch_size and steps_timed must be >= 1")
        if not 0.0 < self.trained <= 1.0:
            raise UserError(f"trained must be in (0, 1], got {self.trained}")
        check_choice("decode_head", self.decode_head, DECODE_HEADS)
        check_choice("dtype", self.dtype, DTYPES)
        check_choice("mode", self.mode, BACKWARD_MODES)
        for mode in self.modes:
            if not is_memory_mode(mode):
                check_choice("modes", mode, MEMORY_MODES, "memory mode")
        if self.length < 4:
            raise UserError(f"length must be >= 4, got {self.length}")
        if self.decode_steps < 1:
            raise UserError(f"decode_steps must be >= 1, got {self.decode_steps}")
        if self.steps <= self.warmup + 2:
            raise UserError(f"steps ({self.steps}) must exceed warmup ({self.warmup}) by 3 or more")


@dataclass
class ServeConfig:
    """`python -m mlxlab serve`: OpenAI-compatible HTTP API over one model."""

    model: str = DEFAULT_MODEL
    """Zoo name, mlx-lm model directory, or .gguf file."""
    dtype: str = "auto"
    """Compute dtype: auto (float32 on CPU, bfloat16 on GPU), float32, bfloat16, float16."""
    decode_head: str = "auto"
    """What the LM head reads at decode on the CPU: auto (a bf16 copy, read with float32 sums,
    when that is lossless, as for zoo models: half the bytes of the step's largest read, for
    half the head's size in memory), exact (the weight), or bfloat16 (the copy even where it
    rounds: opt-in, approximate; `diag decode decode_head=bfloat16` measures it)."""
    host: str = "127.0.0.1"
    """Interface to bind (loopback by default; 0.0.0.0 exposes the server to the network)."""
    port: int = 8090
    """TCP port; the server refuses to start if it is taken."""
    max_queue: int = 16
    """Requests waiting for the model beyond which new ones get 503 + Retry-After."""
    max_body_mb: float = 16.0
    """Largest request body, in MB (10^6 bytes); a larger one gets 413 before any router runs."""
    read_timeout_s: float = 30.0
    """A client has this long to send its request headers, and then this long for its body (a
    route with its own larger cap, as audio uploads, adds a second per MB of that cap); a
    stalled or trickling client is dropped (408 once its headers are in)."""
    max_connections: int = 256
    """Open connections (or requests in progress) beyond which a new request gets 503
    (uvicorn's limit_concurrency)."""
    max_messages: int = 4096
    """Messages (input items) in one request; more is a 400 naming the limit."""
    max_tools: int = 128
    """Tools offered in one request (OpenAI's own limit); more is a 400."""
    max_tools_kb: float = 1024.0
    """Total size of one request's tool definitions, as JSON, in KB (10^3 bytes)."""
    prompt_cache_gb: float = 2.0
    """Byte cap of the prompt (prefix KV) cache, in GB (10^9); 0 disables it."""
    memory_budget_gb: float | None = None
    """Memory the server may use (GB, 10^9); sets the max safe context. Default: 75% of RAM."""
    max_tokens: int = 1024
    """Completion length when a request gives none."""
    temperature: float | None = None
    """Default temperature (request > this > the model's generation_config.json > 1.0)."""
    top_p: float | None = None
    """Default nucleus mass (same precedence; fallback 1.0, off)."""
    top_k: int | None = None
    """Default top-k (same precedence; fallback 0, off)."""
    min_p: float | None = None
    """Default min-p (same precedence; fallback 0, off)."""
    prefill_step: int = 512
    """Prompt tokens per prefill chunk."""
    adapters: dict[str, str] = field(default_factory=dict)
    """Adapters mounted at start, id -> adapter directory or training run directory (its final
    adapter): `adapters.chunk=outputs/chunk_seg4/<run>`."""
    adapter_root: str | None = None
    """Runtime mounts (POST /v1/adapters) must resolve inside this directory (symlinks followed),
    and GET /v1/adapters/available lists what is under it. Default: the runs directory `outputs/`
    under the working directory if it exists, else MLXLAB_HOME/adapters (created)."""
    allow_adapter_mount: bool = True
    """Allow POST/DELETE /v1/adapters."""
    runs_dir: str | None = None
    """Directory whose training runs the runs page (GET /runs, GET /v1/runs) lists and plots.
    Default: the adapter root, so a run's adapter can be mounted from the page."""
    drain_timeout_s: float = 30.0
    """On Ctrl-C/SIGTERM: how long in-flight requests may finish before the server exits."""
    log_requests: bool = False
    """Log one line per HTTP request."""
    openapi: bool = True
    """Serve GET /openapi.json, the server's schema (its routes, request models and error
    shapes: what API fuzzers such as schemathesis read); /docs stays off."""
    batch: int = 1
    """Rows decoded together by the continuous-batching lane; 1 serves one request at a time.
    Requests that cannot batch (explicit seed, repetition/presence/frequency penalties, KV
    quantization) take the serial lane between batches."""
    prefill_batch: int = 8
    """With batch > 1: prompts prefilled together (at most `batch`)."""
    kv_quant: str = "off"
    """KV-cache quantization: off, 4 or 8 (uniform bits, group 64), config (the model's
    kv_config.json: a list of {layer_idx, bits, group_size}) or a path to such a JSON file."""
    api_key: str | None = field(default=None, repr=False)
    """Key clients must send (`Authorization: Bearer <key>` or `x-api-key: <key>`) on every route
    but /health; default: the MLXLAB_API_KEY environment variable, else no key is required."""
    api_key_file: str | None = None
    """File of further API keys, one a line (`#` comments and blank lines ignored), one per client."""
    admin_key: str | None = field(default=None, repr=False)
    """If set (or MLXLAB_ADMIN_KEY), the only key that opens the routes that change the server's
    state (POST /v1/adapters, DELETE /v1/adapters/{id}); an API key gets 403 there."""
    allowed_hosts: list[str] = field(default_factory=list)
    """Host header names accepted besides loopback ones (localhost, 127.0.0.1, [::1]) when bound to
    loopback; bound elsewhere, the only ones accepted if set. `*` accepts any:
    `allowed_hosts=[box.lan,10.0.0.5]`."""
    cors_origins: list[str] = field(default_factory=list)
    """Browser origins (scheme://host[:port]) that may call the API cross-origin and get CORS
    headers; others get 403 on POST/PUT/PATCH/DELETE. `*` allows any; the server's own origin is
    always allowed: `cors_origins=[http://localhost:3000]`."""
    # --- images, on a vision-language model (mlxlab/serve/vision.py) ---
    max_images: int = 5
    """Images in the last user message (the ones the model is shown); more is a 400."""
    max_image_mb: float = 20.0
    """Largest image, in MB of its file (a fetched URL's too); a larger one is a 413."""
    max_images_mb: float = 50.0
    """All the images of one request together (the history's too), in MB; more is a 413."""
    vision_body_mb: float = 72.0
    """Largest request body when the model has vision (base64 is 4/3 of the bytes: 50 MB of
    images is ~67 MB); a text-only model keeps max_body_mb, and the larger of the two applies."""
    allow_image_urls: bool = False
    """Fetch http(s) image URLs (off: data URLs and base64 sources only). A fetch is capped at
    max_image_mb and image_url_timeout_s, follows at most 3 redirects, and refuses any host that
    resolves to a loopback, private, link-local or other non-public address, on every hop."""
    image_url_timeout_s: float = 10.0
    """Deadline of one image URL's whole fetch (redirects included)."""
    image_url_hosts: list[str] = field(default_factory=list)
    """Host names (as written in URLs) that may resolve to private addresses, such as an image
    server on the LAN: `image_url_hosts=[images.lan]`; every other host must be public."""
    image_table: bool = True
    """Begin an answer about images with the filename table (`<!-- mlxk:filenames -->`) that
    keeps image ids stable when a client drops the images from its history."""
    image_exif: bool = True
    """The table's EXIF columns (Original, Location, Date, Camera); false: Image and Filename."""
    # Speech-to-text and embeddings (serve/audio, serve/embeddings), beside the chat model.
    stt_model: str | None = None
    """Speech-to-text model for /v1/audio/transcriptions, /v1/audio/translations and chat
    `input_audio` parts: `whisper-base` (zoo) or a converted Whisper directory; unset, those
    answer 400 saying how to set it."""
    embeddings_model: str | None = None
    """Sentence-embedding model for /v1/embeddings: `all-minilm-l6-v2` (zoo) or a converted
    BERT-family directory; unset, /v1/embeddings answers 400 saying how to set it."""
    stt_language: str | None = None
    """The language chat `input_audio` parts are spoken in (ISO 639-1 code or English name);
    unset: detected per part. The audio routes take theirs from the request's `language`."""
    max_audio_mb: float = 50.0
    """Largest request body on the audio routes (the uploaded file and its form), in MB
    (10^6 bytes): 413 above, spooled to disk below; replaces max_body_mb there."""
    max_chat_audio_mb: float = 5.0
    """Largest decoded `input_audio` part of a chat message, in MB (the body itself stays under
    max_body_mb)."""
    max_audio_s: float = 3600.0
    """Longest audio one request may decode to, in seconds (a small file can hold hours)."""

    def __post_init__(self):
        for name in ("max_audio_mb", "max_chat_audio_mb", "max_audio_s"):
            if not getattr(self, name) > 0:
                raise UserError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("stt_model", "embeddings_model", "stt_language"):
            if getattr(self, name) is not None and not str(getattr(self, name)).strip():
                setattr(self, name, None)  # `stt_model=` on the command line: none
        check_choice("decode_head", self.decode_head, DECODE_HEADS)
        check_choice("dtype", self.dtype, DTYPES)
        if not is_kv_quant(self.kv_quant):  # the wording kv_quant.parse uses for the same problem
            raise UserError(
                f"serve.kv_quant={self.kv_quant!r}: use off, 4, 8, config, or a kv_config.json path"
            )
        if not 0 < self.port < 65536:
            raise UserError(f"port must be in 1..65535, got {self.port}")
        if self.max_queue < 1 or self.max_tokens < 1 or self.prefill_step < 1:
            raise UserError("max_queue, max_tokens and prefill_step must be >= 1")
        for name in ("max_body_mb", "read_timeout_s", "max_tools_kb"):
            if not getattr(self, name) > 0:
                raise UserError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("max_connections", "max_messages", "max_tools"):
            if getattr(self, name) < 1:
                raise UserError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.prompt_cache_gb < 0:
            raise UserError(f"prompt_cache_gb must be >= 0, got {self.prompt_cache_gb}")
        if self.memory_budget_gb is not None and self.memory_budget_gb <= 0:
            raise UserError(f"memory_budget_gb must be > 0, got {self.memory_budget_gb}")
        if self.batch < 1 or self.prefill_batch < 1:
            raise UserError(
                f"batch and prefill_batch must be >= 1, got {self.batch} and {self.prefill_batch}"
            )
        self.kv_quant = str(self.kv_quant)
        for name in ("api_key", "admin_key"):
            if getattr(self, name) is not None:
                check_api_key(getattr(self, name), f"serve.{name}")
        if self.api_key_file is not None and not str(self.api_key_file).strip():
            raise UserError("serve.api_key_file is empty: give the path of a file of keys")
        for host in self.allowed_hosts:
            if not isinstance(host, str) or not host or re.search(r"[\s/]", host):
                raise UserError(
                    f"serve.allowed_hosts: {host!r} is not a host name or address "
                    "(a name, an IP address, or *)"
                )
        for origin in self.cors_origins:
            if not isinstance(origin, str) or not (origin == "*" or ORIGIN.fullmatch(origin)):
                raise UserError(
                    f"serve.cors_origins: {origin!r} is not an origin: scheme://host[:port] "
                    "without a path (http://localhost:3000), or *"
                )
        if self.max_images < 1:
            raise UserError(f"serve.max_images must be >= 1, got {self.max_images}")
        for name in ("max_image_mb", "max_images_mb", "vision_body_mb", "image_url_timeout_s"):
            if not getattr(self, name) > 0:
                raise UserError(f"serve.{name} must be > 0, got {getattr(self, name)}")
        for host in self.image_url_hosts:
            if not isinstance(host, str) or not host or re.search(r"[\s/:]", host):
                raise UserError(
                    f"serve.image_url_hosts: {host!r} is not a host name (a name as it appears "
                    "in URLs, without scheme or port)"
                )


@dataclass
class RunsConfig:
    """`python -m mlxlab runs`: the runs page on its own, without a model: the training runs under
    a directory, their metrics plotted as they train (`serve` has the same page at /runs)."""

    dir: str = "outputs"
    """Directory searched for training runs (run directories up to 4 levels down); the page
    reads nothing outside it."""
    host: str = "127.0.0.1"
    """Interface to bind (loopback by default)."""
    port: int = 8091
    """TCP port (one above serve's default, so both can run)."""
    api_key: str | None = field(default=None, repr=False)
    """Key the page's API calls must send, as on `serve` (default: MLXLAB_API_KEY, else none)."""
    api_key_file: str | None = None
    """File of further keys, one a line, as on `serve`."""
    allowed_hosts: list[str] = field(default_factory=list)
    """Host header names accepted besides loopback ones, as on `serve`."""
    cors_origins: list[str] = field(default_factory=list)
    """Other browser origins that may call the API, as on `serve`."""

    def __post_init__(self):
        if not isinstance(self.dir, str) or not self.dir.strip():
            raise UserError("runs.dir is empty: give the directory holding the training runs")
        self.http()  # host, port, keys, hosts and origins checked as serve's are

    def http(self) -> ServeConfig:
        """The HTTP side's settings as `serve` holds them (for its guard and uvicorn settings),
        checked as `serve` checks them (its errors then name runs.<field>)."""
        try:
            return ServeConfig(
                host=self.host,
                port=self.port,
                api_key=self.api_key,
                api_key_file=self.api_key_file,
                allowed_hosts=list(self.allowed_hosts),
                cors_origins=list(self.cors_origins),
            )
        except UserError as e:
            raise UserError(str(e).replace("serve.", "runs.")) from None


ORIGIN = re.compile(r"[a-z][a-z0-9+.-]*://[^/\s?#]+", re.IGNORECASE)
"""A browser origin as an `Origin` header carries it: scheme://host[:port], no path."""


def check_api_key(key, where: str) -> None:
    """UserError unless `key` can travel in a header: printable ASCII without spaces (the message
    names where the key came from, never the key)."""
    if not isinstance(key, str) or not key or not all(33 <= ord(c) <= 126 for c in key):
        raise UserError(
            f"{where}: an API key must be a non-empty string of printable ASCII without spaces"
        )


@dataclass
class TranscribeConfig:
    """`python -m mlxlab transcribe FILE`: speech to text with Whisper (mlxlab/audio)."""

    file: str | None = None
    """The audio file: wav, mp3, m4a, ogg/opus, flac, webm (decoded by PyAV, resampled to 16 kHz)."""
    model: str = "whisper-base"
    """Zoo name (whisper-base) or a converted Whisper directory."""
    language: str | None = None
    """ISO 639-1 code or English name; unset: detected from the first 30 s."""
    task: str = "transcribe"
    """transcribe, or translate (to English)."""
    format: str = "text"
    """Output: text, json, verbose_json, srt or vtt."""
    prompt: str | None = None
    """Text the first window is conditioned on (names, spellings)."""
    temperature: float = 0.0
    """0: greedy with Whisper's fallback to higher temperatures; > 0: sample at that one."""
    word_timestamps: bool = False
    """Word-level timestamps (verbose_json's `words`)."""
    out: str | None = None
    """Write the output to this file (atomically) instead of stdout; a directory means
    <file's stem>.<txt, json, srt or vtt> inside it. Checked before the model loads."""
    progress: bool = True
    """A progress bar on stderr, advancing one 30 s window at a time."""
    dtype: str = "auto"
    """Compute dtype: auto (float32 on CPU, float16 on GPU), float32, float16."""

    def __post_init__(self):
        check_choice("task", self.task, ("transcribe", "translate"))
        check_choice("format", self.format, ("text", "json", "verbose_json", "srt", "vtt"))
        check_choice("dtype", self.dtype, DTYPES)
        if not 0.0 <= self.temperature <= 1.0:
            raise UserError(f"temperature must be in [0, 1], got {self.temperature}")


SCHEMAS = {
    "generate": GenerateConfig,
    "models": ModelsConfig,
    "train": TrainCommandConfig,
    "lora": LoraToolConfig,
    "diag": DiagConfig,
    "data": DataBuildConfig,
    "eval": EvalConfig,
    "serve": ServeConfig,
    "runs": RunsConfig,
    "transcribe": TranscribeConfig,
}


def from_dict(cls, data: dict):
    """Build a (nested) config dataclass from plain data, rejecting unknown keys."""
    import dataclasses
    import typing

    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(data) - names
    if unknown:
        raise UserError(f"unknown {cls.__name__} keys: {', '.join(sorted(unknown))}")
    kwargs = {}
    for key, value in data.items():
        sub = hints.get(key)
        kwargs[key] = (
            from_dict(sub, value)
            if dataclasses.is_dataclass(sub) and isinstance(value, dict)
            else value
        )
    return cls(**kwargs)


def to_dict(cfg) -> dict:
    import dataclasses

    return dataclasses.asdict(cfg)
