"""Images in requests, from each protocol's parts to the job a vision-language model runs.

    protocol edge: OpenAI `image_url`, Responses `input_image`, Anthropic `image` (base64 / url)
        -> `prompt.image_part` dicts in the user message's content (nothing decoded yet)
    pipeline.prepare: `fetch_images` (async): the last user message's http(s) images, only with
        serve.allow_image_urls (image_fetch.py: public addresses only, size cap, deadline)
    pipeline.make_job (render thread): `plan` -> the checks, the ids, the prompt, the table

`plan` applies the handbook's rules: the model sees the images of the last user message (at most
`max_images`), each at most `max_image_mb` (413), all of the request's images together at most
`max_images_mb` (413); JPEG, PNG, GIF (first frame) and WebP, checked by Pillow (a wrong declared
type, a truncated or corrupt file: 400); ids by content hash over the whole history, restored
from the filename tables of earlier answers (mlxlab/vision/prompt.py); the answer begins with the
table of the shown images (`image_table`, EXIF columns with `image_exif`) unless it must parse
as JSON or a forced tool call. A URL image is known by the hash of its URL (so an image in the
history is never fetched again). A model without vision refuses shown images with a 400 naming
it; images earlier in the history become their labels for any model.

Image requests run on the serial lane through mlx-vlm (engine/vision.py): they bypass the prompt
cache (nothing is fetched or stored for them, `cached_tokens` 0), admission counts the vision
tower's measured bytes per image on top of the KV cache, and adapters are refused (mlx-vlm's
language model has no adapter slots; text requests on the same model take adapters as usual).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import re
from dataclasses import dataclass, field
from urllib.parse import unquote, urlsplit

from mlxlab.serve.config import ServeConfig
from mlxlab.serve.http import APIError
from mlxlab.vision import images as imgs
from mlxlab.vision import prompt as vp

_DATA_URL = re.compile(r"data:(?P<mime>[^;,]*)(?P<params>(?:;[^;,]*)*),(?P<data>.*)", re.DOTALL)


# --- the protocols' image parts -> image parts ----------------------------------------------


def _field(where: str) -> str:
    """The message content field an image part sits in (`messages[0].content[1]` ->
    `messages[0].content`): the `param` of its errors, as for the other content errors."""
    return re.sub(r"\[\d+\]$", "", where)


def _bad(where: str, message: str, status: int = 400, code: str = "invalid_image") -> APIError:
    return APIError(status, f"{where}: {message}", param=_field(where), code=code)


def from_url(url, where: str, name: str | None = None) -> dict:
    if not isinstance(url, str) or not url:
        raise _bad(where, "an image needs a URL (a data: URL or, if allowed, http(s))")
    return vp.image_part(where, url=url, name=name)


def openai_part(part: dict, where: str) -> dict:
    """`{"type": "image_url", "image_url": {"url": ...}}` (a bare string URL is taken too)."""
    spec = part.get("image_url")
    url = spec.get("url") if isinstance(spec, dict) else spec
    return from_url(url, where)


def responses_part(part: dict, where: str) -> dict:
    """`{"type": "input_image", "image_url": ...}`; file ids name files this server has not got."""
    if part.get("image_url") is None and part.get("file_id") is not None:
        raise _bad(where, "file_id images are not supported here; send image_url (a data URL)")
    return from_url(part.get("image_url"), where)


def anthropic_part(block: dict, where: str) -> dict:
    """`{"type": "image", "source": {"type": "base64", "media_type", "data"} | {"type": "url", "url"}}`."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64":
        if not isinstance(source.get("data"), str):
            raise _bad(where, "a base64 image source needs string data")
        return vp.image_part(where, b64=source["data"], mime=source.get("media_type"))
    if kind == "url":
        return from_url(source.get("url"), where)
    raise _bad(where, f"unsupported image source type {kind!r} (use base64 or url)")


IMAGE_PARTS = {"image_url": openai_part, "input_image": responses_part}


def joined(items: list) -> str | list:
    """Text pieces and image parts in order -> a string when all are text, else content parts."""
    if all(isinstance(x, str) for x in items):
        return "".join(items)
    return [x if isinstance(x, dict) else {"type": "text", "text": x} for x in items]


def user_content(content, where: str, text_kinds=("text", "input_text", "output_text")):
    """A user message's content in the chat-template form: a string, or (when it has images) a
    list of text parts and image parts."""
    if not isinstance(content, list) or not any(
        isinstance(p, dict) and (p.get("type") in IMAGE_PARTS or vp.is_image(p)) for p in content
    ):
        return None  # no image: the caller's text handling applies
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        at = f"{where}[{j}]"
        if vp.is_image(part):  # already ours (a stored conversation)
            parts.append(part)
        elif kind in IMAGE_PARTS:
            parts.append(IMAGE_PARTS[kind](part, at))
        elif kind in text_kinds and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind in text_kinds:
            raise APIError(400, f"{at}: a text part needs a string 'text'", param=where)
        else:
            raise APIError(400, f"{at}: unsupported content part type {kind!r}", param=where)
    return parts


def for_store(messages: list[dict]) -> list[dict]:
    """`messages` as JSON a conversation store keeps: image parts without their bytes (their hash
    keeps their ids; the model is only ever shown the images of the newest user message)."""
    out = []
    for m in messages:
        if isinstance(m.get("content"), list) and any(vp.is_image(p) for p in m["content"]):
            parts = []
            for p in m["content"]:
                if vp.is_image(p):
                    url = p.get("url") if (p.get("url") or "").startswith("http") else None
                    p = vp.image_part(p["where"], digest=p.get("digest"), name=p.get("name"))
                    p["url"] = url
                parts.append(p)
            m = {**m, "content": parts}
        out.append(m)
    return out


# --- fetching and resolving ------------------------------------------------------------------


def _shown(messages: list[dict] | None) -> list[dict]:
    """The image parts the model is given: the last user message's, those that carry their
    image (a stored conversation's carry only their hash: they become labels)."""
    if not messages:
        return []
    last = vp.last_user(messages)
    found = vp.images_in(messages[last]) if last is not None else []
    return [p for p in found if vp.has_payload(p)]


async def fetch_images(cfg: ServeConfig, loaded, ask) -> None:
    """Fetch the http(s) images the model will be shown (in place), only with
    serve.allow_image_urls; any other URL image stays unfetched (its id comes from its URL)."""
    from mlxlab.serve.image_fetch import FetchError, fetch

    shown = _shown(ask.messages)
    todo = [
        p
        for p in shown
        if p["bytes"] is None and (p["url"] or "").lower().startswith(("http://", "https://"))
    ]
    if not todo or loaded is None or loaded.vision is None or len(shown) > cfg.max_images:
        return  # nothing to fetch, or make_job refuses the images anyway
    if not cfg.allow_image_urls:
        p = todo[0]
        raise _bad(
            p["where"],
            "image URLs are not fetched by this server (serve.allow_image_urls=true turns them "
            "on); send the image as a data URL (data:image/png;base64,...)",
            code="image_urls_disabled",
        )

    async def one(p):
        try:
            p["bytes"], p["fetched_mime"] = await fetch(
                p["url"],
                int(cfg.max_image_mb * 1e6),
                cfg.image_url_timeout_s,
                cfg.image_url_hosts,
            )
        except FetchError as e:
            raise _bad(p["where"], str(e), e.status, e.code) from None

    await asyncio.gather(*(one(p) for p in todo))


def _decode_b64(text: str, where: str) -> bytes:
    text = re.sub(r"\s+", "", text)
    try:
        return base64.b64decode(text + "=" * (-len(text) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise _bad(where, "the image data is not valid base64") from None


def resolve(part: dict) -> None:
    """Fill in `digest` (and `bytes`, `mime`, `name`) of an image part, in place."""
    if part.get("digest"):
        return
    where, url = part["where"], part.get("url")
    if part.get("b64") is not None:
        part["bytes"] = _decode_b64(part["b64"], where)
    elif url and url.startswith("data:"):
        m = _DATA_URL.fullmatch(url)
        if not m:
            raise _bad(where, "not a data URL (data:<type>;base64,<data>)")
        params = [p.strip() for p in m["params"].split(";") if p.strip()]
        if "base64" not in params:
            raise _bad(where, "image data URLs must be base64 (data:<type>;base64,<data>)")
        for p in params:
            key, _, value = p.partition("=")
            if key.lower() in ("name", "filename") and value:
                part["name"] = unquote(value)
        part["mime"] = m["mime"] or None
        part["bytes"] = _decode_b64(m["data"], where)
    elif url and url.lower().startswith(("http://", "https://")):
        part["digest"] = hashlib.sha256(("url:" + url).encode()).hexdigest()
        part["name"] = part.get("name") or unquote(urlsplit(url).path.rsplit("/", 1)[-1]) or None
        if part.get("fetched_mime") and part["fetched_mime"].lower().startswith("image/"):
            part["mime"] = part["fetched_mime"]
        return
    else:
        scheme = (url or "").split(":", 1)[0]
        raise _bad(where, f"unsupported image URL scheme {scheme!r} (use a data: URL)")
    part["digest"] = imgs.digest_of(part["bytes"])
    part.pop("b64", None)


# --- the plan make_job follows ---------------------------------------------------------------


@dataclass
class Plan:
    """What make_job renders: `messages` for the chat template; with shown images, instead the
    processor's `inputs` and `prompt` tokens, the vision tower's bytes, and the table."""

    messages: list[dict]
    inputs: object | None = None  # mlxlab.vision.model.Inputs
    prompt: list[int] = field(default_factory=list)
    reasoning: bool = False
    image_bytes: int = 0
    preamble: str = ""


def _check_sizes(cfg: ServeConfig, parts: list[dict]) -> None:
    cap, total_cap, total = cfg.max_image_mb * 1e6, cfg.max_images_mb * 1e6, 0
    for p in parts:
        n = len(p["bytes"]) if p.get("bytes") is not None else 0
        if n > cap:
            raise _bad(
                p["where"],
                f"the image is {n / 1e6:.1f} MB, over the {cfg.max_image_mb:g} MB an image may "
                "be (serve.max_image_mb)",
                413,
                "image_too_large",
            )
        total += n
    if total > total_cap:
        raise APIError(
            413,
            f"the request's images are {total / 1e6:.1f} MB together, over the "
            f"{cfg.max_images_mb:g} MB allowed (serve.max_images_mb)",
            param="messages",
            code="images_too_large",
        )


def plan(cfg: ServeConfig, loaded, ask) -> Plan | None:
    """None when the request has no image and no filename table (the text path as it was);
    else the Plan (see the module docstring). Every refusal is an APIError."""
    messages = ask.messages
    if not messages:
        return None
    parts = [p for m in messages for p in vp.images_in(m)]
    tables = any(m["role"] == "assistant" and vp.TABLE_MARK in vp.text_of(m) for m in messages)
    if not parts and not tables:
        return None
    shown = _shown(messages)
    vision = loaded.vision
    if shown and vision is None:
        raise APIError(
            400,
            f"{shown[0]['where']}: the model {cfg.model!r} has no vision: it is a text-only "
            "model and cannot take image input; serve a vision-language model (an mlx-vlm "
            "directory) to send images",
            param=_field(shown[0]["where"]),
            code="model_has_no_vision",
        )
    if len(shown) > cfg.max_images:
        raise APIError(
            400,
            f"{len(shown)} images in the last user message, over the {cfg.max_images} a request "
            "may show the model (serve.max_images)",
            param=_field(shown[0]["where"]),
            code="too_many_images",
        )
    for p in parts:
        resolve(p)
    _check_sizes(cfg, parts)
    ids = vp.assign_ids(messages)
    model_messages = vp.model_messages(messages, ids, shown)
    if not shown:
        return Plan(model_messages)
    if ask.adapter:
        raise APIError(
            400,
            "adapter: adapters apply to text requests on this model; a request with images runs "
            "mlx-vlm's language model, which has no adapter slots (send the images without "
            "'adapter', or the text without images)",
            param="adapter",
            code="adapter_not_supported_with_images",
        )
    pictures = []
    for p in shown:
        try:
            pictures.append(imgs.decode(p["bytes"], p.get("mime"), p["where"]))
        except imgs.ImageError as e:
            raise APIError(e.status, str(e), param=_field(p["where"]), code=e.code) from None
    kwargs = dict(ask.template_kwargs or {})
    if ask.tools:
        kwargs["tools"] = ask.tools
    tok = loaded.tokenizer
    try:
        text = vision.render(model_messages, tok, **kwargs)
    except Exception as e:  # noqa: BLE001 - jinja's errors: the messages do not fit the template
        raise APIError(400, f"the chat template rejected these messages: {e}") from None
    try:
        inputs = vision.inputs(text, [p.image for p in pictures])
    except Exception as e:  # noqa: BLE001 - the processor refused the images or the prompt
        raise APIError(400, f"the model's image processor refused the request: {e}") from None
    prompt = inputs.tokens
    reasoning = False
    if loaded.think:
        start = tok.rfind_think_start(prompt) if hasattr(tok, "rfind_think_start") else -1
        end = tok.rfind_think_end(prompt) if hasattr(tok, "rfind_think_end") else -1
        reasoning = start > end
    preamble = ""
    if cfg.image_table and not ask.shape.constrained:
        rows = [
            (vp.image_id(ids, p), pic, p.get("name"))
            for p, pic in zip(shown, pictures, strict=True)
        ]
        preamble = vp.render_table(rows, cfg.image_exif)
    return Plan(None, inputs, prompt, reasoning, vision.image_bytes(inputs), preamble)


def text_job(loaded, ask, prompt: list[int], seen: Plan | None) -> Plan | None:
    """`seen` as make_job has it after rendering a request without shown images; on a model
    mlx-vlm serves alone (mlx-lm has no text class for it) the job still runs through mlx-vlm,
    so it gets the prompt as mlx-vlm inputs."""
    vision = loaded.vision
    if vision is None or not vision.alone:
        return seen
    if ask.adapter:
        raise APIError(
            400,
            f"adapter: this {vision.model_type} model runs through mlx-vlm alone (mlx-lm has no "
            "text class for it), which has no adapter slots",
            param="adapter",
            code="adapter_not_supported",
        )
    return Plan(
        seen.messages if seen is not None else ask.messages, vision.token_inputs(prompt), prompt
    )


def ceiling(admission, extra_bytes: int) -> int:
    """The longest context that fits the memory budget with `extra_bytes` more in use."""
    lo, hi = 0, admission.max_safe_context
    while lo < hi:
        mid = (lo + hi + 1) // 2
        fits = admission.bytes_for(mid) + extra_bytes <= admission.budget_bytes
        lo, hi = (mid, hi) if fits else (lo, mid - 1)
    return lo


def completion_limit(loaded, cfg: ServeConfig, prompt_len: int, requested, image_bytes: int) -> int:
    """max_tokens for an image job: as ask.completion_limit, the vision tower's bytes added."""
    adm = loaded.admission
    top = ceiling(adm, image_bytes)
    if requested is None and top - prompt_len >= 1:
        return min(cfg.max_tokens, top - prompt_len)
    requested = cfg.max_tokens if requested is None else requested
    if prompt_len + requested > top:
        adm.rejected += 1
        raise APIError(
            400,
            f"prompt ({prompt_len} tokens, with the images) + max_tokens ({requested}) exceeds "
            f"the {top} tokens that fit the memory budget of {adm.budget_bytes / 1e9:.2f} GB "
            f"beside the vision tower's {image_bytes / 1e6:.1f} MB for the images; lower "
            "max_tokens, send fewer or smaller images",
            type="memory_admission",
            param="max_tokens",
            code="context_over_budget",
        )
    return requested
