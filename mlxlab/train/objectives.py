"""Preference objectives on per-sequence log-probabilities: DPO (sigmoid and IPO) and ORPO.

Every function here takes the sums (or means) of the response tokens' log-probabilities of each
sequence of a batch of pairs, chosen and rejected, as arrays [P] (one entry per pair), and
returns the loss (a scalar) and the metrics the trainer logs, as a dict of scalars. They are
the published formulas, written once:

- DPO (Rafailov et al. 2023), `loss="sigmoid"`: with the policy's and the reference's summed
  log-probs, h = beta * ((pi_c - pi_r) - (ref_c - ref_r)) and
  loss = mean(-(1 - eps) * log sigmoid(h) - eps * log sigmoid(-h)) (eps: label smoothing,
  the conservative DPO of Mitchell 2023; 0 is plain DPO).
- IPO (Azar et al. 2023), `loss="ipo"`: loss = mean((h / beta - 1 / (2 beta))^2), on the
  per-token mean log-probs (as TRL computes it: IPO's regression target does not scale with the
  response length).
- ORPO (Hong et al. 2024): with the per-token mean log-probs m_c, m_r (the log of each response's
  geometric-mean token probability), log odds(y) = m - log(1 - exp(m)), and
  loss = NLL(chosen) - lambda * mean(log sigmoid(log odds(y_c) - log odds(y_r))), NLL(chosen) the
  SFT loss (mean cross-entropy over the chosen responses' tokens); no reference model.

Rewards (DPO) are beta * (pi - ref) per sequence; accuracy is the share of pairs whose chosen
reward (DPO) or log odds (ORPO) is the larger.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

OBJECTIVES = ("sft", "dpo", "orpo")
DPO_LOSSES = ("sigmoid", "ipo")


def _log1mexp(x: mx.array) -> mx.array:
    """log(1 - exp(x)) for x < 0, stable at both ends (Maechler 2012)."""
    return mx.where(x > -0.6931471805599453, mx.log(-mx.expm1(x)), mx.log1p(-mx.exp(x)))


def dpo(
    pi_c: mx.array,
    pi_r: mx.array,
    ref_c: mx.array,
    ref_r: mx.array,
    beta: float,
    loss: str = "sigmoid",
    label_smoothing: float = 0.0,
    n_c: mx.array | None = None,
    n_r: mx.array | None = None,
) -> tuple[mx.array, dict[str, mx.array]]:
    """DPO's loss and metrics from summed log-probs [P]; `n_c`, `n_r` (response token counts)
    are needed for IPO, which works on per-token means."""
    if loss == "ipo":
        if n_c is None or n_r is None:
            raise ValueError("IPO needs the response token counts")
        logits = (pi_c / n_c - pi_r / n_r) - (ref_c / n_c - ref_r / n_r)
        losses = (logits - 1 / (2 * beta)) ** 2
    elif loss == "sigmoid":
        logits = (pi_c - pi_r) - (ref_c - ref_r)
        losses = -(1 - label_smoothing) * nn.log_sigmoid(
            beta * logits
        ) - label_smoothing * nn.log_sigmoid(-beta * logits)
    else:
        raise ValueError(f"unknown DPO loss {loss!r}; choose one of {', '.join(DPO_LOSSES)}")
    chosen, rejected = beta * (pi_c - ref_c), beta * (pi_r - ref_r)
    metrics = {
        "reward_chosen": chosen.mean(),
        "reward_rejected": rejected.mean(),
        "reward_margin": (chosen - rejected).mean(),
        "pref_accuracy": (chosen > rejected).astype(mx.float32).mean(),
        "logp_chosen": pi_c.mean(),
        "logp_rejected": pi_r.mean(),
    }
    return losses.mean(), metrics


def orpo(
    sum_c: mx.array,
    sum_r: mx.array,
    n_c: mx.array,
    n_r: mx.array,
    lam: float,
) -> tuple[mx.array, dict[str, mx.array]]:
    """ORPO's loss and metrics from the summed log-probs [P] and response token counts [P]."""
    m_c, m_r = sum_c / n_c, sum_r / n_r
    log_odds = (m_c - m_r) - (_log1mexp(m_c) - _log1mexp(m_r))
    ratio = nn.log_sigmoid(log_odds)
    nll = -sum_c.sum() / n_c.sum()
    metrics = {
        "nll_chosen": nll,
        "log_odds_ratio": log_odds.mean(),
        "or_term": ratio.mean(),
        "pref_accuracy": (log_odds > 0).astype(mx.float32).mean(),
        "logp_chosen": m_c.mean(),
        "logp_rejected": m_r.mean(),
    }
    return nll - lam * ratio.mean(), metrics
