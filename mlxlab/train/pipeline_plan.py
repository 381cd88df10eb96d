"""Segment pipeline (pipeline.py), its placement and order: which rank holds which segments, and
the order of each rank's transfers and passes in a step.

Placement (`assign_stages`): the plan's segments (backward.segment_size layers each) are cut into
K runs of consecutive segments, balanced by their FLOPs (`segment_costs`, train/flops.py's counts)
with the loss head counted on the last run (on Gemma's 262k vocabulary the head of a step costs
about as much as six layers of gemma3-270m); without a FLOP count, by layer count.

Order (`schedule`): one-forward-one-backward (1F1B: rank k starts K-1-k micro-batches before its
first backward), with every rank receiving its next input before it sends a cotangent back:
sends and receives are blocking, and `schedule()` is the order proved deadlock-free for any K and
M by the rendezvous simulation in tests/test_distributed.py. With balanced ranks the idle share
(the bubble) is (K-1)/(M+K-1); each rank measures its own (the time it waits in transfers,
`bubble` in the step records).
"""

from __future__ import annotations

from mlxlab.errors import UserError


def assign_stages(costs: list[float], k: int, tail: float = 0.0) -> list[tuple[int, int]]:
    """Cut segments (their costs: layer counts, or FLOPs) into `k` runs of consecutive segments
    whose largest cost is the smallest possible, the last run also paying `tail` (the loss
    head); (first, last) segment index of each run. Ties: the earlier runs take more."""
    n = len(costs)
    if k > n:
        raise UserError(
            f"backward.pipeline on {k} ranks needs at least {k} segments; the plan has {n} "
            "(lower backward.segment_size)"
        )
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    best: dict = {}

    def solve(start: int, parts: int):
        """(largest run, cuts) for segments start..n-1 in `parts` runs."""
        if (start, parts) in best:
            return best[(start, parts)]
        if parts == 1:
            out = (prefix[n] - prefix[start] + tail, [(start, n - 1)])
        else:
            out = None
            for end in range(n - parts, start - 1, -1):  # the longest first run first
                rest = solve(end + 1, parts - 1)
                cost = max(prefix[end + 1] - prefix[start], rest[0])
                if out is None or cost < out[0]:
                    out = (cost, [(start, end), *rest[1]])
        best[(start, parts)] = out
        return out

    return solve(0, k)[1]


def segment_costs(shapes, plan, length: float, trained: float, head_chunk: int = 0):
    """(FLOPs of each segment, FLOPs of the loss head) of one sequence of `length` tokens with
    `trained` response positions in a pipelined step (train/flops.py's counts): a segment's
    layers run forward, then again inside its vjp with their backward (the last segment only
    inside its vjp); the head runs forward and backward (and again with head_chunk)."""
    from mlxlab.train.flops import layer_flops

    lengths = [max(int(round(length)), 1)]
    costs = []
    for s, seg in enumerate(plan.segments):
        passes = 3 if s == len(plan.segments) - 1 else 4  # (forward) + recompute + ~2x backward
        costs.append(sum(passes * layer_flops(shapes, i, lengths) for i in seg))
    head = 2 * shapes.hidden * shapes.vocab * trained
    return costs, head * (3 if head_chunk else 2)


def schedule(k: int, n_stages: int, micro: int) -> list[tuple[str, int]]:
    """Rank k's program for one step of `micro` micro-batches: 1F1B (K-1-k forwards before the
    first backward, then one of each), where ops are `recv_f`, `F`, `send_f`, `recv_b`, `B`,
    `send_b` with a micro-batch index. On the last rank `F` is forward and backward together (the
    last segment runs once, inside its vjp) and `B` has no work. Wherever a rank would send a
    cotangent and then wait for its next input, it receives first: with blocking transfers the
    plain 1F1B order deadlocks (both neighbours sending), this one never does."""
    last = k == n_stages - 1
    warm = min(n_stages - 1 - k, micro)

    def fwd(m):
        return [*([("recv_f", m)] if k > 0 else []), ("F", m), *([] if last else [("send_f", m)])]

    def bwd(m):
        return [*([] if last else [("recv_b", m)]), ("B", m), *([("send_b", m)] if k > 0 else [])]

    ops: list[tuple[str, int]] = []
    for m in range(warm):
        ops += fwd(m)
    for i in range(micro - warm):
        ops += fwd(warm + i) + bwd(i)
    for m in range(micro - warm, micro):
        ops += bwd(m)
    changed = True
    while changed:  # receive the next input before sending a cotangent back
        changed = False
        for a in range(len(ops) - 1):
            if ops[a][0] == "send_b" and ops[a + 1][0] == "recv_f":
                ops[a], ops[a + 1] = ops[a + 1], ops[a]
                changed = True
    return ops
