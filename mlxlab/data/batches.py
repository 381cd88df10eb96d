"""Batches for response-only training, and a seeded sampler whose position can be saved.

A batch carries the flat positions of the trained targets, so the loss computes logits only
there. Both the padded length and the number of positions are rounded up to multiples of 32,
which keeps the set of shapes small (and compiled graphs reusable); padding positions have
weight 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mlxlab.data.datasets import Example

PAD_TO = 32


@dataclass
class Batch:
    inputs: object  # mx.array [B, T] int32: tokens[:, :-1], zero-padded
    positions: object  # mx.array [N] int32: flat indices into B*T of trained targets
    labels: object  # mx.array [N] int32: the target token at each position
    weights: object  # mx.array [N] float32: 1 for real positions, 0 for padding
    ntoks: int  # trained tokens (sum of weights)
    lengths: tuple = ()  # real (unpadded) input length of each row, for the FLOP count

    def arrays(self) -> tuple:
        return self.inputs, self.positions, self.labels, self.weights


def _round_up(n: int, k: int = PAD_TO) -> int:
    return max(k, k * ((n + k - 1) // k))


def collate(examples: list[Example]) -> Batch:
    """Pad a list of examples into a Batch (targets at token index >= max(offset, 1))."""
    import mlx.core as mx

    width = _round_up(max(len(e.ids) for e in examples) - 1)
    inputs = np.zeros((len(examples), width), np.int32)
    positions, labels = [], []
    for row, ex in enumerate(examples):
        ids = np.asarray(ex.ids, np.int32)
        inputs[row, : len(ids) - 1] = ids[:-1]
        # Target t predicts token t+1; train on tokens offset..len-1.
        t = np.arange(max(ex.offset, 1) - 1, len(ids) - 1)
        positions.append(row * width + t)
        labels.append(ids[t + 1])
    positions = np.concatenate(positions).astype(np.int32)
    labels = np.concatenate(labels).astype(np.int32)
    n = len(positions)
    padded = _round_up(n)
    weights = np.zeros(padded, np.float32)
    weights[:n] = 1.0
    positions = np.pad(positions, (0, padded - n))
    labels = np.pad(labels, (0, padded - n))
    lengths = tuple(len(e.ids) - 1 for e in examples)
    return Batch(
        mx.array(inputs), mx.array(positions), mx.array(labels), mx.array(weights), n, lengths
    )


def dense_targets(batch: Batch):
    """(targets [B, T], mask [B, T]) equivalent to a batch's positions, for full-logits losses."""
    import mlx.core as mx

    b, t = batch.inputs.shape
    n = batch.ntoks
    targets = np.zeros(b * t, np.int32)
    mask = np.zeros(b * t, np.float32)
    pos = np.array(batch.positions)[:n]
    targets[pos] = np.array(batch.labels)[:n]
    mask[pos] = 1.0
    return mx.array(targets.reshape(b, t)), mx.array(mask.reshape(b, t))


class BatchSampler:
    """Length-grouped batches in a seeded order per epoch; `state()` / `restore()` for resume.

    Like mlx-lm's iterate_batches: sort by length, cut into batches, shuffle batch order.
    """

    def __init__(self, examples: list[Example], batch_size: int, seed: int, shuffle: bool = True):
        from mlxlab.errors import UserError

        if len(examples) < batch_size:
            raise UserError(
                f"the dataset has {len(examples)} examples, fewer than batch_size={batch_size}"
            )
        self.examples = examples
        order = sorted(range(len(examples)), key=lambda i: len(examples[i].ids))
        self.groups = [
            order[i : i + batch_size] for i in range(0, len(order) - batch_size + 1, batch_size)
        ]
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.index = 0

    def _order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.groups))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.groups))

    def __len__(self) -> int:
        return len(self.groups)

    def next(self) -> Batch:
        if self.index >= len(self.groups):
            self.epoch, self.index = self.epoch + 1, 0
        group = self.groups[self._order(self.epoch)[self.index]]
        self.index += 1
        return collate([self.examples[i] for i in group])

    def state(self) -> dict:
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed}

    def restore(self, state: dict) -> None:
        self.epoch, self.index, self.seed = state["epoch"], state["index"], state["seed"]

    def one_pass(self, limit: int = 0):
        """Every batch once, in order (validation); `limit` > 0 caps the count."""
        groups = self.groups[:limit] if limit else self.groups
        for group in groups:
            yield collate([self.examples[i] for i in group])
