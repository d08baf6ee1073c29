"""Each job's photo on its way to the engine: kept from an earlier job, shared with another job's
decode, or decoded in its lane's pool; and, for a kept photo that its job names by content, not
fetched at all.

A photo asked several things (the nightly backlog's questions of each complaint, a ticket's
follow-ups) is decoded once while it is kept (workers/decoded_images.py). Its bytes need not travel
either: an uploaded image's URI names its content (`inputs/[<owner>/]<sha256>.<ext>` in mrc's bucket,
written by the producer and never changed, shared/names.py), so a job naming a photo its key's jobs
already had decoded is answered from the photo kept, without an S3 GET or the header's checks again
(`kept_encoded`, called by the fetch stage). The photo kept was decoded from bytes whose sha256 the
worker computed itself: the result's hash is still of the bytes used, never a claim. A kept photo
dropped between the fetch stage and the decode is fetched then, by its decode thread.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import CancelledError, Future
from functools import partial
from typing import Any

from shared import names, tenants
from shared.errors import MrcError
from shared.jobs import Job
from shared.settings import Settings
from workers import images, stages
from workers.backends.base import ModelBackend
from workers.decoded_images import DecodedImages, Key
from workers.metrics import Metrics
from workers.slots import Slot

_FETCHED_KEPT = 65_536  # uploads remembered as fetched, least recently used out first (~10 MB)
Decoded = tuple[images.DecodedImage | MrcError, float]  # a job's decode: its image or error, and seconds
Fetch = Callable[[Job], images.EncodedImage]


def image_of(shared: Future[Any]) -> images.DecodedImage | None:
    """The image a shared decode gave: a future of DecodedImages' (the image) or of the pool's (an
    image or error, and seconds); None when it failed."""
    if shared.exception() is not None:
        return None
    result = shared.result()
    image = result[0] if isinstance(result, tuple) else result
    return image if isinstance(image, images.DecodedImage) else None


def forward(out: Future[Decoded], own: Future[Decoded]) -> None:
    if own.cancelled():  # the pool shut down before it ran: ends as an unshared job's decode would
        out.set_exception(CancelledError())
        return
    failed = own.exception()
    if failed is not None:
        out.set_exception(failed)
    else:
        out.set_result(own.result())


def _settle(out: Future[Decoded], task: Future[None]) -> None:
    """A decode task the pool cancelled (shut down) or that raised (a device fault) ends its job's
    decode the same way; one that ran has set it, or left it to a shared decode's callback."""
    if task.cancelled():
        out.set_exception(CancelledError())
    elif task.exception() is not None and not out.done():
        out.set_exception(task.exception())


class Photos:
    def __init__(
        self,
        backend: ModelBackend,
        settings: Settings,
        metrics: Metrics,
        pool: Any,  # workers/lane_pools.py LanePools: submit(slot, work, *args) -> Future
        fetch: Fetch,
    ) -> None:
        self.backend, self.settings, self.metrics = backend, settings, metrics
        self._pool, self._fetch = pool, fetch
        self.decoded = DecodedImages(settings.decoded_image_cache_mb * 2**20)
        # The uploads each key's jobs really fetched, with their content checked (stages.fetch_image):
        # a kept photo answers only a URI it was fetched from, never another name of the same hash.
        self._fetched: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._lock = threading.Lock()

    def key(self, slot: Slot) -> Key | None:
        """What a decoded photo is kept under: the key that sent the job (one tenant never learns by a
        faster answer that another sent the same photo) and the bytes' sha256."""
        encoded = slot.encoded
        if encoded is None or slot.job is None or not encoded.sha256 or not self.backend.needs_pixels:
            return None
        return (tenants.owner_of(slot.job.job_id) or "", encoded.sha256)

    def kept_encoded(self, slot: Slot) -> images.EncodedImage | None:
        """What the job's fetch would give, without fetching it: the header's facts of a kept photo the
        job names by content (no bytes; the hash its bytes had); None when it must be fetched."""
        job = slot.job
        if job is None or not self.backend.needs_pixels or self.decoded.budget <= 0:
            return None
        sha256 = names.content_sha256(job.image_uri, self.settings.s3_bucket, self.settings.s3_prefix)
        if sha256 is None or job.image_sha256 not in (None, sha256):
            return None
        owner = tenants.owner_of(job.job_id) or ""
        with self._lock:
            if (owner, job.image_uri) not in self._fetched:
                return None
            self._fetched.move_to_end((owner, job.image_uri))
        kept = self.decoded.peek((owner, sha256))
        if kept is None:
            return None
        return images.EncodedImage(b"", kept.format, kept.width, kept.height, sha256=sha256)

    def fetched(self, slot: Slot) -> None:
        """The job's image was fetched (its content checked against an upload's name)."""
        job, encoded = slot.job, slot.encoded
        if job is None or encoded is None or not encoded.data:
            return
        if names.content_sha256(job.image_uri, self.settings.s3_bucket, self.settings.s3_prefix) is None:
            return
        with self._lock:
            self._fetched[(tenants.owner_of(job.job_id) or "", job.image_uri)] = None
            self._fetched.move_to_end((tenants.owner_of(job.job_id) or "", job.image_uri))
            while len(self._fetched) > _FETCHED_KEPT:
                self._fetched.popitem(last=False)

    def soon(self, slot: Slot, first: dict[tuple[str, ...], Future[Decoded]]) -> Future[Decoded]:
        """The job's decode, started. A photo kept, being decoded, or decoded by a job of the same lane
        before it in this delivery is shared without taking a decode thread (one waiting there would
        keep another job's new photo waiting for a thread); otherwise the pool decodes it. A ticket
        never waits for a backlog job's decode still queued behind the backlog's others."""
        key = self.key(slot)
        if key is None or self.decoded.budget <= 0:
            alone: Future[Decoded] = Future()
            self._pool.submit(slot, self._decode_alone, slot, alone).add_done_callback(
                partial(_settle, alone)
            )
            return alone
        lane = (slot.job.lane if slot.job is not None else "", *key)
        shared: Future[Any] | None = self.decoded.share(key) or first.get(lane)
        out: Future[Decoded] = Future()
        if shared is None:
            task = self._pool.submit(slot, self._decode_into, slot, out)
            task.add_done_callback(partial(_settle, out))
            first[lane] = out
            return out
        shared.add_done_callback(partial(self.take_shared, slot, out, began=time.perf_counter()))
        return out

    def _decode_alone(self, slot: Slot, out: Future[Decoded]) -> None:
        """The job's decode into `out`, a future of our own: one the pool cancels at shutdown is never
        seen as done by `concurrent.futures.wait` (the delivery's loop), `_settle` ends ours."""
        out.set_result(self._decode_one(slot))

    def _decode_into(self, slot: Slot, out: Future[Decoded]) -> None:
        """On a decode thread: the job's decode into `out`; or, if its photo began decoding for another
        job since the job was handed over (a decode queued behind its lane's others, or another lane's),
        that decode's result, taken when it ends: the thread goes back to the pool meanwhile."""
        encoded = slot.encoded
        if encoded is not None and encoded.data:  # a job whose fetch was skipped goes its own way
            running = self.decoded.share(self.key(slot))
            if running is not None:
                running.add_done_callback(partial(self.take_shared, slot, out, began=time.perf_counter()))
                return
        self._decode_alone(slot, out)

    def take_shared(self, slot: Slot, out: Future[Decoded], shared: Future[Any], began: float = 0.0) -> None:
        """The shared decode's image for this job, with the time it waited for it (its preprocessing,
        as much as the decoding job's); if it failed, this job's own try (its own error)."""
        # The pool shut down under the delivery: end this job's wait too, and submit nothing (the
        # shutdown may be running this callback while it holds the pool's lock).
        if shared.cancelled() or isinstance(shared.exception(), CancelledError):
            out.set_exception(CancelledError())
            return
        image = image_of(shared)
        if image is not None:
            self.decoded.reused()
            self.metrics.image_decodes.labels(result="reused").inc()
            out.set_result((image, time.perf_counter() - began if began else 0.0))
            return
        try:
            own = self._pool.submit(slot, self._decode_one, slot)
        except Exception as exc:  # the pool is shut down: the delivery must not wait forever
            out.set_exception(exc)
            return
        own.add_done_callback(partial(forward, out))

    def _decode_one(self, slot: Slot) -> Decoded:
        return stages.timed("image decode", partial(self._decode_or_reuse, slot))

    def _decode_or_reuse(self, slot: Slot) -> images.DecodedImage:
        encoded = slot.encoded
        assert encoded is not None
        assert slot.job is not None
        if not encoded.data:  # its fetch was skipped for a kept photo: kept still, or fetched now
            kept = self.decoded.peek(self.key(slot))
            if kept is not None:
                self.decoded.reused()
                self.metrics.image_decodes.labels(result="reused").inc()
                return kept
            slot.encoded = None  # a failed fetch's result says nothing of bytes it never had
            encoded = slot.encoded = self._fetch(slot.job)
            self.metrics.image_fetches.labels(result="fetched").inc()
        key = self.key(slot)  # from the bytes' own hash
        image, reused = self.decoded.get(
            key, partial(stages.decode_image, encoded, self.backend), slot.job.lane
        )
        if key is not None:
            self.metrics.image_decodes.labels(result="reused" if reused else "decoded").inc()
            self.metrics.decoded_images_held.set(self.decoded.held)
        return image
