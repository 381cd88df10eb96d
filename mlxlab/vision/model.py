"""A vision-language model: mlx-vlm's model and processor beside the text model mlx-lm loads.

`load(model_dir, dtype, decode_head)` is what `serve` and `generate` call for any model spec: a
text model comes back as before, `(model, tokenizer, None)`. For a VLM directory (config.json
with a `vision_config` of a family mlx-vlm knows):

- mlx-lm loads the language model (its text class for the family: Gemma 3, Qwen2-VL, Mistral 3,
  ...), so text-only requests run exactly as on a text model (prompt cache, batching, adapters,
  the CPU decode kernel);
- mlx-vlm loads the whole model lazily, and its language model is pointed at mlx-lm's arrays
  (same names and shapes after both loaders' sanitizing), so the language weights are in memory
  once and only the vision tower and projector are read in addition (`shared_bytes`,
  `own_bytes`);
- requests with images run mlx-vlm's own `generate_step` on mlx-vlm's model (its vision tower,
  projector, embedding merge, family-specific positions such as Qwen's 3-D mRoPE, and its
  language model), with the server's sampler and logits processors (`steps`).

A family mlx-lm has no text class for (PaliGemma, Idefics3, Phi-3-vision, ...) is served by
mlx-vlm alone (`VisionModel.alone`): every request, with images or not, runs mlx-vlm's
`generate_step`, and the engine's model is a `TextView` of mlx-vlm's language model (what
admission measures and the tokenizer-side code reads); such a model has no prompt cache,
batching, adapters or decode kernel.

The image processor runs where the prompt is rendered (`inputs`; mlx-vlm's `prepare_inputs`,
its outputs copied to numpy there), the model only on the thread that calls `steps`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import mlx.nn as nn

from mlxlab.errors import UserError

log = logging.getLogger(__name__)

REFERENCE_SIZE = 448  # pixels a side of the image the vision tower's memory is measured on


def vision_config(model_dir) -> dict | None:
    """The model's config.json if it describes a vision-language model, else None."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict) or not isinstance(config.get("vision_config"), dict):
        return None
    return config


def is_vlm(model_dir) -> bool:
    return vision_config(model_dir) is not None


@dataclass
class Inputs:
    """A prompt with its images, as the image processor made them (numpy, any thread)."""

    input_ids: object  # np.ndarray [1, L]
    pixel_values: object | None
    mask: object | None
    extra: dict = field(default_factory=dict)  # image_grid_thw, ...: mlx-vlm's data kwargs
    n_images: int = 0
    image_tokens: int = 0  # prompt positions the images fill

    @property
    def tokens(self) -> list[int]:
        return [int(t) for t in self.input_ids[0]]


def _numpy(value):
    import mlx.core as mx
    import numpy as np

    if isinstance(value, mx.array):
        return np.array(value)
    return value


class VisionModel:
    """mlx-vlm's model and processor for `model_dir`, its language weights shared with the
    mlx-lm `text_model` (see the module docstring)."""

    def __init__(self, model_dir, dtype: str, text_model=None, pace=None):
        from mlx.utils import tree_flatten, tree_unflatten
        from mlx_vlm.utils import load_image_processor, load_model, load_processor

        from mlxlab.models.zoo import evaluate
        from mlxlab.runtime import resolve_dtype

        path = Path(model_dir)
        self.model = load_model(path, lazy=True)
        self.model.set_dtype(resolve_dtype(dtype))
        self.config = self.model.config
        self.model_type = self.config.model_type
        self.alone = text_model is None  # no mlx-lm model beside it: every request runs here
        theirs = dict(tree_flatten(text_model.parameters())) if text_model is not None else {}
        shared = []
        for name, value in tree_flatten(self.model.language_model.parameters()):
            full = f"language_model.{name}"
            mine = theirs.get(full)
            if mine is None and name == "lm_head.weight":  # mlx-vlm unties what mlx-lm ties
                mine = theirs.get("language_model.model.embed_tokens.weight")
            if mine is not None and mine.shape == value.shape and mine.dtype == value.dtype:
                shared.append((name, mine))
        self.model.language_model.update(tree_unflatten(shared))
        evaluate([v for _, v in tree_flatten(self.model.parameters())], pace)

        def nbytes(pairs, skip=()) -> int:  # each array once (a tied head is the embedding)
            seen = {id(v): v.nbytes for _, v in pairs if id(v) not in skip}
            return sum(seen.values())

        ids = {id(v) for _, v in shared}
        self.shared_bytes = nbytes(shared)
        self.own_bytes = nbytes(tree_flatten(self.model.parameters()), ids)
        language = nbytes(tree_flatten(self.model.language_model.parameters()))
        # resident bytes beyond the engine's model (mlx-lm's, or the TextView of this one's
        # language model): the vision tower, projector, and any parameter loaded twice
        self.extra_bytes = self.own_bytes - (language if self.alone else 0)
        processor = load_processor(
            path, True, eos_token_ids=getattr(self.config, "eos_token_id", None)
        )
        image_processor = load_image_processor(path)
        if image_processor is not None:
            processor.image_processor = image_processor
        self.processor = processor
        self.tokenizer = getattr(processor, "tokenizer", processor)
        self.image_token_id = next(
            (
                getattr(self.config, k)
                for k in ("image_token_index", "image_token_id")
                if isinstance(getattr(self.config, k, None), int)
            ),
            None,
        )
        try:
            measured = pace(self._measure) if pace is not None else self._measure()
            self.bytes_per_image, self.reference_tokens = measured
        except Exception as e:  # noqa: BLE001 - a family whose processor wants more than this
            log.warning(
                "mlxlab: could not measure the vision tower's memory on a reference image (%s); "
                "admission counts the images' prompt positions only",
                e,
            )
            self.bytes_per_image, self.reference_tokens = 0, 1

    # --- on the render thread ---------------------------------------------------------------

    @property
    def chat_template(self) -> str | None:
        return getattr(self.tokenizer, "chat_template", None) or getattr(
            self.processor, "chat_template", None
        )

    def inputs(self, prompt: str, images: list) -> Inputs:
        """The processor's token ids (image positions expanded), pixel values and the family's
        extra inputs for `prompt` (rendered by the chat template) and PIL `images`."""
        from mlx_vlm.utils import prepare_inputs, should_add_special_tokens

        add_special = should_add_special_tokens(self.model_type, self.processor)
        bos = getattr(self.tokenizer, "bos_token", None)
        if add_special and bos and prompt.startswith(bos):
            add_special = False  # the template wrote the BOS: never a second one
        raw = prepare_inputs(
            self.processor,
            images=list(images) or None,
            prompts=prompt,
            image_token_index=self.image_token_id,
            add_special_tokens=add_special,
        )
        raw = {k: _numpy(v) for k, v in raw.items()}
        ids = raw.pop("input_ids")
        pixels = raw.pop("pixel_values", None)
        mask = raw.pop("attention_mask", None)
        extra = {k: v for k, v in raw.items() if v is not None and hasattr(v, "shape")}
        n_image = int((ids == self.image_token_id).sum()) if self.image_token_id is not None else 0
        return Inputs(ids, pixels, mask, extra, len(images), n_image)

    def token_inputs(self, tokens: list[int]) -> Inputs:
        """Inputs for a prompt already tokenized and without images."""
        import numpy as np

        ids = np.array([tokens], dtype=np.int32)
        return Inputs(ids, None, np.ones_like(ids))

    def image_bytes(self, inputs: Inputs) -> int:
        """Memory the vision tower needs for `inputs`' images, from the measured reference: each
        image at the reference's cost, scaled by the square of its share of vision tokens above
        the reference's (attention over an image's patches grows with their square)."""
        if not inputs.n_images:
            return 0
        per_image = inputs.image_tokens / inputs.n_images
        scale = max(1.0, per_image / max(self.reference_tokens, 1)) ** 2
        return int(inputs.n_images * self.bytes_per_image * scale)

    # --- on the engine thread ---------------------------------------------------------------

    def _embed(self, inputs: Inputs):
        import mlx.core as mx

        ids = mx.array(inputs.input_ids)
        pixels = mx.array(inputs.pixel_values) if inputs.pixel_values is not None else None
        mask = mx.array(inputs.mask) if inputs.mask is not None else None
        extra = {k: mx.array(v) for k, v in inputs.extra.items()}
        return ids, pixels, mask, extra

    def _measure(self) -> tuple[int, int]:
        """(peak bytes of the vision tower, projector and embedding merge for one reference
        image, its vision tokens), measured once at load."""
        import mlx.core as mx
        import numpy as np
        from PIL import Image

        rng = np.random.default_rng(0)
        pixels = rng.integers(0, 256, (REFERENCE_SIZE, REFERENCE_SIZE, 3), dtype=np.uint8)
        text = self.render([{"role": "user", "content": [{"type": "image"}]}])
        inputs = self.inputs(text, [Image.fromarray(pixels)])
        ids, pixel_values, mask, extra = self._embed(inputs)
        mx.eval(ids, pixel_values, *extra.values())
        mx.synchronize()
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        out = self.model.get_input_embeddings(ids, pixel_values, mask=mask, **extra)
        mx.eval(out.inputs_embeds)
        peak = max(mx.get_peak_memory() - base, 0)
        del out
        mx.clear_cache()
        return int(peak), max(inputs.image_tokens, 1)

    def render(self, messages: list[dict], tokenizer=None, **kwargs) -> str:
        """The chat template applied to `messages` (image parts as `{"type": "image"}`). A model
        without one (PaliGemma: a prompt, not a chat) gets mlx-vlm's own prompt format for its
        family, which places the images and keeps the last user message's text."""
        tok = tokenizer if tokenizer is not None else self.tokenizer
        if getattr(tok, "chat_template", None):
            return tok.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False, **kwargs
            )
        from mlx_vlm.prompt_utils import apply_chat_template

        n = sum(
            1
            for m in messages
            if isinstance(m.get("content"), list)
            for p in m["content"]
            if p.get("type") == "image"
        )
        plain = [
            {
                "role": m["role"],
                "content": m["content"]
                if isinstance(m.get("content"), str)
                else "".join(p.get("text", "") for p in m.get("content") or []),
            }
            for m in messages
        ]
        return apply_chat_template(self.processor, self.config, plain, num_images=n)

    def steps(self, inputs: Inputs, sampler, processors, max_tokens: int, prefill_step: int):
        """mlx-vlm's `generate_step` over `inputs`: (token, logprobs) pairs, sampled with
        `sampler` after `processors`."""
        from mlx_vlm.generate import generate_step

        ids, pixels, mask, extra = self._embed(inputs)
        return generate_step(
            ids,
            self.model,
            pixels,
            mask,
            max_tokens=max_tokens,
            sampler=sampler,
            logits_processors=processors,
            prefill_step_size=prefill_step,
            **extra,
        )

    def stats(self) -> dict:
        return {
            "model_type": self.model_type,
            "shared_bytes": self.shared_bytes,
            "vision_bytes": self.own_bytes,
            "alone": self.alone,
            "bytes_per_image": self.bytes_per_image,
            "reference_image_tokens": self.reference_tokens,
        }


class TextView(nn.Module):
    """mlx-lm's model interface over mlx-vlm's language model (logits out, `layers`, `args`,
    `make_cache` with mlx-lm's cache classes), for a VLM that mlx-vlm serves alone: what the
    engine measures (admission) and inspects. It holds the same module: no second copy."""

    def __init__(self, vlm):
        super().__init__()
        self.language_model = vlm.language_model
        text = vlm.config.text_config
        vocab = getattr(text, "vocab_size", None) or getattr(vlm.config, "vocab_size", 0)
        self.args = SimpleNamespace(
            model_type=vlm.config.model_type,
            vocab_size=vocab,
            num_attention_heads=getattr(text, "num_attention_heads", None),
            max_position_embeddings=getattr(text, "max_position_embeddings", None),
        )

    def __call__(self, inputs, cache=None, input_embeddings=None):
        return self.language_model(inputs, cache=cache, inputs_embeds=input_embeddings).logits

    @property
    def layers(self):
        return self.language_model.layers

    def make_cache(self):
        from mlx_lm.models.cache import KVCache, RotatingKVCache

        lm = self.language_model
        theirs = lm.make_cache() if hasattr(lm, "make_cache") else None
        if theirs is None:
            return [KVCache() for _ in self.layers]
        out = []
        for c in theirs:  # mlx-vlm's own classes -> mlx-lm's, which admission knows
            kind = type(c).__name__
            if kind == "RotatingKVCache":
                out.append(RotatingKVCache(max_size=c.max_size, keep=getattr(c, "keep", 0)))
            else:
                out.append(KVCache() if kind == "KVCache" else c)
        return out


def mlx_lm_has(model_type: str | None) -> bool:
    """Whether mlx-lm has a text class for `model_type` (its own remapping applied)."""
    import importlib.util

    from mlx_lm.utils import MODEL_REMAPPING

    if not model_type:
        return False
    name = MODEL_REMAPPING.get(model_type, model_type)
    try:
        return importlib.util.find_spec(f"mlx_lm.models.{name}") is not None
    except (ImportError, ValueError):
        return False


def needs_mlx_vlm(spec: str) -> bool:
    """Whether `spec` is a VLM that only mlx-vlm can run (no text class in mlx-lm)."""
    from mlxlab.models.zoo import resolve

    config = vision_config(resolve(spec))
    return config is not None and not mlx_lm_has(config.get("model_type"))


def load(
    spec: str,
    dtype: str = "auto",
    decode_head: str = "auto",
    text_model: bool | None = None,
    pace=None,
):
    """(model, tokenizer, VisionModel or None) for any model spec (see the module docstring).
    `text_model`: for a VLM, whether mlx-lm runs its text requests (default: when mlx-lm has the
    family); False serves it through mlx-vlm alone. `pace`: as `zoo.load`'s (every evaluation,
    the vision tower's and its measurement included, runs through it)."""
    from mlxlab.models.zoo import load as load_text
    from mlxlab.models.zoo import resolve

    model_dir = resolve(spec)
    config = vision_config(model_dir)
    if config is None:
        return (*load_text(str(model_dir), dtype, decode_head=decode_head, pace=pace), None)
    try:
        from mlx_vlm.utils import get_model_and_args
    except ImportError as e:  # pragma: no cover - mlx-vlm is a dependency
        raise UserError(f"{model_dir} is a vision-language model and needs mlx-vlm ({e})") from e
    try:
        get_model_and_args(config)
    except (ValueError, KeyError) as e:
        raise UserError(
            f"{model_dir}: mlx-vlm does not know the model type {config.get('model_type')!r} ({e})"
        ) from None
    if text_model is None:
        text_model = mlx_lm_has(config.get("model_type"))
    if not text_model:
        return _load_alone(model_dir, dtype, config, pace)
    try:
        model, tokenizer = load_text(str(model_dir), dtype, decode_head=decode_head, pace=pace)
    except ValueError as e:
        raise UserError(
            f"{model_dir}: mlx-lm cannot load the language model of this "
            f"{config.get('model_type')} model ({e})"
        ) from None
    vision = VisionModel(model_dir, dtype, model, pace)
    if not getattr(tokenizer, "chat_template", None) and vision.chat_template:
        # mlx-community conversions keep the template in the processor's chat_template.json
        tokenizer._tokenizer.chat_template = vision.chat_template
    log.info(
        "mlxlab: %s is a vision-language model (%s): language weights shared with mlx-vlm "
        "(%.1f MB), vision tower %.1f MB, %.1f MB per image at %d x %d",
        model_dir,
        vision.model_type,
        vision.shared_bytes / 1e6,
        vision.own_bytes / 1e6,
        vision.bytes_per_image / 1e6,
        REFERENCE_SIZE,
        REFERENCE_SIZE,
    )
    return model, tokenizer, vision


def _load_alone(model_dir, dtype: str, config: dict, pace=None):
    """A VLM served by mlx-vlm alone: its model, mlx-lm's tokenizer wrapper over the same
    tokenizer files (streaming detokenizer, end tokens), a TextView for the engine."""
    from mlx_lm.utils import load_tokenizer

    vision = VisionModel(model_dir, dtype, pace=pace)
    eos = config.get("eos_token_id", config.get("text_config", {}).get("eos_token_id"))
    eos = [eos] if isinstance(eos, int) else eos
    tokenizer = load_tokenizer(Path(model_dir), eos_token_ids=eos)
    if not getattr(tokenizer, "chat_template", None) and vision.chat_template:
        tokenizer._tokenizer.chat_template = vision.chat_template
    log.info(
        "mlxlab: %s is a vision-language model (%s) that mlx-lm has no text class for: every "
        "request runs through mlx-vlm (%.1f MB; no prompt cache, batching or adapters)",
        model_dir,
        vision.model_type,
        vision.own_bytes / 1e6,
    )
    return TextView(vision.model), tokenizer, vision
