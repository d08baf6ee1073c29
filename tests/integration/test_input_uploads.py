"""An uploaded photo's object is written again when its content is sent again after a day, so that the
bucket's lifecycle rule (deploy/s3-lifecycle.json: `inputs/` after 30 days) counts from its last use
(review, helper-117: a photo first sent 30 days ago and sent again today was deleted on the first
upload's schedule, under the job that had just named it)."""

from __future__ import annotations

import time

import pytest

from producer.client import Client
from scripts import devservices as services
from shared.stores import s3

pytestmark = pytest.mark.integration


def _calls(connection: s3.S3Connection) -> list[tuple[str, dict[str, str]]]:
    """Each request the connection sends from now on: its operation and its headers."""
    sent: list[tuple[str, dict[str, str]]] = []

    def seen(request: object, event_name: str, **_kwargs: object) -> None:
        headers = {k: v.decode() if isinstance(v, bytes) else v for k, v in request.headers.items()}  # type: ignore[attr-defined]
        sent.append((event_name.rsplit(".", 1)[-1], headers))

    connection.client.meta.events.register("before-send.s3", seen)
    return sent


def test_a_photo_sent_again_after_a_day_is_written_again(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = s3.S3ImageSource(s3.S3Connection(client.settings), client.settings)
    key = f"{client.settings.s3_prefix}inputs/{'ab' * 32}.png"
    photo = b"p" * (s3.INPUT_PUT_AT_ONCE_BYTES + 1)  # looked for first: not sent twice in a day
    source.put_input(photo, key, "image/png")
    connection = source.connection
    first = connection.modified(source.bucket, key)
    assert first is not None
    time.sleep(1.1)  # S3's times are in whole seconds
    source.put_input(photo, key, "image/png")  # sent again within the day: not written again
    assert connection.modified(source.bucket, key) == first
    monkeypatch.setattr(s3, "INPUT_REFRESH_S", 0)  # as if the day had passed
    source.put_input(photo, key, "image/png")
    again = connection.modified(source.bucket, key)
    assert again is not None
    assert again > first


def test_a_small_photo_is_one_put_and_only_a_large_body_waits_for_continue(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review, helper-120, at 25 ms of S3 latency: a new photo was a HEAD then a PUT, and every PUT two
    round trips (`Expect: 100-continue`, which botocore adds to any upload): a result 57 ms against a
    GET's 31. A small photo is now one PUT (sending it again costs less than asking), and only a body
    of 2 MiB or more waits for the server's go-ahead."""
    source = s3.S3ImageSource(s3.S3Connection(client.settings), client.settings)
    source.put_input(b"warm", f"{client.settings.s3_prefix}inputs/{'cd' * 32}.png", "image/png")  # bucket
    sent = _calls(source.connection)
    key = f"{client.settings.s3_prefix}inputs/{'ef' * 32}.png"
    source.put_input(b"small photo", key, "image/png")
    assert [name for name, _ in sent] == ["PutObject"]
    assert "Expect" not in sent[0][1]
    del sent[:]
    # sent again (a chat's next turn, a Batch's next line about it): neither written nor asked about
    # (review, helper-121: each send was a PUT, a new version in a versioned bucket)...
    source.put_input(b"small photo", key, "image/png")
    assert sent == []
    monkeypatch.setattr(s3, "INPUT_REMEMBERED_S", 0)  # ...for minutes: then written again
    source.put_input(b"small photo", key, "image/png")
    assert [name for name, _ in sent] == ["PutObject"]
    del sent[:]
    source.connection.put(source.bucket, f"{key}.large", b"x" * (2 * 1024 * 1024), "image/png")
    assert [name for name, _ in sent] == ["PutObject"]
    assert sent[0][1].get("Expect") == "100-continue"
    assert source.connection.get(source.bucket, key, 100) == b"small photo"


def test_a_photo_sent_again_after_its_bucket_was_lost_and_made_again_is_written_again(
    env: dict[str, str], client: Client
) -> None:
    """Review, helper-122: the inputs a process remembers writing outlived the bucket: lost, then made
    again by this process's next write, the bucket lacked the photos sent again, answered from memory,
    and their jobs failed `image_not_found`."""
    import uuid

    import boto3

    from shared.stores import open_stores

    settings = services.settings_from_env({**env, "MRC_S3_BUCKET": f"mrc-lost-{uuid.uuid4().hex[:6]}"})
    source, results = open_stores(settings)
    small, large = (
        f"{settings.s3_prefix}inputs/{'aa' * 32}.png",
        f"{settings.s3_prefix}inputs/{'bb' * 32}.png",
    )
    photos = {small: b"small photo", large: b"l" * (s3.INPUT_PUT_AT_ONCE_BYTES + 1)}
    for key, data in photos.items():
        source.put_input(data, key, "image/png")
    bucket = boto3.resource(
        "s3", endpoint_url=env["MRC_S3_ENDPOINT_URL"], region_name="us-east-1",
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"], aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
    ).Bucket(settings.s3_bucket)  # fmt: skip
    bucket.objects.all().delete()
    bucket.delete()
    results.put_result("after-the-loss", {"status": "succeeded"})  # makes the bucket again
    for key, data in photos.items():
        source.put_input(data, key, "image/png")
        assert source.get_bytes(settings.s3_bucket, key, len(data)) == data, key


def test_a_photo_written_while_its_bucket_was_found_lost_is_not_remembered(client: Client) -> None:
    """Review, helper-122: a PUT that finished just as another thread found the bucket gone was
    remembered after the memory was cleared; the photo may have gone with the bucket, and sent again
    it was answered from memory, its jobs failing `image_not_found`."""
    source = s3.S3ImageSource(s3.S3Connection(client.settings), client.settings)
    source.put_input(b"warm", f"{client.settings.s3_prefix}inputs/{'a1' * 32}.png", "image/png")
    key = f"{client.settings.s3_prefix}inputs/{'a2' * 32}.png"

    def lost_meanwhile(**_kwargs: object) -> None:  # another thread's call finds the bucket gone
        source.connection.bucket_losses += 1

    events = source.connection.client.meta.events
    events.register("after-call.s3.PutObject", lost_meanwhile)
    source.put_input(b"written as the bucket went", key, "image/png")
    events.unregister("after-call.s3.PutObject", lost_meanwhile)
    sent = _calls(source.connection)
    source.put_input(b"written as the bucket went", key, "image/png")
    assert [name for name, _ in sent] == ["PutObject"]  # written again, not answered from memory
    source.put_input(b"written as the bucket went", key, "image/png")
    assert [name for name, _ in sent] == ["PutObject"]  # and remembered from then on
