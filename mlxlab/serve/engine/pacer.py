"""Loads give way to generation. A model loads on the loader thread (engine/loader.py) in slices
(`zoo.load(pace=...)`: weights read and cast ~32 MB at a time, the tokenizer, each decode copy);
after each slice, while the engine is generating for other models, the loader waits so that it
takes at most `share` of the time (`serve.load_share`): a slice of s seconds is followed by
s * (1/share - 1) seconds of waiting, cut short the moment the engine goes idle. With nothing
generating a load runs at full speed.

Why it is needed: on a CPU the loader's work competes with decoding for the cores and the memory
bandwidth, and parts of a load (a tokenizer's construction, ~1-5 s for a 262k vocabulary) hold
Python's GIL, which stops the engine thread's per-token Python for as long. Waiting after each
slice bounds what a load costs the others' decoding to `share` of it on average."""

from __future__ import annotations

import threading
import time


class Pacer:
    def __init__(self, share: float = 1.0):
        self.share = share
        self.idle = threading.Event()  # set while the engine has nothing to run
        self.idle.set()
        self._mark = time.monotonic()
        self.waited_s = 0.0  # seconds loads have waited for generation (for /stats)

    def busy(self, running: bool) -> None:
        """The engine thread says whether it is running something (it is, between these)."""
        if running:
            self.idle.clear()
        else:
            self.idle.set()

    def start(self) -> None:
        """A load begins: its first slice starts now."""
        self._mark = time.monotonic()

    def pace(self) -> None:
        """A slice of the load ended: wait its share out while the engine generates."""
        now = time.monotonic()
        spent = now - self._mark
        if self.share < 1.0 and not self.idle.is_set():
            self.idle.wait(spent * (1.0 / self.share - 1.0))
            self.waited_s += time.monotonic() - now
        self._mark = time.monotonic()
