"""Fetching an image URL for a request, only when `serve.allow_image_urls=true`, without letting a
client reach what the server can reach and it cannot (SSRF).

Every hop (the URL, then each redirect, at most `MAX_REDIRECTS`) is checked the same way before
anything is sent: http or https only; the host name is resolved and every address it resolves
to must be public (not loopback, private, link-local, multicast, reserved, unspecified or another
non-global range; an IPv4-mapped IPv6 address is judged by its IPv4 address), unless the host is
one of `serve.image_url_hosts`, names an operator has allowed to resolve privately. The request
then goes to the address that was checked (the Host header and TLS SNI name the host), so a DNS
answer that changes between the check and the connection cannot redirect it. The body is read up
to the byte cap (413 above it, at once when Content-Length says so) within one deadline for the
whole fetch; proxies from the environment are not used.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
from urllib.parse import urljoin

MAX_REDIRECTS = 3


class FetchError(Exception):
    """A URL that cannot be fetched: `status` (400, or 413 when too large) and a short `code`."""

    def __init__(self, message: str, status: int = 400, code: str = "image_url_failed"):
        super().__init__(message)
        self.status, self.code = status, code


def address_kind(ip: str) -> str | None:
    """Why `ip` may not be fetched from ("loopback", "private", ...), or None when it is public."""
    addr = ipaddress.ip_address(ip.split("%", 1)[0])
    if addr.version == 6 and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    for kind in ("loopback", "link_local", "private", "multicast", "reserved", "unspecified"):
        if getattr(addr, f"is_{kind}"):
            return kind.replace("_", "-")
    return None if addr.is_global else "non-public"


async def resolve(host: str, port: int) -> list[str]:
    """Every address `host` resolves to (an IP literal resolves to itself)."""
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise FetchError(f"cannot resolve {host!r} ({e.strerror or e})") from None
    return list(dict.fromkeys(info[4][0] for info in infos))


async def checked_addresses(url, allowed_hosts: set[str]) -> list[str]:
    """The addresses to connect to for httpx.URL `url` (in the resolver's order), after the
    policy above."""
    if url.scheme not in ("http", "https"):
        raise FetchError(f"only http and https image URLs are fetched, not {url.scheme}:")
    host = url.host
    if not host:
        raise FetchError("the image URL has no host")
    addresses = await resolve(host, url.port or (443 if url.scheme == "https" else 80))
    if host.lower() not in allowed_hosts:
        for ip in addresses:
            kind = address_kind(ip)
            if kind:
                raise FetchError(
                    f"refused to fetch {url.scheme}://{url.netloc.decode()}: {host} resolves to "
                    f"{ip}, a {kind} address (only public addresses are fetched; "
                    "serve.image_url_hosts lists hosts that may be private)",
                    code="image_url_refused",
                )
    return addresses


@contextlib.asynccontextmanager
async def _connect(client, target, addresses: list[str], headers: dict, extensions: dict):
    """The response of the first checked address that takes the connection."""
    import httpx

    for i, ip in enumerate(addresses):
        try:
            async with client.stream(
                "GET", target.copy_with(host=ip), headers=headers, extensions=extensions
            ) as r:
                yield r
                return
        except httpx.ConnectError:
            if i == len(addresses) - 1:
                raise


async def _fetch(url: str, max_bytes: int, allowed_hosts: set[str]) -> tuple[bytes, str | None]:
    import httpx

    async with httpx.AsyncClient(follow_redirects=False, trust_env=False) as client:
        for _ in range(MAX_REDIRECTS + 1):
            try:
                target = httpx.URL(url)
            except Exception as e:  # noqa: BLE001 - httpx's InvalidURL and friends
                raise FetchError(f"not a valid URL: {url[:200]!r} ({e})") from None
            addresses = await checked_addresses(target, allowed_hosts)
            extensions = {}
            if target.scheme == "https":
                extensions["sni_hostname"] = target.host
            headers = {"Host": target.netloc.decode(), "Accept": "image/*"}
            async with _connect(client, target, addresses, headers, extensions) as r:
                if r.is_redirect and "location" in r.headers:
                    url = urljoin(str(target), r.headers["location"])
                    continue
                if r.status_code != 200:
                    raise FetchError(f"fetching {target} answered HTTP {r.status_code}")
                declared = r.headers.get("content-length")
                if declared and declared.isdigit() and int(declared) > max_bytes:
                    raise FetchError(
                        f"{target} is {int(declared) / 1e6:.1f} MB, over the "
                        f"{max_bytes / 1e6:g} MB an image may be (serve.max_image_mb)",
                        413,
                        "image_too_large",
                    )
                body = bytearray()
                async for chunk in r.aiter_bytes():
                    body += chunk
                    if len(body) > max_bytes:
                        raise FetchError(
                            f"{target} is over the {max_bytes / 1e6:g} MB an image may be "
                            "(serve.max_image_mb)",
                            413,
                            "image_too_large",
                        )
                return bytes(body), r.headers.get("content-type")
    raise FetchError(f"more than {MAX_REDIRECTS} redirects")


async def fetch(
    url: str, max_bytes: int, timeout_s: float, allowed_hosts=()
) -> tuple[bytes, str | None]:
    """(body, Content-Type) of the image at `url`, or FetchError (see the module docstring)."""
    import httpx

    allowed = {h.lower() for h in allowed_hosts}
    try:
        return await asyncio.wait_for(_fetch(url, max_bytes, allowed), timeout_s)
    except asyncio.TimeoutError:
        raise FetchError(
            f"fetching the image URL took longer than {timeout_s:g} s (serve.image_url_timeout_s)"
        ) from None
    except httpx.HTTPError as e:
        raise FetchError(f"fetching the image URL failed: {type(e).__name__}: {e}") from None
