"""Images by URL: fetched by mrc-api (never by a worker), only from hosts an operator allowed.

`MRC_IMAGE_URL_HOSTS` names the hosts (`photos.example.com`, or `*.example.com` for its subdomains;
`:port` to allow one port only: shared/url_hosts.py);
empty, no URL is fetched. A fetch:

- resolves the name once and refuses private, loopback, link-local, multicast, reserved and
  unspecified addresses (IPv4-mapped IPv6 included) unless `MRC_IMAGE_URL_PRIVATE` is on, then
  connects to the address it checked, never to a second resolution of the name (a name that answers
  a public address to the check and 127.0.0.1 to the connection gets nowhere), and confirms the
  socket's peer is that address; HTTPS verifies the certificate against the host name;
- follows at most MAX_REDIRECTS redirects, each to an allowed host and checked the same way;
- reads at most MRC_MAX_IMAGE_BYTES (a larger `Content-Length`, or more bytes than that, ends it);
- gives up past CONNECT_S to connect and MRC_IMAGE_URL_TIMEOUT_S in all, the name's lookups
  included: a watchdog shuts the socket at the deadline, so a server that trickles its headers, its
  chunk sizes or its body is cut there, not at each read's timeout.

Each refusal is a `FetchRefused` whose code names it: `image_url_host_not_allowed`,
`image_url_fetch_failed`, `image_too_large`; no other exception leaves `fetch` (whatever the URL or
the server sends). The bytes then go through the upload checks as a
`data:` URL's would, and are stored as the calling key's upload.
"""

from __future__ import annotations

import contextlib
import http.client
import io
import ipaddress
import re
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import quote, urljoin, urlsplit

from shared import url_hosts
from shared.errors import UsageError
from shared.settings import Settings

MAX_REDIRECTS = 3
CONNECT_S = 3.0
# Fetches at once in one mrc-api process (each may hold MRC_MAX_IMAGE_BYTES), and of those, at most
# PER_KEY for one key: a key whose URLs hang holds its own slots, never the body slots every request
# needs nor every fetch slot. A fetch past either is refused at once (`FetchBusy`, 429).
SLOTS, PER_KEY = 16, 4
_CHUNK = 64 * 1024
_REDIRECTS = (301, 302, 303, 307, 308)
_LENGTH = re.compile(r"[0-9]{1,15}", re.ASCII)
_PATH_SAFE = "/%:@!$&'()*+,;=-._~"  # what a path may hold as it is (RFC 3986); the rest is %-encoded
# IPv6 prefixes that carry an IPv4 address (NAT64, 6to4, IPv4-compatible, IPv4-translated): the
# address reached is the IPv4 one, checked as such. The local-use NAT64 prefix is never public.
_EMBEDDING = (
    ipaddress.ip_network("64:ff9b::/96"),
    ipaddress.ip_network("::/96"),
    ipaddress.ip_network("::ffff:0:0:0/96"),
)
_NEVER_PUBLIC = (ipaddress.ip_network("64:ff9b:1::/48"), ipaddress.ip_network("fec0::/10"))


class FetchRefused(UsageError):
    """A URL not fetched: `reason` is the code the answer carries."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason, self.detail = reason, message


class FetchBusy(FetchRefused):
    """Too many fetches at once (this key's, or the process's): nothing was fetched; try again."""

    def __init__(self, message: str) -> None:
        super().__init__("too_many_fetches", message)


class _Slots:
    """Counted places, by key and in all (threads of one process): fetches, or name lookups."""

    def __init__(self, limit: int, what: str) -> None:
        self._lock = threading.Lock()
        self._by_key: dict[str, int] = {}
        self._all = 0
        self.limit, self.what = limit, what

    def take(self, owner: str) -> Callable[[], None]:
        """A place for `owner`, and how to give it back (once), or FetchBusy."""
        with self._lock:
            if self._by_key.get(owner, 0) >= PER_KEY:
                raise FetchBusy(f"this key has {PER_KEY} {self.what} under way already; retry shortly")
            if self._all >= self.limit:
                raise FetchBusy(f"{self.limit} {self.what} are under way already; retry shortly")
            self._by_key[owner] = self._by_key.get(owner, 0) + 1
            self._all += 1
        given = threading.Event()

        def release() -> None:
            with self._lock:
                if given.is_set():
                    return
                given.set()
                self._all -= 1
                self._by_key[owner] -= 1
                if not self._by_key[owner]:
                    del self._by_key[owner]

        return release

    @contextlib.contextmanager
    def held(self, owner: str) -> Iterator[None]:
        release = self.take(owner)
        try:
            yield
        finally:
            release()


LOOKUPS = SLOTS  # host name lookups at once in one process (_lookup), those given up on included
slots = _Slots(SLOTS, "image URL fetches")
lookups = _Slots(LOOKUPS, "host name lookups")


def address_problem(address: str, private: bool) -> str | None:
    """Why an address may not be fetched from, or None."""
    ip = _reached(ipaddress.ip_address(address.split("%", 1)[0]))
    if ip.is_multicast or ip.is_unspecified:
        return f"{ip} is not a host address"
    local = not ip.is_global or any(ip in net for net in _NEVER_PUBLIC)  # private, loopback, CGNAT...
    if local and not private:
        return f"{address} is a private, loopback or link-local address (MRC_IMAGE_URL_PRIVATE is off)"
    return None


def _reached(
    ip: ipaddress.IPv4Address | ipaddress.IPv6Address,
) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """The IPv4 address an IPv6 one stands for (mapped, NAT64, 6to4, compatible), else itself."""
    if isinstance(ip, ipaddress.IPv4Address):
        return ip
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip.sixtofour is not None:
        return ip.sixtofour
    if any(ip in net for net in _EMBEDDING) and int(ip) & 0xFFFFFFFF:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return ip


def fetch(
    url: str, settings: Settings, owner: str = "", held: list[Callable[[], None]] | None = None
) -> bytes:
    """The image at `url`, fetched for `owner` (a key's id), or FetchRefused (and nothing else).
    `held`: the fetch's slot is kept past the return, its release put there, so that the bytes the
    caller goes on to check and upload stay counted (review, helper-83: a request gave its body turn
    back before its fetch, and then held the fetched image under no bound at all)."""
    release = slots.take(owner)
    try:
        data = _fetch(url, settings, owner)
    except FetchRefused:
        release()
        raise
    except Exception as exc:  # a URL or an answer no rule above foresaw: refused, never a 500
        release()
        raise FetchRefused("image_url_fetch_failed", f"{_show(url)}: {_why(exc)}") from None
    except BaseException:
        release()
        raise
    if held is None:
        release()
    else:
        held.append(release)
    return data


def _fetch(url: str, settings: Settings, owner: str) -> bytes:
    deadline = time.monotonic() + settings.image_url_timeout_s
    for _ in range(MAX_REDIRECTS + 1):
        status, location, body = _get(url, settings, deadline, owner)
        if status in _REDIRECTS:
            if not location:
                raise FetchRefused(
                    "image_url_fetch_failed", f"{_show(url)} answered {status} with no Location"
                )
            url = urljoin(url, location)
            continue
        if status != 200:
            raise FetchRefused("image_url_fetch_failed", f"{_show(url)} answered HTTP {status}")
        return body
    raise FetchRefused("image_url_fetch_failed", f"more than {MAX_REDIRECTS} redirects")


def _target(url: str, settings: Settings) -> tuple[str, int, bool, str]:
    """(host as DNS and Host: carry it, port, TLS, path and query to send) of a URL on an allowed host."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        raise FetchRefused("image_url_fetch_failed", f"{_show(url)} is not a valid URL") from None
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
        raise FetchRefused("image_url_fetch_failed", f"{_show(url)} is not an http(s) URL")
    try:
        host = parts.hostname.encode("idna").decode("ascii").lower()
    except UnicodeError:
        host = ""
    if not url_hosts.is_host(host.rstrip(".")):
        raise FetchRefused("image_url_fetch_failed", f"{_show(url)}: the host name is not valid") from None
    if port == 0:
        raise FetchRefused("image_url_fetch_failed", f"{_show(url)}: port 0")
    tls = parts.scheme.lower() == "https"
    port = port or (443 if tls else 80)
    if not url_hosts.allowed(host, port, settings.image_url_host_patterns):
        raise FetchRefused(
            "image_url_host_not_allowed",
            f"{host[:100]}:{port} is not among the hosts (and ports) MRC_IMAGE_URL_HOSTS allows",
        )
    path = quote(parts.path or "/", safe=_PATH_SAFE)
    if parts.query:
        path += "?" + quote(parts.query, safe=_PATH_SAFE + "?")
    return host, port, tls, path


def _get(url: str, settings: Settings, deadline: float, owner: str) -> tuple[int, str | None, bytes]:
    host, port, tls, path = _target(url, settings)
    address = _resolve(host, port, settings.image_url_private, deadline, owner)
    watchdog = _Watchdog(deadline)
    connection = (_PinnedTLS if tls else _Pinned)(host, address, port, watchdog)
    response: http.client.HTTPResponse | None = None
    try:
        with watchdog:
            bare = f"[{host}]" if ":" in host else host  # an IPv6 address goes in brackets (RFC 9110)
            named = bare if port == (443 if tls else 80) else f"{bare}:{port}"
            connection.request(
                "GET", path, headers={"Host": named, "User-Agent": "mrc-api", "Accept": "image/*"}
            )
            response = connection.getresponse()
            status, location = response.status, response.getheader("Location")
            body = _read(response, settings.max_image_bytes) if status == 200 else b""
        if watchdog.fired:  # what was read may be cut anywhere (a header, the body): nothing of it
            raise FetchRefused("image_url_fetch_failed", "MRC_IMAGE_URL_TIMEOUT_S ran out")
        return status, location if status in _REDIRECTS else None, body
    except FetchRefused:
        if watchdog.fired:  # a body cut by the deadline: the deadline is why
            raise FetchRefused("image_url_fetch_failed", "MRC_IMAGE_URL_TIMEOUT_S ran out") from None
        raise
    except (OSError, http.client.HTTPException, ValueError) as exc:
        if watchdog.fired:
            raise FetchRefused("image_url_fetch_failed", "MRC_IMAGE_URL_TIMEOUT_S ran out") from None
        raise FetchRefused("image_url_fetch_failed", f"{_show(url)}: {_why(exc)}") from None
    finally:
        if response is not None:
            response.close()  # its socket, which the connection let go of
        connection.close()


def _resolve(host: str, port: int, private: bool, deadline: float, owner: str) -> str:
    """The first address of `host` that may be fetched from; every address is checked, and a name
    with any address that may not is refused (it could answer either)."""
    try:
        found = _lookup(host, port, deadline, owner)
    except (OSError, UnicodeError) as exc:
        raise FetchRefused("image_url_fetch_failed", f"{host[:100]} does not resolve ({_why(exc)})") from None
    addresses = [str(info[4][0]) for info in found]
    for address in addresses:
        problem = address_problem(address, private)
        if problem:
            raise FetchRefused("image_url_fetch_failed", f"{host[:100]} resolves to {problem}")
    if not addresses:
        raise FetchRefused("image_url_fetch_failed", f"{host[:100]} has no address")
    return addresses[0]


def _lookup(host: str, port: int, deadline: float, owner: str) -> list[Any]:
    """getaddrinfo, within the fetch's deadline: the resolver's own timeouts (5 s a server, tried in
    turn) ran past MRC_IMAGE_URL_TIMEOUT_S (review: 10 s for a limit of 4). It cannot be cancelled, so
    it runs on a thread of its own that ends with the resolver, counted as the fetches are (`lookups`:
    the process's LOOKUPS and the key's PER_KEY, those given up on included) so a name that never
    answers piles no threads up, and one key's stuck names hold that key's lookups only."""
    release = lookups.take(owner)
    outcome: dict[str, Any] = {}
    done = threading.Event()

    def look() -> None:
        try:
            outcome["found"] = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except BaseException as exc:  # handed to the fetch, if it still waits
            outcome["error"] = exc
        finally:
            release()
            done.set()

    try:
        threading.Thread(target=look, name="mrc-url-lookup", daemon=True).start()
    except BaseException:  # no thread (a limit): its place back, or it would be lost for good
        release()
        raise
    if not done.wait(_left(deadline)):
        raise FetchRefused(
            "image_url_fetch_failed", f"{host[:100]} did not resolve within MRC_IMAGE_URL_TIMEOUT_S"
        )
    if "error" in outcome:
        raise outcome["error"]
    return list(outcome["found"])


class _Watchdog:
    """Shuts the connection's socket at the deadline: whatever read is blocked then (a header, a chunk
    size, a body byte) ends at once, however slowly the server trickles."""

    def __init__(self, deadline: float) -> None:
        self.deadline, self.fired = deadline, False
        self.sock: socket.socket | None = None
        self._timer: threading.Timer | None = None

    def __enter__(self) -> _Watchdog:
        self._timer = threading.Timer(max(0.0, _left(self.deadline)), self._fire)
        self._timer.daemon = True
        self._timer.start()
        return self

    def __exit__(self, *_: object) -> None:
        if self._timer is not None:
            self._timer.cancel()

    def _fire(self) -> None:
        self.fired = True
        if self.sock is not None:
            with contextlib.suppress(OSError):  # already closed: nothing to end
                # socket's own shutdown, also for a TLS socket: its descriptor, not the TLS state the
                # reading thread is using
                socket.socket.shutdown(self.sock, socket.SHUT_RDWR)


class _Pinned(http.client.HTTPConnection):
    """HTTP to the checked address; `host` stays the name (the Host header)."""

    def __init__(self, host: str, address: str, port: int, watchdog: _Watchdog) -> None:
        super().__init__(host, port, timeout=_left(watchdog.deadline))
        self.address, self.watchdog = address, watchdog

    def connect(self) -> None:
        self.sock = self.watchdog.sock = _connect(self.address, self.port, self.watchdog.deadline)
        if self.watchdog.fired:  # the deadline came before the watchdog knew the socket: nothing shut it
            raise TimeoutError("the deadline passed while connecting")


class _PinnedTLS(http.client.HTTPSConnection):
    """HTTPS to the checked address; the certificate verified against the name."""

    def __init__(self, host: str, address: str, port: int, watchdog: _Watchdog) -> None:
        super().__init__(host, port, timeout=_left(watchdog.deadline), context=ssl.create_default_context())
        self.address, self.watchdog = address, watchdog

    def connect(self) -> None:
        raw = _connect(self.address, self.port, self.watchdog.deadline)
        # wrap_socket takes the raw socket's descriptor over (the raw one is closed then): the watchdog
        # shuts the TLS socket, handshake included (review: it shut nothing, and a server trickling
        # over HTTPS held a fetch past its deadline for as long as it kept sending).
        wrapped = self._context.wrap_socket(  # type: ignore[attr-defined]
            raw, server_hostname=self.host, do_handshake_on_connect=False
        )
        self.sock = self.watchdog.sock = wrapped
        if self.watchdog.fired:  # the deadline came between the two: nothing would shut this one
            raise TimeoutError("the deadline passed while connecting")
        wrapped.do_handshake()


def _connect(address: str, port: int, deadline: float) -> socket.socket:
    sock = socket.create_connection((address, port), timeout=min(CONNECT_S, _left(deadline)))
    peer = str(sock.getpeername()[0]).split("%", 1)[0]
    if ipaddress.ip_address(peer) != ipaddress.ip_address(address.split("%", 1)[0]):
        sock.close()
        raise OSError(f"connected to {peer}, not the address checked ({address})")
    sock.settimeout(_left(deadline))
    return sock


def _read(response: http.client.HTTPResponse, limit: int) -> bytes:
    """The body, at most `limit` bytes (the watchdog ends it at the deadline)."""
    length = (response.getheader("Content-Length") or "").strip()
    exact = int(length) if _LENGTH.fullmatch(length) else None
    if exact is not None and exact > limit:
        raise FetchRefused("image_too_large", f"the image is {exact} bytes; the limit is {limit}")
    body = io.BytesIO()  # getvalue() hands its buffer over: the image is in memory once, not twice
    while chunk := response.read1(_CHUNK):
        if body.write(chunk) and body.tell() > limit:
            raise FetchRefused("image_too_large", f"the image is over the limit of {limit} bytes")
    size = body.tell()
    if length and (exact is None or size != exact):
        raise FetchRefused("image_url_fetch_failed", f"the body ({size} bytes) does not match its length")
    return body.getvalue()


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise FetchRefused("image_url_fetch_failed", "MRC_IMAGE_URL_TIMEOUT_S ran out")
    return left


def _show(url: str) -> str:
    """The URL as an error names it: scheme, host and port as given, and the start of the path (no
    query, no userinfo; review, helper-73: a bad port was named without it, as if the URL were fine)."""
    try:
        parts = urlsplit(url)
        return f"{parts.scheme}://{parts.netloc.rpartition('@')[2][:100]}{parts.path[:60]}"
    except ValueError:
        return repr(url[:60])


def _why(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError | socket.timeout):
        return "timed out"
    return f"{type(exc).__name__}: {str(exc)[:120]}"
