"""Decoded photos kept for their next question: a photo asked several things (the nightly backlog's
questions of each complaint, a ticket's follow-ups) is fetched by every job, but decoded, fitted and
made into the model's input once while it stays here.

Keyed by what decides the pixels: the key that sent the job (one tenant never learns by a faster
answer that another sent the same photo, as with the engine's prefixes) and the bytes' sha256; the
worker's settings fit every image the same way. Kept with the image: the model's input made from it
(Fuyu on the CPU: its normalised patches, twelve bytes a pixel, made in the decode threads), which a
profile of the worker found costing more CPU than the engine's steps when made for every question.
Two jobs of one photo decoding at once share the one decode. Held within a budget of bytes, least
recently used out first; only what is in the CPU's memory is kept (on a GPU the decoded tensor is the
device's, whose memory the engine's cache was sized to fill, and the device decodes a JPEG and makes
its patches in a millisecond or two). A failed decode is never kept: each job of a corrupt photo gets
its own error.

Nothing here may change a tensor it hands out: every job of the photo reads the same one.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future

from workers.images import DecodedImage

Key = tuple[str, str]  # (the key that sent the job, the bytes' sha256)


def _bytes_of(image: DecodedImage) -> int | None:
    """What keeping the image costs in the CPU's memory (its pixels and the model input made from
    them); None for a tensor on a device."""
    tensors = [image.tensor, getattr(image.pixels, "values", None)]
    held = 0
    for tensor in (t for t in tensors if t is not None):
        if getattr(getattr(tensor, "device", None), "type", "") != "cpu":
            return None
        held += int(tensor.numel()) * int(tensor.element_size())
    return held


class DecodedImages:
    def __init__(self, budget_bytes: int) -> None:
        self.budget = budget_bytes
        self._lock = threading.Lock()
        self._kept: OrderedDict[Key, tuple[DecodedImage, int]] = OrderedDict()
        self._decoding: dict[Key, tuple[Future[DecodedImage], str]] = {}  # and the lane it is for
        self.held = 0  # bytes of the images kept
        self.hits = 0
        self.misses = 0
        self.waiting = 0  # jobs waiting now for another's decode of their photo

    def get(
        self, key: Key | None, decode: Callable[[], DecodedImage], lane: str = ""
    ) -> tuple[DecodedImage, bool]:
        """The image for `key`, decoded by `decode` unless it is kept or being decoded for a job of the
        same `lane`; and whether it was (a hit). A decode running for another lane is not waited for:
        a ticket's decode thread never waits on the backlog's decode, nor keeps the tickets behind it
        waiting for that thread. `key` None, or a budget of 0: decoded, never kept."""
        if key is None or self.budget <= 0:
            return decode(), False
        with self._lock:
            kept = self._kept.get(key)
            if kept is not None:
                self._kept.move_to_end(key)
                self.hits += 1
                return kept[0], True
            running = self._decoding.get(key)
            pending = running[0] if running is not None and running[1] == lane else None
            if running is None:
                mine: Future[DecodedImage] = Future()
                self._decoding[key] = (mine, lane)
            elif pending is not None:
                self.waiting += 1
        if running is not None and pending is None:  # another lane's decode: this job's own, not kept
            return decode(), False
        if pending is not None:  # another job of this photo decodes it now: its result
            failed = pending.exception()
            with self._lock:
                self.waiting -= 1
            if failed is None:
                with self._lock:
                    self.hits += 1
                return pending.result(), True
            return decode(), False  # that decode failed: this job's own try, and its own error
        try:
            image = decode()
        except BaseException as exc:
            with self._lock:
                del self._decoding[key]
                self.misses += 1
            mine.set_exception(exc)
            raise
        with self._lock:
            del self._decoding[key]
            self.misses += 1
            self._keep(key, image)
        mine.set_result(image)
        return image, False

    def share(self, key: Key | None) -> Future[DecodedImage] | None:
        """Without waiting: a done future for a kept photo, or the future of its decode running now;
        None when neither, and the caller decodes it (`get`). The caller counts what it takes from one
        (`reused`). A job of a photo being decoded then holds no decode thread while it waits."""
        if key is None or self.budget <= 0:
            return None
        with self._lock:
            kept = self._kept.get(key)
            if kept is None:
                running = self._decoding.get(key)
                return None if running is None else running[0]
            self._kept.move_to_end(key)
        done: Future[DecodedImage] = Future()
        done.set_result(kept[0])
        return done

    def peek(self, key: Key | None) -> DecodedImage | None:
        """The photo kept under `key`, or None; counts nothing (the caller counts what it takes)."""
        if key is None or self.budget <= 0:
            return None
        with self._lock:
            kept = self._kept.get(key)
            if kept is None:
                return None
            self._kept.move_to_end(key)
            return kept[0]

    def reused(self) -> None:
        """A job's photo came from another job's decode (a future `share` gave)."""
        with self._lock:
            self.hits += 1

    def _keep(self, key: Key, image: DecodedImage) -> None:
        size = _bytes_of(image)
        if size is None or size > self.budget:
            return
        self._kept[key] = (image, size)
        self.held += size
        while self.held > self.budget:
            _key, (_image, dropped) = self._kept.popitem(last=False)
            self.held -= dropped
