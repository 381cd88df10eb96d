"""Image bytes -> a checked, decoded picture.

Pillow sniffs the format from the bytes (JPEG, PNG, GIF, WebP are accepted; a GIF gives its first
frame), a declared MIME type (a data URL's, Anthropic's `media_type`, a fetched URL's
Content-Type) must name that format, the whole file is decoded (a truncated or corrupt file is
refused, never half-read), EXIF orientation is applied and the result is RGB: what mlx-vlm's own
`load_image` hands its processors. A picture also carries its content hash (the key of the stable
image ids) and the EXIF fields the filename table shows (date, camera, GPS position).
"""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass, field

# Pillow's format name -> (MIME type, file extension)
FORMATS = {
    "JPEG": ("image/jpeg", "jpeg"),
    "PNG": ("image/png", "png"),
    "GIF": ("image/gif", "gif"),
    "WEBP": ("image/webp", "webp"),
}
MIME_ALIASES = {"image/jpg": "image/jpeg", "image/pjpeg": "image/jpeg", "image/x-png": "image/png"}
ACCEPTED = "JPEG, PNG, GIF or WebP"


class ImageError(ValueError):
    """An image that cannot be used: `status` (400, or 413 when too large) and a short `code`."""

    def __init__(self, message: str, status: int = 400, code: str = "invalid_image"):
        super().__init__(message)
        self.status, self.code = status, code


def digest_of(data: bytes) -> str:
    """The content hash an image is known by (sha256, hex)."""
    return hashlib.sha256(data).hexdigest()


def normalize_mime(mime: str | None) -> str | None:
    if not mime:
        return None
    mime = mime.split(";")[0].strip().lower()
    return MIME_ALIASES.get(mime, mime)


@dataclass
class Picture:
    image: object  # a PIL.Image.Image, RGB, orientation applied
    digest: str
    format: str  # JPEG | PNG | GIF | WEBP
    nbytes: int
    meta: dict = field(default_factory=dict)  # date, camera, location: what EXIF says

    @property
    def mime(self) -> str:
        return FORMATS[self.format][0]

    @property
    def filename(self) -> str:
        """`image_<first 8 hex of the hash>.<ext>`: the name the filename table gives it."""
        return f"image_{self.digest[:8]}.{FORMATS[self.format][1]}"


def decode(
    data: bytes, declared: str | None = None, what: str = "image", max_pixels: int | None = None
) -> Picture:
    """A checked, decoded picture of `data`; ImageError naming `what` when it cannot be one.
    `max_pixels`: the most width x height accepted (default: Pillow's decompression-bomb bound)."""
    from PIL import Image, ImageOps, UnidentifiedImageError

    if not data:
        raise ImageError(f"{what}: the image is empty")
    try:
        img = Image.open(io.BytesIO(data))
    except UnidentifiedImageError:
        raise ImageError(
            f"{what}: not an image Pillow can read ({ACCEPTED} are accepted)"
        ) from None
    except Image.DecompressionBombError as e:
        raise ImageError(f"{what}: {e}", 413, "image_too_large") from None
    except Exception as e:  # noqa: BLE001 - any other failure to parse the header is bad input
        raise ImageError(f"{what}: cannot read the image ({e})") from None
    fmt = img.format
    if fmt not in FORMATS:
        raise ImageError(
            f"{what}: {fmt or 'this'} images are not supported ({ACCEPTED} are accepted)",
            code="unsupported_image_format",
        )
    mime = FORMATS[fmt][0]
    declared = normalize_mime(declared)
    if declared and declared != mime:
        raise ImageError(
            f"{what}: declared as {declared} but the data is a {fmt} image ({mime})",
            code="image_type_mismatch",
        )
    limit = max_pixels or Image.MAX_IMAGE_PIXELS
    if limit and img.width * img.height > limit:
        raise ImageError(
            f"{what}: {img.width} x {img.height} pixels is over the {limit} pixels accepted",
            413,
            "image_too_large",
        )
    try:
        if fmt == "PNG":  # CRCs and the end of the file: catches truncation before decoding
            Image.open(io.BytesIO(data)).verify()
        img.seek(0)  # a GIF's (or animated WebP's) first frame
        img.load()
        meta = exif_meta(img)
        rgb = ImageOps.exif_transpose(img).convert("RGB")
    except Exception as e:  # noqa: BLE001 - truncated, corrupt, or undecodable pixels
        raise ImageError(f"{what}: the {fmt} data is truncated or corrupt ({e})") from None
    return Picture(rgb, digest_of(data), fmt, len(data), meta)


def _ratio(value) -> float:
    try:
        return float(value)
    except (TypeError, ValueError, ZeroDivisionError):
        num, den = value
        return num / den


def _degrees(dms, ref) -> float | None:
    try:
        d, m, s = (_ratio(v) for v in dms)
    except (TypeError, ValueError, ZeroDivisionError):
        return None
    value = d + m / 60 + s / 3600
    return -value if str(ref).upper() in ("S", "W") else value


def exif_meta(img) -> dict:
    """The EXIF date (YYYY-MM-DD), camera and GPS position of `img`, for each it has."""
    try:
        exif = img.getexif()
    except Exception:  # noqa: BLE001 - malformed EXIF is no reason to refuse the picture
        return {}
    if not exif:
        return {}
    out = {}
    try:
        sub = exif.get_ifd(0x8769)  # Exif IFD: DateTimeOriginal
    except Exception:  # noqa: BLE001
        sub = {}
    date = sub.get(0x9003) or exif.get(0x0132)
    if isinstance(date, str) and len(date) >= 10:
        out["date"] = date[:10].replace(":", "-")
    make = str(exif.get(0x010F) or "").strip("\x00 ")
    model = str(exif.get(0x0110) or "").strip("\x00 ")
    camera = model if model.lower().startswith(make.lower()) else f"{make} {model}".strip()
    if camera:
        out["camera"] = camera
    try:
        gps = exif.get_ifd(0x8825)
    except Exception:  # noqa: BLE001
        gps = {}
    if gps:
        lat, lon = _degrees(gps.get(2), gps.get(1)), _degrees(gps.get(4), gps.get(3))
        if lat is not None and lon is not None:
            out["location"] = (
                f"{abs(lat):.4f}°{'N' if lat >= 0 else 'S'}, {abs(lon):.4f}°{'E' if lon >= 0 else 'W'}"
            )
    return out
