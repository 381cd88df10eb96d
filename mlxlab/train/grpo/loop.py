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

Data parallel (`dist`, train/parallel.py): each rank rolls out its share of every batch's
prompts (its rank folded into the step's key), scores and normalizes its own groups, and the
update is the trainer's data-parallel step (units summed, gradients all-summed); the record's
reward and length figures are the world's, its times rank 0's, completions.jsonl rank 0's
share.
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


def rollout_stats(ro: Rollout) -> dict[str, list[float]]:
    """The numbers a step's record is made of, per completion."""
    stats = {"reward": list(ro.rewards)}
    stats.update({f"reward_{n}": list(v) for n, v in ro.per_reward.items()})
    stats["length"] = [float(len(c.tokens)) for c in ro.completions]
    stats["truncated"] = [float(c.finish == "length") for c in ro.completions]
    stats["keep"] = [float(k) for k in ro.keep]
    return stats


def gather_stats(stats: dict[str, list[float]], world) -> dict[str, list[float]]:
    """Every rank's completions' numbers, rank after rank (a data-parallel world; every rank
    has as many completions)."""
    if world is None:
        return stats
    keys = list(stats)
    n = len(stats["reward"])
    rows = world.gather_values([v for k in keys for v in stats[k]], "gathering the rewards")
    return {k: [v for row in rows for v in row[i * n : (i + 1) * n]] for i, k in enumerate(keys)}


def rollout_record(stats: dict[str, list[float]], group_size: int) -> dict:
    """The step's reward and completion statistics."""
    total = np.asarray(stats["reward"], np.float64)
    rec = {}
    rec["reward"], rec["reward_std"] = _mean_std(total)
    rec["reward_group_std"] = float(total.reshape(-1, group_size).std(axis=1, ddof=1).mean())
    for name, values in stats.items():
        if name.startswith("reward_"):
            rec[name], rec[f"{name}_std"] = _mean_std(values)
    lengths = stats["length"]
    rec["completion_len"] = float(np.mean(lengths))
    rec["completion_len_min"], rec["completion_len_max"] = int(min(lengths)), int(max(lengths))
    rec["truncated"] = float(np.mean(stats["truncated"]))
    rec["groups_kept"] = float(np.asarray(stats["keep"]).reshape(-1, group_size)[:, 0].mean())
    return rec


def validate(model, tokenizer, sampler, cfg, reward_fns, limit: int = 0, world=None) -> dict:
    """The validation prompts' mean reward (`val_reward`, and per reward function): each
    sampled `group_size` times as the rollouts are, from a key fixed for the run (the seed's,
    not the rollouts' key, so every validation draws alike and none moves the training draws).
    `world`: each rank its share of every batch (its rank folded into the key), summed."""
    g = cfg.grpo
    key = mx.random.split(mx.random.key(cfg.seed), 3)[2]
    texts, records = [], []
    for k, prompts in enumerate(sampler.one_pass(limit)):
        if not prompts:
            continue
        batch_key = mx.random.split(key, k + 1)[k]
        if world is not None:
            batch_key = mx.random.split(batch_key, world.size)[world.rank]
        done = rollout(
            model,
            tokenizer,
            [p.ids for p in prompts],
            g.group_size,
            g.max_tokens,
            KeyedSampler(batch_key, g.temperature, g.top_p, g.top_k),
            g.stop,
            g.share_prefill,
        )
        texts += [c.text for c in done]
        records += [p.record for p in prompts for _ in range(g.group_size)]
    total, per = R.score(reward_fns, texts, records) if texts else ([], {})
    names = [r.name for r in reward_fns]
    sums = [float(np.sum(total)), float(len(total))] + [
        float(np.sum(per.get(n, []))) for n in names
    ]
    if world is not None:
        sums = world.sum_values(sums, "summing validation rewards")
    rec = {"val_reward": sums[0] / sums[1]}
    rec.update({f"val_reward_{n}": v / sums[1] for n, v in zip(names, sums[2:], strict=True)})
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
    from mlxlab.train import checkpoint, trainer

    g = cfg.grpo
    world = None if dist is None else dist.world
    writer = dist is None or dist.writer
    reward_fns = R.resolve(g.rewards, g.reward_weights)
    R.check(reward_fns, [p.record for p in train_sampler.prompts], "training prompts")
    if valid_sampler is not None:
        R.check(reward_fns, [p.record for p in valid_sampler.prompts], "validation prompts")
    optimizer = trainer.make_optimizer(cfg.optim, cfg.iters * g.updates)
    optimizer.init(model.trainable_parameters())
    completions_log = run_dir / "completions.jsonl"
    if dist is None:
        start = checkpoint.resume(run_dir, model, optimizer, train_sampler) if cfg.resume else 0
    else:  # rank 0 restores; every rank gets its state, and the rollouts' key
        start = 0
        if cfg.resume:
            start = dist.on_writer(
                lambda: checkpoint.resume(
                    run_dir, model, optimizer, train_sampler, dist.world_info()
                ),
                "restoring the checkpoint",
            )
        start = dist.sync(model, optimizer, train_sampler, start or 0)
        key = mx.array(np.asarray(train_sampler.key, np.uint32))
        key = world.broadcast_arrays([key], "copying the rollouts' key")[0]
        train_sampler.key = [int(x) for x in np.array(key)]
    if cfg.resume and writer:  # the records a killed run wrote after its checkpoint are redone
        checkpoint.truncate_metrics(completions_log, start)
    # the writer's checkpoints and summary carry them (another rank's summary is not written)
    totals = checkpoint.RunTotals.load(run_dir, start) if writer else checkpoint.RunTotals()
    run_log = run_log or trainer.RunLog(run_dir, cfg.iters)
    model.train()
    mx.reset_peak_memory()
    summary: dict = {"start_step": start, "val_reward": None}
    t0 = since = time.perf_counter()
    totals.t0 = t0
    window_tokens = 0
    try:
        if valid_sampler is not None and cfg.val_every and start == 0:
            val = validate(model, tokenizer, valid_sampler, cfg, reward_fns, cfg.val_batches, world)
            run_log.metrics({"step": 0, **val}, show=True)
            summary["initial_val_reward"] = val["val_reward"]
        for step in range(start + 1, cfg.iters + 1):
            prompts = train_sampler.next()
            train_sampler.key, key = step_key(train_sampler.key, 0 if world is None else world.rank)
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
            kept = int(ro.keep.sum())
            if world is not None:  # every rank updates, or none
                kept_world = int(world.sum_values([kept], "counting the kept groups")[0])
            else:
                kept_world = kept
            if kept_world:
                if kept:
                    batches = update_batches(ro, cfg, cfg.grad_accum, start_adapter, model, timer)
                else:  # this rank's groups all left out: one row that weighs nothing
                    none = dataclasses.replace(
                        ro,
                        advantages=np.zeros_like(ro.advantages),
                        keep=np.eye(len(ro.keep))[0] > 0,
                    )
                    batches = [
                        dataclasses.replace(b, unit_count=0.0)
                        for b in update_batches(none, cfg, 1, start_adapter, model, timer)
                    ]
                t_update = time.perf_counter()
                for u in range(g.updates):
                    update = (step - 1) * g.updates + u + 1
                    mx.random.seed(cfg.seed * 1_000_003 + update)  # dropout of this update
                    loss, norm, aux = trainer.train_step(
                        model, optimizer, grad_fn, batches, cfg.optim.grad_clip, update, dist
                    )
                    losses.append(loss)
                    norms.append(norm)
                    metrics.append(aux)
                timer["update_s"] = time.perf_counter() - t_update
                tokens = sum(sum(b.lengths) for b in batches if b.units) * g.updates
                trained = sum(b.ntoks for b in batches if b.units)
                if dist is not None:  # the world's
                    tokens, trained, _ = dist.counts(tokens, trained, 0.0)
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
            record.update(rollout_record(gather_stats(rollout_stats(ro), world), g.group_size))
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
                if dist is not None:  # every rank's peak memory and traffic
                    record.update(dist.log_fields())
                totals.saw(record["peak_mem_gb"])
                window_tokens, since = 0, now
            if (
                valid_sampler is not None
                and cfg.val_every
                and (step % cfg.val_every == 0 or step == cfg.iters)
            ):
                val = validate(
                    model, tokenizer, valid_sampler, cfg, reward_fns, cfg.val_batches, world
                )
                record.update(val)
                summary["val_reward"] = val["val_reward"]
            if "loss" in record and not math.isfinite(record["loss"]):
                raise trainer.TrainingDiverged(f"loss became {record['loss']} at step {step}")
            run_log.metrics(record, show="tok_per_s" in record or "val_reward" in record)
            if g.log_completions and writer:  # (rank 0's share, under data parallel)
                with completions_log.open("a") as f:
                    f.write(json.dumps(completions_record(step, ro, g.group_size)) + "\n")
            summary["loss"] = record.get("loss")
            summary["reward"] = record["reward"]
            if cfg.save_every and step % cfg.save_every == 0 and step < cfg.iters:
                save = checkpoint.save_checkpoint if dist is None else dist.save_checkpoint
                save(
                    run_dir,
                    step,
                    model,
                    plan,
                    optimizer,
                    train_sampler,
                    meta or {},
                    cfg.keep_last,
                    totals=totals.so_far(),
                )
    finally:
        run_log.close()
    summary.update(
        steps=cfg.iters, seconds=time.perf_counter() - t0, peak_mem_gb=mx.get_peak_memory() / 1e9
    )
    if dist is not None:  # every rank's peak memory and traffic over the run
        summary.update(dist.summary_fields())
    summary.update(totals.summary(summary["peak_mem_gb"]))  # the whole run's, over its attempts
    return summary
