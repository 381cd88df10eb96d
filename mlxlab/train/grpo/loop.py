"""GRPO's loop: a rollout batch, its rewards and advantages, then `grpo.updates` optimizer steps.

Each of `iters` steps:

1. the prompt sampler's next `batch_size` prompts (data/prompts.py), each decoded
   `grpo.group_size` times on the batched decoder (rollout.py), with the step's key split off
   the run's key;
2. the rewards (rewards.py) of every completion, their weighted sum, and the group-normalized
   advantages (losses.py); DAPO leaves the groups whose rewards are all equal out;
3. the completions as training rows (prompt + completion, the completion's tokens trained, the
   token that ended it included), split into `grad_accum` micro-batches; the reference's
   log-probs (grpo.beta > 0: the adapter off, or lora.init's adapter swapped in) and, with
   mu > 1, the old policy's, computed forward-only once;
4. mu optimizer steps of the trainer's `train_step` over those micro-batches, through whatever
   backward mode the run uses (`grad_fn` with a GRPOObjective: every mode computes the same
   numbers).

One record per step goes to metrics.jsonl: the update's loss, gradient norm and head metrics
(averaged over the mu updates), the reward's mean and std (in total and per reward function),
completion lengths and the truncated share, and the rollout, reference and update times.
Checkpoints hold the trainer's state plus the prompt sampler's position and the rollouts' key,
so a resumed run continues with the completions the uninterrupted one drew.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlxlab.data.batches import collate_rows
from mlxlab.data.datasets import Example
from mlxlab.train.grpo import losses as L
from mlxlab.train.grpo import rewards as R
from mlxlab.train.grpo.rollout import KeyedSampler, RolloutStats, rollout, step_key

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Rollout:
    """One step's rollouts, scored: rows prompt-major (group k's at k * G ...)."""

    prompts: list
    completions: list
    rewards: list[float]
    per_reward: dict[str, list[float]]
    advantages: np.ndarray
    keep: np.ndarray
    """[rows] bool: the rows that go into the update (all, or DAPO's non-uniform groups)."""


def score(cfg, reward_fns, prompts, completions) -> Rollout:
    """Rewards, advantages and the rows kept for the update."""
    g = cfg.grpo
    records = [p.record for p in prompts for _ in range(g.group_size)]
    total, per = R.score(reward_fns, [c.text for c in completions], records)
    adv = L.group_advantages(total, g.group_size, g.scale)
    keep = np.ones(len(total), bool)
    if g.drops_uniform_groups:
        keep = np.repeat(~L.uniform_groups(total, g.group_size), g.group_size)
    return Rollout(prompts, completions, total, per, adv, keep)


def update_batches(ro: Rollout, cfg, grad_accum: int, start: dict | None, model, timer: dict):
    """The kept rows as `grad_accum` micro-batches (or fewer, when fewer rows are kept), each
    with its per-position array (advantage, old log-prob, reference log-prob) in `ref` and its
    loss units (completions, or tokens for DAPO's token-level mean)."""
    g = cfg.grpo
    rows = []  # (prompt + completion with the completion trained, its advantage)
    for k, c in enumerate(ro.completions):
        if ro.keep[k]:
            prompt = list(ro.prompts[k // g.group_size].ids)
            rows.append((Example(prompt + c.tokens, len(prompt)), float(ro.advantages[k])))
    parts = np.array_split(np.arange(len(rows)), min(grad_accum, len(rows)))
    out = []
    for part in parts:
        chunk = [rows[i] for i in part]
        batch = collate_rows([[e] for e, _ in chunk], packed=False)
        n, width = batch.ntoks, batch.inputs.shape[1]
        aux = np.zeros((batch.positions.shape[0], 3), np.float32)
        row_of = np.array(batch.positions[:n]) // width
        aux[:n, L.ADV] = np.array([a for _, a in chunk], np.float32)[row_of]
        t0 = time.perf_counter()
        if g.beta:
            aux[:, L.REF] = np.array(L.position_logps(model, batch, start, reference=True))
        if g.updates > 1:
            aux[:, L.OLD] = np.array(L.position_logps(model, batch))
        timer["ref_s"] = timer.get("ref_s", 0.0) + time.perf_counter() - t0
        units = float(n) if g.loss == "dapo" else float(len(chunk))
        out.append(dataclasses.replace(batch, ref=mx.array(aux), unit_count=units))
    return out


def _mean_std(values) -> tuple[float, float]:
    a = np.asarray(values, np.float64)
    return float(a.mean()), float(a.std())


def rollout_record(ro: Rollout, group_size: int) -> dict:
    """The step's reward and completion statistics."""
    total = np.asarray(ro.rewards, np.float64)
    rec = {}
    rec["reward"], rec["reward_std"] = _mean_std(total)
    rec["reward_group_std"] = float(total.reshape(-1, group_size).std(axis=1, ddof=1).mean())
    for name, values in ro.per_reward.items():
        rec[f"reward_{name}"], rec[f"reward_{name}_std"] = _mean_std(values)
    lengths = [len(c.tokens) for c in ro.completions]
    rec["completion_len"] = float(np.mean(lengths))
    rec["completion_len_min"], rec["completion_len_max"] = min(lengths), max(lengths)
    rec["truncated"] = float(np.mean([c.finish == "length" for c in ro.completions]))
    rec["groups_kept"] = float(ro.keep.reshape(-1, group_size)[:, 0].mean())
    return rec


def validate(model, tokenizer, sampler, cfg, reward_fns, limit: int = 0) -> dict:
    """The validation prompts' mean reward (`val_reward`, and per reward function): each
    sampled `group_size` times as the rollouts are, from a key fixed for the run (the seed's,
    not the rollouts' key, so every validation draws alike and none moves the training draws)."""
    g = cfg.grpo
    key = mx.random.split(mx.random.key(cfg.seed), 3)[2]
    texts, records = [], []
    for k, prompts in enumerate(sampler.one_pass(limit)):
        if not prompts:
            continue
        done = rollout(
            model,
            tokenizer,
            [p.ids for p in prompts],
            g.group_size,
            g.max_tokens,
            KeyedSampler(mx.random.split(key, k + 1)[k], g.temperature, g.top_p, g.top_k),
            g.stop,
            g.share_prefill,
        )
        texts += [c.text for c in done]
        records += [p.record for p in prompts for _ in range(g.group_size)]
    total, per = R.score(reward_fns, texts, records)
    rec = {"val_reward": float(np.mean(total))}
    rec.update({f"val_reward_{k}": float(np.mean(v)) for k, v in per.items()})
    return rec


def completions_record(step: int, ro: Rollout, group_size: int) -> dict:
    """One line of completions.jsonl: every completion of the step, with its prompt's line in
    the prompt file, its reward(s) and how it ended."""
    rows = []
    for k, c in enumerate(ro.completions):
        rows.append(
            {
                "line": ro.prompts[k // group_size].line,
                "text": c.text,
                "reward": ro.rewards[k],
                **{f"reward_{n}": v[k] for n, v in ro.per_reward.items()},
                "tokens": len(c.tokens),
                "finish": c.finish,
                "kept": bool(ro.keep[k]),
            }
        )
    return {"step": step, "completions": rows}


def train(
    model,
    tokenizer,
    plan,
    train_sampler,
    valid_sampler,
    cfg,
    run_dir: Path,
    grad_fn,
    run_log=None,
    meta: dict | None = None,
    start_adapter: dict | None = None,
    dist=None,
) -> dict:
    """Train `model`'s LoRA parameters for cfg.iters rollout batches; return a summary. Resumes
    from the newest checkpoint in `run_dir` when cfg.resume is set."""
    from mlxlab.errors import UserError
    from mlxlab.train import trainer

    if dist is not None:
        raise UserError("objective=grpo trains on one process (data parallel is not wired yet)")
    g = cfg.grpo
    reward_fns = R.resolve(g.rewards, g.reward_weights)
    R.check(reward_fns, [p.record for p in train_sampler.prompts], "training prompts")
    if valid_sampler is not None:
        R.check(reward_fns, [p.record for p in valid_sampler.prompts], "validation prompts")
    optimizer = trainer.make_optimizer(cfg.optim, cfg.iters * g.updates)
    optimizer.init(model.trainable_parameters())
    start = trainer._resume(run_dir, model, optimizer, train_sampler) if cfg.resume else 0
    completions_log = run_dir / "completions.jsonl"
    if cfg.resume:  # the records a killed run wrote after its checkpoint are redone
        trainer._truncate_metrics(completions_log, start)
    run_log = run_log or trainer.RunLog(run_dir, cfg.iters)
    model.train()
    mx.reset_peak_memory()
    summary: dict = {"start_step": start, "val_reward": None}
    t0 = since = time.perf_counter()
    window_tokens = 0
    try:
        if valid_sampler is not None and cfg.val_every and start == 0:
            val = validate(model, tokenizer, valid_sampler, cfg, reward_fns, cfg.val_batches)
            run_log.metrics({"step": 0, **val}, show=True)
            summary["initial_val_reward"] = val["val_reward"]
        for step in range(start + 1, cfg.iters + 1):
            prompts = train_sampler.next()
            train_sampler.key, key = step_key(train_sampler.key)
            sampler = KeyedSampler(key, g.temperature, g.top_p, g.top_k)
            stats = RolloutStats()
            completions = rollout(
                model,
                tokenizer,
                [p.ids for p in prompts],
                g.group_size,
                g.max_tokens,
                sampler,
                g.stop,
                g.share_prefill,
                stats=stats,
            )
            t_reward = time.perf_counter()
            ro = score(cfg, reward_fns, prompts, completions)
            timer = {"reward_s": time.perf_counter() - t_reward}
            record = {"step": step}
            losses, norms, metrics = [], [], []
            tokens = trained = 0
            if ro.keep.any():
                batches = update_batches(ro, cfg, cfg.grad_accum, start_adapter, model, timer)
                t_update = time.perf_counter()
                for u in range(g.updates):
                    update = (step - 1) * g.updates + u + 1
                    mx.random.seed(cfg.seed * 1_000_003 + update)  # dropout of this update
                    loss, norm, aux = trainer.train_step(
                        model, optimizer, grad_fn, batches, cfg.optim.grad_clip, update
                    )
                    losses.append(loss)
                    norms.append(norm)
                    metrics.append(aux)
                timer["update_s"] = time.perf_counter() - t_update
                tokens = sum(sum(b.lengths) for b in batches) * g.updates
                trained = sum(b.ntoks for b in batches)
                record.update(
                    loss=float(np.mean(losses)),
                    lr=optimizer.learning_rate.item(),
                    grad_norm=float(np.mean(norms)),
                )
                record.update(
                    zip(L.METRICS, np.mean(np.asarray(metrics), axis=0).tolist(), strict=True)
                )
                if g.updates > 1:
                    record["loss_updates"] = losses
            record.update(rollout_record(ro, g.group_size))
            record.update(
                elapsed_s=round(time.perf_counter() - t0, 3),
                tokens=tokens,
                trained_tokens=trained,
                rollout_s=round(stats.seconds, 3),
                rollout_tok_per_s=stats.completion_tokens / max(stats.seconds, 1e-9),
                prefill_tokens=stats.prefill_tokens,
                **{k: round(v, 3) for k, v in timer.items()},
            )
            window_tokens += tokens
            if step % cfg.log_every == 0 or step == cfg.iters:
                now = time.perf_counter()
                record["tok_per_s"] = window_tokens / (now - since)
                record["peak_mem_gb"] = mx.get_peak_memory() / 1e9
                window_tokens, since = 0, now
            if (
                valid_sampler is not None
                and cfg.val_every
                and (step % cfg.val_every == 0 or step == cfg.iters)
            ):
                val = validate(model, tokenizer, valid_sampler, cfg, reward_fns, cfg.val_batches)
                record.update(val)
                summary["val_reward"] = val["val_reward"]
            if "loss" in record and not math.isfinite(record["loss"]):
                raise trainer.TrainingDiverged(f"loss became {record['loss']} at step {step}")
            run_log.metrics(record, show="tok_per_s" in record or "val_reward" in record)
            if g.log_completions:
                with completions_log.open("a") as f:
                    f.write(json.dumps(completions_record(step, ro, g.group_size)) + "\n")
            summary["loss"] = record.get("loss")
            summary["reward"] = record["reward"]
            if cfg.save_every and step % cfg.save_every == 0 and step < cfg.iters:
                trainer.save_checkpoint(
                    run_dir, step, model, plan, optimizer, train_sampler, meta or {}, cfg.keep_last
                )
    finally:
        run_log.close()
    summary.update(
        steps=cfg.iters, seconds=time.perf_counter() - t0, peak_mem_gb=mx.get_peak_memory() / 1e9
    )
    return summary
