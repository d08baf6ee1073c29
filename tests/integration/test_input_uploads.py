"""An uploaded photo's object is written again when its content is sent again after a day, so that the
bucket's lifecycle rule (deploy/s3-lifecycle.json: `inputs/` after 30 days) counts from its last use
(review, helper-117: a photo first sent 30 days ago and sent again today was deleted on the first
upload's schedule, under the job that had just named it)."""

from __future__ import annotations

import time

import pytest

from producer.client import Client
from shared.stores import s3

pytestmark = pytest.mark.integration


def test_a_photo_sent_again_after_a_day_is_written_again(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = s3.S3ImageSource(s3.S3Connection(client.settings), client.settings)
    key = f"{client.settings.s3_prefix}inputs/{'ab' * 32}.png"
    source.put_input(b"first", key, "image/png")
    connection = source.connection
    first = connection.modified(source.bucket, key)
    assert first is not None
    time.sleep(1.1)  # S3's times are in whole seconds
    source.put_input(b"first", key, "image/png")  # sent again within the day: not written again
    assert connection.modified(source.bucket, key) == first
    monkeypatch.setattr(s3, "INPUT_REFRESH_S", 0)  # as if the day had passed
    source.put_input(b"first", key, "image/png")
    again = connection.modified(source.bucket, key)
    assert again is not None
    assert again > first
