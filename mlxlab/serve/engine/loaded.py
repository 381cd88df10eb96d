"""What the engine thread loads once: the model and tokenizer, and what is derived from them
(stop and hidden tokens, tool and reasoning markup, admission, KV quantization, prompt cache,
generation defaults, adapters mounted at start)."""

from __future__ import annotations

import json
import logging
import threading
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
    def __init__(self, cfg: EngineSettings):
        import mlx.core as mx

        self.model_dir = resolve(cfg.model)
        # `vision`: mlx-vlm's model beside mlx-lm's when the directory is a VLM, else None.
        self.model, self.tokenizer, self.vision = load_model(
            str(self.model_dir), cfg.dtype, decode_head=cfg.decode_head
        )
        self.model_id = cfg.model
        self.eos = set(self.tokenizer.eos_token_ids)
        # The width of the logits (embedding rows; may exceed the tokenizer's vocabulary).
        self.n_vocab = int(
            getattr(self.model.args, "vocab_size", 0) or len(self.tokenizer._tokenizer)
        )
        # The grammar engine's view of the vocabulary, for structured output: slow to build on a big
        # vocabulary (~4 s for Gemma 3's), so it is built alongside the rest of loading and the
        # server is ready only when it is (no request pays for it, nor shares the CPU with it).
        vocab = threading.Thread(
            target=self._grammar_vocab, name="mlxlab-grammar-vocab", daemon=True
        )
        vocab.start()
        self.tool = tool_syntax(self.tokenizer)
        self.think = think_markers(self.tokenizer)
        self.hidden = hidden_token_ids(self.tokenizer, self.tool, self.think)
        self.token_chars = longest_token_chars(self.tokenizer)
        budget = int(cfg.memory_budget_gb * 1e9) if cfg.memory_budget_gb else None
        self.kv = kv_quant.parse(cfg.kv_quant, self.model, self.model_dir)
        if self.vision is not None and self.vision.alone and self.kv.enabled:
            log.warning("mlxlab serve: kv_quant does not apply to a model mlx-vlm runs alone")
        extra = self.vision.extra_bytes if self.vision is not None else 0  # the vision tower
        self.admission = admission.measure(
            self.model, budget, cfg.decode.prefill_step, self.kv, extra
        )
        mx.set_memory_limit(self.admission.budget_bytes)
        self.cache = PromptCache(int(cfg.prompt_cache_gb * 1e9))
        # speculative=draft_model's drafts (decode/speculative.py): loaded before the adapters
        # are mounted, so a draft made of the model's own layers shares their wrappers
        self.draft = None
        if cfg.draft_model:
            from mlxlab.decode.speculative import load_draft

            self.draft = load_draft(cfg.draft_model, self.model, self.tokenizer, cfg.dtype)
            log.info("mlxlab serve: speculative drafts from %s", cfg.draft_model)
        self.generation_config = read_generation_config(self.model_dir)
        self.adapters = Adapters(self.model, cfg.adapter_root)
        for adapter_id, path in (cfg.adapters or {}).items():
            m = self.adapters.mount(adapter_id, path)
            log.info(
                "mlxlab serve: mounted adapter %r from %s (rank %d, %d modules)",
                adapter_id,
                m.path,
                m.rank,
                len(m.modules),
            )
        # The models served beside the chat one (serve/sidecars.py), loaded here so that they
        # too are only ever run by this thread.
        self.speech = self.embedder = None
        if cfg.stt_model:
            from mlxlab.audio.speech import Speech, language_code

            language_code(cfg.stt_language)  # a bad one fails at start, not per request
            self.speech = Speech(cfg.stt_model, cfg.dtype)
            log.info("mlxlab serve: speech-to-text model %s", self.speech.name)
        if cfg.embeddings_model:
            from mlxlab.embed.model import Embedder

            self.embedder = Embedder(cfg.embeddings_model)
            log.info("mlxlab serve: embedding model %s", self.embedder.name)
        vocab.join()

    def _grammar_vocab(self) -> None:
        try:
            grammar.vocab_for(self.tokenizer, self.n_vocab)
        except Exception as e:  # noqa: BLE001 - structured output then fails per request, with this message
            log.warning("mlxlab serve: the grammar engine cannot read this tokenizer (%s)", e)


def longest_token_chars(tokenizer) -> int:
    """The most characters of text one token can stand for: the longest vocabulary entry (an
    entry's spelling is never shorter than the text it decodes to), at least 1. A text of C
    characters is therefore at least C / this many tokens (`pipeline.check_length`)."""
    backend = getattr(tokenizer, "_tokenizer", tokenizer)
    try:
        return max(1, max(map(len, backend.get_vocab())))
    except Exception:  # noqa: BLE001 - no vocabulary to read: no bound
        return 1 << 30


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
