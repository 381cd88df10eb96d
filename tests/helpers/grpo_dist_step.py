"""One GRPO update on the fixed case (tests/helpers/grpo_case.py), its gradient saved.

    python -m tests.helpers.grpo_dist_step OUT.npz VARIANT

as the two ranks of a data-parallel world (tests/helpers/dist.py start_ranks: rank r holds prompt
r's group, its reference log-probs computed there, the trainer's data-parallel step), or in one
process, which writes OUT.npz (both groups in one batch) and OUT_shares.npz (each group as a
rank holds it, rank 1's added after rank 0's as the all_sum adds them).
"""

from __future__ import annotations

import sys

import mlxlab  # noqa: F401  (BLAS before MLX)


def main(argv: list[str]) -> None:
    import mlx.core as mx
    import numpy as np
    from mlx.utils import tree_flatten

    from mlxlab.config import BackwardConfig, DistConfig
    from mlxlab.train import trainer
    from mlxlab.train.backward import make_grad_fn
    from mlxlab.train.grpo import loop
    from mlxlab.train.grpo.losses import GRPOObjective
    from mlxlab.train.parallel import DataParallel
    from mlxlab.train.world import World
    from tests.helpers.dist_step import Recorder, Shares
    from tests.helpers.grpo_case import case_config, rollout_case, scored

    out, variant = argv[0], argv[1]
    world = World.start(DistConfig())
    model, prompts, completions = rollout_case()
    cfg = case_config(variant, updates=1, beta=0.05)
    grad_fn, _ = make_grad_fn(
        model, BackwardConfig(mode="segmented", segment_size=2), (8, 64), False,
        GRPOObjective.from_config(cfg),
    )  # fmt: skip
    model.train()

    def batches(groups):
        ro = scored(prompts, completions, cfg, groups)
        return loop.update_batches(ro, cfg, 1, None, model, {})

    def step(own, dist, path):
        mx.random.seed(7)
        recorder = Recorder()
        loss, norm, _ = trainer.train_step(model, recorder, grad_fn, own, 1.0, 1, dist)
        if world is None or world.writer:
            arrays = {k: np.array(v) for k, v in tree_flatten(recorder.grads)}
            np.savez(path, loss=np.float64(loss), grad_norm=np.float64(norm), **arrays)

    if world is not None:
        step(batches([world.rank]), DataParallel(world), out)
        return
    step(batches([0, 1]), None, out)
    shares = [batches([0]), batches([1])]
    step(shares[0], Shares(shares), out.replace(".npz", "") + "_shares.npz")


if __name__ == "__main__":
    main(sys.argv[1:])
