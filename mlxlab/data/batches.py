"""Batches for response-only training, and a seeded sampler whose position can be saved.

A batch carries the flat positions of the trained targets, so the loss computes logits only
there. Both the padded length and the number of positions are rounded up to multiples of 32,
which keeps the set of shapes small (and compiled graphs reusable); padding positions have
weight 0, the others 1 or their example's loss weight (mlxlab/data/datasets.py `loss_weights`).

Packing (data.pack=true): several examples share a row, up to max_seq_length tokens, placed by
first-fit decreasing; `segments` numbers each position's example in its row (0: padding), and
the layer runner turns it into block-diagonal masks (mlxlab/models/runners.py), so each example
attends only to itself and its loss is the one it has alone in a row.
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
    weights: object  # mx.array [N] float32: 0 for padding, else 1 or the example's loss weight
    ntoks: int  # trained tokens (padding excluded)
    lengths: tuple = ()  # real input length of each example (not row), for the FLOP count
    segments: object = None  # packed rows: mx.array [B, T] int32, example number (0: padding)
    ref: object = None  # preference pairs (rows 2k, 2k+1: chosen, rejected of pair k): the
    # reference model's summed response log-prob per row, mx.array [B] float32 (DPO)
    pairs: bool = False  # rows are (chosen, rejected) pairs
    weight: float | None = None  # sum of `weights` (None: ntoks, every weight 1)
    unit_count: float | None = None  # what the loss is a mean over, where it is neither the
    # trained tokens nor pairs (GRPO: its completions, or its tokens)

    def arrays(self) -> tuple:
        """What the losses take: (inputs, positions, labels, weights[, segments][, ref])."""
        base = (self.inputs, self.positions, self.labels, self.weights)
        if self.segments is not None:
            base = (*base, self.segments)
        return base if self.ref is None else (*base, self.ref)

    @property
    def units(self) -> float:
        """What a batch's mean loss is over: pairs for a preference batch, `unit_count` where
        set (GRPO), else trained tokens by their loss weights (how accumulation and validation
        weight batches)."""
        if self.unit_count is not None:
            return self.unit_count
        if self.pairs:
            return self.inputs.shape[0] // 2
        return self.ntoks if self.weight is None else self.weight

    @property
    def padding(self) -> float:
        """Share of the batch's [B, T] positions that are padding."""
        return 1.0 - sum(self.lengths) / (self.inputs.shape[0] * self.inputs.shape[1])


def _round_up(n: int, k: int = PAD_TO) -> int:
    return max(k, k * ((n + k - 1) // k))


def collate(examples: list[Example]) -> Batch:
    """Pad a list of examples into a Batch (targets at token index >= max(offset, 1))."""
    return collate_rows([[e] for e in examples], packed=False)


def collate_rows(rows: list[list[Example]], packed: bool = True, width: int = 0) -> Batch:
    """Rows of one or more examples each into a Batch; with `packed`, it carries `segments`.
    `width` > 0 pads to that many positions (a data-parallel shard, as wide as its whole batch)."""
    import mlx.core as mx

    width = width or _round_up(max(sum(len(e.ids) - 1 for e in row) for row in rows))
    inputs = np.zeros((len(rows), width), np.int32)
    segments = np.zeros((len(rows), width), np.int32)
    positions, labels, weights = [], [], []
    for r, row in enumerate(rows):
        start = 0
        for k, ex in enumerate(row):
            ids = np.asarray(ex.ids, np.int32)
            n = len(ids) - 1
            inputs[r, start : start + n] = ids[:-1]
            segments[r, start : start + n] = k + 1
            # Target t predicts token t+1; train on tokens offset..len-1.
            t = np.arange(max(ex.offset, 1) - 1, n)
            positions.append(r * width + start + t)
            labels.append(ids[t + 1])
            weights.append(
                np.ones(len(t), np.float32)
                if ex.weights is None
                else np.asarray(ex.weights, np.float32)[t + 1]
            )
            start += n
    positions = np.concatenate(positions).astype(np.int32)
    labels = np.concatenate(labels).astype(np.int32)
    n = len(positions)
    padded = _round_up(n)
    weights = np.pad(np.concatenate(weights), (0, padded - n))
    positions = np.pad(positions, (0, padded - n))
    labels = np.pad(labels, (0, padded - n))
    lengths = tuple(len(e.ids) - 1 for row in rows for e in row)
    return Batch(
        mx.array(inputs),
        mx.array(positions),
        mx.array(labels),
        mx.array(weights),
        n,
        lengths,
        mx.array(segments) if packed else None,
        weight=float(weights.sum())
        if any(e.weights is not None for r in rows for e in r)
        else None,
    )


def pack_rows(lengths: list[int], capacity: int) -> list[list[int]]:
    """Indices grouped into rows of at most `capacity` tokens: first-fit decreasing (longest
    first, each into the first row with room), so rows come out nearly full. Deterministic."""
    rows: list[list[int]] = []
    room: list[int] = []
    open_rows: list[int] = []  # rows that the shortest example still fits, in creation order
    shortest = min(lengths, default=0)
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        n = lengths[i]
        for k, r in enumerate(open_rows):
            if n <= room[r]:
                rows[r].append(i)
                room[r] -= n
                if room[r] < shortest:
                    del open_rows[k]
                break
        else:
            rows.append([i])
            room.append(capacity - n)
            if room[-1] >= shortest:
                open_rows.append(len(rows) - 1)
    return rows


def dense_targets(batch: Batch):
    """(targets [B, T], mask [B, T]) equivalent to a batch's positions and weights, for
    full-logits losses."""
    import mlx.core as mx

    b, t = batch.inputs.shape
    n = batch.ntoks
    targets = np.zeros(b * t, np.int32)
    mask = np.zeros(b * t, np.float32)
    pos = np.array(batch.positions)[:n]
    targets[pos] = np.array(batch.labels)[:n]
    mask[pos] = np.array(batch.weights)[:n]
    return mx.array(targets.reshape(b, t)), mx.array(mask.reshape(b, t))


class BatchSampler:
    """Length-grouped batches in a seeded order per epoch; `state()` / `restore()` for resume.

    Like mlx-lm's iterate_batches: sort by length, cut into batches, shuffle batch order. With
    `pack_length`, the units cut into batches are packed rows (pack_rows) instead of examples.

    `shard=(rank, size)` (data parallel, mlxlab/train/parallel.py): every rank walks the same
    batches in the same order (so the position it saves is every rank's) and collates only its
    share of each, units rank, rank + size, ... (length-sorted, so the shares are alike), padded
    to the whole batch's width: each row is computed as in a single process.
    """

    def __init__(
        self,
        examples: list[Example],
        batch_size: int,
        seed: int,
        shuffle: bool = True,
        pack_length: int = 0,
        pairs: bool = False,
        shard: tuple[int, int] = (0, 1),
    ):
        from mlxlab.errors import UserError

        self.examples = examples
        self.shard = shard
        self.pairs = pairs
        self.ref = None  # per example: the reference log-prob (set_reference)
        if pairs:  # examples 2k, 2k+1 are pair k's chosen and rejected sides, one row each
            units = sorted(
                ([i, i + 1] for i in range(0, len(examples) - 1, 2)),
                key=lambda u: max(len(examples[u[0]].ids), len(examples[u[1]].ids)),
            )
        elif pack_length:
            lengths = [len(e.ids) - 1 for e in examples]
            rows = pack_rows(lengths, pack_length)
            units = sorted(rows, key=lambda row: sum(lengths[i] for i in row))
        else:
            units = [[i] for i in sorted(range(len(examples)), key=lambda i: len(examples[i].ids))]
        if len(units) < batch_size:
            what = "pairs" if pairs else "packed rows" if pack_length else "examples"
            raise UserError(
                f"the dataset has {len(units)} {what}, fewer than batch_size={batch_size}"
            )
        self.packed = bool(pack_length)
        self.pack_length = pack_length
        self.groups = [
            units[i : i + batch_size] for i in range(0, len(units) - batch_size + 1, batch_size)
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
        return self._collate(group)

    def shard_of(self, group: list[list[int]]) -> list[list[int]]:
        """The units of a batch this rank collates (all of them in a single process)."""
        rank, size = self.shard
        return group if size == 1 else group[rank::size]

    def _collate(self, group: list[list[int]]) -> Batch | None:
        """The batch of `group` (this rank's share of it; None when that share is empty)."""
        width = 0
        if self.shard[1] > 1:
            width = _round_up(
                max(sum(len(self.examples[i].ids) - 1 for i in row) for row in self._rows(group))
            )
            group = self.shard_of(group)
            if not group:
                return None
        if not self.pairs:
            return collate_rows(
                [[self.examples[i] for i in row] for row in group], self.packed, width
            )
        import dataclasses

        import mlx.core as mx

        order = [i for unit in group for i in unit]
        batch = collate_rows([[self.examples[i]] for i in order], packed=False, width=width)
        ref = None if self.ref is None else mx.array([self.ref[i] for i in order], mx.float32)
        return dataclasses.replace(batch, ref=ref, pairs=True)

    def set_reference(self, ref: list[float]) -> None:
        """The reference model's summed response log-prob of every example (DPO), in order."""
        if len(ref) != len(self.examples):
            raise ValueError(f"{len(ref)} reference log-probs for {len(self.examples)} examples")
        self.ref = list(ref)

    def _rows(self, group: list[list[int]]) -> list[list[int]]:
        return [[i] for unit in group for i in unit] if self.pairs else group

    def padding(self) -> float:
        """Share of padding positions over one epoch's batches (as collate pads them)."""
        real = total = 0
        for group in self.groups:
            n = [sum(len(self.examples[i].ids) - 1 for i in row) for row in self._rows(group)]
            real += sum(n)
            total += len(n) * _round_up(max(n))
        return 1.0 - real / max(total, 1)

    def examples_per_epoch(self) -> int:
        return sum(len(row) for group in self.groups for row in group)

    def state(self) -> dict:
        return {
            "epoch": self.epoch,
            "index": self.index,
            "seed": self.seed,
            "pack_length": self.pack_length,
            "batches": len(self.groups),
        }

    def restore(self, state: dict) -> None:
        from mlxlab.errors import UserError

        saved = (state.get("pack_length", 0), state.get("batches", len(self.groups)))
        if saved != (self.pack_length, len(self.groups)):
            raise UserError(
                f"the checkpoint's sampler had {saved[1]} batches (pack_length {saved[0]}), this "
                f"run's has {len(self.groups)} (pack_length {self.pack_length}): resume with "
                "the same data, data.pack and data.max_seq_length"
            )
        self.epoch, self.index, self.seed = state["epoch"], state["index"], state["seed"]

    def one_pass(self, limit: int = 0):
        """Every batch once, in order (validation); `limit` > 0 caps the count. A data-parallel
        rank gets its share of each (None where a batch has fewer units than ranks)."""
        groups = self.groups[:limit] if limit else self.groups
        for group in groups:
            yield self._collate(group)
