"""The ids a producer looks up in its result store (a HEAD each against S3), counted as it makes them."""

from __future__ import annotations

import pytest

from shared.stores import ResultStore


def counted(results: ResultStore, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The list each `has_result` call appends its job id to, the real look made as before."""
    looked: list[str] = []
    real_has_result = results.has_result

    def has_result(job_id: str) -> bool:
        looked.append(job_id)
        return real_has_result(job_id)

    monkeypatch.setattr(results, "has_result", has_result)
    return looked
