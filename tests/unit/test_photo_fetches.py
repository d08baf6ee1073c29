"""A photo kept decoded is not fetched again when its job names it by content (issue 38: the
photo-questions workload's S3 GETs), and jobs of one delivery naming the same image share a fetch.
The worker's pipeline over the echo model and the in-process store, counting the store's GETs."""

from __future__ import annotations

import hashlib
import threading
import time
from typing import Any

import pytest

from shared import names
from shared.memory_records import MemoryJobRecords
from shared.settings import Settings
from shared.stores.memory import MemoryStore
from tests.support import imagegen
from workers.backends.echo import EchoBackend
from workers.images import EncodedImage
from workers.pipeline import Pipeline, assemble
from workers.slots import Message, Slot

OWNER_A, OWNER_B = "a" * 12, "b" * 12
GUARD_S = 15.0  # how long a held GET or a delivery lasts at most, should the test fail


class CountingStore(MemoryStore):
    """The in-process store, counting the GETs of each key; a GET of `held` waits for `release`."""

    def __init__(self) -> None:
        super().__init__("mrc")
        self.gets: dict[str, int] = {}
        self.held, self.holding, self.release = "", threading.Event(), threading.Event()

    def get_bytes(self, bucket: str, key: str, max_bytes: int) -> bytes | None:
        self.gets[key] = self.gets.get(key, 0) + 1
        if key == self.held:
            self.holding.set()
            self.release.wait(GUARD_S)
        return super().get_bytes(bucket, key, max_bytes)


def _upload(store: CountingStore, data: bytes, owner: str | None = None) -> tuple[str, str]:
    digest = hashlib.sha256(data).hexdigest()
    key = names.input_key("", digest, "jpg", owner)
    store.put_bytes(key, data, "image/jpeg")
    return names.s3_uri("mrc", key), key


def _job(job_id: str, uri: str, owner: str | None = None, **fields: Any) -> Message:
    body = {"job_id": job_id, "image_uri": uri, "prompt": "refund?", "max_new_tokens": 4, **fields}
    if owner is not None:
        body |= {"job_id": f"{owner}~{job_id}", "api_key": owner}
    return Message(job_id, body)


def _pipeline(store: MemoryStore, **settings: Any) -> Pipeline:
    return assemble(
        EchoBackend(), store, store, MemoryJobRecords(), Settings(**settings), sleep=lambda _s: None
    )


def _fetches(pipeline: Pipeline) -> dict[str, float | None]:
    count = pipeline.metrics.registry.get_sample_value
    return {r: count("mrc_image_fetches_total", {"result": r}) for r in ("fetched", "shared", "kept")}


def _result(store: MemoryStore, message: Message) -> dict[str, Any]:
    result = store.get_result(str(message.body["job_id"]))  # type: ignore[index]
    assert result is not None
    return result


@pytest.fixture
def store() -> CountingStore:
    return CountingStore()


def test_a_kept_photo_named_by_its_content_is_not_fetched_again(store: CountingStore) -> None:
    data = imagegen.photo(64, 48)
    uri, key = _upload(store, data)
    pipeline = _pipeline(store)
    try:
        first, again = _job("first", uri), _job("again", uri, image_sha256=hashlib.sha256(data).hexdigest())
        assert pipeline.run([first]) == ["succeeded"]
        assert pipeline.run([again]) == ["succeeded"]
        assert store.gets[key] == 1
        assert _fetches(pipeline) == {"fetched": 1.0, "shared": 0.0, "kept": 1.0}
        one, two = _result(store, first), _result(store, again)
        assert two["image"] == one["image"]  # the same uri, hash of the bytes used, and size
        assert one["image"]["sha256"] == hashlib.sha256(data).hexdigest()
        assert two["text"] == one["text"]
    finally:
        pipeline.close()


@pytest.mark.parametrize(
    ("name", "detail"),
    [
        ("not-named-by-content", "inputs/photo.jpg"),
        ("claim-differs-from-name", "claim"),
        ("another-keys-photo", "owner"),
        ("nothing-kept", "budget"),
    ],
)
def test_a_photo_is_fetched_whenever_its_name_or_its_key_does_not_match(
    store: CountingStore, name: str, detail: str
) -> None:
    """A URI that does not name the bytes' hash in mrc's uploads, a job whose image_sha256 says other
    than its URI, another key's job (the kept photo is its key's alone) and a worker keeping nothing
    fetch the photo for every job."""
    data = imagegen.photo(64, 48)
    uri, key = _upload(store, data)
    first, again = _job("first", uri, OWNER_A), _job("again", uri, OWNER_A)
    settings: dict[str, Any] = {}
    if detail == "inputs/photo.jpg":
        store.put_bytes(detail, data, "image/jpeg")
        uri, key = "s3://mrc/inputs/photo.jpg", detail
        first, again = _job("first", uri), _job("again", uri)
    elif detail == "claim":
        again = _job("again", uri, OWNER_A, image_sha256="0" * 64)
    elif detail == "owner":
        again = _job("again", uri, OWNER_B)
    else:
        settings["decoded_image_cache_mb"] = 0
    pipeline = _pipeline(store, **settings)
    try:
        assert pipeline.run([first]) == ["succeeded"]
        assert pipeline.run([again]) == ["succeeded"]
        assert store.gets[key] == 2, name
        assert _fetches(pipeline)["kept"] == 0.0
        assert _result(store, again)["image"]["sha256"] == hashlib.sha256(data).hexdigest()
    finally:
        pipeline.close()


def _asked_again_after_a_drop(
    store: CountingStore, data: bytes, replacement: bytes | None = None, also: list[Message] | None = None
) -> Pipeline:
    """The photo asked about, then asked again: the fetch stage finds it kept, and the cache drops it
    (another delivery's photos took its room) before the job's decode; `replacement`, if given, is
    then written under the photo's name (never by mrc); `also` are jobs of the second delivery. The
    pipeline, its jobs "first" and "again" run."""
    uri, key = _upload(store, data)
    pipeline = _pipeline(store)
    photos = pipeline.model.photos
    kept_encoded = photos.kept_encoded

    def found_then_dropped(slot: Slot) -> EncodedImage | None:
        found = kept_encoded(slot)
        photos.decoded = type(photos.decoded)(photos.decoded.budget)  # all dropped
        if replacement is not None:
            store.put_bytes(key, replacement, "image/jpeg")
        return found

    assert pipeline.run([_job("first", uri)]) == ["succeeded"]
    photos.kept_encoded = found_then_dropped  # type: ignore[method-assign]
    pipeline.run([_job("again", uri), *(also or [])])
    return pipeline


def test_a_kept_photo_dropped_before_its_decode_is_fetched_then(store: CountingStore) -> None:
    """The decode thread fetches it, and the job is answered as the first was."""
    data = imagegen.photo(64, 48)
    pipeline = _asked_again_after_a_drop(store, data)
    try:
        assert (store.get_result("again") or {})["status"] == "succeeded"
        assert store.gets[_upload(store, data)[1]] == 2
        assert _fetches(pipeline) == {"fetched": 2.0, "shared": 0.0, "kept": 1.0}
        first, again = (store.get_result(job_id) or {} for job_id in ("first", "again"))
        assert again["image"]["sha256"] == hashlib.sha256(data).hexdigest()
        assert again["text"] == first["text"]
    finally:
        pipeline.close()


def test_bytes_under_an_uploads_name_that_are_not_its_content_fail_the_job_that_names_it(
    store: CountingStore,
) -> None:
    """Another object written under a photo's upload name (never by mrc), found by the fetch after
    the kept photo was dropped: the job fails image_not_found, its result claims no image facts, and
    a job of the same delivery whose own URI holds the photo is answered from its own bytes (it had
    shared the failed job's decode)."""
    data, other = imagegen.photo(64, 48), imagegen.photo(80, 60)
    store.put_bytes("inputs/photo.jpg", data, "image/jpeg")
    pipeline = _asked_again_after_a_drop(
        store, data, replacement=other, also=[_job("same-photo", "s3://mrc/inputs/photo.jpg")]
    )
    try:
        result = store.get_result("again") or {}
        assert result["error"]["code"] == "image_not_found"
        assert "is not the upload its name says" in result["error"]["message"]
        assert result["image"]["sha256"] is None
        assert (result["image"]["width"], result["image"]["height"]) == (0, 0)
        same = store.get_result("same-photo") or {}
        assert same["text"] == (store.get_result("first") or {})["text"]
        assert same["image"]["sha256"] == hashlib.sha256(data).hexdigest()
    finally:
        pipeline.close()


def test_a_kept_photo_answers_only_a_uri_it_was_fetched_from(store: CountingStore) -> None:
    """The photo is kept from its upload; jobs naming the same hash under a name never fetched (another
    extension, an empty or another key's folder) are fetched, and fail as the store says."""
    data = imagegen.photo(64, 48)
    uri, _key = _upload(store, data)
    digest = hashlib.sha256(data).hexdigest()
    pipeline = _pipeline(store)
    try:
        assert pipeline.run([_job("first", uri)]) == ["succeeded"]
        ghosts = [f"s3://mrc/inputs/{digest}.gif", f"s3://mrc/inputs//{digest}.jpg"]
        delivery = [_job(f"ghost-{n}", ghost) for n, ghost in enumerate(ghosts)]
        delivery.append(_job("other-folder", f"s3://mrc/inputs/{OWNER_A}/{digest}.jpg", OWNER_A))
        assert pipeline.run(delivery) == ["failed"] * 3
        codes = [_result(store, message)["error"]["code"] for message in delivery]
        # an empty segment (//) is refused by its name (a store folding it reads another key's folder)
        assert codes == ["image_not_found", "image_source_forbidden", "image_not_found"]
        assert _fetches(pipeline)["kept"] == 0.0
    finally:
        pipeline.close()


def test_jobs_of_a_delivery_naming_one_image_share_its_fetch_within_a_lane(store: CountingStore) -> None:
    """Three jobs of one URI and one of another in one delivery: two GETs for the first (one per lane:
    a ticket never waits on the backlog's threads), one for the other; every job answered."""
    store.put_bytes("inputs/a.jpg", imagegen.photo(64, 48), "image/jpeg")
    store.put_bytes("inputs/b.jpg", imagegen.photo(80, 60), "image/jpeg")
    pipeline = _pipeline(store)
    try:
        delivery = [
            _job("a1", "s3://mrc/inputs/a.jpg"),
            _job("b1", "s3://mrc/inputs/b.jpg"),
            _job("a2", "s3://mrc/inputs/a.jpg"),
            _job("a3", "s3://mrc/inputs/a.jpg", lane="backlog"),
        ]
        assert pipeline.run(delivery) == ["succeeded"] * 4
        assert {k: n for k, n in store.gets.items() if k.startswith("inputs/")} == {
            "inputs/a.jpg": 2,
            "inputs/b.jpg": 1,
        }
        assert _fetches(pipeline) == {"fetched": 3.0, "shared": 1.0, "kept": 0.0}
        texts = {_result(store, m)["text"] for m in (delivery[0], delivery[2], delivery[3])}
        assert len(texts) == 1
    finally:
        pipeline.close()


def test_a_fetch_running_in_one_delivery_is_shared_by_another_of_the_same_key(store: CountingStore) -> None:
    """A delivery whose GET of a photo is held; a second delivery naming the same photo for the same key
    waits on that GET instead of its own, and another key's job makes its own; all three answered."""
    store.put_bytes("inputs/slow.jpg", imagegen.photo(64, 48), "image/jpeg")
    store.held = "inputs/slow.jpg"
    uri = "s3://mrc/inputs/slow.jpg"
    pipeline = _pipeline(store, decoded_image_cache_mb=0)
    outcomes: list[list[str]] = []
    first = threading.Thread(target=lambda: outcomes.append(pipeline.run([_job("first", uri, OWNER_A)])))
    second = threading.Thread(target=lambda: outcomes.append(pipeline.run([_job("second", uri, OWNER_A)])))
    other = threading.Thread(target=lambda: outcomes.append(pipeline.run([_job("other", uri, OWNER_B)])))
    try:
        first.start()
        assert store.holding.wait(GUARD_S)
        second.start()
        deadline = time.monotonic() + GUARD_S
        while _fetches(pipeline)["shared"] != 1.0 and time.monotonic() < deadline:
            time.sleep(0.01)
        other.start()
        while store.gets["inputs/slow.jpg"] < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        store.release.set()
        for thread in (first, second, other):
            if thread.is_alive() or thread.ident:
                thread.join(GUARD_S)
        pipeline.close()
    assert outcomes == [["succeeded"]] * 3
    assert store.gets["inputs/slow.jpg"] == 2  # the first key's two jobs, one GET; the other key's own
    assert _fetches(pipeline) == {"fetched": 2.0, "shared": 1.0, "kept": 0.0}


def test_a_missing_image_shared_by_a_delivery_fails_each_of_its_jobs(store: CountingStore) -> None:
    pipeline = _pipeline(store)
    try:
        delivery = [_job("m1", "s3://mrc/inputs/gone.jpg"), _job("m2", "s3://mrc/inputs/gone.jpg")]
        assert pipeline.run(delivery) == ["failed", "failed"]
        for message in delivery:
            assert _result(store, message)["error"]["code"] == "image_not_found"
    finally:
        pipeline.close()


@pytest.mark.parametrize(
    ("uri", "expected"),
    [
        (f"s3://mrc/inputs/{'a1' * 32}.jpg", "a1" * 32),
        (f"s3://mrc/inputs/{OWNER_A}/{'a1' * 32}.webp", "a1" * 32),
        (f"s3://other/inputs/{'a1' * 32}.jpg", None),  # another bucket: not mrc's uploads
        (f"s3://mrc/photos/{'a1' * 32}.jpg", None),  # outside the uploads folder
        (f"s3://mrc/inputs/{'A1' * 32}.jpg", None),  # not how mrc names them
        (f"s3://mrc/inputs/{'a1' * 32}", None),  # no extension
        (f"s3://mrc/inputs/{'a1' * 31}.jpg", None),  # short
        (f"s3://mrc/inputs/x/{'a1' * 32}.jpg", None),  # not a key's folder
        (f"s3://mrc/inputs/{OWNER_A}/y/{'a1' * 32}.jpg", None),
        (f"https://mrc/inputs/{'a1' * 32}.jpg", None),
    ],
)
def test_which_uris_name_an_image_by_its_content(uri: str, expected: str | None) -> None:
    assert names.content_sha256(uri, "mrc", "") == expected


def test_a_prefix_moves_the_uploads_folder() -> None:
    digest = "c3" * 32
    assert names.content_sha256(f"s3://mrc/tenant-1/inputs/{digest}.png", "mrc", "tenant-1/") == digest
    assert names.content_sha256(f"s3://mrc/inputs/{digest}.png", "mrc", "tenant-1/") is None
