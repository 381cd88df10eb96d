"""The per-process response store behind `previous_response_id`: what a follow-up needs (the
conversation as chat messages, the instructions, the response object), kept for an hour,
byte-capped (32 MiB) with least-recently-used eviction."""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict


class ResponseStore:
    """id -> stored response; TTL plus a byte cap with LRU eviction."""

    def __init__(self, max_bytes: int = 32 * 2**20, ttl_s: float = 3600.0):
        self.max_bytes, self.ttl_s = max_bytes, ttl_s
        self._items: OrderedDict[str, tuple[float, int, dict]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.evicted = self.expired = 0

    @staticmethod
    def size_of(entry: dict) -> int:
        return len(json.dumps(entry, ensure_ascii=False).encode())

    def _expire(self, now: float) -> None:
        for key in [k for k, (t, _, _) in self._items.items() if now - t > self.ttl_s]:
            self._bytes -= self._items.pop(key)[1]
            self.expired += 1

    def put(self, rid: str, entry: dict) -> bool:
        size = self.size_of(entry)
        if size > self.max_bytes:
            return False
        with self._lock:
            now = time.time()
            self._expire(now)
            if rid in self._items:
                self._bytes -= self._items.pop(rid)[1]
            self._items[rid] = (now, size, entry)
            self._bytes += size
            while self._bytes > self.max_bytes:
                _, (_, old, _) = self._items.popitem(last=False)
                self._bytes -= old
                self.evicted += 1
        return True

    def get(self, rid: str) -> dict | None:
        with self._lock:
            self._expire(time.time())
            item = self._items.get(rid)
            if item is None:
                return None
            self._items.move_to_end(rid)
            return item[2]

    def delete(self, rid: str) -> bool:
        with self._lock:
            item = self._items.pop(rid, None)
            if item:
                self._bytes -= item[1]
            return item is not None

    def stats(self) -> dict:
        with self._lock:
            self._expire(time.time())
            return {
                "entries": len(self._items),
                "bytes": self._bytes,
                "max_bytes": self.max_bytes,
                "ttl_ms": int(self.ttl_s * 1000),
                "evicted": self.evicted,
                "expired": self.expired,
            }
