"""Whether a progressive JPEG's scans make a whole image.

A progressive JPEG sends each component's coefficients in several scans: coarse ones first (the DC
term, a few low frequencies, the top bits), then the rest. A file cut at a scan's end and given an end
marker decodes without a single warning from any libjpeg (nor nvjpeg): the coefficients no scan sent
are zero, and the photo comes out blurred or with its colours flat, reported as a success. So the
scans' own headers are read: every coefficient (0-63) of every component must be sent to its last bit
(a scan with Al = 0 covers it), as every encoder's progression does. A sequential file's one scan per
component is whole by construction, and not read.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

_PROGRESSIVE = frozenset({0xC2, 0xC6, 0xCA, 0xCE})  # Huffman, differential, arithmetic, both
_STANDALONE = frozenset({0x01, 0xD8})  # TEM, SOI: markers with no length
# A marker as libjpeg finds one: 0xFF then a byte that is not a stuffed zero, a restart marker or fill
# (fill 0xFFs before a marker match at the last one). Inside entropy-coded data nothing else follows
# an 0xFF. Written `\xff+` the search took 38 ms over a 12 MP photo's 3.9 MB; as it is, 2.2 ms.
_MARKER = re.compile(rb"\xff([^\x00\xd0-\xd7\xff])")
_EOI = 0xD9
_SOS = 0xDA
# More scans than any encoder's progression sends (libjpeg's: 10 for colour, 18 for CMYK; one scan per
# coefficient and bit of four components would be ~3,300): read past it, a crafted file of millions
# of tiny scans held the worker 10 s in this loop after nvjpeg had decoded it (review, helper-100).
_MOST_SCANS = 4096
# And more markers of any kind than a file of that many scans has (its tables and restart-free scans):
# millions of empty comments or TEM markers between two scans cost a step each (review, helper-101:
# 7 s for 8 million in a 32 MB file, then accepted).
_MOST_MARKERS = 4 * _MOST_SCANS


def progression_gap(data: bytes) -> str | None:
    """What is wrong with a progressive JPEG's scans ("its scans never send component 2's coefficients
    1-63"), or None: all sent, not progressive, or a file whose markers do not parse (the decoder says
    what is wrong)."""
    sent: dict[int, bytearray] | None = None  # component id -> a flag per coefficient sent whole
    scans = 0
    try:
        for marker, segment in _segments(data):
            if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):  # a frame (not DHT, JPG, DAC)
                if marker not in _PROGRESSIVE:
                    return None
                sent = _components(segment)
            elif marker == _SOS and sent is not None:
                scans += 1
                if scans > _MOST_SCANS:
                    return f"it holds more than {_MOST_SCANS} scans"
                if not _record_scan(segment, sent):
                    return None
    except _Unreadable:
        return None
    except _TooMany:
        return f"it holds more than {_MOST_MARKERS} markers"
    return None if sent is None else _unsent(sent)


class _Unreadable(Exception):
    """A segment whose length runs past the file."""


class _TooMany(Exception):
    """More markers than _MOST_MARKERS."""


def _segments(data: bytes) -> Iterator[tuple[int, bytes]]:
    """Each marker with a length and its payload, as libjpeg finds them, up to the first end marker."""
    at, markers = 2, 0
    while (found := _MARKER.search(data, at)) is not None:
        marker, at = found[1][0], found.end()
        markers += 1
        if markers > _MOST_MARKERS:
            raise _TooMany
        if marker == _EOI:
            return
        if marker in _STANDALONE:
            continue
        end = at + int.from_bytes(data[at : at + 2], "big") if at + 2 <= len(data) else len(data) + 1
        if end > len(data):
            raise _Unreadable
        yield marker, data[at + 2 : end]
        at = end


def _components(frame: bytes) -> dict[int, bytearray]:
    """The frame's component ids (P, Y, X, Nf, then Nf × (id, sampling, table)), none sent yet."""
    count = frame[5] if len(frame) > 5 else 0
    return {frame[6 + 3 * n]: bytearray(64) for n in range(count) if 6 + 3 * n < len(frame)}


def _record_scan(scan: bytes, sent: dict[int, bytearray]) -> bool:
    """Mark what one scan (Ns, Ns × (id, tables), Ss, Se, Ah/Al) sends to its last bit; False where the
    header is not one."""
    if not scan:
        return False
    count = scan[0]
    if len(scan) < 1 + 2 * count + 3:
        return False
    first, last, bits = scan[1 + 2 * count], scan[2 + 2 * count], scan[3 + 2 * count]
    if bits & 0x0F:  # Al > 0: the low bits come in a later scan
        return True
    for n in range(count):
        flags = sent.get(scan[1 + 2 * n])
        if flags is None:
            continue
        for k in range(first, min(last, 63) + 1):
            flags[k] = 1
    return True


def _unsent(sent: dict[int, bytearray]) -> str | None:
    for number, (_, flags) in enumerate(sent.items(), start=1):
        missing = [k for k in range(64) if not flags[k]]
        if missing:
            return f"its scans never send component {number}'s coefficients {_ranges(missing)}"
    return None


def _ranges(numbers: list[int]) -> str:
    """[1, 2, 3, 9] -> "1-3, 9"."""
    spans: list[list[int]] = []
    for n in numbers:
        if spans and spans[-1][1] == n - 1:
            spans[-1][1] = n
        else:
            spans.append([n, n])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
