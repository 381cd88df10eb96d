"""llama.cpp (llama-cpp-python) as the other runtime for GGUF adapters: next-token logits of
every position of a prompt, on a base GGUF with an optional LoRA adapter (`--lora`).

Extra buffer types (weight repacking, AMX) are turned off: llama.cpp's AMX matmul crashed with
SIGSEGV on the development VM (its CPU reports AMX); the plain CPU kernels compute the same
products."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def llama_logits(model: Path, ids: list[int], lora: Path | None = None) -> np.ndarray:
    import llama_cpp
    import llama_cpp.llama as llama_module

    default = llama_cpp.llama_model_default_params

    def params():
        p = default()
        p.use_extra_bufts = False
        return p

    llama_module.llama_cpp.llama_model_default_params = params
    try:
        kw = {"model_path": str(model), "n_ctx": 256, "logits_all": True, "verbose": False}
        if lora is not None:
            kw["lora_path"] = str(lora)
        llm = llama_cpp.Llama(n_threads=2, **kw)
        llm.eval(ids)
        out = np.array(llm.scores[: len(ids)], dtype=np.float32)
        llm.close()
        return out
    finally:
        llama_module.llama_cpp.llama_model_default_params = default
