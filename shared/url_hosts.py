"""MRC_IMAGE_URL_HOSTS read: the hosts (and, where named, the ports) whose http(s) image URLs
mrc-api may fetch (producer/intake/fetch.py). Plain Python, no I/O: Settings refuses a malformed
value at start (every process that reads the settings), the fetch matches every URL and every
redirect against it.

An entry is `name`, `*.name` (every name below it, not the name itself), an IPv4 address or an IPv6
one in brackets, each optionally with `:port`. Without a port any port of that host is allowed (as
before ports could be named); with one, only that port: `photos.example.com:443` keeps a redirect to
`photos.example.com:8080` off. Names are compared as DNS carries them (IDNA, lower case, no final
dot), so `bücher.example` matches the URL `http://BÜCHER.example./`.
"""

from __future__ import annotations

import ipaddress
import re
from typing import NamedTuple


class HostPattern(NamedTuple):
    name: str  # as DNS carries it; `*.` first for every name below
    port: int | None  # None: any port


def parse(value: str) -> tuple[HostPattern, ...]:
    """The comma-separated entries of MRC_IMAGE_URL_HOSTS; ValueError naming the first bad one."""
    return tuple(_entry(part.strip()) for part in value.split(",") if part.strip())


def allowed(host: str, port: int, patterns: tuple[HostPattern, ...]) -> bool:
    """Whether `host` (as DNS carries it) on `port` is one the operator named."""
    host = host.lower().rstrip(".")
    if ":" in host:  # an IPv6 address however the URL wrote it (2001:0db8:0::1 is 2001:db8::1)
        try:
            host = str(ipaddress.IPv6Address(host))
        except ValueError:
            return False
    for pattern in patterns:
        if pattern.port is not None and pattern.port != port:
            continue
        if pattern.name.startswith("*."):
            if host.endswith(pattern.name[1:]) and len(host) > len(pattern.name) - 1:
                return True
        elif host == pattern.name:
            return True
    return False


def _entry(entry: str) -> HostPattern:
    if "/" in entry or "@" in entry:  # `https://photos.example.com`, `user@host`: a URL, not a host
        raise ValueError(f"MRC_IMAGE_URL_HOSTS: {entry!r} is a URL; name the host alone (name:port at most)")
    name, port = _split(entry)
    wildcard = name.startswith("*.")
    bare = name[2:] if wildcard else name
    if wildcard and (":" in bare or bare.startswith("[") or _numeric_end(bare)):
        raise ValueError(f"MRC_IMAGE_URL_HOSTS: {entry!r}: `*.` goes before a name, not an address")
    if ":" in bare or entry.startswith("["):  # an IPv6 address, compressed and lower case as URLs give it
        try:
            address = ipaddress.IPv6Address(bare)
        except ValueError:
            raise ValueError(f"MRC_IMAGE_URL_HOSTS: {entry!r} is not an IPv6 address") from None
        return HostPattern(str(address), port)
    try:
        bare = bare.encode("idna").decode("ascii").lower().rstrip(".")
    except UnicodeError:
        bare = ""
    if not is_host(bare):
        raise ValueError(
            f"MRC_IMAGE_URL_HOSTS: {entry!r} is not a host name or address (name, *.name, name:port, "
            "a dotted IPv4 address, [IPv6])"
        )
    return HostPattern(("*." if wildcard else "") + bare, port)


_NAME = re.compile(r"[a-z0-9_]([a-z0-9_-]*[a-z0-9_])?(\.[a-z0-9_]([a-z0-9_-]*[a-z0-9_])?)*")


def is_host(host: str) -> bool:
    """Whether `host` (as DNS carries it: IDNA, lower case, no final dot) is a DNS name of letters,
    digits, `-` and `_`, a dotted IPv4 address or an IPv6 one: nothing a resolver reads another way.
    A name ending in a number is an address or nothing: the C resolver reads `2130706433`, `0x7f.1`
    and `127.1` as 127.0.0.1, and `evil\\.example.com` (an escaped dot) as a name in `com`, not in
    `example.com` (review, helper-83)."""
    if ":" in host:
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            return False
        return True
    if not _NAME.fullmatch(host):
        return False
    if _numeric_end(host):
        try:
            ipaddress.IPv4Address(host)  # four decimal parts, no leading zeros
        except ValueError:
            return False
    return True


def _numeric_end(host: str) -> bool:
    """Whether the last label is a number (decimal, or hex as `0x..` the resolver also reads)."""
    last = host.rsplit(".", 1)[-1]
    return last.isdigit() or bool(re.fullmatch(r"0x[0-9a-f]*", last))


def _split(entry: str) -> tuple[str, int | None]:
    """(host, port or None) of `host`, `host:port`, `[v6]`, `[v6]:port`."""
    if entry.startswith("["):
        host, closed, rest = entry[1:].partition("]")
        if not closed or (rest and not rest.startswith(":")):
            raise ValueError(f"MRC_IMAGE_URL_HOSTS: {entry!r} is not [address] or [address]:port")
        return host, _port(entry, rest[1:]) if rest else None
    if entry.count(":") == 1:
        host, _, port = entry.partition(":")
        return host, _port(entry, port)
    return entry, None  # no port (or an IPv6 address without brackets: no port can follow it)


def _port(entry: str, text: str) -> int:
    if not text.isascii() or not text.isdigit() or not 0 < int(text) < 65536:
        raise ValueError(f"MRC_IMAGE_URL_HOSTS: {entry!r}: the port must be 1-65535")
    return int(text)
