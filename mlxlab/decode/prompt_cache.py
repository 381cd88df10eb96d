"""The prompt cache: reuse the KV of the longest cached token prefix.

Built on mlx-lm's `LRUPromptCache` (a token trie, byte-capped LRU) with what the decoder adds:

- entries are namespaced (the server's: by model and adapter spec), so a row never reuses KV
  computed under another adapter;
- lookups always leave at least one prompt token to run (the logits of the last token are needed);
- hits, misses, reused tokens and bytes are counted (the server's /stats);
- a store may refuse to evict (`insert(evict=False)`): an evaluation that decodes the same
  prompts again keeps the first ones it stored instead of cycling through them.

Sliding-window layers (Gemma 3: 512 tokens) keep a rotating cache that cannot be cut back once it
has wrapped, so an entry longer than the shared prefix is useless to them; mlx-lm's trie then
falls back to the longest stored *shorter* entry. The decoder therefore also stores a checkpoint
at the end of the system prompt, and every finished row stores prompt + completion, which is
exactly the prefix of the next turn of a chat.
"""

from __future__ import annotations

import copy
import logging
import threading

import mlx.core as mx
from mlx_lm.models.cache import LRUPromptCache

log = logging.getLogger(__name__)


class PromptCache:
    def __init__(self, max_bytes: int):
        self.max_bytes = int(max_bytes)
        self._lru = LRUPromptCache(max_size=1 << 20, max_bytes=max(self.max_bytes, 1))
        self._lock = threading.Lock()  # /stats reads from the HTTP thread
        self.hits = self.misses = self.reused_tokens = self.inserts = 0

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def fetch(self, namespace, tokens: list[int]):
        """(a copy of the cache covering tokens[:n], n) with n <= len(tokens) - 1; (None, 0) on a miss."""
        if not self.enabled or len(tokens) < 2:
            return None, 0
        with self._lock:
            cache, rest = self._lru.fetch_nearest_cache(namespace, list(tokens[:-1]))
            n = len(tokens) - 1 - len(rest) if cache is not None else 0
            if cache is None or n == 0:
                self.misses += 1
                return None, 0
            self.hits += 1
            self.reused_tokens += n
            return cache, n

    def insert(
        self,
        namespace,
        tokens: list[int],
        cache,
        kind: str = "assistant",
        copy_cache: bool = True,
        evict: bool = True,
    ):
        """Store the cache for exactly `tokens` (kind: system | user | assistant, for eviction order).
        `evict=False`: store it only where it fits beside what is held (a caller that reads its
        entries back in the order it stored them: evicting would drop the next one it needs)."""
        if not self.enabled or not tokens:
            return
        room = self.max_bytes if evict else self.max_bytes - self._lru.nbytes
        if sum(c.nbytes for c in cache) > room:  # from the shapes
            return
        entry = copy.deepcopy(cache) if copy_cache else cache
        # Materialized now: a cache extracted from a batch is a lazy slice whose graph would
        # keep the whole batch's KV buffers alive, far more memory than the entry's nbytes.
        mx.eval([c.state for c in entry])
        with self._lock:
            self._lru.insert_cache(namespace, list(tokens), entry, cache_type=kind)
            self.inserts += 1

    def store(self, namespace, tokens: list[int], cache, **kw) -> None:
        """`insert`, for a decoder storing a row's KV as it goes (a prompt checkpoint, a finished
        answer): a failure is logged and costs a later request its cache hit, never the row's
        answer."""
        try:
            self.insert(namespace, tokens, cache, **kw)
        except Exception:  # noqa: BLE001
            log.exception("mlxlab decode: storing a row's KV in the prompt cache failed")

    def stats(self) -> dict:
        with self._lock:
            return {
                "enabled": self.enabled,
                "entries": len(self._lru),
                "bytes": self._lru.nbytes,
                "max_bytes": self.max_bytes,
                "hits": self.hits,
                "misses": self.misses,
                "reused_tokens": self.reused_tokens,
            }


def prefill(model, cache, tokens: list[int], step: int, cancelled=None) -> bool:
    """Run `tokens` into `cache`, `step` tokens a forward pass, on the stream mlx-lm's
    `generate_step` uses (on a CPU the default stream ran this prefill ~4x slower: tiny-gemma3,
    400 tokens, 2.5 s vs 0.6 s). `cancelled()` is asked before each chunk; False when it
    stopped the prefill (the cache then holds a part of `tokens`)."""
    from mlx_lm.generate import generation_stream

    with mx.stream(generation_stream):
        for at in range(0, len(tokens), step):
            if cancelled is not None and cancelled():
                return False
            model(mx.array(tokens[at : at + step])[None], cache=cache)
            mx.eval([c.state for c in cache])
    return True
