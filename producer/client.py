"""The producer's Python surface: submit / submit_many / wait / status / result, what `mrc` and Python
programs use. A `Client` is a `Queue` (producer/queue/sender.py: sending and reading back) that builds
its jobs through the intake (producer/intake/)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from celery import Celery

from producer.intake import checks
from producer.intake.intake import Intake
from producer.intake.request import Submission
from producer.queue.sender import Queue
from shared.errors import NotReplicated
from shared.jobs import Job
from shared.records import JobRecords
from shared.response_format import ChoiceFormat, JsonSchemaFormat
from shared.settings import Settings
from shared.stores import ImageSource, ResultStore

__all__ = ["Client", "Submission"]


class Client(Queue):
    def __init__(
        self,
        settings: Settings,
        *,
        images: ImageSource | None = None,
        results: ResultStore | None = None,
        records: JobRecords | None = None,
        celery: Celery | None = None,
    ) -> None:
        super().__init__(settings, images=images, results=results, records=records, celery=celery)
        self.intake = Intake(settings, self.images)

    # ---- checks and images: the intake's ----
    def validate(self, sub: Submission) -> None:
        """Every check that needs neither Redis nor S3: a bad submission is refused before either."""
        self.intake.validate(sub)

    def response_format(self, sub: Submission) -> JsonSchemaFormat | ChoiceFormat | None:
        return checks.response_format(self.settings, sub)

    def upload_image(self, path: Path, owner: str | None = None) -> tuple[str, str]:
        """Upload a local image to inputs/<sha256>.<ext> (once per content); return (uri, sha256)."""
        return self.intake.upload_image(path, owner)

    def upload_bytes(self, data: bytes, owner: str | None = None) -> tuple[str, str]:
        """Upload image bytes to inputs/<sha256>.<ext> (once per content); return (uri, sha256)."""
        return self.intake.upload_bytes(data, owner)

    def build_job(self, sub: Submission) -> Job:
        return self.intake.job(sub)

    # ---- submit ----
    def submit(self, image: str | Path, prompt: str, block: bool = True, **options: Any) -> str:
        sub = Submission(image=image, prompt=prompt, **options)
        job = self.build_job(sub)
        self.enqueue(job, block=block, minted=sub.job_id is None)  # a drawn id: S3 not asked
        return job.job_id

    def submit_many(self, submissions: Iterable[Submission]) -> list[str]:
        """Every job enqueued (one not replicated does not stop the rest); NotReplicated at the end
        names those whose replication was not confirmed (`job_ids`) and all the ids (`submitted`)."""
        subs = list(submissions)
        jobs = [self.build_job(s) for s in subs]
        unreplicated: list[str] = []
        for sub, job in zip(subs, jobs, strict=True):
            try:
                self.enqueue(job, minted=sub.job_id is None)
            except NotReplicated:
                unreplicated.append(job.job_id)
        ids = [job.job_id for job in jobs]
        if unreplicated:
            settings = self.settings
            error = NotReplicated(
                0,
                settings.redis_wait_replicas,
                settings.redis_wait_timeout_ms,
                f"{len(unreplicated)} of the jobs",
            )
            error.job_ids, error.submitted = unreplicated, ids
            raise error
        return ids
