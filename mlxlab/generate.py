"""Stream text from a model.

    python -m mlxlab generate prompt="def fibonacci(n):" max_tokens=64
    python -m mlxlab generate chat=true prompt="Name three colours." temperature=0.7 seed=1
    python -m mlxlab generate chat=true adapter=outputs/quickstart/<run>/adapter prompt="..."
    python -m mlxlab generate model=tiny-llama --cfg job     # print the resolved config
    python -m mlxlab generate model=DIR image=photo.jpg prompt="What is in this picture?"

Decoded on the decoder's serial path (mlxlab/decode/serial.py: mlx-lm's `generate_step` and
samplers, the prompt read in steps of 512 tokens); the stats line reports prompt and decode
tokens/s and peak memory. With `image=`, on a vision-language model (an mlx-vlm directory), the
prompt and images become one user message, rendered and run as the server runs an image request
(mlxlab/vision: the images checked, each after its `[Image N]` label, mlx-vlm's generate_step).
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


def encode(tokenizer, prompt: str) -> list[int]:
    """The prompt's token ids as mlx-lm's `stream_generate` makes them: with the tokenizer's
    special tokens unless the text already begins with its BOS (a rendered chat template)."""
    bos = getattr(tokenizer, "bos_token", None)
    return tokenizer.encode(prompt, add_special_tokens=bos is None or not prompt.startswith(bos))


def stream(model, tokenizer, cfg: GenerateConfig, draft=None) -> Iterator:
    """(text segment, stats or None) pairs for `cfg` on the decoder's serial path
    (mlxlab/decode/serial.py); the last pair carries the stats. `draft`: the draft model of
    speculative=draft_model."""
    import time

    import mlx.core as mx
    from mlx_lm.sample_utils import make_sampler

    from mlxlab.decode.batch import Row
    from mlxlab.decode.serial import run_serial
    from mlxlab.decode.settings import DecodeSettings

    ids = encode(tokenizer, build_prompt(tokenizer, cfg))
    mx.random.seed(cfg.seed)
    sampler = make_sampler(temp=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k)
    eos = set(tokenizer.eos_token_ids)
    detok = tokenizer.detokenizer
    detok.reset()
    segments: list[str] = []
    times = [time.perf_counter()]

    def feed(token: int, _logprobs) -> str | None:
        if len(times) == 1:
            times.append(time.perf_counter())  # the first token: the prompt is read
        if token in eos:
            return "stop"
        detok.add_token(token)
        segments.append(detok.last_segment)
        return None

    finish = []
    row = Row(
        ids, cfg.max_tokens, feed, lambda f, _t: finish.append(f), sampler=sampler, logprobs=False
    )
    settings = DecodeSettings(speculative=cfg.speculative, draft_tokens=cfg.draft_tokens)
    run_serial(model, row, settings, draft_model=draft)
    detok.finalize()
    end = time.perf_counter()
    first = times[1] if len(times) > 1 else end
    n = len(row.tokens) - (finish[0] == "stop")
    for text in segments:
        yield text, None
    yield (
        detok.last_segment,
        {
            "prompt_tokens": len(ids),
            "prompt_tps": round(len(ids) / max(first - times[0], 1e-9), 2),
            "generation_tokens": n,
            "generation_tps": round(max(n - 1, 0) / max(end - first, 1e-9), 2),
            "peak_memory_gb": round(mx.get_peak_memory() / 1e9, 3),
            "finish_reason": finish[0],
            **({"speculative": row.speculation.as_dict()} if row.speculation else {}),
        },
    )


def stream_images(cfg: GenerateConfig) -> Iterator:
    """(text segment, stats or None) pairs for a prompt with `cfg.image` on a VLM (or without
    images on a VLM only mlx-vlm runs); the last pair carries the stats."""
    import time
    from pathlib import Path

    import mlx.core as mx
    from mlx_lm.sample_utils import make_sampler

    from mlxlab.errors import UserError
    from mlxlab.vision import images, model, prompt

    if cfg.adapter:
        raise UserError("adapter= applies to text prompts; image= runs mlx-vlm's model without it")
    pictures = []
    for f in cfg.image or []:
        try:
            data = Path(f).expanduser().read_bytes()
        except OSError as e:
            raise UserError(f"image={f}: {e.strerror or e}") from None
        try:
            pictures.append(images.decode(data, None, f"image={f}"))
        except images.ImageError as e:
            raise UserError(str(e)) from None
    _, tokenizer, vision = model.load(cfg.model, cfg.dtype, decode_head=cfg.decode_head)
    if vision is None:
        raise UserError(
            f"model {cfg.model!r} has no vision: it is a text-only model; image= needs a "
            "vision-language model (an mlx-vlm directory, e.g. model=tiny-gemma3-vl)"
        )
    parts = [{"type": "text", "text": cfg.prompt}]
    for n in range(1, len(pictures) + 1):
        parts += [{"type": "text", "text": prompt.label(n)}, {"type": "image"}]
    messages = ([{"role": "system", "content": cfg.system}] if cfg.system else []) + [
        {"role": "user", "content": parts}
    ]
    inputs = vision.inputs(vision.render(messages, tokenizer), [p.image for p in pictures])
    mx.random.seed(cfg.seed)
    mx.reset_peak_memory()
    sampler = make_sampler(temp=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k)
    detok = tokenizer.detokenizer
    detok.reset()
    eos = set(tokenizer.eos_token_ids)
    t0 = time.perf_counter()
    first = t0
    n, finish = 0, "length"
    for token, _ in vision.steps(inputs, sampler, [], cfg.max_tokens, 512):
        if n == 0:
            first = time.perf_counter()
        if token in eos:
            finish = "stop"
            break
        n += 1
        detok.add_token(token)
        yield detok.last_segment, None
    detok.finalize()
    end = time.perf_counter()
    stats = {
        "prompt_tokens": len(inputs.tokens),
        "prompt_tps": round(len(inputs.tokens) / max(first - t0, 1e-9), 2),
        "generation_tokens": n,
        "generation_tps": round(max(n - 1, 0) / max(end - first, 1e-9), 2),
        "peak_memory_gb": round(mx.get_peak_memory() / 1e9, 3),
        "finish_reason": finish,
        "images": len(pictures),
    }
    yield detok.last_segment, stats


def run(cfg: GenerateConfig, out=sys.stdout) -> dict:
    """Load, stream to `out`, and return the stats of the run."""
    import mlx.core as mx

    from mlxlab.models.zoo import load
    from mlxlab.vision.model import needs_mlx_vlm

    if cfg.image or needs_mlx_vlm(cfg.model):  # images, or a VLM only mlx-vlm can run
        stats = None
        for text, last in stream_images(cfg):
            out.write(text)
            out.flush()
            stats = last or stats
        out.write("\n")
        log.info(
            f"[prompt: {stats['prompt_tokens']} tokens ({stats['images']} image(s)), "
            f"{stats['prompt_tps']:.1f} tok/s | decode: {stats['generation_tokens']} tokens, "
            f"{stats['generation_tps']:.1f} tok/s | peak memory: {stats['peak_memory_gb']:.2f} GB]"
        )
        return stats

    model, tokenizer = load(cfg.model, cfg.dtype, decode_head=cfg.decode_head)
    if cfg.adapter:
        from mlxlab.lora import io as lora_io

        lora_io.load(model, cfg.adapter)
    draft = None
    if cfg.draft_model:
        from mlxlab.decode.speculative import load_draft

        draft = load_draft(cfg.draft_model, model, tokenizer, cfg.dtype)
    mx.reset_peak_memory()
    stats = None
    for text, last in stream(model, tokenizer, cfg, draft):
        out.write(text)
        out.flush()
        stats = last or stats
    out.write("\n")
    log.info(
        f"[prompt: {stats['prompt_tokens']} tokens, {stats['prompt_tps']:.1f} tok/s | "
        f"decode: {stats['generation_tokens']} tokens, {stats['generation_tps']:.1f} tok/s | "
        f"peak memory: {stats['peak_memory_gb']:.2f} GB]"
    )
    if s := stats.get("speculative"):
        rate = s["acceptance_rate"]
        log.info(
            f"[speculative {cfg.speculative}: {s['drafted_tokens']} drafted, "
            f"{s['accepted_tokens']} accepted ({'-' if rate is None else f'{rate:.0%}'}) in "
            f"{s['verify_steps']} verify steps]"
        )
    return stats


def main(argv: list[str]) -> None:
    run_hydra("generate", argv, run)
