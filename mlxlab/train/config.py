"""`python -m mlxlab train`'s config (registered here: mlxlab/registry.py imports this provider):
TrainConfig, TrainCommandConfig (TrainConfig plus the run's task), and GRPO's settings, which
only training reads.

The parts TrainConfig shares with other commands and layers (LoraConfig, DataConfig,
OptimConfig, BackwardConfig, DistConfig, DPOConfig, ORPOConfig: diag, the data readers and the
LoRA tools take them too) stay in mlxlab/config.py, which imports nothing of mlxlab.train.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from mlxlab import registry
from mlxlab.config import (
    DEFAULT_MODEL,
    DTYPES,
    BackwardConfig,
    DataConfig,
    DistConfig,
    DPOConfig,
    LoraConfig,
    OptimConfig,
    ORPOConfig,
)
from mlxlab.errors import UserError
from mlxlab.schema import check_choice

GRPO_LOSSES = ("grpo", "dr_grpo", "gspo", "dapo")
"""GRPO's loss variants (mlxlab/train/grpo/losses.py: the formulas and the papers)."""
GRPO_BUILTIN_REWARDS = ("json", "match")
"""Rewards named by a bare word (mlxlab/train/grpo/rewards.py); any other is `module:function`."""
# Clip ranges by loss where grpo.epsilon / epsilon_high are left unset: the published ones
# (DAPO's clip-higher 0.28; GSPO's sequence-level ratios are clipped far tighter, 3e-4 / 4e-4).
GRPO_CLIP = {
    "grpo": (0.2, 0.2),
    "dr_grpo": (0.2, 0.2),
    "gspo": (3e-4, 4e-4),
    "dapo": (0.2, 0.28),
}


@dataclass
class GRPOConfig:
    """GRPO (`objective=grpo`): online training on the policy's own completions, sampled in
    groups per prompt on the batched decoder and scored by reward functions; the update is a
    clipped policy gradient on group-normalized advantages (mlxlab/train/grpo/)."""

    loss: str = "grpo"
    """grpo (DeepSeekMath: per-sequence token means, std-normalized group advantages) | dr_grpo
    (Dr. GRPO: no std normalization, token sums over a constant max_tokens) | gspo (GSPO:
    sequence-level importance ratios) | dapo (DAPO: token-level mean over the batch,
    clip-higher)."""
    group_size: int = 8
    """Completions sampled per prompt (G); batch_size counts prompts, so a step holds
    batch_size x group_size completions."""
    max_tokens: int = 256
    """Most tokens of a completion (a completion cut there counts as truncated)."""
    temperature: float = 1.0
    """Sampling temperature of the rollouts (> 0)."""
    top_p: float = 1.0
    """Nucleus sampling mass of the rollouts; 1.0 turns it off."""
    top_k: int = 0
    """Keep only the k most likely tokens in the rollouts; 0 turns it off."""
    stop: list[str] = field(default_factory=list)
    """Stop strings: a completion ends with the token that completes one (kept as a trained
    token; the text the rewards see ends before the string). The end-of-sequence tokens always
    stop."""
    rewards: list[str] = field(default_factory=lambda: ["json"])
    """Reward functions: built-in `json` (the completion parses as JSON and, where the record
    has a `schema`, validates against it) and `match` (the record's `answer` exactly, or its
    `answer_regex`), or `module:function` taking (completions, records) and returning one
    float per completion."""
    reward_weights: list[float] | None = None
    """A weight per reward (the reward is their weighted sum); null: 1 each."""
    beta: float = 0.0
    """Weight of the KL penalty to the reference (the base model with the adapter off, or the
    lora.init adapter; DoRA and full: the starting arrays); 0 skips the reference pass (DeepSeekMath used 0.04; Dr. GRPO and DAPO
    drop the term)."""
    epsilon: float | None = None
    """Lower clip of the importance ratio (1 - epsilon); null: the loss's published value
    (0.2; gspo 3e-4)."""
    epsilon_high: float | None = None
    """Upper clip (1 + epsilon_high); null: the loss's published value (epsilon; dapo 0.28,
    gspo 4e-4)."""
    updates: int = 1
    """Optimizer steps per rollout batch (mu); with mu > 1 the log-probs of the policy that
    sampled them are kept for the importance ratio (with 1 the ratio is 1)."""
    scale_rewards: str | None = None
    """group (divide advantages by the group's reward std) | none; null: the loss's own
    (none for dr_grpo, group for the others)."""
    drop_uniform_groups: bool | None = None
    """Leave groups whose rewards are all equal (advantage 0) out of the update, as DAPO's
    dynamic sampling does (without sampling more to refill the batch); null: true for dapo."""
    share_prefill: bool = True
    """Prefill each prompt once and start its group's other rows from that prompt cache
    (false: each row prefills its own prompt; completions from the same distribution, though
    not the same draws: the rows join the batch at other steps)."""
    log_completions: bool = True
    """Write every completion of every step (its text, reward and finish) to the run
    directory's completions.jsonl."""

    def __post_init__(self):
        check_choice("grpo.loss", self.loss, GRPO_LOSSES)
        if self.group_size < 2:
            raise UserError(
                f"grpo.group_size must be >= 2, got {self.group_size} (advantages compare a "
                "group's completions)"
            )
        if self.max_tokens < 1:
            raise UserError(f"grpo.max_tokens must be >= 1, got {self.max_tokens}")
        if not self.temperature > 0:
            raise UserError(
                f"grpo.temperature must be > 0, got {self.temperature} (a greedy group holds "
                "one completion G times)"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise UserError(f"grpo.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise UserError(f"grpo.top_k must be >= 0, got {self.top_k}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise UserError(f"grpo.stop: give non-empty strings, got {list(self.stop)!r}")
        self.stop = list(self.stop)
        if not self.rewards:
            raise UserError("grpo.rewards is empty; name at least one (json, match, module:fn)")
        self.rewards = list(self.rewards)
        for name in self.rewards:
            if not isinstance(name, str) or (
                name not in GRPO_BUILTIN_REWARDS and not re.fullmatch(r"[\w.]+:[\w.]+", name)
            ):
                raise UserError(
                    f"grpo.rewards: {name!r} is neither a built-in reward "
                    f"({', '.join(GRPO_BUILTIN_REWARDS)}) nor module:function"
                )
        if self.reward_weights is not None:
            self.reward_weights = [float(w) for w in self.reward_weights]
            if len(self.reward_weights) != len(self.rewards):
                raise UserError(
                    f"grpo.reward_weights has {len(self.reward_weights)} weights for "
                    f"{len(self.rewards)} rewards"
                )
        if self.beta < 0:
            raise UserError(f"grpo.beta must be >= 0, got {self.beta}")
        low, high = self.clip
        if not 0 < low < 1 or not high > 0:
            raise UserError(
                f"grpo.epsilon must be in (0, 1) and grpo.epsilon_high > 0, got {low} and {high}"
            )
        if self.updates < 1:
            raise UserError(f"grpo.updates must be >= 1, got {self.updates}")
        if self.scale_rewards is not None:
            check_choice("grpo.scale_rewards", self.scale_rewards, ("group", "none"))

    # The settings left null take the loss's published values (resolved here, not stored, so a
    # config that changes grpo.loss alone gets the new loss's).

    @property
    def clip(self) -> tuple[float, float]:
        """(epsilon, epsilon_high): the ratio is clipped to [1 - epsilon, 1 + epsilon_high]."""
        low, high = GRPO_CLIP[self.loss]
        eps = low if self.epsilon is None else float(self.epsilon)
        if self.epsilon_high is not None:
            return eps, float(self.epsilon_high)
        return eps, high if self.epsilon is None else eps

    @property
    def scale(self) -> str:
        """How advantages are scaled: group (by the group's reward std) | none."""
        if self.scale_rewards is not None:
            return self.scale_rewards
        return "none" if self.loss == "dr_grpo" else "group"

    @property
    def drops_uniform_groups(self) -> bool:
        return self.loss == "dapo" if self.drop_uniform_groups is None else self.drop_uniform_groups


OBJECTIVES = ("sft", "dpo", "orpo", "grpo")


@dataclass
class TrainConfig:
    """`python -m mlxlab train`: LoRA SFT, DPO, ORPO or GRPO."""

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
    record's `tools` are not used) | grpo (data: prompts, mlxlab/data/prompts.py; batch_size
    counts prompts, each sampled grpo.group_size times; `iters` counts rollout batches, each
    trained grpo.updates optimizer steps). The policy keeps lora.dropout (0 by default) in
    training; DPO's and GRPO's reference and GRPO's rollouts run without it."""
    data: DataConfig = field(default_factory=DataConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    backward: BackwardConfig = field(default_factory=BackwardConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    orpo: ORPOConfig = field(default_factory=ORPOConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    dist: DistConfig = field(default_factory=DistConfig)

    def __post_init__(self):
        check_choice("objective", self.objective, OBJECTIVES)
        if self.objective != "sft" and self.data.pack:
            raise UserError(
                f"data.pack is for SFT; objective={self.objective} keeps one side a row"
            )
        for key in ("iters", "batch_size", "grad_accum", "keep_last", "log_every"):
            if getattr(self, key) < 1:
                raise UserError(f"{key} must be >= 1, got {getattr(self, key)}")
        for key in ("val_every", "val_batches", "save_every"):  # 0 has its own meaning
            if getattr(self, key) < 0:
                raise UserError(f"{key} must be >= 0, got {getattr(self, key)}")
        if not 0 <= self.seed < 2**63:
            raise UserError(f"seed must be in [0, 2^63), got {self.seed}")
        check_choice("dtype", self.dtype, DTYPES)
        check_choice("wandb", self.wandb, ("offline", "online", "disabled"))
        if self.resume and not self.out_dir:
            raise UserError("resume=true needs out_dir=<the run directory to continue>")
        if self.objective == "grpo":
            if self.backward.pipeline:
                raise UserError(
                    "objective=grpo runs on one process or data parallel; backward.pipeline "
                    "places segments on ranks, and the rollouts need the whole model"
                )
            rows = self.batch_size * self.grpo.group_size
            if self.grad_accum > rows:
                raise UserError(
                    f"grad_accum={self.grad_accum} exceeds the {rows} completions of a step "
                    f"(batch_size x grpo.group_size)"
                )
            if self.data.max_seq_length <= self.grpo.max_tokens:
                raise UserError(
                    f"data.max_seq_length={self.data.max_seq_length} leaves no room for a prompt "
                    f"beside grpo.max_tokens={self.grpo.max_tokens} (it caps prompt + completion)"
                )


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


registry.command("train", TrainCommandConfig)
