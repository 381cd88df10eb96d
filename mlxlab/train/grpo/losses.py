"""GRPO's advantages and policy losses, and the objective head every backward mode runs.

The formulas, each as published (and as TRL's `GRPOTrainer._compute_loss` implements them, the
implementation followed where a paper leaves a detail open):

- Advantages (DeepSeekMath, Shao et al. 2024, section 4.1.2, outcome supervision): each
  completion's reward minus its group's mean, divided by the group's standard deviation
  (Bessel-corrected, + 1e-4 against a zero std, as TRL); every token of the completion gets it.
  Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training") drops the division
  (`scale_rewards=none`).
- The per-token objective (DeepSeekMath eq. 3): with r_t = pi(o_t) / pi_old(o_t),
  l_t = -min(r_t A, clip(r_t, 1 - eps_low, 1 + eps_high) A) + beta * KL_t, where KL_t is the
  unbiased k3 estimator of KL(pi || pi_ref) (DeepSeekMath eq. 4):
  exp(ref_t - logp_t) - (ref_t - logp_t) - 1.
- `grpo`: the mean over completions of each completion's token mean (DeepSeekMath eq. 3's
  1/G sum_i 1/|o_i| sum_t).
- `dr_grpo`: the token sum over all completions divided by (completions x max_tokens), a
  constant: no length normalization (Dr. GRPO's fix of the length bias).
- `gspo` (Zheng et al. 2025, "Group Sequence Policy Optimization"): one importance ratio per
  completion, s_i = exp(mean_t (logp_t - old_t)), clipped as a whole; the loss is the mean over
  completions (each completion's tokens share s_i, so its token mean is -min(s_i A_i,
  clip(s_i) A_i) plus its mean KL). Its published clip range is 3e-4 / 4e-4.
- `dapo` (Yu et al. 2025, "DAPO"): the token-level loss, every token of the batch weighted
  alike (the token sum over the batch's token count), with clip-higher (eps_high 0.28) and the
  groups whose rewards are all equal left out (dynamic sampling, without refilling the batch).

The old policy's log-probs: with one update per rollout batch (mu = 1) they are the current
ones under a stop-gradient, so r_t = 1 and its gradient is that of logp_t (as TRL); with mu > 1
they are computed once before the first update and kept.

A batch's reference array (`Batch.ref`, what every backward mode hands the objective's head) is
[N, 3] per trained position: the advantage of its completion, the old policy's log-prob and the
reference's log-prob. Sums over rows go through a one-hot product, one summation order in every
backward mode, as DPO's `row_logps`.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

METRICS = ("kl", "clip_frac", "clip_low", "clip_high", "ratio", "logp")
"""What the head reports besides the loss: mean per-token KL to the reference (0 without
one), the share of tokens whose ratio is clipped (low: r < 1 - eps with A < 0; high: r > 1 +
eps_high with A > 0, TRL's regions), the mean ratio and the mean token log-prob."""

ADV, OLD, REF = 0, 1, 2
"""Columns of a batch's per-position array."""


def group_advantages(rewards, group_size: int, scale: str = "group") -> np.ndarray:
    """Advantages [R] of rewards [R] (R = groups x group_size, a group's completions together):
    reward minus the group mean, divided by the group's std (+ 1e-4) when `scale` is group."""
    r = np.asarray(rewards, np.float64).reshape(-1, group_size)
    adv = r - r.mean(axis=1, keepdims=True)
    if scale == "group":
        adv = adv / (r.std(axis=1, ddof=1, keepdims=True) + 1e-4)
    return adv.reshape(-1).astype(np.float32)


def uniform_groups(rewards, group_size: int) -> np.ndarray:
    """[groups] bool: the groups whose rewards are all equal (no signal; DAPO drops them)."""
    r = np.asarray(rewards, np.float64).reshape(-1, group_size)
    return np.all(r == r[:, :1], axis=1)


def policy_loss(
    logp: mx.array,
    aux: mx.array,
    weights: mx.array,
    onehot: mx.array,
    loss: str,
    epsilon: float,
    epsilon_high: float,
    beta: float,
    max_tokens: int,
    fixed_old: bool,
) -> tuple[mx.array, dict[str, mx.array]]:
    """The loss and metrics from per-position log-probs `logp` [N] of the policy, the batch's
    per-position array `aux` [N, 3] (advantage, old log-prob, reference log-prob), `weights`
    [N] (0 at padding) and `onehot` [N, B] (position -> its completion's row).

    `fixed_old` (mu = 1): the old log-probs are `logp` itself under a stop-gradient."""
    adv, ref = aux[:, ADV], aux[:, REF]
    old = mx.stop_gradient(logp) if fixed_old else aux[:, OLD]
    counts = weights @ onehot  # [B] trained tokens per completion
    per_row = mx.maximum(counts, 1.0)
    real = weights > 0  # padding positions hold no log-probs of their own: ratio 1, KL 0
    log_ratio = mx.where(real, logp - old, 0.0)
    if loss == "gspo":  # one ratio per completion: the mean token log-ratio
        seq = ((log_ratio * weights) @ onehot) / per_row
        log_ratio = onehot @ seq
    ratio = mx.exp(log_ratio)
    clipped = mx.clip(ratio, 1 - epsilon, 1 + epsilon_high)
    per_token = -mx.minimum(ratio * adv, clipped * adv)
    delta = mx.where(real, ref - logp, 0.0)
    kl = mx.exp(delta) - delta - 1
    if beta:
        per_token = per_token + beta * kl
    total = weights.sum()
    if loss in ("grpo", "gspo"):
        value = (((per_token * weights) @ onehot) / per_row).sum() / onehot.shape[1]
    elif loss == "dr_grpo":
        value = (per_token * weights).sum() / (onehot.shape[1] * max_tokens)
    elif loss == "dapo":
        value = (per_token * weights).sum() / total
    else:
        raise ValueError(f"unknown GRPO loss {loss!r}")
    low = (ratio < 1 - epsilon) & (adv < 0)
    high = (ratio > 1 + epsilon_high) & (adv > 0)
    f32 = mx.float32

    def mean(x):
        return (x.astype(f32) * weights).sum() / total

    metrics = {
        "kl": mean(kl) if beta else mx.array(0.0),
        "clip_frac": mean(low | high),
        "clip_low": mean(low),
        "clip_high": mean(high),
        "ratio": mean(ratio),
        "logp": mean(logp),
    }
    return value, metrics


@dataclass(frozen=True)
class GRPOObjective:
    """GRPO's loss as a backward mode's objective (train/backward.py): its `head` turns final
    states into per-position log-probs and those into the policy loss; a batch's `ref` is the
    per-position array (advantage, old log-prob, reference log-prob)."""

    variant: str = "grpo"  # grpo | dr_grpo | gspo | dapo
    epsilon: float = 0.2
    epsilon_high: float = 0.2
    beta: float = 0.0
    max_tokens: int = 256
    fixed_old: bool = True
    kind: str = "grpo"
    needs_reference: bool = False  # the loop fills the reference column itself

    @classmethod
    def from_config(cls, cfg) -> GRPOObjective:
        g = cfg.grpo
        return cls(g.loss, *g.clip, g.beta, g.max_tokens, g.updates == 1)

    @property
    def metrics(self) -> tuple[str, ...]:
        return METRICS

    @property
    def description(self) -> str:
        return f"grpo (loss {self.variant}) on completions"

    def head(self, model, h, positions, labels, weights, ref=None, chunk: int = 0):
        """(loss, trained tokens, metrics [len(METRICS)]) from final-normed states h."""
        from mlxlab.train.objectives import position_ce

        if ref is None:
            raise ValueError("GRPO needs the batch's advantages (its per-position array)")
        b, t = h.shape[0], h.shape[1]
        logp = -position_ce(model, h, positions, labels, chunk)
        onehot = (positions[:, None] // t == mx.arange(b)[None, :]).astype(mx.float32)
        value, m = policy_loss(
            logp,
            ref,
            weights,
            onehot,
            self.variant,
            self.epsilon,
            self.epsilon_high,
            self.beta,
            self.max_tokens,
            self.fixed_old,
        )
        return value, weights.sum(), mx.stack([m[k] for k in METRICS])

    def loss(self, model, inputs, positions, labels, weights, ref=None, head_chunk: int = 0):
        """The whole forward and the head (the full backward)."""
        from mlxlab.train.losses import hidden_states

        return self.head(
            model, hidden_states(model, inputs), positions, labels, weights, ref, head_chunk
        )


def position_logps(model, batch, start: dict | None = None, reference: bool = False):
    """Per-position log-probs [N] float32 of a batch's trained tokens, evaluated and without a
    graph, in eval mode: the policy as it is, or with `reference` the reference (the base model
    with every LoRA scale at 0, or with `start` the adapter the run started from, swapped in)."""
    from contextlib import nullcontext

    from mlxlab.train.losses import hidden_states
    from mlxlab.train.objectives import adapter_swapped, adapters_off, position_ce

    was_training = model.training
    model.eval()
    try:
        if not reference:
            ctx = nullcontext()
        else:
            ctx = adapters_off(model) if start is None else adapter_swapped(model, start)
        with ctx:
            h = hidden_states(model, batch.inputs)
            logp = mx.stop_gradient(-position_ce(model, h, batch.positions, batch.labels))
            mx.eval(logp)
    finally:
        model.train(was_training)
    return logp
