"""The media fetcher: data: and file URLs, http(s) with limits, redirects and the SSRF rules."""
from __future__ import annotations

import asyncio
import base64
import ipaddress

import pytest

from epd.errors import EPDError
from epd.router.media_fetch import FetchLimits, MediaFetcher, non_public_kind
from tests.conftest import make_image_bytes
from tests.router.fake_core import redirect_to, send_bytes, serve_files, slow

PNG = make_image_bytes(8, 6)


def image_message(url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": "look"},
                                         {"type": "image_url", "image_url": {"url": url}}]}]


def resolve(fetcher: MediaFetcher, url: str) -> bytes:
    messages = asyncio.run(fetcher.resolve(image_message(url)))
    part = messages[0]["content"][1]
    assert part["type"] == "image" and messages[0]["content"][0] == {"type": "text", "text": "look"}
    return part["image"]


def refusal(fetcher: MediaFetcher, url: str) -> str:
    with pytest.raises(EPDError) as info:
        resolve(fetcher, url)
    assert info.value.http_status == 400 and info.value.param == "messages[0].content[1].image_url.url"
    return info.value.message


@pytest.mark.parametrize("address, kind", [
    ("127.0.0.1", "loopback"), ("10.1.2.3", "private"), ("192.168.0.1", "private"), ("172.16.0.1", "private"),
    ("169.254.169.254", "link-local"), ("224.0.0.1", "multicast"), ("0.0.0.0", "unspecified"),
    ("240.0.0.1", "reserved"), ("100.64.0.1", "non-global"), ("::1", "loopback"), ("fe80::1", "link-local"),
    ("fc00::1", "private"), ("::ffff:127.0.0.1", "loopback (via ::ffff:7f00:1)"),
    ("8.8.8.8", None), ("2606:4700:4700::1111", None), ("::ffff:8.8.8.8", None),
])
def test_non_public_kind(address, kind):
    assert non_public_kind(ipaddress.ip_address(address)) == kind


def test_data_url_becomes_bytes_and_messages_are_not_mutated():
    url = "data:image/png;base64," + base64.b64encode(PNG).decode()
    original = image_message(url)
    messages = asyncio.run(MediaFetcher().resolve(original))
    assert messages[0]["content"][1] == {"type": "image", "image": PNG}
    assert original[0]["content"][1]["type"] == "image_url"


def test_data_url_that_is_not_an_image_is_refused():
    url = "data:image/png;base64," + base64.b64encode(b"not an image at all").decode()
    assert "expected an image" in refusal(MediaFetcher(), url)


def test_local_files_only_under_the_allowed_root(tmp_path):
    root, other = tmp_path / "media", tmp_path / "other"
    root.mkdir(), other.mkdir()
    (root / "a.png").write_bytes(PNG)
    (other / "b.png").write_bytes(PNG)
    fetcher = MediaFetcher(allowed_local_media_path=str(root))
    assert resolve(fetcher, f"file://{root / 'a.png'}") == PNG
    assert resolve(fetcher, str(root / "a.png")) == PNG
    message = refusal(fetcher, f"file://{other / 'b.png'}")
    assert "outside the allowed root" in message and "--allowed-local-media-path" in message
    assert "started without --allowed-local-media-path" in refusal(MediaFetcher(), str(root / "a.png"))


def test_loopback_http_refused_by_default_allowed_on_request():
    with serve_files({"/a.png": send_bytes(PNG)}) as base:
        message = refusal(MediaFetcher(), f"{base}/a.png")
        assert "127.0.0.1, a loopback address" in message and "--allow-private-network" in message
        assert resolve(MediaFetcher(allow_private_network=True), f"{base}/a.png") == PNG


def test_redirects_are_followed_up_to_the_limit():
    routes = {"/a.png": send_bytes(PNG), "/r1": redirect_to("/a.png"), "/r2": redirect_to("/r1", 307),
              "/loop": redirect_to("/loop"), "/nowhere": redirect_to("")}
    fetcher = MediaFetcher(allow_private_network=True, limits=FetchLimits(max_redirects=2))
    with serve_files(routes) as base:
        assert resolve(fetcher, f"{base}/r2") == PNG
        assert "more than 2 redirects" in refusal(fetcher, f"{base}/loop")
        assert "without a Location header" in refusal(fetcher, f"{base}/nowhere")


def test_redirect_to_another_scheme_is_refused():
    routes = {"/r": redirect_to("file:///etc/passwd")}
    with serve_files(routes) as base:
        assert "expected an http(s) URL" in refusal(MediaFetcher(allow_private_network=True), f"{base}/r")


def test_oversize_bodies_are_refused_declared_or_not():
    big = PNG + b"\0" * 5000
    routes = {"/declared": send_bytes(big), "/undeclared": send_bytes(big, declare_length=False)}
    fetcher = MediaFetcher(allow_private_network=True, limits=FetchLimits(max_bytes=4096))
    with serve_files(routes) as base:
        assert "Content-Length 5" in refusal(fetcher, f"{base}/declared")
        assert "exceeds the limit of 4096 bytes (stopped reading)" in refusal(fetcher, f"{base}/undeclared")


def test_http_errors_and_timeouts_name_the_url():
    routes = {"/gone": send_bytes(b"nope", status=404), "/slow": slow(1.5, send_bytes(PNG))}
    fetcher = MediaFetcher(allow_private_network=True, limits=FetchLimits(timeout_s=0.3))
    with serve_files(routes) as base:
        message = refusal(fetcher, f"{base}/gone")
        assert f"{base}/gone" in message and "HTTP 404, expected 200" in message
        assert "no complete response within 0.3 s" in refusal(fetcher, f"{base}/slow")


def test_unresolvable_host_and_long_urls_are_shortened():
    url = "http://does-not-exist.invalid/" + "x" * 300
    message = refusal(MediaFetcher(), url)
    assert "cannot resolve host 'does-not-exist.invalid'" in message
    assert "x" * 300 not in message and "..." in message


def test_every_redirect_hop_is_checked_again(monkeypatch):
    # Pretend 127.0.0.1 is public so the first hop passes; the redirect's target must still be refused.
    import epd.router.media_fetch as media_fetch
    monkeypatch.setattr(media_fetch, "non_public_kind", lambda ip: "loopback" if str(ip) == "127.0.0.2" else None)
    with serve_files({"/a.png": send_bytes(PNG)}) as base:
        port = base.rsplit(":", 1)[1]
        with serve_files({"/r": redirect_to(f"http://127.0.0.2:{port}/a.png")}) as redirecting:
            assert resolve(MediaFetcher(), f"{base}/a.png") == PNG
            assert "resolves to 127.0.0.2, a loopback address" in refusal(MediaFetcher(), f"{redirecting}/r")


def test_too_many_images_are_refused_before_any_loads():
    fetcher = MediaFetcher(limits=FetchLimits(max_items=2))
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://192.0.2.1/x.png"}}
                                             for _ in range(3)]}]
    with pytest.raises(EPDError, match=r"request has 3 media items \(images and videos\); the limit is 2 per request \(max_items_per_request\)"):
        asyncio.run(fetcher.resolve(messages))
