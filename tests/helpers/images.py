"""Test images made with Pillow: distinct pictures in every accepted format, EXIF, bad files."""

from __future__ import annotations

import base64
import io


def picture(kind: int = 0, size=(40, 56)):
    """A PIL image, different for each `kind`: solid colours, gradients, a checkerboard."""
    import numpy as np
    from PIL import Image

    h, w = size
    y, x = np.mgrid[0:h, 0:w]
    if kind == 0:
        rgb = np.stack([np.full_like(x, 220), np.full_like(x, 30), np.full_like(x, 40)], -1)
    elif kind == 1:
        rgb = np.stack([x * 255 // w, y * 255 // h, np.full_like(x, 128)], -1)
    elif kind == 2:
        board = ((x // 8 + y // 8) % 2) * 255
        rgb = np.stack([board, board, 255 - board], -1)
    else:
        rng = np.random.default_rng(kind)
        rgb = rng.integers(0, 256, (h, w, 3))
    return Image.fromarray(rgb.astype("uint8"), "RGB")


def encoded(kind: int = 0, fmt: str = "PNG", size=(40, 56), **save) -> bytes:
    out = io.BytesIO()
    picture(kind, size).save(out, format=fmt, **save)
    return out.getvalue()


def data_url(data: bytes, mime: str = "image/png", name: str | None = None) -> str:
    extra = f";name={name}" if name else ""
    return f"data:{mime}{extra};base64,{base64.b64encode(data).decode()}"


def jpeg_with_exif(kind: int = 1) -> bytes:
    """A JPEG whose EXIF has a date, a camera and a GPS position (34.0522 N, 118.2437 W)."""
    from PIL import Image

    exif = Image.Exif()
    exif[0x010F] = "Apple"
    exif[0x0110] = "iPhone 14"
    exif[0x0132] = "2024:06:15 10:11:12"
    exif.get_ifd(0x8769)[0x9003] = "2024:06:15 10:11:12"
    gps = exif.get_ifd(0x8825)
    gps[1], gps[2] = "N", (34.0, 3.0, 7.92)
    gps[3], gps[4] = "W", (118.0, 14.0, 37.32)
    return encoded(kind, "JPEG", exif=exif)


def gif_two_frames() -> bytes:
    """An animated GIF: a red first frame, a blue second one."""
    from PIL import Image

    frames = [Image.new("RGB", (24, 24), c) for c in ((255, 0, 0), (0, 0, 255))]
    out = io.BytesIO()
    frames[0].save(out, format="GIF", save_all=True, append_images=frames[1:], duration=100)
    return out.getvalue()


def anthropic_user(data: bytes | str, media_type: str = "image/png", text: str | None = None):
    """An Anthropic Messages user turn with one base64 image (bytes are encoded; a str is sent
    as it is, for bad-data cases), after `text` when given."""
    import base64

    if isinstance(data, bytes):
        data = base64.b64encode(data).decode()
    image = {"type": "image", "source": {"type": "base64", "media_type": media_type, "data": data}}
    parts = [{"type": "text", "text": text}] if text is not None else []
    return {"role": "user", "content": [*parts, image]}
