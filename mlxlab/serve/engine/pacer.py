"""Loads give way to generation. A model loads in slices (`zoo.load(pace=...)`): the loader thread
(engine/loader.py) only reads files and builds the lazy model; every slice of MLX work (its
weights evaluated ~32 MB at a time, the decode copies: one slice for those read with the
weights, one each for those checked and cast; a VLM's vision tower) runs on the engine thread
between two decode steps (`run`: the gateway's `between`), since MLX must not evaluate on
two threads at once. After each slice, while the engine is generating for other models, the
loader waits so that the load takes at most `share` of the time (`serve.load_share`): a slice of
s seconds is followed by s * (1/share - 1) seconds of waiting, cut short the moment the engine
goes idle. With nothing generating a load runs at full speed.

Why it is needed: a slice run on the engine thread delays every other model's next decode step
by its length, and parts of a load on the loader thread (a tokenizer's construction, ~1-5 s for
a 262k vocabulary) hold Python's GIL, which stops the engine thread's per-token Python for as
long. Waiting after each slice bounds what a load costs the others' decoding to `share` of it on
average."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


def _here(fn: Callable[[], object]) -> object:
    return fn()


class Pacer:
    def __init__(self, share: float = 1.0):
        self.share = share
        self.idle = threading.Event()  # set while the engine has nothing to run
        self.idle.set()
        self._mark = time.monotonic()
        self.waited_s = 0.0  # seconds loads have waited for generation (for /stats)
        # runs a slice's MLX work and returns its result (the gateway: on the engine thread)
        self.run: Callable[[Callable[[], object]], object] = _here

    def busy(self, running: bool) -> None:
        """The engine thread says whether it is running something (it is, between these)."""
        if running:
            self.idle.clear()
        else:
            self.idle.set()

    def start(self) -> None:
        """A load begins: its first slice starts now."""
        self._mark = time.monotonic()

    def pace(self, fn: Callable[[], object] | None = None) -> object:
        """A slice of the load: `fn` (its MLX work, if any) run by `run`, then its share waited
        out while the engine generates; `fn`'s result. The slice's length is the time since the
        last one ended on the loader thread plus `fn`'s own run (not its wait for the engine)."""
        ran = 0.0
        out = None
        if fn is not None:

            def timed():
                began = time.monotonic()
                try:
                    return fn()
                finally:
                    nonlocal ran
                    ran = time.monotonic() - began

            asked = time.monotonic()
            out = self.run(timed)
            spent = (asked - self._mark) + ran
        else:
            spent = time.monotonic() - self._mark
        if self.share < 1.0 and not self.idle.is_set():
            now = time.monotonic()
            self.idle.wait(spent * (1.0 / self.share - 1.0))
            self.waited_s += time.monotonic() - now
        self._mark = time.monotonic()
        return out
