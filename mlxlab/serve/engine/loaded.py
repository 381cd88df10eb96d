"""A loaded model: the model and tokenizer, and what is derived from them (stop and hidden
tokens, tool and reasoning markup, admission, KV quantization, generation defaults, its adapters;
the default model's speech and embedding models beside it). The default model is loaded by the
engine thread at start; the others by the loader thread when a request first names them
(engine/loader.py)."""

from __future__ import annotations

import json
import logging
import threading
import weakref
from pathlib import Path

from mlxlab import grammar
from mlxlab.decode.prompt_cache import PromptCache
from mlxlab.models.zoo import resolve
from mlxlab.serve.engine import admission, kv_quant
from mlxlab.serve.engine.adapters import Adapters
from mlxlab.serve.engine.output import think_markers, tool_syntax
from mlxlab.serve.engine.settings import EngineSettings
from mlxlab.vision.model import load as load_model

log = logging.getLogger(__name__)


class Loaded:
    """One loaded model. Built in two steps: the constructor reads the files (the weights, in
    slices when `pace` is given, so it can run on the loader thread beside generation:
    engine/pacer.py), `start` (on the engine thread) measures admission and mounts adapters;
    the constructor runs `start` too unless `deferred` (the loader thread's models).

    `cache`: the server's prompt cache (one for every model: entries are namespaced by
    `cache_id` and adapter); `name`: the id requests use (default: the spec); `model_dir`: the
    resolved directory, when the caller resolved it; `vocab`: build the grammar engine's
    vocabulary while loading, in a thread `start` joins (the default model: no request pays for
    it); an on-demand model's is built by the loader thread (`grammar_vocab`) before it serves.
    `remount`: id -> path of adapters mounted at runtime on an earlier load of this model
    (engine/entries.py's mount list), mounted after `cfg.adapters` if still under the adapter
    root; one that fails or is not is logged and listed in its registry's `not_remounted`
    (which the model's entry keeps) instead of failing the load."""

    def __init__(
        self,
        cfg: EngineSettings,
        cache: PromptCache | None = None,
        name: str | None = None,
        model_dir: Path | None = None,
        pace=None,
        vocab: bool = True,
        deferred: bool = False,
        remount: dict[str, str] | None = None,
    ):
        self.cfg = cfg
        self.remount = dict(remount or {})
        self.model_dir = Path(model_dir) if model_dir is not None else resolve(cfg.model)
        # `vision`: mlx-vlm's model beside mlx-lm's when the directory is a VLM, else None.
        self.model, self.tokenizer, self.vision = load_model(
            str(self.model_dir), cfg.dtype, decode_head=cfg.decode_head, pace=pace
        )
        self.model_id = name or cfg.model
        # Prompt-cache entries are this model's while its files are unchanged (a reload of the
        # same files finds its entries again).
        self.cache_id = (self.model_id, files_key(self.model_dir))
        self.eos = set(self.tokenizer.eos_token_ids)
        # The width of the logits (embedding rows; may exceed the tokenizer's vocabulary).
        self.n_vocab = int(
            getattr(self.model.args, "vocab_size", 0) or len(self.tokenizer._tokenizer)
        )
        # The grammar engine's view of the vocabulary, for structured output: slow to build on a big
        # vocabulary (~4 s for Gemma 3's), so it is built alongside the rest of loading and the
        # server is ready only when it is (no request pays for it, nor shares the CPU with it).
        self._vocab = None
        if vocab:
            self._vocab = threading.Thread(
                target=self.grammar_vocab, name="mlxlab-grammar-vocab", daemon=True
            )
            self._vocab.start()
        self.tool = tool_syntax(self.tokenizer)
        self.think = think_markers(self.tokenizer)
        self.hidden = hidden_token_ids(self.tokenizer, self.tool, self.think)
        self.token_chars = longest_token_chars(self.tokenizer)
        self.kv = kv_quant.parse(cfg.kv_quant, self.model, self.model_dir)
        if self.vision is not None and self.vision.alone and self.kv.enabled:
            log.warning("mlxlab serve: kv_quant does not apply to a model mlx-vlm runs alone")
        self.cache = cache if cache is not None else PromptCache(int(cfg.prompt_cache_gb * 1e9))
        self.generation_config = read_generation_config(self.model_dir)
        self.admission = None
        self.adapters: Adapters | None = None
        self.draft = None
        self.speech = self.embedder = None
        if not deferred:
            self.start()

    def start(self) -> None:
        """The engine thread's part: admission measured (a one-token forward), the allocator
        capped, the draft model, the adapters of `cfg.adapters` mounted, the speech and
        embedding models (the default model's)."""
        import mlx.core as mx

        cfg = self.cfg
        extra = self.vision.extra_bytes if self.vision is not None else 0  # the vision tower
        self.admission = admission.measure(
            self.model, cfg.memory_budget_gb, cfg.decode.prefill_step, self.kv, extra
        )
        mx.set_memory_limit(self.admission.budget_bytes)
        # speculative=draft_model's drafts (decode/speculative.py): loaded before the adapters
        # are mounted, so a draft made of the model's own layers shares their wrappers
        if cfg.draft_model:
            from mlxlab.decode.speculative import load_draft

            self.draft = load_draft(cfg.draft_model, self.model, self.tokenizer, cfg.dtype)
            log.info("mlxlab serve: speculative drafts from %s", cfg.draft_model)
        self.adapters = Adapters(self.model, cfg.adapter_root, self.model_id)
        for adapter_id, path in (cfg.adapters or {}).items():
            m = self.adapters.mount(adapter_id, path)
            log.info(
                "mlxlab serve: mounted adapter %r from %s on %s (rank %d, %d modules)",
                adapter_id,
                m.path,
                self.model_id,
                m.rank,
                len(m.modules),
            )
        for adapter_id, path in self.remount.items():
            try:
                # under the adapter root still (a directory on the way may have been swapped
                # for a link out of it since), as POST /v1/adapters checks
                m = self.adapters.mount(adapter_id, self.adapters.confine(path))
            except Exception as e:  # noqa: BLE001 - its files may have gone or left the root since: reported, the load goes on
                log.warning(
                    "mlxlab serve: adapter %r (mounted at runtime from %s) is not mounted again "
                    "on %s: %s",
                    adapter_id,
                    path,
                    self.model_id,
                    e,
                )
                self.adapters.not_remounted.append(
                    {"id": adapter_id, "path": path, "error": str(e)}
                )
                continue
            log.info("mlxlab serve: mounted adapter %r again on %s", adapter_id, self.model_id)
        # The models served beside the chat one (serve/sidecars.py), loaded here so that they
        # too are only ever run by this thread.
        if cfg.stt_model:
            from mlxlab.audio.speech import Speech, language_code

            language_code(cfg.stt_language)  # a bad one fails at start, not per request
            self.speech = Speech(cfg.stt_model, cfg.dtype)
            log.info("mlxlab serve: speech-to-text model %s", self.speech.name)
        if cfg.embeddings_model:
            from mlxlab.embed.model import Embedder

            self.embedder = Embedder(cfg.embeddings_model)
            log.info("mlxlab serve: embedding model %s", self.embedder.name)
        if self._vocab is not None:
            self._vocab.join()

    def grammar_vocab(self) -> None:
        """Build the grammar engine's vocabulary (memoized by `grammar.vocab_for`)."""
        try:
            grammar.vocab_for(self.tokenizer, self.n_vocab)
        except Exception as e:  # noqa: BLE001 - structured output then fails per request, with this message
            log.warning("mlxlab serve: the grammar engine cannot read this tokenizer (%s)", e)


_TOKEN_CHARS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def longest_token_chars(tokenizer) -> int:
    """The most characters of text one token can stand for: the longest vocabulary entry (an
    entry's spelling is never shorter than the text it decodes to), at least 1. A text of C
    characters is therefore at least C / this many tokens (`pipeline.check_length`). Memoized
    per tokenizer: reading a 262k vocabulary holds the GIL for ~0.2-0.4 s, which a model
    sharing a loaded model's tokenizer (`tokenizers.shared_tokenizer`) does not pay again."""
    backend = getattr(tokenizer, "_tokenizer", tokenizer)
    try:
        return _TOKEN_CHARS[backend]
    except (KeyError, TypeError):
        pass
    try:
        n = max(1, max(map(len, backend.get_vocab())))
    except Exception:  # noqa: BLE001 - no vocabulary to read: no bound
        return 1 << 30
    try:
        _TOKEN_CHARS[backend] = n
    except TypeError:  # not weakly referenceable: not memoized
        pass
    return n


def hidden_token_ids(tokenizer, tool, think) -> set[int]:
    """Special tokens whose text must never reach a client (<eos>, <start_of_turn>, ...), except
    the markers the output parser needs to see."""
    hidden = set(getattr(tokenizer, "all_special_ids", []) or [])
    backend = getattr(tokenizer, "_tokenizer", tokenizer)
    for tid, tok in (getattr(backend, "added_tokens_decoder", None) or {}).items():
        if getattr(tok, "special", False):
            hidden.add(int(tid))
    keep = set()
    for marker in ([tool.start, tool.end] if tool else []) + (list(think) if think else []):
        ids = tokenizer.encode(marker, add_special_tokens=False) if marker else []
        if len(ids) == 1:
            keep.add(ids[0])
    return hidden - keep


def read_generation_config(model_dir) -> dict:
    """The sampling defaults in the model's generation_config.json (numbers only)."""
    path = Path(model_dir) / "generation_config.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {
        k: data[k]
        for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
        if isinstance(data.get(k), (int, float)) and not isinstance(data.get(k), bool)
    }


def files_key(model_dir: Path) -> tuple:
    """The identity of a model directory's files: the path and each weight and config file's
    size and modification time (a model whose files changed is another model to the cache)."""
    parts = [str(Path(model_dir).resolve())]
    for f in sorted(Path(model_dir).glob("*.safetensors")) + [Path(model_dir) / "config.json"]:
        try:
            st = f.stat()
            parts.append((f.name, st.st_size, st.st_mtime_ns))
        except OSError:
            pass
    return tuple(parts)
