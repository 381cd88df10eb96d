"""A fixed GRPO case on a tiny model: two prompts' groups of four completions (token ids drawn
once, from a seed) with fixed rewards, what the loss tests and the data-parallel step share."""

from __future__ import annotations

import numpy as np

from mlxlab.data.prompts import Prompt
from mlxlab.train.config import GRPOConfig, TrainConfig
from mlxlab.train.grpo.rollout import Completion
from tests.helpers.lora_model import lora_model

G = 4
# two groups of four: (prompt tokens after BOS, completion tokens)
PROMPTS = [9, 14]
COMPLETIONS = [5, 12, 3, 8, 10, 4, 7, 6]
REWARDS = [1.0, 0.0, 0.5, 1.0, 0.0, 0.0, 1.0, 0.25]


def rollout_case(family: str = "llama", seed: int = 0):
    """(model with LoRA, prompts, completions): prompt k's group is completions 4k..4k+3."""
    shapes = [(PROMPTS[k // G] + c, PROMPTS[k // G] + 1) for k, c in enumerate(COMPLETIONS)]
    model, examples = lora_model(family, shapes, seed)
    for e in examples:
        e.ids = [int(t) for t in e.ids]
    prompts = [Prompt(examples[k * G].ids[: PROMPTS[k] + 1], {}) for k in range(2)]
    completions = []
    for k, e in enumerate(examples):
        tail = list(e.ids[len(prompts[k // G].ids) :])
        assert len(tail) == COMPLETIONS[k]
        completions.append(Completion(tail, "", "stop"))
    return model, prompts, completions


def case_config(variant: str, updates: int = 2, beta: float = 0.05, **kw) -> TrainConfig:
    grpo = GRPOConfig(
        loss=variant,
        group_size=G,
        max_tokens=16,
        updates=updates,
        beta=beta,
        rewards=["json"],
        **kw,
    )
    return TrainConfig(objective="grpo", batch_size=2, grpo=grpo)


def scored(prompts, completions, cfg, groups=None):
    """The case as a scored rollout (loop.Rollout), of all groups or of the ones listed."""
    from mlxlab.train.grpo import loop
    from mlxlab.train.grpo.losses import group_advantages

    groups = list(range(len(prompts))) if groups is None else groups
    rows = [k * G + j for k in groups for j in range(G)]
    rewards = [REWARDS[i] for i in rows]
    adv = group_advantages(rewards, G, cfg.grpo.scale)
    return loop.Rollout(
        [prompts[k] for k in groups],
        [completions[i] for i in rows],
        rewards,
        {},
        adv,
        np.ones(len(rows), bool),
    )
