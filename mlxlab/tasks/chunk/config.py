"""The chunk task's settings: how its data is built (`ChunkDataConfig`), how a model is evaluated
on it (`EvalSettings`), the `data chunk` and `eval chunk` verbs' configs, and the two train
`task` options (`task=chunk`, `task=chunk_pref`). Checks in `__post_init__`, as every config."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

from mlxlab.config import DEFAULT_MODEL, DTYPES, MAX_LOSS_WEIGHT
from mlxlab.errors import UserError
from mlxlab.schema import check_choice


def check_window_messages(value: int, overlap: int, zero: str, source: str = "") -> None:
    """UserError unless `value` is 0 (meaning `zero`) or more messages than `overlap` (and 1):
    a window that holds no more than it shares with the one before cannot move on. `source`:
    where an inherited value came from and what to set instead, added to the message."""
    if value and value <= max(overlap, 1):
        raise UserError(
            f"window_messages must be 0 ({zero}) or more than window_overlap (and 1), "
            f"got {value} with window_overlap {overlap}" + (f" ({source})" if source else "")
        )


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
class ChunkEvalConfig(EvalSettings):
    """`python -m mlxlab eval chunk`: score a model (and adapter) on the chunk task's split."""

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
    """Per-case results (JSONL) path; default: eval_chunk_<split>.jsonl in the current directory
    (with `decisions`, the counts as JSON; default decisions_chunk_<split>.json). A directory
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
    report: str | None = None
    """Markdown report written after the run (e.g. experiments/chunk_seg4/README.md)."""

    def __post_init__(self):
        check_choice("task.name", self.name, ("chunk",), "task")


@dataclass
class ChunkPrefConfig:
    """`task=chunk_pref`: pairs from a chunk SFT run, training on top of its adapter, evaluation
    of both, the report."""

    name: str = "chunk_pref"
    """The task (config group option `task/chunk_pref`)."""
    sft: str | None = None
    """The chunk-task SFT run to start from (`train +exp=chunk_seg4`'s run directory: its adapter
    and its data/); unset: the newest finished run under outputs/chunk_seg4."""
    examples: int = 64
    """Training examples the SFT adapter answers (by sampling) for the rejected answers."""
    multi_share: float = 0.75
    """The share of those drawn from examples with two or more gold chunks (where a one-chunk
    answer is wrong); the rest from one-chunk examples."""
    temperature: float = 1.0
    """Sampling temperature of the SFT adapter's answers."""
    moved: bool = True
    """Also pair each picked multi-chunk example's gold against the gold with one boundary moved
    by one message."""
    seed: int = 0
    """Seeds which examples are picked, the sampling and the moved boundaries."""
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
