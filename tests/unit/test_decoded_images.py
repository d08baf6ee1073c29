"""Decoded photos kept for their next question (workers/decoded_images.py): one decode per photo and
key while kept, within a budget of bytes, least recently used out first; never a failed decode, never a
device's tensor; two jobs of one photo decoding at once share the one decode."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
import torch

from workers.decoded_images import DecodedImages
from workers.images import DecodedImage

KIB = 1024


def _image(side: int = 32, device: str = "cpu") -> DecodedImage:
    """uint8 [3, side, side]: 3 * side * side bytes."""
    return DecodedImage(torch.zeros((3, side, side), dtype=torch.uint8, device=device), "jpg", side, side)


class Decoder:
    """Counts its calls; the image it makes, or `error`."""

    def __init__(self, side: int = 32, error: Exception | None = None, device: str = "cpu") -> None:
        self.side, self.error, self.device, self.calls = side, error, device, 0

    def __call__(self) -> DecodedImage:
        self.calls += 1
        if self.error is not None:
            raise self.error
        return _image(self.side, self.device)


def test_a_photo_is_decoded_once_per_key_while_kept() -> None:
    kept, decode = DecodedImages(64 * KIB), Decoder()
    first, reused = kept.get(("a", "sha1"), decode)
    again, reused_again = kept.get(("a", "sha1"), decode)
    assert (reused, reused_again, decode.calls) == (False, True, 1)
    assert again is first
    # Another key's job of the same bytes decodes its own (one tenant never learns of another's photo).
    other, reused_other = kept.get(("b", "sha1"), decode)
    assert (reused_other, decode.calls) == (False, 2)
    assert other is not first
    assert kept.held == 2 * 3 * 32 * 32
    assert (kept.hits, kept.misses) == (1, 2)


def test_the_budget_holds_the_least_recently_used_out_first() -> None:
    kept = DecodedImages(3 * 3 * 32 * 32)  # three images of 32x32
    for name in ("p1", "p2", "p3"):
        kept.get(("a", name), Decoder())
    kept.get(("a", "p1"), Decoder())  # p1 used again: p2 is now the oldest
    kept.get(("a", "p4"), Decoder())
    assert kept.held == 3 * 3 * 32 * 32
    for name, reused in (("p1", True), ("p3", True), ("p4", True), ("p2", False)):
        assert kept.get(("a", name), Decoder())[1] is reused, name
    big = Decoder(side=64)  # larger than the whole budget: used, not kept, nothing else dropped
    kept.get(("a", "big"), big)
    kept.get(("a", "big"), big)
    assert big.calls == 2


@pytest.mark.parametrize("budget", [0, 64 * KIB])
def test_nothing_is_kept_without_a_key_or_a_budget(budget: int) -> None:
    kept, decode = DecodedImages(budget), Decoder()
    kept.get(None, decode)
    kept.get(None, decode)
    kept.get(("a", "sha"), decode)
    kept.get(("a", "sha"), decode)
    assert decode.calls == (4 if budget == 0 else 3)
    assert kept.held == (0 if budget == 0 else 3 * 32 * 32)


def test_a_failed_decode_is_never_kept_and_each_job_gets_its_own_error() -> None:
    kept, bad = DecodedImages(64 * KIB), Decoder(error=ValueError("truncated"))
    for _ in range(2):
        with pytest.raises(ValueError, match="truncated"):
            kept.get(("a", "corrupt"), bad)
    assert (bad.calls, kept.held) == (2, 0)


def test_a_tensor_on_a_device_is_not_kept() -> None:
    kept, decode = DecodedImages(64 * KIB), Decoder(device="meta")
    kept.get(("a", "gpu"), decode)
    kept.get(("a", "gpu"), decode)
    assert (decode.calls, kept.held) == (2, 0)


class Slow(Decoder):
    """A decode that waits until told to finish, so others ask for the photo meanwhile."""

    def __init__(self, error: Exception | None = None, device: str = "cpu") -> None:
        super().__init__(error=error, device=device)
        self.go = threading.Event()

    def __call__(self) -> DecodedImage:
        assert self.go.wait(30)
        return super().__call__()


@pytest.mark.parametrize("fails", [False, True], ids=["decoded", "failed"])
def test_jobs_of_one_photo_decoding_at_once_share_the_decode(fails: bool) -> None:
    """Shared when it succeeds; when it fails, each waiting job tries on its own (its own error). The
    image is a device's (never kept), so only the decode in flight can be shared."""
    kept = DecodedImages(64 * KIB)
    first = Slow(error=ValueError("corrupt") if fails else None, device="meta")
    others = [Decoder(error=ValueError("corrupt") if fails else None, device="meta") for _ in range(3)]
    got: list[object] = []

    def ask(decode: Decoder) -> None:
        try:
            got.append(kept.get(("a", "photo"), decode))
        except ValueError as exc:
            got.append(exc)

    threads = [threading.Thread(target=ask, args=(d,)) for d in (first, *others)]
    threads[0].start()
    _until(lambda: bool(kept._decoding))
    for thread in threads[1:]:
        thread.start()
    _until(lambda: kept.waiting == 3)  # all three wait on the first's decode
    first.go.set()
    for thread in threads:
        thread.join(30)
    assert len(got) == 4
    assert kept.waiting == 0
    calls = first.calls + sum(d.calls for d in others)
    if fails:
        assert all(isinstance(g, ValueError) for g in got)
        assert len({id(g) for g in got}) == 4  # never one error object shared by several jobs
        assert calls == 4
    else:
        assert calls == 1
        assert len({id(g[0]) for g in got if isinstance(g, tuple)}) == 1
        assert sorted(g[1] for g in got if isinstance(g, tuple)) == [False, True, True, True]


def _until(check: Callable[[], bool]) -> None:
    """Waits for a state (never a duration): how long it takes is the machine's business."""
    deadline = time.monotonic() + 30
    while not check():
        assert time.monotonic() < deadline, "the state never came"
        time.sleep(0.01)
