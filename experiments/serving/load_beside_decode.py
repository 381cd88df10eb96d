"""Experiment (experiments/serving/several_models.md, 2026-12-06): gemma3-270m decodes on one
thread while a copy of it loads, paced, on another; the load's MLX work either runs on the
decoding thread between two steps (as serve does) or is evaluated on the loading thread's own
stream (MLX 0.32's per-thread streams). Prints, per mode, the decode rate over the load against
the rate just before it, the longest gap between two tokens and the slowest slice.

    python experiments/serving/load_beside_decode.py SHARE REPS
"""

from __future__ import annotations

import queue
import sys
import threading
import time

import mlxlab  # noqa: F401  (BLAS before MLX)

# isort: split
import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from mlxlab.models import zoo

SPEC = "gemma3-270m"


class Decoder:
    """Greedy decode on a thread of its own; between two steps it runs the tasks it is handed."""

    def __init__(self, model):
        self.model = model
        self.tasks: queue.Queue = queue.Queue()
        self.stop = threading.Event()
        self.stream = None
        self.times: list[float] = []

    def run(self) -> None:
        self.stream = mx.default_stream(mx.cpu)
        prompt = mx.array([[2, 106, 1645]])
        cache = make_prompt_cache(self.model)
        logits = self.model(prompt, cache=cache)
        mx.eval(logits)
        while not self.stop.is_set():
            while not self.tasks.empty():
                fn, box, done = self.tasks.get()
                box.append(fn())
                done.set()
            nxt = mx.argmax(logits[:, -1], axis=-1, keepdims=True)
            logits = self.model(nxt, cache=cache)
            mx.eval(logits)
            self.times.append(time.perf_counter())
            if cache[0].offset > 900:  # stay in a short context
                cache = make_prompt_cache(self.model)
                logits = self.model(prompt, cache=cache)
                mx.eval(logits)

    def between(self, fn):
        box: list = []
        done = threading.Event()
        self.tasks.put((fn, box, done))
        done.wait()
        return box[0]


def paced_load(mode: str, share: float, dec: Decoder) -> tuple[float, float, list[float]]:
    mark = time.perf_counter()
    ran: list[float] = []

    def pace(fn=None):
        # as engine/pacer.py: a slice is the time since the last one ended plus fn's own run,
        # not its wait for the decoder to reach a step's end
        nonlocal mark
        took = [0.0]

        def timed():
            began = time.perf_counter()
            try:
                return fn()
            finally:
                took[0] = time.perf_counter() - began

        asked = time.perf_counter()
        out = None
        if fn is not None:
            out = timed() if mode == "own-stream" else dec.between(timed)
        ran.append(took[0])
        time.sleep(((asked - mark) + took[0]) * (1 / share - 1))
        mark = time.perf_counter()
        return out

    t0 = time.perf_counter()
    # an array made lazily on one thread's stream cannot be evaluated on another thread
    stream = mx.new_stream(mx.cpu) if mode == "own-stream" else dec.stream
    with mx.stream(stream):
        zoo.load(SPEC, pace=pace)
    return t0, time.perf_counter(), ran


def rate(ts: list[float]) -> float:
    return (len(ts) - 1) / (ts[-1] - ts[0])


def main() -> None:
    share, reps = float(sys.argv[1]), int(sys.argv[2])
    model, _ = zoo.load(SPEC)
    for _rep in range(reps):
        for mode in ("between-steps", "own-stream"):
            dec = Decoder(model)
            th = threading.Thread(target=dec.run)
            th.start()
            time.sleep(6)
            alone = rate(dec.times)
            dec.times.clear()
            a, b, ran = paced_load(mode, share, dec)
            dec.stop.set()
            th.join()
            w = [t for t in dec.times if a <= t <= b]
            gap = max(y - x for x, y in zip(w, w[1:], strict=False))
            print(
                f"{mode:13s} share {share}: load {b - a:5.1f} s, decode alone {alone:5.2f} "
                f"tok/s, during {rate(w):5.2f} (ratio {rate(w) / alone:.3f}), longest gap "
                f"{gap * 1e3:.0f} ms, slowest slice {max(ran):.2f} s",
                flush=True,
            )


if __name__ == "__main__":
    main()
