"""Stream text from a model.

    python -m mlxlab generate prompt="def fibonacci(n):" max_tokens=64
    python -m mlxlab generate chat=true prompt="Name three colours." temperature=0.7 seed=1
    python -m mlxlab generate chat=true adapter=outputs/quickstart/<run>/adapter prompt="..."
    python -m mlxlab generate model=tiny-llama --cfg job     # print the resolved config

Built on mlx-lm's `stream_generate` and samplers; the stats line reports prompt and decode
tokens/s and peak memory.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator

from mlxlab.cli import run_hydra
from mlxlab.config import GenerateConfig

log = logging.getLogger(__name__)


def build_prompt(tokenizer, cfg: GenerateConfig) -> str:
    """The prompt text: raw, or the chat template applied to (system, user)."""
    if not cfg.chat:
        return cfg.prompt
    if not getattr(tokenizer, "chat_template", None):
        from mlxlab.errors import UserError

        raise UserError("chat=true but the model's tokenizer has no chat template")
    messages = ([{"role": "system", "content": cfg.system}] if cfg.system else []) + [
        {"role": "user", "content": cfg.prompt}
    ]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def stream(model, tokenizer, cfg: GenerateConfig) -> Iterator:
    """mlx-lm GenerationResponse items for `cfg` (text segments, then the final one with stats)."""
    import mlx.core as mx
    from mlx_lm.generate import stream_generate
    from mlx_lm.sample_utils import make_sampler

    mx.random.seed(cfg.seed)
    sampler = make_sampler(temp=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k)
    prompt = build_prompt(tokenizer, cfg)
    yield from stream_generate(model, tokenizer, prompt, max_tokens=cfg.max_tokens, sampler=sampler)


def run(cfg: GenerateConfig, out=sys.stdout) -> dict:
    """Load, stream to `out`, and return the stats of the run."""
    import mlx.core as mx

    from mlxlab.models.zoo import load

    model, tokenizer = load(cfg.model, cfg.dtype, decode_head=cfg.decode_head)
    if cfg.adapter:
        from mlxlab.lora import io as lora_io

        lora_io.load(model, cfg.adapter)
    mx.reset_peak_memory()
    last = None
    for last in stream(model, tokenizer, cfg):
        out.write(last.text)
        out.flush()
    stats = {
        "prompt_tokens": last.prompt_tokens,
        "prompt_tps": round(last.prompt_tps, 2),
        "generation_tokens": last.generation_tokens,
        "generation_tps": round(last.generation_tps, 2),
        "peak_memory_gb": round(mx.get_peak_memory() / 1e9, 3),
        "finish_reason": last.finish_reason,
    }
    out.write("\n")
    log.info(
        f"[prompt: {stats['prompt_tokens']} tokens, {stats['prompt_tps']:.1f} tok/s | "
        f"decode: {stats['generation_tokens']} tokens, {stats['generation_tps']:.1f} tok/s | "
        f"peak memory: {stats['peak_memory_gb']:.2f} GB]"
    )
    return stats


def main(argv: list[str]) -> None:
    run_hydra("generate", argv, run)
