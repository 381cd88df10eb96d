"""The registry of the models one server may serve: the names a request may use, an entry per
model (its state, mount list and counters), what each model is (its settings, what its files
say) and the reports of them (/v1/models, /stats, /metrics). engine/models.py's `Models` builds
on it (`Entries`) with leases, the load queue, the shared memory budget and the state changes.

    serve model=A models.b=SPEC models.c=SPEC [models_from_cache=true] memory_budget_gb=...

- Names: the default model (`model=`: its id is its spec, as echoed before) answers a request
  that names it or nothing; `models.NAME=SPEC` adds NAME (a SPEC equal to the default's makes
  NAME another name for it); `models_from_cache=true` adds every model of the Hugging Face cache
  by its repo id (`zoo.hub_cached`). With none of those (one model) any name reaches the
  default, as it always has; otherwise an unknown name is a `ModelError` 404 `model_not_found`.
- Mounts: each model keeps its mount list (`Entry.mounts`): its adapters of `model_adapters.`
  at start, plus those mounted at runtime (POST /v1/adapters), minus those unmounted (DELETE,
  also while it is not loaded). Every load mounts that list, so an eviction or an idle unload
  loses nothing a user mounted; a runtime mount whose files have gone since is logged and
  reported (`Entry.not_remounted`: `/stats` models' and adapters_by_model's `not_remounted`,
  kept across later loads until that id is mounted or unmounted again) and dropped from the
  list, rather than failing the reload; so is one that now resolves outside the adapter root.
  Start-up paths are kept resolved (`adapter_path`), as runtime mounts are, so a run's adapter
  is known by its path whether it was mounted at start or at runtime.

Everything here is guarded by one lock (`Models.lock`, made here): requests (the render thread,
the event loop), the loader thread and the engine thread all come here.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass, field

from mlxlab.lora import io as lora_io
from mlxlab.models import zoo
from mlxlab.serve.engine.admission import RESERVE_BYTES, budget_bytes
from mlxlab.serve.engine.catalog import Facts, facts
from mlxlab.serve.engine.pacer import Pacer
from mlxlab.serve.engine.settings import EngineSettings

HUB_TTL_S = 10.0
"""How long a scan of the Hugging Face cache (models_from_cache) is reused."""

HOLDING = ("loading", "loaded", "evicting")
"""States whose weights count against the budget."""


class ModelError(Exception):
    """A request's model cannot serve it: `status` and `code` for its protocol's error shape."""

    def __init__(self, message: str, status: int, code: str, retry_after: int | None = None):
        super().__init__(message)
        self.status, self.code, self.retry_after = status, code, retry_after


@dataclass
class Entry:
    """One model a request may name."""

    name: str
    spec: str
    pinned: bool = False
    state: str = "unloaded"
    loaded: object | None = None  # engine.loaded.Loaded while loaded
    error: str | None = None
    failed_at: float = 0.0
    reserved: int = 0  # bytes counted against the budget: the estimate while loading, then measured
    last_used: float = field(default_factory=time.monotonic)
    leases: set = field(default_factory=set)
    # (future, name asked) of requests waiting for its load
    waiters: list = field(default_factory=list)
    facts: Facts | None = None  # from its files, when unloaded (memoized)
    # its mount list: adapter id -> (path, mounted at runtime), what every load mounts
    mounts: dict = field(default_factory=dict)
    # runtime mounts a load could not mount again (id, path, error), until that id is mounted or
    # unmounted again
    not_remounted: list = field(default_factory=list)
    # counters (since start)
    loads: int = 0
    load_seconds: float = 0.0
    last_load_seconds: float | None = None
    evictions: int = 0  # to make room for another model
    idle_unloads: int = 0
    failures: int = 0
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @property
    def busy(self) -> bool:
        return bool(self.leases)


def adapter_path(path) -> str:
    """A start-up adapter path as a mount records it: the adapter directory (a run's final
    adapter for a run directory: `lora_io.resolve_dir`), resolved; as given where it cannot be
    resolved (its load then says why)."""
    try:
        return str(lora_io.resolve_dir(path).resolve())
    except Exception:  # noqa: BLE001 - a bad path fails its model's load, not the start
        return str(path)


class Entries:
    """The registry part of `Models` (engine/models.py): see the module docstring."""

    def __init__(self, cfg: EngineSettings):
        self.cfg = cfg
        self.lock = threading.RLock()
        self.budget_bytes = budget_bytes(cfg.memory_budget_gb)
        self.pacer = Pacer(cfg.load_share)
        self.default = Entry(cfg.model, cfg.model, pinned=True)
        self.default.mounts = {i: (adapter_path(p), False) for i, p in (cfg.adapters or {}).items()}
        self.entries: dict[str, Entry] = {self.default.name: self.default}
        self.aliases: dict[str, str] = {}
        for name, spec in (cfg.models or {}).items():
            if name == self.default.name:  # its own name for itself (another spec: a config error)
                continue
            if spec == cfg.model:
                self.aliases[name] = self.default.name
                continue
            self.entries[name] = Entry(name, spec)
            startup = (cfg.model_adapters or {}).get(name) or {}
            self.entries[name].mounts = {i: (adapter_path(p), False) for i, p in startup.items()}
        self.strict = bool(cfg.models or cfg.models_from_cache)
        self._hub: tuple[float, dict] | None = None  # (when, zoo.hub_cached()): `hub`
        self._facts: dict[str, Facts] = {}  # by model directory: `facts_of`

    # --- names ------------------------------------------------------------------------------

    def hub(self) -> dict:
        """The Hugging Face cache's models (`zoo.hub_cached`) with models_from_cache, else none:
        the folders are scanned at most once every HUB_TTL_S, never under the lock."""
        if not self.cfg.models_from_cache:
            return {}
        scanned = self._hub
        now = time.monotonic()
        if scanned is None or now - scanned[0] >= HUB_TTL_S:
            scanned = self._hub = (now, zoo.hub_cached())
        return scanned[1]

    def find(self, name: str | None, create: bool = True) -> Entry:
        """The entry a request's `model` names (see the module docstring); ModelError 404.
        `create=False`: a lookup that changes nothing (a cache model not asked for yet gets an
        entry of its own only from a request; here a detached one)."""
        # before the lock: a scan at most every HUB_TTL_S (`not_found` reads it too)
        cached = self.hub()
        with self.lock:
            if not name or name == self.default.name:
                return self.default
            name = self.aliases.get(name, name)
            if name in self.entries:
                return self.entries[name]
            if name in cached:
                if not create:
                    return Entry(name, name)
                self.entries[name] = Entry(name, name)
                return self.entries[name]
            if not self.strict:
                return self.default
            raise self.not_found(name)

    def not_found(self, name: str) -> ModelError:
        """The 404 of a name no model answers to (here and GET /v1/models/{id})."""
        known = ", ".join(self.names()[:20])
        more = " (and the Hugging Face cache's models)" if self.cfg.models_from_cache else ""
        return ModelError(
            f"model {name!r} is not served here (models: {known}{more})", 404, "model_not_found"
        )

    def names(self) -> list[str]:
        """Every name a request may use now, the default first."""
        with self.lock:
            out = list(self.entries) + list(self.aliases)
        out += [r for r in self.hub() if r not in out]
        return out

    def serving(self, spec: str | None) -> Entry | None:
        """The served model that `spec` (a run's `model`, say) names, or None: the one it
        names as a request would (its name, an alias, a cached repo id), else the one whose
        spec is `spec`, else the one whose local directory is `spec`'s (a zoo name and the
        directory it resolves to are the same model). Never resolves anything (no download),
        never changes anything (a read: the runs page); None for what cannot name a model (not a
        string, empty, a path the file system refuses)."""
        if not isinstance(spec, str) or not spec:
            return None
        try:
            e = self.find(spec, create=False)
        except ModelError:
            e = None
        if e is not None and (e is not self.default or spec in (e.name, e.spec)):
            return e  # (a one-model server's default answers any name: not a match by itself)
        with self.lock:
            entries = list(self.entries.values())
            aliases = dict(self.aliases)
        if spec in aliases:
            return self.entries[aliases[spec]]
        for x in entries:
            if x.spec == spec:
                return x
        cached = self.hub() if self.cfg.models_from_cache else None
        try:
            want = zoo.local_dir(spec, cached)
            if want is None:
                return None
            want = want.resolve()
        except (OSError, ValueError, RuntimeError):  # a name too long, a NUL, a symlink loop
            return None
        for x in entries:
            try:
                there = zoo.local_dir(x.spec, cached)
                if there is not None and there.resolve() == want:
                    return x
            except (OSError, ValueError, RuntimeError):
                continue
        return None

    def owner_of(self, adapter_id: str) -> Entry | None:
        """The loaded model adapter `adapter_id` is mounted on, if any."""
        with self.lock:
            for e in self.entries.values():
                reg = getattr(e.loaded, "adapters", None)
                if e.state == "loaded" and reg is not None and adapter_id in reg.mounted:
                    return e
        return None

    def loaded_models(self) -> list[tuple[str, object]]:
        """(name, engine.loaded.Loaded) of each loaded model, the default first (GET
        /v1/adapters lists their adapters)."""
        with self.lock:
            return [(e.name, e.loaded) for e in self.entries.values() if e.state == "loaded"]

    # --- mount lists --------------------------------------------------------------------------

    def mounted(self, e: Entry, adapter_id: str, path: str) -> None:
        """An adapter was mounted on `e` at runtime (from `path`): every later load mounts it."""
        with self.lock:
            e.mounts[adapter_id] = (path, True)
            e.not_remounted = [x for x in e.not_remounted if x["id"] != adapter_id]

    def forget(self, e: Entry, adapter_id: str) -> bool:
        """`adapter_id` was unmounted from `e` (or is, while `e` is not loaded): no load
        mounts it again, and a report that a load could not mount it again is cleared. Whether
        it was on `e`'s mount list or so reported."""
        with self.lock:
            reported = any(x["id"] == adapter_id for x in e.not_remounted)
            e.not_remounted = [x for x in e.not_remounted if x["id"] != adapter_id]
            return e.mounts.pop(adapter_id, None) is not None or reported

    def not_remounted(self, name: str) -> list[dict]:
        """The runtime mounts model `name`'s loads could not mount again (`Entry.not_remounted`)."""
        with self.lock:
            e = self.entries.get(name)
            return [dict(x) for x in e.not_remounted] if e is not None else []

    def remounts(self, e: Entry) -> dict[str, str]:
        """id -> path of the adapters mounted on `e` at runtime, for its next load."""
        with self.lock:
            return {i: p for i, (p, runtime) in e.mounts.items() if runtime}

    # --- what each model is ------------------------------------------------------------------

    def settings_for(self, e: Entry) -> EngineSettings:
        """The engine settings a model other than the default loads with: the server's, without
        the speech and embedding models (the default's), the adapters of its mount list that
        came from the start (`serve model_adapters.NAME.ID=PATH`, less those unmounted since;
        `serve adapters.` are the default model's: its runtime mounts are `remounts`'), KV
        quantization only
        when uniform (a kv_config plan is the default model's), and speculative drafts only from
        its own layers (`self:N`; a named draft model shares the default's tokenizer)."""
        cfg = self.cfg
        draft = cfg.draft_model if (cfg.draft_model or "").startswith("self:") else None
        decode = cfg.decode
        if decode.speculative == "draft_model" and draft is None:
            decode = dataclasses.replace(decode, speculative="off")
        kv = cfg.kv_quant if str(cfg.kv_quant).strip().lower() in ("4", "8") else "off"
        with self.lock:
            startup = {i: p for i, (p, runtime) in e.mounts.items() if not runtime}
        return dataclasses.replace(
            cfg,
            model=e.spec,
            kv_quant=kv,
            adapters=startup,
            stt_model=None,
            embeddings_model=None,
            draft_model=draft,
            decode=decode,
        )

    def facts_of(self, e: Entry) -> Facts:
        """What its files say (loaded or not), memoized until it loads or unloads, and by the
        model's directory (a cache model listed but never asked for has no lasting entry)."""
        if e.facts is None:
            path = zoo.local_dir(e.spec, self.hub() if self.cfg.models_from_cache else None)
            if path is None:
                return facts(None)
            key = str(path)
            if key not in self._facts:
                self._facts[key] = facts(path, self.cfg.dtype, self.cfg.decode_head)
            e.facts = self._facts[key]
        return e.facts

    def describe(self, e: Entry) -> dict:
        """Its state and counters, for /v1/models, /stats and /metrics."""
        with self.lock:
            loaded = e.loaded if e.state == "loaded" else None
            info = {
                "id": e.name,
                "spec": e.spec,
                "default": e is self.default,
                "state": e.state,
                "loaded": loaded is not None,
                "pinned": e.pinned,
                "in_flight": len(e.leases),
                "error": e.error,
                "loads": e.loads,
                "load_seconds": round(e.load_seconds, 3),
                "last_load_seconds": (
                    round(e.last_load_seconds, 3) if e.last_load_seconds is not None else None
                ),
                "evictions": e.evictions,
                "idle_unloads": e.idle_unloads,
                "failures": e.failures,
                "requests": e.requests,
                "prompt_tokens": e.prompt_tokens,
                "completion_tokens": e.completion_tokens,
                "not_remounted": [dict(x) for x in e.not_remounted],
            }
        if loaded is not None:
            info["adapters"] = sorted(loaded.adapters.mounted)
            adm = loaded.admission
            info["size_bytes"] = adm.weights_bytes
            info["context_length"] = adm.max_safe_context
            info["vision"] = loaded.vision is not None
        else:
            f = self.facts_of(e)
            info["size_bytes"] = f.weight_bytes
            info["context_length"] = f.context_length
            info["vision"] = f.vision
        return info

    def listing(self) -> list[dict]:
        """`describe` of every name a request may use, the default first (an alias as its
        model, under its own id; a cache model not yet asked for as unloaded)."""
        with self.lock:
            entries = dict(self.entries)
            aliases = dict(self.aliases)
        out = []
        for name in self.names():
            if name in aliases:
                out.append({**self.describe(entries[aliases[name]]), "id": name})
            else:
                out.append(self.describe(entries.get(name) or Entry(name, name)))
        return out

    def stats(self) -> dict:
        with self.lock:
            entries = list(self.entries.values())
            aliases = dict(self.aliases)
            resident = sum(x.reserved for x in entries if x.state in HOLDING)
        return {
            "budget_bytes": self.budget_bytes,
            "weights_bytes": resident,
            "reserve_bytes": RESERVE_BYTES,
            "load_share": self.cfg.load_share,
            "load_waited_s": round(self.pacer.waited_s, 3),
            "idle_s": self.cfg.model_idle_s,
            "aliases": aliases,
            "models": [self.describe(x) for x in entries],
        }
