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

Rewards (DPO) are beta * (pi - ref) per sequence (per token for IPO); accuracy is the share of pairs whose chosen
reward (DPO) or log odds (ORPO) is the larger.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn

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
    if loss == "ipo":  # IPO's margin is on per-token means: its rewards too (as TRL's)
        chosen, rejected = beta * (pi_c - ref_c) / n_c, beta * (pi_r - ref_r) / n_r
    else:
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


# --- the model side: per-row log-probs, the pair head, the reference --------------------------

METRICS = {
    "dpo": (
        "reward_chosen",
        "reward_rejected",
        "reward_margin",
        "pref_accuracy",
        "logp_chosen",
        "logp_rejected",
    ),
    "orpo": (
        "nll_chosen",
        "log_odds_ratio",
        "or_term",
        "pref_accuracy",
        "logp_chosen",
        "logp_rejected",
    ),
}


def position_ce(model, h: mx.array, positions, labels, chunk: int = 0) -> mx.array:
    """Cross-entropy [N] float32 of final-normed states h [B, T, D] at `positions` (flat
    indices into B*T) against `labels`: minus each trained token's log-prob. `chunk` > 0 runs
    the LM head over that many positions at a time under `mx.checkpoint` (as losses.head_ce)."""
    from mlxlab.train.losses import _head_is_trainable, lm_head, token_ce

    flat = h.reshape(-1, h.shape[-1])[positions]
    n = flat.shape[0]
    if chunk > 0 and _head_is_trainable(model):
        from mlxlab.errors import UserError

        raise UserError("backward.head_chunk needs a frozen LM head (it would get no gradient)")
    if chunk <= 0 or chunk >= n:
        ce = token_ce(lm_head(model, flat), labels)
    else:
        part = mx.checkpoint(lambda hc, lc: token_ce(lm_head(model, hc), lc))
        ce = mx.concatenate(
            [part(flat[i : i + chunk], labels[i : i + chunk]) for i in range(0, n, chunk)]
        )
    return ce.astype(mx.float32)


def row_logps(model, h: mx.array, positions, labels, weights, chunk: int = 0):
    """(summed log-prob, trained-token count) of each row of final-normed states h [B, T, D] at
    its trained `positions` (flat indices into B*T), both [B] float32. `chunk` > 0 runs the LM
    head over that many positions at a time under `mx.checkpoint` (as losses.head_ce)."""
    b, t = h.shape[0], h.shape[1]
    ce = position_ce(model, h, positions, labels, chunk) * weights
    # rows by a one-hot product: a fixed summation order, the same in every backward mode
    onehot = (positions[:, None] // t == mx.arange(b)[None, :]).astype(mx.float32)
    return -(ce @ onehot), weights @ onehot


@dataclass(frozen=True)
class PairObjective:
    """DPO or ORPO over batches of pairs (data/batches.py: rows 2k, 2k+1 are pair k's chosen and
    rejected sides; DPO's batches carry the reference's summed log-prob per row)."""

    kind: str  # dpo | orpo
    beta: float = 0.1
    dpo_loss: str = "sigmoid"
    label_smoothing: float = 0.0
    lam: float = 0.1
    # DPO's reference: None = the base model (adapters off); else the LoRA arrays the run
    # started from (lora.init), swapped in for the reference pass
    start: dict | None = field(default=None, compare=False, repr=False)

    @classmethod
    def from_config(cls, cfg, start: dict | None = None) -> PairObjective | None:
        """From a TrainConfig (and the adapter the run starts from); None for SFT."""
        if cfg.objective == "sft":
            return None
        return cls(
            cfg.objective,
            cfg.dpo.beta,
            cfg.dpo.loss,
            cfg.dpo.label_smoothing,
            cfg.orpo.lam,
            start,
        )

    @property
    def metrics(self) -> tuple[str, ...]:
        return METRICS[self.kind]

    @property
    def needs_reference(self) -> bool:
        return self.kind == "dpo"

    def head(self, model, h, positions, labels, weights, ref=None, chunk: int = 0):
        """(loss, trained tokens, metrics [len(self.metrics)]) from final-normed states h."""
        sums, counts = row_logps(model, h, positions, labels, weights, chunk)
        pi_c, pi_r, n_c, n_r = sums[0::2], sums[1::2], counts[0::2], counts[1::2]
        if self.kind == "dpo":
            if ref is None:
                raise ValueError("DPO needs the reference log-probs of the batch's rows")
            loss, m = dpo(
                pi_c,
                pi_r,
                ref[0::2],
                ref[1::2],
                self.beta,
                self.dpo_loss,
                self.label_smoothing,
                n_c,
                n_r,
            )
        else:
            loss, m = orpo(pi_c, pi_r, n_c, n_r, self.lam)
        return loss, weights.sum(), mx.stack([m[k] for k in self.metrics])

    def loss(self, model, inputs, positions, labels, weights, ref=None, head_chunk: int = 0):
        """The whole forward and the head (full backward, validation)."""
        from mlxlab.train.losses import hidden_states

        return self.head(
            model, hidden_states(model, inputs), positions, labels, weights, ref, head_chunk
        )


@contextmanager
def adapters_off(model):
    """The base model: every LoRA layer's scale set to 0 (its output is then the base linear's,
    exactly: y + 0 * z), restored on exit. No second copy of any weight."""
    from mlx_lm.tuner.dora import DoRALinear

    from mlxlab.lora.apply import lora_modules

    if any(isinstance(m, DoRALinear) for _, m in lora_modules(model)):
        # DoRA's trained magnitudes rescale the output whatever the scale: no switch turns it
        # off (nor a full fine-tune's weights): the run keeps its starting arrays instead.
        raise ValueError(
            "adapters_off needs LoRA adapters (DoRA's magnitudes stay on): pass the starting "
            "arrays as the reference instead (train/job.py attach_lora)"
        )
    modules = [m for _, m in lora_modules(model)]
    saved = [m.scale for m in modules]
    try:
        for m in modules:
            m.scale = 0.0
        yield model
    finally:
        for m, s in zip(modules, saved, strict=True):
            m.scale = s


@contextmanager
def adapter_swapped(model, weights: dict):
    """The model with these LoRA arrays (by full parameter name) in place of its own, which are
    put back on exit (the same array objects: nothing is copied)."""
    from mlxlab.lora.apply import adapter_parameters

    own = adapter_parameters(model)
    try:
        model.load_weights(list(weights.items()), strict=False)
        yield model
    finally:
        model.load_weights(list(own.items()), strict=False)


def reference_logps(model, batch, start: dict | None = None) -> mx.array:
    """The reference model's summed response log-prob of each row of a batch of pairs, [B]
    float32, evaluated and without a graph, in eval mode: the base model (adapters off), or with
    `start` the adapter the run started from."""
    from mlxlab.train.losses import hidden_states

    was_training = model.training
    model.eval()
    try:
        with adapters_off(model) if start is None else adapter_swapped(model, start):
            h = hidden_states(model, batch.inputs)
            sums, _ = row_logps(model, h, batch.positions, batch.labels, batch.weights)
            sums = mx.stop_gradient(sums)
            mx.eval(sums)
    finally:
        model.train(was_training)
    return sums


def _fingerprint(model_name: str, sampler, start: dict | None = None) -> str:
    """What the reference log-probs depend on: the model (and the adapter it starts from) and
    every example's tokens and offset."""
    import hashlib

    import numpy as np

    h = hashlib.sha256(model_name.encode())
    for name in sorted(start or {}):
        h.update(name.encode() + np.asarray(start[name].astype(mx.float32)).tobytes())
    for e in sampler.examples:
        h.update(f"{e.offset}:{','.join(map(str, e.ids))};".encode())
    return h.hexdigest()


def precompute_reference(
    model,
    sampler,
    path,
    model_name: str = "",
    start: dict | None = None,
    world=None,
    reference=None,
) -> None:
    """Give `sampler` (of pairs) the reference log-prob of every example it batches, computed
    once over its batches (the shapes training sees, so the values equal a per-batch
    computation) and written to `path` (JSON, with a fingerprint of the model name and the
    examples); a later run (resume) reads `path` instead, and refuses one made for other data.

    `world` (a run on several processes, train/world.py): rank 0 alone reads and writes `path`,
    each rank computes its share of every batch (a data-parallel sampler's), and every rank gets
    every value. `reference(model, batch)` stands in for reference_logps (the segment
    pipeline's)."""
    import json
    import logging
    from pathlib import Path

    from mlxlab.errors import UserError
    from mlxlab.fsutil import atomic_write_text

    path = Path(path)
    n = len(sampler.examples)
    fingerprint = _fingerprint(model_name, sampler, start)
    if reference is None:

        def reference(model, batch):
            return reference_logps(model, batch, start)

    def read():
        if not path.is_file():
            return None
        try:
            saved = json.loads(path.read_text())
            ref, saved_fp = saved["ref"], saved["fingerprint"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise UserError(f"{path} is not a reference log-prob file ({e}); delete it") from None
        if saved_fp != fingerprint or len(ref) != n:
            raise UserError(
                f"{path} holds reference log-probs of other data or another model; resume with "
                "the run's own data and model, or delete the file to recompute them"
            )
        return [float("nan") if v is None else v for v in ref]

    if world is None:
        saved = read()
    else:
        saved = world.share_floats(
            world.agree(read, "reading reference log-probs"), n, "sharing reference log-probs"
        )
    if saved is not None:
        sampler.set_reference(saved)
        return
    logging.getLogger(__name__).info(
        f"reference log-probs ({'adapter off' if start is None else 'the starting adapter'}) "
        f"for {n // 2} pairs -> {path.name}"
    )
    ref: list = [None] * n
    for group in sampler.groups:
        batch = sampler._collate(group)
        if batch is None:  # a data-parallel rank's empty share
            continue
        order = [i for unit in sampler.shard_of(group) for i in unit]
        for i, v in zip(order, reference(model, batch).tolist(), strict=True):
            ref[i] = v
    if world is not None:
        ref = world.merge_floats(ref, "sharing reference log-probs")
    if world is None or world.writer:
        atomic_write_text(path, json.dumps({"fingerprint": fingerprint, "ref": ref}) + "\n")
    sampler.set_reference([float("nan") if v is None else v for v in ref])
