"""Images by URL (producer/intake/fetch.py) against a real HTTP server on loopback, started here: what
is fetched, and each refusal by its name (a host not allowed, a redirect out of the allowed hosts, a
name that resolves to loopback, a body past the limit, a server that stalls or trickles)."""

from __future__ import annotations

import contextlib
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from producer.intake import fetch
from producer.intake.fetch import FetchRefused
from producer.openai.chat_request import parse_chat
from producer.openai.errors import OpenAIError
from shared import url_hosts
from shared.settings import Settings
from tests.support import tls

IMAGE = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4
COUNTED: list[str] = []  # the paths of /counted/... asked for


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *_: Any) -> None:  # quiet
        pass

    served: threading.Event | None = None  # a subclass's own: set once a request's whole answer is sent

    def do_GET(self) -> None:
        self._answer()
        if self.served is not None:
            self.served.set()

    def _answer(self) -> None:
        port = self.server.server_address[1]
        route = {
            "/parcel.png": lambda: self._send(IMAGE),
            "/counted/parcel.png": lambda: (COUNTED.append(self.path), self._send(IMAGE)),
            "/to-parcel": lambda: self._redirect(f"http://localhost:{port}/parcel.png"),
            "/to-ip": lambda: self._redirect(f"http://127.0.0.1:{port}/parcel.png"),
            "/to-next-port": lambda: self._redirect(f"http://localhost:{port + 1}/parcel.png"),
            "/loop": lambda: self._redirect("/loop"),
            "/big": lambda: self._send(IMAGE * 10),
            "/big-unsized": lambda: self._send(IMAGE * 10, sized=False),
            "/stall": lambda: time.sleep(3),
            "/trickle": self._trickle,
            "/missing": lambda: self.send_error(404),
            "/%C3%A4.png": lambda: self._send(IMAGE),  # a non-ASCII path, as sent: percent-encoded
            "/slow-headers": lambda: self._raw(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nabcd", 0.1),
            "/slow-chunk": lambda: self._raw(
                b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b"0" * 60 + b"1\r\nx\r\n0\r\n\r\n",
                0.05,
            ),
            "/signed-length": lambda: self._raw(
                b"HTTP/1.1 200 OK\r\nContent-Length: +99999\r\n\r\n" + IMAGE, 0
            ),
        }.get(self.path)
        if route is None:
            self.send_error(404)
            return
        route()

    def _send(self, body: bytes, sized: bool = True) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        if sized:
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _raw(self, data: bytes, pause: float) -> None:
        """Bytes as they are, one at a time `pause` apart (a server that trickles what it sends)."""
        if not pause:
            self.wfile.write(data)
            return
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # the fetch gave up: its point
            for byte in data:
                self.wfile.write(bytes([byte]))
                self.wfile.flush()
                time.sleep(pause)

    def _redirect(self, where: str) -> None:
        self.send_response(302)
        self.send_header("Location", where)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _trickle(self) -> None:  # every read gets a byte before its timeout; the whole never comes
        self.send_response(200)
        self.send_header("Content-Length", str(len(IMAGE)))
        self.end_headers()
        for byte in IMAGE[:40]:
            self.wfile.write(bytes([byte]))
            self.wfile.flush()
            time.sleep(0.1)


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield int(server.server_address[1])
    server.shutdown()
    server.server_close()


def _settings(**fields: Any) -> Settings:
    values = {"image_url_hosts": "localhost", "image_url_private": True, "max_image_bytes": 5000,
              "image_url_timeout_s": 1.5, **fields}  # fmt: skip
    return Settings(**values)


def _refusal(url: str, settings: Settings) -> str:
    with pytest.raises(FetchRefused) as refused:
        fetch.fetch(url, settings)
    return refused.value.reason


def test_an_allowed_host_is_fetched_through_its_redirects(port: int) -> None:
    assert fetch.fetch(f"http://localhost:{port}/parcel.png", _settings()) == IMAGE
    assert fetch.fetch(f"http://localhost:{port}/to-parcel", _settings()) == IMAGE


@pytest.mark.parametrize(
    ("path", "fields", "reason"),
    [
        ("/parcel.png", {"image_url_hosts": "photos.example.com"}, "image_url_host_not_allowed"),
        ("/to-ip", {}, "image_url_host_not_allowed"),  # a redirect out of the allowed hosts
        ("/parcel.png", {"image_url_private": False}, "image_url_fetch_failed"),  # localhost: loopback
        ("/loop", {}, "image_url_fetch_failed"),
        ("/missing", {}, "image_url_fetch_failed"),
        ("/big", {}, "image_too_large"),
        ("/big-unsized", {}, "image_too_large"),
        ("/stall", {}, "image_url_fetch_failed"),
        ("/trickle", {}, "image_url_fetch_failed"),  # cut at the deadline, not at each read
        ("/slow-headers", {}, "image_url_fetch_failed"),  # the deadline covers the headers too
        ("/slow-chunk", {}, "image_url_fetch_failed"),  # and the chunks' framing
        ("/signed-length", {}, "image_url_fetch_failed"),  # a length that is not a plain number
    ],
)
def test_each_refusal_says_why(port: int, path: str, fields: dict[str, Any], reason: str) -> None:
    began = time.monotonic()
    assert _refusal(f"http://localhost:{port}{path}", _settings(**fields)) == reason
    assert time.monotonic() - began < 1.5 + 1.0  # MRC_IMAGE_URL_TIMEOUT_S, whatever the server does


def test_the_loopback_refusal_names_the_address_it_resolved(port: int) -> None:
    with pytest.raises(FetchRefused) as refused:
        fetch.fetch(f"http://localhost:{port}/parcel.png", _settings(image_url_private=False))
    assert "127.0.0.1" in refused.value.detail or "::1" in refused.value.detail


@pytest.mark.parametrize(
    ("address", "allowed"),
    [
        ("8.8.8.8", True),
        ("2606:4700:4700::1111", True),
        ("127.0.0.1", False),
        ("10.1.2.3", False),
        ("192.168.0.9", False),
        ("172.16.5.5", False),
        ("169.254.169.254", False),  # cloud metadata
        ("100.64.0.1", False),  # carrier-grade NAT
        ("::1", False),
        ("fe80::1", False),
        ("fd00::1", False),
        ("::ffff:127.0.0.1", False),  # IPv4-mapped loopback
        ("0.0.0.0", False),
        ("224.0.0.1", False),
    ],
)
def test_only_public_addresses_unless_private_ones_are_allowed(address: str, allowed: bool) -> None:
    assert (fetch.address_problem(address, private=False) is None) == allowed
    unfit = address in ("0.0.0.0", "224.0.0.1")
    assert (fetch.address_problem(address, private=True) is None) == (not unfit)


def test_host_patterns_match_names_not_substrings() -> None:
    patterns = url_hosts.parse("photos.example.com, *.cdn.example.net")
    for host in ("photos.example.com", "PHOTOS.example.com.", "a.cdn.example.net"):
        assert url_hosts.allowed(host, 443, patterns), host
    for host in ("cdn.example.net", "evilcdn.example.net", "photos.example.com.evil.org", "example.com"):
        assert not url_hosts.allowed(host, 443, patterns), host
    assert (
        Settings(image_url_hosts=" Photos.Example.com , *.cdn.example.net ").image_url_host_patterns
        == patterns
    )


def test_a_host_named_with_a_port_allows_that_port_only() -> None:
    """`name:port` binds a host to one port (review: an allowed host's every port was open, a redirect
    to another port followed); a name alone keeps allowing any port, IPv6 in brackets, IDNA names."""
    patterns = url_hosts.parse("photos.example.com:443,*.cdn.example.net:8443,10.0.0.5,[2001:db8::1]:80")
    assert url_hosts.allowed("photos.example.com", 443, patterns)
    assert not url_hosts.allowed("photos.example.com", 80, patterns)
    assert url_hosts.allowed("a.cdn.example.net", 8443, patterns)
    assert not url_hosts.allowed("a.cdn.example.net", 443, patterns)
    assert url_hosts.allowed("10.0.0.5", 6379, patterns)
    assert url_hosts.allowed("2001:db8::1", 80, patterns)
    assert not url_hosts.allowed("2001:db8::1", 81, patterns)
    assert url_hosts.allowed("2001:0db8:0:0::1", 80, patterns)  # as a URL may write it
    with pytest.raises(ValueError, match="is a URL; name the host alone"):
        Settings(image_url_hosts="https://photos.example.com")
    assert url_hosts.allowed("xn--bcher-kva.example", 443, url_hosts.parse("Bücher.example"))
    for bad in (
        "photos.example.com:",
        "photos.example.com:0",
        "photos.example.com:65536",
        "a:b",
        "[::1]x",
        "*.",
        "a*.example.com",
        "user@host",
        "a..b",
        "host/path",
        "h:\u0663",
        "[::1",
        "photos.example.com :443",
        "photos example.com",
        "[not-an-address]:80",
        # What the C resolver reads as another host (review, helper-83): numbers it takes for
        # 127.0.0.1, a wildcard over an address (`*.1` matched every IPv4 address ending in .1),
        # an escaped dot.
        "*.::1",
        "*.[::1]",
        "*.1",
        "2130706433",
        "0x7f.1",
        "127.1",
        "1.2.3.4.5",
        "example.123",
        "evil\\.example.com",
    ):
        with pytest.raises(ValueError, match="MRC_IMAGE_URL_HOSTS"):
            Settings(image_url_hosts=f"ok.example.com,{bad}")


@pytest.mark.parametrize(
    "url",
    ["http://evil\\.localhost/parcel.png", "http://evil%5C.localhost/parcel.png", "http://2130706433/",
     "http://0x7f.1/", "http://127.1/", "http://a.0x7f/", "http://017700000001/"],
)  # fmt: skip
def test_a_host_a_resolver_reads_as_another_is_not_fetched(url: str) -> None:
    """An escaped dot passed `*.localhost` and went to the resolver, which reads `evil\\.localhost` as a
    name in the parent zone (review, helper-83); numbers it reads as addresses: never looked up."""
    assert _refusal(url, _settings(image_url_hosts="*.localhost,localhost")) == "image_url_fetch_failed"


def test_an_ipv6_host_goes_in_brackets_in_the_host_header() -> None:
    """`Host: ::1:PORT` is no host at all to a strict server or a virtual-host router (review,
    helper-83): an IPv6 address goes in brackets, RFC 9110."""
    seen: list[str] = []

    class Host(_Handler):
        def do_GET(self) -> None:
            seen.append(self.headers["Host"])
            self._send(IMAGE)

    class Server6(ThreadingHTTPServer):
        address_family = socket.AF_INET6
        daemon_threads = True

    try:
        server = Server6(("::1", 0), Host)
    except OSError:
        pytest.skip("no IPv6 loopback on this machine")
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        port = int(server.server_address[1])
        assert fetch.fetch(f"http://[::1]:{port}/parcel.png", _settings(image_url_hosts="[::1]")) == IMAGE
        assert seen == [f"[::1]:{port}"]
    finally:
        server.shutdown()
        server.server_close()


def test_a_port_bound_host_refuses_its_other_ports_and_redirects_to_them(port: int) -> None:
    bound = _settings(image_url_hosts=f"localhost:{port}")
    assert fetch.fetch(f"http://localhost:{port}/parcel.png", bound) == IMAGE
    assert _refusal(f"http://localhost:{port}/to-next-port", _settings()) == "image_url_fetch_failed"
    assert _refusal(f"http://localhost:{port}/to-next-port", bound) == "image_url_host_not_allowed"
    assert _refusal(f"http://localhost:{port + 1}/parcel.png", bound) == "image_url_host_not_allowed"


@pytest.mark.parametrize(
    "url",
    ["http://[::1/x", "http://[x]/", "http://a\uff03@localhost/", "http://localhost:0/parcel.png",
     "http://localhost:99999/", "ftp://localhost/x", "http:///x", "http://\u20ac.localhost/"],
)  # fmt: skip
def test_any_url_is_a_refusal_never_another_error(url: str) -> None:
    with pytest.raises(FetchRefused):
        fetch.fetch(url, _settings(image_url_hosts="localhost,*.localhost"))


def test_a_non_ascii_path_is_sent_percent_encoded(port: int) -> None:
    assert fetch.fetch(f"http://localhost:{port}/\u00e4.png", _settings()) == IMAGE


@pytest.mark.parametrize(
    "address",
    ["64:ff9b::a00:1", "64:ff9b::7f00:1", "64:ff9b:1::a00:1", "2002:a9fe:a9fe::1", "::7f00:1", "fec0::1"],
)
def test_ipv6_that_reaches_a_private_ipv4_is_private(address: str) -> None:
    """NAT64, 6to4, IPv4-compatible: the address reached is the IPv4 one; site-local is never public."""
    assert fetch.address_problem(address, private=False) is not None
    assert fetch.address_problem("64:ff9b::808:808", private=False) is None  # NAT64 to 8.8.8.8


def test_https_is_verified_against_the_name_on_the_pinned_connection(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The socket goes to the checked address; the certificate is still checked against the name:
    refused while its authority is not trusted, fetched once it is (SSL_CERT_FILE, as OpenSSL reads it)."""
    certs = tls.make(tmp_path / "tls")
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(certs.cert, certs.key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"https://localhost:{server.server_address[1]}/parcel.png"
    try:
        monkeypatch.setenv("SSL_CERT_FILE", str(tmp_path / "no-such-bundle.pem"))
        assert _refusal(url, _settings()) == "image_url_fetch_failed"
        monkeypatch.setenv("SSL_CERT_FILE", str(certs.ca))
        assert fetch.fetch(url, _settings()) == IMAGE
    finally:
        server.shutdown()
        server.server_close()


def test_a_key_whose_urls_hang_holds_its_own_fetch_slots_only(port: int) -> None:
    """PER_KEY hanging fetches of one key: its next is refused at once (429 on the route), another
    key's fetch goes through (review: one key's slow URLs held every key's request slots)."""
    settings = _settings(image_url_timeout_s=2.0)
    errors: list[str] = []

    def hang() -> None:
        try:
            fetch.fetch(f"http://localhost:{port}/stall", settings, "slow-key")
        except FetchRefused as refused:
            errors.append(refused.reason)

    hanging = [threading.Thread(target=hang) for _ in range(fetch.PER_KEY)]
    for thread in hanging:
        thread.start()
    deadline = time.monotonic() + 2
    while sum(fetch.slots._by_key.values()) < fetch.PER_KEY and time.monotonic() < deadline:
        time.sleep(0.01)
    began = time.monotonic()
    with pytest.raises(fetch.FetchBusy):
        fetch.fetch(f"http://localhost:{port}/parcel.png", settings, "slow-key")
    assert time.monotonic() - began < 0.5  # refused at once, not after a wait
    assert fetch.fetch(f"http://localhost:{port}/parcel.png", settings, "other-key") == IMAGE
    for thread in hanging:
        thread.join()
    assert errors == ["image_url_fetch_failed"] * fetch.PER_KEY
    assert fetch.fetch(f"http://localhost:{port}/parcel.png", settings, "slow-key") == IMAGE  # slots back


def test_a_name_that_never_resolves_ends_at_the_fetch_timeout_and_lookups_are_bounded(
    port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A resolver that does not answer (review: the system's lookup ran 10 s past a limit of 4 s): the
    fetch ends at MRC_IMAGE_URL_TIMEOUT_S, before the lookup does. Lookups given up on still count,
    as fetches do: past PER_KEY of one key's, that key's next fetch is refused at once (429) and
    another key's goes through (review: one key's stuck names took every place); past LOOKUPS in all,
    every key's is; they free as they end."""
    answer = threading.Event()
    returned: list[str] = []
    real = socket.getaddrinfo

    def resolver(host: str, *args: Any, **kwargs: Any) -> Any:
        if host == "stuck.example":  # a name server that never answers, until the test lets it
            answer.wait(60)
            returned.append(host)
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", resolver)
    settings = _settings(image_url_hosts="stuck.example,localhost", image_url_timeout_s=0.2)
    keys = [f"key-{n}" for n in range(fetch.LOOKUPS // fetch.PER_KEY)]
    try:
        for _ in range(fetch.PER_KEY):
            with pytest.raises(FetchRefused) as refused:
                fetch.fetch("http://stuck.example/parcel.png", settings, keys[0])
            assert refused.value.reason == "image_url_fetch_failed"
            assert "did not resolve within MRC_IMAGE_URL_TIMEOUT_S" in refused.value.detail
        assert not returned, "the fetches waited for the lookups"
        with pytest.raises(fetch.FetchBusy, match="this key"):
            fetch.fetch(f"http://localhost:{port}/parcel.png", settings, keys[0])
        assert fetch.fetch(f"http://localhost:{port}/parcel.png", settings, keys[1]) == IMAGE
        for key in keys[1:]:
            for _ in range(fetch.PER_KEY):
                with pytest.raises(FetchRefused):
                    fetch.fetch("http://stuck.example/parcel.png", settings, key)
        with pytest.raises(fetch.FetchBusy, match="host name lookups"):
            fetch.fetch(f"http://localhost:{port}/parcel.png", settings, "another-key")
    finally:
        answer.set()
    deadline = time.monotonic() + 30
    while fetch.lookups._all and time.monotonic() < deadline:
        time.sleep(0.01)  # each lookup's thread gives its place back as its lookup ends
    assert len(returned) == fetch.LOOKUPS
    assert fetch.fetch(f"http://localhost:{port}/parcel.png", settings, keys[0]) == IMAGE


def test_a_lookup_whose_thread_cannot_start_gives_its_place_back(
    port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A thread limit reached: the fetch is refused, and the place it took is free again (review: it
    was lost for good, and after LOOKUPS such fetches every later one was refused)."""
    real = threading.Thread.start

    def start(thread: threading.Thread) -> None:
        if thread.name == "mrc-url-lookup":
            raise RuntimeError("can't start new thread")
        real(thread)

    monkeypatch.setattr(threading.Thread, "start", start)
    for _ in range(fetch.LOOKUPS + 1):
        assert _refusal(f"http://localhost:{port}/parcel.png", _settings()) == "image_url_fetch_failed"
    assert fetch.lookups._all == 0
    monkeypatch.setattr(threading.Thread, "start", real)
    assert fetch.fetch(f"http://localhost:{port}/parcel.png", _settings()) == IMAGE


@pytest.mark.parametrize("path", ["/slow-headers", "/slow-chunk", "/trickle"])
def test_an_https_server_that_trickles_is_cut_at_the_deadline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    """Over TLS as over plain HTTP the watchdog ends the fetch at MRC_IMAGE_URL_TIMEOUT_S (review: it
    shut the raw socket TLS had taken over, so a server that kept sending held the fetch for as long
    as it did): the fetch is refused while the server is still sending."""
    certs = tls.make(tmp_path / "tls")
    monkeypatch.setenv("SSL_CERT_FILE", str(certs.ca))
    served = threading.Event()  # this server's own (the module's plain server's handlers may still run)
    handler = type("_Served", (_Handler,), {"served": served})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(certs.cert, certs.key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"https://localhost:{server.server_address[1]}{path}"
        assert _refusal(url, _settings(image_url_timeout_s=0.5)) == "image_url_fetch_failed"
        assert not served.is_set(), "the fetch waited for the server to stop sending"
    finally:
        server.shutdown()
        server.server_close()


def _chat(url: str, model: str = "fuyu") -> dict[str, Any]:
    content = [{"type": "text", "text": "Refund?"}, {"type": "image_url", "image_url": {"url": url}}]
    return {"model": model, "messages": [{"role": "user", "content": content}]}


def test_a_chat_naming_a_model_no_worker_serves_fetches_nothing(port: int) -> None:
    """Review, helper-73: the photo was fetched, then the answer was 404 model_not_found."""

    def served_here(model: str) -> None:
        if model != "fuyu":
            raise OpenAIError(404, f"The model `{model}` does not exist", "model", "model_not_found")

    url = f"http://localhost:{port}/counted/parcel.png"
    with pytest.raises(OpenAIError) as refused:
        parse_chat(_chat(url, "echo"), _settings(), check_model=served_here)
    assert (refused.value.status, refused.value.code) == (404, "model_not_found")
    assert COUNTED == []
    assert parse_chat(_chat(url), _settings(), check_model=served_here).data == IMAGE
    assert COUNTED == ["/counted/parcel.png"]


@pytest.mark.parametrize("url", ["ftp://localhost/parcel.png", "file:///etc/passwd", "gopher://localhost/"])
def test_a_url_of_another_scheme_is_refused_for_its_scheme(url: str) -> None:
    with pytest.raises(OpenAIError) as refused:
        parse_chat(_chat(url), _settings())
    assert refused.value.code == "image_source_forbidden"
    assert "only http:// and https:// image URLs are fetched" in refused.value.message
    assert url.split(":")[0] + ":" in refused.value.message


def test_a_refused_url_is_named_with_its_port_as_given(port: int) -> None:
    with pytest.raises(FetchRefused) as refused:
        fetch.fetch(f"http://user:secret@localhost:{port}:80/parcel.png", _settings())
    assert f"http://localhost:{port}:80/parcel.png" in refused.value.detail
    assert "secret" not in refused.value.detail


def test_a_fetch_whose_caller_holds_its_slot_keeps_it_until_given_back(port: int) -> None:
    """Review, helper-83: a chat request gave its body turn back before its fetch and then held the
    fetched image, while it was checked and uploaded, under no bound; the caller keeps the fetch's
    slot until the upload is done. A refused fetch gives its slot back at once."""
    held: list[Any] = []
    assert fetch.fetch(f"http://localhost:{port}/parcel.png", _settings(), "key-h", held) == IMAGE
    assert fetch.slots._by_key.get("key-h") == 1
    held.pop()()
    assert "key-h" not in fetch.slots._by_key
    with pytest.raises(FetchRefused):
        fetch.fetch(f"http://localhost:{port}/missing", _settings(), "key-h", held)
    assert held == []
    assert "key-h" not in fetch.slots._by_key


def test_each_url_a_chat_fetches_or_is_refused_is_logged_for_its_key(port: int) -> None:
    """Review, helper-83: refused and timed-out fetches left no line and no count, so an operator could
    not see a key's hanging or refused URLs."""
    from structlog.testing import capture_logs

    with capture_logs() as logged:
        parse_chat(_chat(f"http://localhost:{port}/parcel.png"), _settings(), owner="abcdef012345")
        with pytest.raises(OpenAIError):
            parse_chat(_chat(f"http://localhost:{port}/missing"), _settings(), owner="abcdef012345")
    events = [
        (e["event"], e["owner"], e.get("code"), e.get("bytes")) for e in logged if "IMAGE_URL" in e["event"]
    ]
    assert events == [
        ("MRC_IMAGE_URL_FETCHED", "abcdef012345", None, len(IMAGE)),
        ("MRC_IMAGE_URL_REFUSED", "abcdef012345", "image_url_fetch_failed", None),
    ]
