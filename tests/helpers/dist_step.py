"""One training step's gradient and loss, as the trainer computes them, saved for comparison.

    python -m tests.helpers.dist_step OUT.npz [train overrides]

in one process, or as the ranks of a data-parallel world (tests/helpers/dist.py start_ranks):
the same set-up as `mlxlab train` (model, LoRA, the sampler's first batch, the backward mode,
the objective), then `trainer.train_step` with an optimizer whose update records the gradients
it is given (after the cross-rank sum, before any change to the model). Rank 0 writes OUT.npz:
every gradient array, `loss` and `grad_norm`.
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
    cfg = compose("train", overrides).train_config()
    world = World.start(cfg.dist)
    model, tokenizer = load(cfg.model, cfg.dtype, decode_head="exact")
    pairs = cfg.objective != "sft"
    if pairs:
        from mlxlab.data.preference import load_pair_split as load_split  # noqa: F811
    train_path, _ = resolve_paths(cfg.data)
    examples = load_split(train_path, tokenizer, cfg.data).examples
    plan = lora_apply.plan(model, cfg.lora)
    lora_apply.apply(model, plan, seed=cfg.seed)
    shard = (0, 1) if world is None else (world.rank, world.size)
    sampler = BatchSampler(examples, cfg.batch_size, cfg.seed, pairs=pairs, shard=shard)
    dist = None if world is None else DataParallel(world)
    objective = PairObjective.from_config(cfg)
    grad_fn, _ = make_grad_fn(
        model,
        cfg.backward,
        (cfg.batch_size * (2 if pairs else 1), 512),
        compile=cfg.compile,
        objective=objective,
    )
    model.train()
    batches = [sampler.next() for _ in range(cfg.grad_accum)]
    mx.random.seed(cfg.seed * 1_000_003 + 1)
    recorder = Recorder()
    loss, norm, _ = trainer.train_step(
        model, recorder, grad_fn, batches, cfg.optim.grad_clip, 1, dist
    )
    if world is None or world.writer:
        arrays = {k: np.array(v) for k, v in tree_flatten(recorder.grads)}
        np.savez(out, loss=np.float64(loss), grad_norm=np.float64(norm), **arrays)


if __name__ == "__main__":
    main(sys.argv[1:])
