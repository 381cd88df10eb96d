"""One training step's gradient and loss, as the trainer computes them, saved for comparison.

    python -m tests.helpers.dist_step OUT.npz [shares=N] [train overrides]

in one process, or as the ranks of a data-parallel world (tests/helpers/dist.py start_ranks):
the same set-up as `mlxlab train` (model, LoRA, the sampler's first batch, the backward mode,
the objective), then `trainer.train_step` with an optimizer whose update records the gradients
it is given (after the cross-rank sum, before any change to the model). Rank 0 writes OUT.npz:
every gradient array, `loss` and `grad_norm`. `shares=N` (one process): also OUT_shares.npz, the
batch computed as N data-parallel ranks' shares, one after the other, summed as the all_sum sums
them.
"""

from __future__ import annotations

import sys

import mlxlab  # noqa: F401  (BLAS before MLX)


class Recorder:
    """Stands in for the optimizer of one step: keeps the gradients train_step applies."""

    def __init__(self):
        self.grads = None
        self.state = {}

    def update(self, model, grads):
        self.grads = grads


class Shares:
    """A `dist` in one process: the ranks' shares of the step's batches (`shares[r]`: rank r's),
    rank 0's through train_step, the others' weighted and added after it in rank order (what a
    two-rank all_sum adds)."""

    def __init__(self, shares):
        self.shares = shares
        self.total = sum(b.units for share in shares for b in share)

    def total_units(self, units):
        return self.total

    def grads(self, model, grad_fn, batches):
        self.grad_fn, self.model = grad_fn, model
        return (grad_fn(model, b) for b in batches)

    def reduce(self, loss_sum, acc, metrics):
        import mlx.core as mx
        from mlx.utils import tree_map

        for share in self.shares[1:]:
            part_loss, part = mx.array(0.0), None
            for b in share:
                loss, _, grads, *_ = self.grad_fn(self.model, b)
                w = b.units / self.total
                grads = tree_map(lambda g, w=w: g * w, grads)
                part = grads if part is None else tree_map(mx.add, part, grads)
                part_loss = part_loss + loss * w
            acc = tree_map(mx.add, acc, part)
            loss_sum = loss_sum + part_loss
        return loss_sum, acc, metrics

    def clip(self, acc, grad_clip):
        from mlxlab.train.trainer import clip_or_norm

        return clip_or_norm(acc, grad_clip)


def main(argv: list[str]) -> None:
    import mlx.core as mx
    import numpy as np
    from mlx.utils import tree_flatten

    from mlxlab.cli import compose
    from mlxlab.data.batches import BatchSampler
    from mlxlab.data.datasets import load_split, resolve_paths
    from mlxlab.lora import apply as lora_apply
    from mlxlab.models.zoo import load
    from mlxlab.train import trainer
    from mlxlab.train.backward import make_grad_fn
    from mlxlab.train.objectives import PairObjective
    from mlxlab.train.parallel import DataParallel
    from mlxlab.train.world import World

    out, overrides = argv[0], argv[1:]
    shares = [int(a.split("=", 1)[1]) for a in overrides if a.startswith("shares=")]
    overrides = [a for a in overrides if not a.startswith("shares=")]
    cfg = compose("train", overrides).train_config()
    world = World.start(cfg.dist)
    model, tokenizer = load(cfg.model, cfg.dtype, decode_head="exact")
    pairs = cfg.objective != "sft"
    if pairs:
        from mlxlab.data.preference import load_pair_split as load_split  # noqa: F811
    train_path, _ = resolve_paths(cfg.data)
    examples = load_split(train_path, tokenizer, cfg.data).examples
    if cfg.lora.init:
        raise SystemExit("dist_step starts from a fresh LoRA; lora.init is train's (job.py)")
    plan = lora_apply.plan(model, cfg.lora)
    lora_apply.apply(model, plan, seed=cfg.seed)
    objective = PairObjective.from_config(cfg)
    grad_fn, _ = make_grad_fn(
        model,
        cfg.backward,
        (cfg.batch_size * (2 if pairs else 1), 512),
        compile=cfg.compile,
        objective=objective,
    )
    model.train()

    def step(sampler, dist, path):
        batches = [sampler.next() for _ in range(cfg.grad_accum)]
        mx.random.seed(cfg.seed * 1_000_003 + 1)
        recorder = Recorder()  # the model is left as it was
        loss, norm, _ = trainer.train_step(
            model, recorder, grad_fn, batches, cfg.optim.grad_clip, 1, dist
        )
        if world is None or world.writer:
            arrays = {k: np.array(v) for k, v in tree_flatten(recorder.grads)}
            np.savez(path, loss=np.float64(loss), grad_norm=np.float64(norm), **arrays)

    def sampler_of(shard):
        return BatchSampler(examples, cfg.batch_size, cfg.seed, pairs=pairs, shard=shard)

    if world is not None:
        step(sampler_of((world.rank, world.size)), DataParallel(world), out)
        return
    step(sampler_of((0, 1)), None, out)
    if shares:  # rank r's share from rank r's sampler; rank 0's batches go through train_step
        n = shares[0]
        others = Shares(
            [[sampler_of((r, n)).next() for _ in range(cfg.grad_accum)] for r in range(n)]
        )
        step(sampler_of((0, n)), others, out.replace(".npz", "") + "_shares.npz")


if __name__ == "__main__":
    main(sys.argv[1:])
