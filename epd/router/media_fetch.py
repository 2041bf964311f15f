"""Every image and video of a request, from either front end, becomes bytes here and only here:
parts with bytes pass (checked: an image's header, a video's container header), ``data:`` URLs and
local files go through ``load_media_bytes`` (files only under the allowed root), ``http(s)`` URLs
are fetched, and everything about them is untrusted:

* the body is streamed and dropped once it passes ``max_bytes`` (a declared Content-Length over
  the limit is refused before reading);
* one deadline covers the whole fetch, redirects included;
* each hop (the first URL and every redirect) is resolved and **every** address the host resolves
  to must be public, unless ``allow_private_network``; the connection then goes to the checked
  address itself (Host header and TLS SNI keep the name), so a second DNS answer cannot swap in
  a private one (DNS rebinding);
* environment proxies are ignored, so the checked address is the one connected to.

Every failure is an ``InvalidRequest`` (400) naming the part, the URL (shortened) and what was wrong.
"""
from __future__ import annotations

import asyncio
import ipaddress
import re
import socket
import urllib.parse
from dataclasses import dataclass

import httpx

from epd.errors import InvalidRequest
from epd.multimodal.media import (
    DEFAULT_LIMITS,
    LocalFileRefused,
    MediaError,
    MediaLimits,
    load_media_bytes,
    read_image_size,
)
from epd.multimodal.messages import media_parts, media_source, modality_of, part_location
from epd.multimodal.video import DEFAULT_VIDEO_LIMITS, VideoLimits, probe_video

_URL_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):")
_URL_PREVIEW_CHARS = 100
_REDIRECT_STATUSES = (301, 302, 303, 307, 308)
_USER_AGENT = "epd-router-media-fetch"


@dataclass(frozen=True)
class FetchLimits:
    max_bytes: int = DEFAULT_LIMITS.max_bytes  # per image, after content decoding
    max_video_bytes: int = DEFAULT_VIDEO_LIMITS.max_bytes  # per video
    timeout_s: float = 10.0  # whole fetch of one URL, redirects included
    max_redirects: int = 3
    # refused before anything loads; the core's own per-request item limit applies after
    max_items: int = 64

    def __post_init__(self) -> None:
        if min(self.max_bytes, self.max_video_bytes) <= 0 or self.timeout_s <= 0 or self.max_redirects < 0 \
                or self.max_items < 1:
            raise ValueError(f"FetchLimits needs max_bytes > 0, timeout_s > 0, max_redirects >= 0, max_items >= 1; "
                             f"got {self}")


class _FetchError(Exception):
    """What went wrong with one URL; the caller adds which URL and where it was."""


class MediaFetcher:
    def __init__(self, *, allowed_local_media_path: str | None = None, allow_private_network: bool = False,
                 limits: FetchLimits = FetchLimits(), media_limits: MediaLimits = DEFAULT_LIMITS,
                 allowed_media_domains: tuple[str, ...] = ()) -> None:
        """``allowed_media_domains``: when given, http(s) media only from these hosts (or their
        subdomains), at every redirect hop too (vLLM's ``--allowed-media-domains``)."""
        self.allowed_local_media_path = allowed_local_media_path
        self.allow_private_network = allow_private_network
        self.allowed_media_domains = tuple(d.lower().strip(".") for d in allowed_media_domains if d)
        self.limits = limits
        self.media_limits = MediaLimits(max_bytes=min(limits.max_bytes, media_limits.max_bytes),
                                        max_pixels=media_limits.max_pixels, max_side_px=media_limits.max_side_px)
        self.video_limits = VideoLimits(max_bytes=limits.max_video_bytes)

    async def resolve(self, messages: list[dict]) -> list[dict]:
        """A copy of ``messages`` with every media part (``image_url`` / ``video_url`` with a URL,
        ``image`` / ``video`` with bytes or a URL) replaced by ``{"type": "image", "image": <bytes>}``
        or ``{"type": "video", "video": <bytes>}``; all load concurrently."""
        slots = media_parts(messages)
        if not slots:
            return messages
        if len(slots) > self.limits.max_items:
            raise InvalidRequest(f"request has {len(slots)} media items (images and videos); the limit is "
                                 f"{self.limits.max_items} per request (max_items_per_request)", param="messages")
        tasks = [asyncio.ensure_future(self._load_part(part, part_location(i, j))) for i, j, part in slots]
        try:
            loaded = await asyncio.gather(*tasks)
        finally:  # one bad item fails the request: stop downloading the others
            for task in tasks:
                task.cancel()
        out = [{**m, "content": list(m["content"])} if isinstance(m.get("content"), list) else m for m in messages]
        for (i, j, part), data in zip(slots, loaded):
            modality = modality_of(part)
            out[i]["content"][j] = {"type": modality, modality: data}
        return out

    async def _load_part(self, part: dict, where: str) -> bytes:
        modality = modality_of(part)
        source = media_source(part)
        if isinstance(source, (bytes, bytearray, memoryview)):
            try:
                data = load_media_bytes(bytes(source), limits=self._byte_limits(modality), modality=modality)
                await asyncio.to_thread(self._check_header, data, modality)
                return data
            except MediaError as exc:
                raise InvalidRequest(f"{where}: {exc}", param="messages") from None
        if not isinstance(source, str) or not source:
            raise InvalidRequest(f"{where} needs {modality} bytes or a non-empty URL, got {source!r:.80}",
                                 param="messages")
        return await self.load(source, f"{where}.{modality}_url.url", modality)

    async def load(self, url: str, param: str = "image_url", modality: str = "image") -> bytes:
        """One item's encoded bytes, checked to carry a readable image header (a video: a
        container header within the video limits)."""
        try:
            if _scheme(url) in ("http", "https"):
                data = await asyncio.wait_for(self._fetch(url, modality), self.limits.timeout_s)
            else:
                data = await asyncio.to_thread(self._load_local, url, modality)
            await asyncio.to_thread(self._check_header, data, modality)
            return data
        except asyncio.TimeoutError:
            reason = f"no complete response within {self.limits.timeout_s:g} s"
        except (_FetchError, MediaError) as exc:
            reason = str(exc)
        raise InvalidRequest(f"{modality}_url {_preview(url)!r} ({param}): {reason}", param=param)

    def _byte_limits(self, modality: str) -> MediaLimits:
        if modality == "video":
            return MediaLimits(max_bytes=self.video_limits.max_bytes)
        return self.media_limits

    def _check_header(self, data: bytes, modality: str) -> None:
        if modality == "video":
            probe_video(data, self.video_limits)
        else:
            read_image_size(data)

    # ---- data: and local files ----------------------------------------------------------------
    def _load_local(self, url: str, modality: str = "image") -> bytes:
        try:
            return load_media_bytes(url, allowed_local_root=self.allowed_local_media_path,
                                    limits=self._byte_limits(modality), modality=modality)
        except LocalFileRefused as exc:
            if self.allowed_local_media_path is None:
                raise _FetchError(f"local files are refused: this server was started without "
                                  f"--allowed-local-media-path; send the {modality} as a data: URL or http(s) URL") \
                    from None
            raise _FetchError(f"{exc} (--allowed-local-media-path)") from None

    # ---- http(s) ------------------------------------------------------------------------------
    async def _fetch(self, url: str, modality: str = "image") -> bytes:
        timeout = httpx.Timeout(self.limits.timeout_s)
        async with httpx.AsyncClient(timeout=timeout, follow_redirects=False, trust_env=False,
                                     headers={"User-Agent": _USER_AGENT}) as client:
            for _ in range(self.limits.max_redirects + 1):
                response = await self._get(client, url)
                try:
                    if response.status_code in _REDIRECT_STATUSES:
                        location = response.headers.get("location")
                        if not location:
                            raise _FetchError(f"HTTP {response.status_code} redirect without a Location header")
                        url = urllib.parse.urljoin(url, location)
                        continue
                    if response.status_code != 200:
                        raise _FetchError(f"the server answered HTTP {response.status_code}, expected 200")
                    return await self._read_body(response, self._byte_limits(modality).max_bytes)
                finally:
                    await response.aclose()
        raise _FetchError(f"more than {self.limits.max_redirects} redirects (last to {_preview(url)!r})")

    async def _get(self, client: httpx.AsyncClient, url: str) -> httpx.Response:
        """GET ``url`` from one of its host's checked addresses (headers only; the body streams)."""
        parsed = httpx.URL(url)
        if parsed.scheme not in ("http", "https") or not parsed.host:
            raise _FetchError(f"expected an http(s) URL with a host, got {_preview(url)!r}")
        host = parsed.host.lower().rstrip(".")
        if self.allowed_media_domains and not any(host == d or host.endswith("." + d)
                                                  for d in self.allowed_media_domains):
            raise _FetchError(f"host {parsed.host!r} is not among the allowed media domains "
                              f"({', '.join(self.allowed_media_domains)}; --allowed-media-domains)")
        addresses = await self._checked_addresses(parsed)
        host_header = f"[{parsed.host}]" if ":" in parsed.host else parsed.host
        if parsed.port is not None:  # None: the scheme's default port
            host_header += f":{parsed.port}"
        last_error: Exception | None = None
        for address in addresses:  # the name's addresses in resolver order, as a browser would try them
            request = client.build_request("GET", parsed.copy_with(host=address), headers={"Host": host_header},
                                           extensions={"sni_hostname": parsed.host})
            try:
                return await client.send(request, stream=True)
            except httpx.ConnectError as exc:
                last_error = exc
            except httpx.HTTPError as exc:
                raise _FetchError(f"request to {parsed.host} failed: {exc or type(exc).__name__}") from None
        raise _FetchError(f"cannot connect to {parsed.host} ({', '.join(addresses)}): {last_error}")

    async def _checked_addresses(self, url: httpx.URL) -> list[str]:
        port = url.port or (443 if url.scheme == "https" else 80)
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(url.host, port, type=socket.SOCK_STREAM)
        except (socket.gaierror, UnicodeError) as exc:
            raise _FetchError(f"cannot resolve host {url.host!r}: {exc}") from None
        addresses = list(dict.fromkeys(info[4][0].split("%")[0] for info in infos))
        if not addresses:
            raise _FetchError(f"host {url.host!r} resolves to no address")
        if not self.allow_private_network:
            for address in addresses:
                kind = non_public_kind(ipaddress.ip_address(address))
                if kind:
                    raise _FetchError(
                        f"host {url.host!r} resolves to {address}, a {kind} address; private-network targets "
                        f"are refused (start the router with --allow-private-network to allow them)")
        return addresses

    async def _read_body(self, response: httpx.Response, max_bytes: int) -> bytes:
        declared = response.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > max_bytes:
            raise _FetchError(f"Content-Length {declared} bytes exceeds the limit of {max_bytes} bytes")
        chunks, num_bytes = [], 0
        try:
            async for chunk in response.aiter_bytes():
                num_bytes += len(chunk)
                if num_bytes > max_bytes:
                    raise _FetchError(f"body exceeds the limit of {max_bytes} bytes (stopped reading)")
                chunks.append(chunk)
        except httpx.HTTPError as exc:
            raise _FetchError(f"reading the body failed: {exc or type(exc).__name__}") from None
        if not num_bytes:
            raise _FetchError("the body is empty, expected media bytes")
        return b"".join(chunks)


def non_public_kind(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str | None:
    """Why ``ip`` is not a public unicast address ("loopback", "private", ...), or None if it is."""
    if isinstance(ip, ipaddress.IPv6Address):
        embedded = ip.ipv4_mapped or ip.sixtofour or (ip.teredo[1] if ip.teredo else None)
        if embedded is not None:  # an IPv6 form that reaches an IPv4 host: judge that host
            kind = non_public_kind(embedded)
            return f"{kind} (via {ip})" if kind else None
    for kind in ("loopback", "link_local", "multicast", "unspecified", "reserved", "private"):
        if getattr(ip, f"is_{kind}"):
            return kind.replace("_", "-")
    return None if ip.is_global else "non-global"


def _scheme(url: str) -> str | None:
    match = _URL_SCHEME.match(url)
    # a one-letter "scheme" is a Windows drive letter, i.e. a path (as in media.py)
    return match.group(1).lower() if match and len(match.group(1)) > 1 else None


def _preview(url: str) -> str:
    return url if len(url) <= _URL_PREVIEW_CHARS else url[:_URL_PREVIEW_CHARS] + "..."
