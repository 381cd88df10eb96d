"""GRPO: the four losses against a plain implementation of the published formulas, bit for bit
across the backward modes, and the parts around them (advantages, rewards, prompts, rollouts on
the batched decoder, the loop, resume)."""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

import mlxlab  # noqa: F401
from mlxlab.config import GRPOConfig, TrainConfig
from mlxlab.data.prompts import Prompt
from mlxlab.models import tiny
from mlxlab.train import backward as bw
from mlxlab.train import trainer
from mlxlab.train.grpo import loop
from mlxlab.train.grpo import losses as L
from mlxlab.train.grpo.rollout import Completion
from tests.helpers.lora_model import lora_model

VARIANTS = ("grpo", "dr_grpo", "gspo", "dapo")
G = 4
# two groups of four: (prompt tokens after BOS, completion tokens)
PROMPTS = [9, 14]
COMPLETIONS = [5, 12, 3, 8, 10, 4, 7, 6]
REWARDS = [1.0, 0.0, 0.5, 1.0, 0.0, 0.0, 1.0, 0.25]


# --- advantages, by hand ------------------------------------------------------------------------


def test_group_advantages_by_hand():
    # group [1, 0, 0.5, 1]: mean 0.625, deviations [.375, -.625, -.125, .375], sample std
    # sqrt((.140625 + .390625 + .015625 + .140625) / 3) = 0.478713...
    adv = L.group_advantages(REWARDS, G)
    std = (0.6875 / 3) ** 0.5
    want = [d / (std + 1e-4) for d in (0.375, -0.625, -0.125, 0.375)]
    assert adv[:4].tolist() == pytest.approx(want, rel=1e-6)
    # Dr. GRPO: deviations only; the second group [0, 0, 1, .25]: mean .3125
    assert L.group_advantages(REWARDS, G, "none")[4:].tolist() == pytest.approx(
        [-0.3125, -0.3125, 0.6875, -0.0625], rel=1e-6
    )
    assert L.uniform_groups([1, 1, 0, 1, 2, 2, 2, 2], G).tolist() == [False, True]
    assert L.group_advantages([2, 2, 2, 2], G).tolist() == [0, 0, 0, 0]


# --- the losses on a tiny model ------------------------------------------------------------------


def _rollout(family: str = "llama", seed: int = 0):
    """A tiny model with LoRA and fixed completions and rewards, as a scored rollout."""
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


def _cfg(variant: str, updates: int = 2, beta: float = 0.05, **kw) -> TrainConfig:
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


def _batches(variant: str, family: str = "llama", updates: int = 2, grad_accum: int = 1, **kw):
    """(model, objective, batches): the rollout's update batches, the old log-probs moved off
    the current ones (as after a first update) so that ratios leave the clip range."""
    model, prompts, completions = _rollout(family)
    cfg = _cfg(variant, updates, **kw)
    adv = L.group_advantages(REWARDS, G, cfg.grpo.scale_rewards)
    ro = loop.Rollout(prompts, completions, REWARDS, {}, adv, np.ones(len(REWARDS), bool))
    batches = loop.update_batches(ro, cfg, grad_accum, None, model, {})
    if updates > 1:
        rng = np.random.default_rng(1)
        shifted = []
        for b in batches:
            aux = np.array(b.ref)
            aux[:, L.OLD] += rng.normal(0, 0.3, len(aux)).astype(np.float32)
            shifted.append(dataclasses.replace(b, ref=mx.array(aux)))
        batches = shifted
    return model, L.GRPOObjective.from_config(cfg), batches, cfg


def _plain_loss(model, prompts, completions, adv, old, ref, cfg):
    """The published formulas, row by row: each completion run alone through the model's own
    __call__ (full logits, log-softmax, the sampled token's entry), then DeepSeekMath's clipped
    surrogate with the k3 KL, aggregated as each paper does."""
    g = cfg.grpo
    rows, at = [], 0
    for k, c in enumerate(completions):
        ids = prompts[k // G].ids + c.tokens
        logits = model(mx.array(ids[:-1])[None])[0].astype(mx.float32)
        logp_all = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        p = len(prompts[k // G].ids)
        lp = mx.stack([logp_all[p - 1 + t, tok] for t, tok in enumerate(c.tokens)])
        n = len(c.tokens)
        o = mx.stop_gradient(lp) if g.updates == 1 else mx.array(old[at : at + n])
        r = mx.array(ref[at : at + n])
        at += n
        a = float(adv[k])
        if g.loss == "gspo":
            s = mx.exp((lp - o).sum() / n)
            surrogate = -mx.minimum(s * a, mx.clip(s, 1 - g.epsilon, 1 + g.epsilon_high) * a)
            terms = mx.broadcast_to(surrogate, (n,))
        else:
            ratio = mx.exp(lp - o)
            clipped = mx.clip(ratio, 1 - g.epsilon, 1 + g.epsilon_high)
            terms = -mx.minimum(ratio * a, clipped * a)
        kl = mx.exp(r - lp) - (r - lp) - 1
        rows.append(terms + g.beta * kl)
    if g.loss in ("grpo", "gspo"):  # 1/G sum_i 1/|o_i| sum_t
        return mx.stack([t.mean() for t in rows]).mean()
    if g.loss == "dr_grpo":  # sum_i sum_t / (G * max_tokens)
        return mx.stack([t.sum() for t in rows]).sum() / (len(rows) * g.max_tokens)
    return mx.stack([t.sum() for t in rows]).sum() / sum(t.shape[0] for t in rows)  # dapo


@pytest.mark.parametrize("updates", [1, 2])
@pytest.mark.parametrize("variant", VARIANTS)
def test_loss_and_gradients_match_the_published_formulas(variant, updates):
    model, objective, (batch,), cfg = _batches(variant, updates=updates)
    model_, prompts, completions = _rollout()
    assert model_ is not model  # a second, identical copy: the plain side's own
    loss, _, grads, metrics = trainer.full_backward(model, objective.loss, compile=False)(
        model, batch
    )
    n = batch.ntoks
    aux = np.array(batch.ref)[:n]
    adv = L.group_advantages(REWARDS, G, cfg.grpo.scale_rewards)

    def plain(params):
        model_.update(params)
        return _plain_loss(model_, prompts, completions, adv, aux[:, L.OLD], aux[:, L.REF], cfg)

    want, want_grads = mx.value_and_grad(plain)(model_.trainable_parameters())
    assert loss.item() == pytest.approx(want.item(), rel=1e-5, abs=1e-7)
    g, r = dict(tree_flatten(grads)), dict(tree_flatten(want_grads))
    num = sum(float(((g[k] - r[k]) ** 2).sum()) for k in r) ** 0.5
    den = sum(float((r[k] ** 2).sum()) for k in r) ** 0.5
    assert den > 0 and num / den < 1e-4
    m = dict(zip(L.METRICS, np.array(metrics).tolist(), strict=True))
    assert m["kl"] > 0  # the adapter moves the policy off the reference
    if updates == 1:  # the ratio is 1: nothing clipped
        assert m["ratio"] == 1.0 and m["clip_frac"] == 0.0
    else:  # old log-probs moved by 0.3: some ratios leave the clip range, some stay in it
        assert 0 < m["clip_frac"] < 1 and m["ratio"] != 1.0


@pytest.mark.parametrize("family", tiny.FAMILIES)
@pytest.mark.parametrize("variant", VARIANTS)
def test_gradients_are_bit_exact_across_backward_modes(family, variant):
    model, objective, (batch,), _ = _batches(variant, family)
    full = trainer.full_backward(model, objective.loss, compile=False)(model, batch)
    runs = [bw.checkpointed_backward(model, objective=objective)(model, batch)]
    for size in (1, 4):
        plan = bw.plan_by_size(len(model.layers), size)
        runs.append(bw.segmented_backward(model, plan, objective=objective)(model, batch))
    for got in runs:
        assert got[0].item() == full[0].item() and got[1].item() == full[1].item()
        assert np.array_equal(np.array(got[3]), np.array(full[3]))
        g, r = dict(tree_flatten(got[2])), dict(tree_flatten(full[2]))
        assert g.keys() == r.keys() and r
        for k in r:
            assert np.array_equal(np.array(g[k]), np.array(r[k])), k
    assert any(float(np.abs(np.array(v)).max()) > 0 for _, v in tree_flatten(full[2]))


@pytest.mark.parametrize("variant", VARIANTS)
def test_accumulated_micro_batches_equal_one_batch(variant):
    """grad_accum splits the completions; each micro-batch weighs its completions (its tokens
    for DAPO), so the step is the one-batch step to float rounding."""
    model, objective, (whole,), _ = _batches(variant, updates=1)
    _, _, parts, _ = _batches(variant, updates=1, grad_accum=3)
    assert len(parts) == 3
    grad_fn = trainer.full_backward(model, objective.loss, compile=False)
    loss, _, grads, _ = grad_fn(model, whole)
    total = sum(b.units for b in parts)
    acc, acc_loss = None, 0.0
    for b in parts:
        part_loss, _, g, _ = grad_fn(model, b)
        w = b.units / total
        acc_loss += part_loss.item() * w
        g = {k: v * w for k, v in tree_flatten(g)}
        acc = g if acc is None else {k: acc[k] + g[k] for k in g}
    assert acc_loss == pytest.approx(loss.item(), rel=1e-5, abs=1e-8)
    want = dict(tree_flatten(grads))
    num = sum(float(((acc[k] - want[k]) ** 2).sum()) for k in want) ** 0.5
    den = sum(float((want[k] ** 2).sum()) for k in want) ** 0.5
    assert den > 0 and num / den < 1e-5


def test_the_first_of_several_updates_has_ratio_one_and_the_second_does_not():
    """mu = 2: the old log-probs are the rollout policy's, computed before the first update, so
    its ratio is exactly 1; after one optimizer step the second update's is not."""
    model, _, _, cfg = _batches("grpo", updates=2)
    model, prompts, completions = _rollout()
    adv = L.group_advantages(REWARDS, G)
    ro = loop.Rollout(prompts, completions, REWARDS, {}, adv, np.ones(len(REWARDS), bool))
    batches = loop.update_batches(ro, cfg, 1, None, model, {})
    objective = L.GRPOObjective.from_config(cfg)
    assert not objective.fixed_old
    optimizer = trainer.make_optimizer(cfg.optim, 2)
    optimizer.init(model.trainable_parameters())
    grad_fn = trainer.full_backward(model, objective.loss, compile=False)
    ratios = []
    for step in (1, 2):
        _, _, metrics = trainer.train_step(model, optimizer, grad_fn, batches, None, step)
        ratios.append(dict(zip(L.METRICS, metrics, strict=True))["ratio"])
    assert ratios[0] == 1.0 and ratios[1] != 1.0


def test_the_reference_is_the_adapter_switched_off():
    model, _, (batch,), _ = _batches("grpo", "gemma3")
    base, _, _ = tiny.build("gemma3", seed=0)
    from mlxlab.train.losses import hidden_states
    from mlxlab.train.objectives import position_ce

    want = -position_ce(base, hidden_states(base, batch.inputs), batch.positions, batch.labels)
    assert np.array_equal(np.array(batch.ref)[:, L.REF], np.array(want))
    policy = L.position_logps(model, batch)
    assert not np.array_equal(np.array(policy), np.array(want))
