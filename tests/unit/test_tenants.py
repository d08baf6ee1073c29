"""shared/tenants.py and the keys' scopes: how a key's ids, uploads and sources are kept apart."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest

from producer.http.guard import Keys
from shared import names, tenants
from shared.jobs import Job

A, B = "a" * 12, "b" * 12


def test_a_keys_job_ids_live_in_its_own_namespace() -> None:
    assert tenants.job_id(None, "order-42") == "order-42"  # mrc submit, no keys: as before
    stored = tenants.job_id(A, "order-42")
    assert stored != tenants.job_id(B, "order-42")
    assert tenants.owner_of(stored) == A
    assert tenants.owner_of("order-42") is None
    assert tenants.owner_of("not~hex~x") is None
    assert tenants.client_id(A, stored) == "order-42"
    assert tenants.client_id(None, stored) == stored  # ops and the CLI see stored ids
    assert tenants.client_id(B, stored) == stored  # never stripped by another key's namespace
    assert tenants.own_view(stored) == "order-42"
    assert tenants.STORED_JOB_ID_RE.match(stored)


def test_a_job_in_a_keys_namespace_must_carry_that_key() -> None:
    base = {"image_uri": "s3://mrc/inputs/x.jpg", "prompt": "p", "max_new_tokens": 2}
    Job.model_validate({**base, "job_id": tenants.job_id(A, "x"), "api_key": A})
    with pytest.raises(ValueError, match="another API key"):
        Job.model_validate({**base, "job_id": tenants.job_id(A, "x"), "api_key": B})
    with pytest.raises(ValueError, match="another API key"):
        Job.model_validate({**base, "job_id": tenants.job_id(A, "x")})  # no key at all


def test_sources_are_parsed_and_checked_from_the_uri_alone() -> None:
    full_b = "b" * 64
    sources = tenants.parse_sources(f"*=s3://public/, {A}=s3://mrc/catalogue/, {full_b}=s3://other/x/")
    assert set(sources) == {"*", A, B}
    own = f"s3://mrc/{names.uploads_folder('', A)}{'0' * 64}.jpg"
    theirs = f"s3://mrc/{names.uploads_folder('', B)}{'0' * 64}.jpg"
    assert tenants.source_problem(own, A, "mrc", "", sources) is None
    assert tenants.source_problem(theirs, A, "mrc", "", sources) is not None
    assert tenants.source_problem("s3://public/p.jpg", A, "mrc", "", sources) is None  # every key's
    assert tenants.source_problem("s3://mrc/catalogue/p.jpg", A, "mrc", "", sources) is None
    assert tenants.source_problem("s3://mrc/catalogue/p.jpg", B, "mrc", "", sources) is not None
    # Review: an empty segment hid A's folder from the owner check, where every key may read `inputs/`,
    # and a store that folds `//` reads A's upload.
    shared = tenants.parse_sources("*=s3://mrc/inputs/")
    doubled = f"s3://mrc/inputs//{A}/{'0' * 64}.jpg"
    assert tenants.source_problem(doubled, B, "mrc", "", shared) is not None
    assert tenants.source_problem("s3://other/x/p.jpg", B, "mrc", "", sources) is None
    # A source as wide as the whole bucket still never reaches another key's uploads.
    wide = tenants.parse_sources("*=s3://mrc/")
    assert tenants.source_problem(theirs, A, "mrc", "", wide) is not None
    assert tenants.source_problem("s3://mrc/inputs/shared.jpg", A, "mrc", "", wide) is None
    # The same words whether or not anything lies there: nothing is looked up.
    missing = theirs.replace("0" * 64, "1" * 64)
    first = tenants.source_problem(theirs, A, "mrc", "", {})
    second = tenants.source_problem(missing, A, "mrc", "", {})
    assert first is not None
    assert second is not None
    assert first.replace(theirs, "U") == second.replace(missing, "U")


@pytest.mark.parametrize("spec", ["x=s3://b/", f"{A}=http://b/x", f"{A}", "=s3://b/", f"{A}=s3://B_/x"])
def test_a_bad_source_entry_is_refused_by_name(spec: str) -> None:
    with pytest.raises(ValueError, match="MRC_API_KEY_SOURCES"):
        tenants.parse_sources(spec)


def test_keys_carry_lanes_and_the_all_tenants_scope() -> None:
    digest = {name: hashlib.sha256(name.encode()).hexdigest() for name in ("k1", "k2", "k3", "k4")}
    keys = Keys(
        f"{digest['k1']},{digest['k2']}@backlog,{digest['k3']}@interactive+backlog+all-tenants,"
        f"{digest['k4']}@all-tenants"
    )
    one = keys.caller("Bearer k1", "ip")
    ops = keys.caller("Bearer k3", "ip")
    reader = keys.caller("Bearer k4", "ip")
    assert one is not None
    assert ops is not None
    assert reader is not None
    assert one.namespace == digest["k1"][:12]
    assert (ops.namespace, ops.owner, ops.lanes) == (None, digest["k3"][:12], frozenset(names.LANES))
    assert (reader.namespace, reader.lanes) == (None, frozenset())  # reads everything, submits nothing
    assert Keys("").caller(None, "10.0.0.1").namespace is None  # no keys: everything, as before
    with pytest.raises(ValueError, match="unknown lane"):
        Keys(f"{digest['k1']}@root")
    # one tenant per key: an entry listed twice, or two sharing the 12 digits a key's data is kept
    # under, are refused at start (review, helper-73)
    with pytest.raises(ValueError, match="is listed twice"):
        Keys(f"{digest['k1']},{digest['k2']},{digest['k1'].upper()}@backlog")
    twin = digest["k1"][:12] + digest["k2"][12:]
    with pytest.raises(ValueError, match=f"shares 12 digits with {digest['k1'][:16]}"):
        Keys(f"{digest['k1']},{twin}")


@pytest.mark.parametrize("job_id", ["nl-1\n", "a\n", "x" * 10 + "\n"])
def test_an_id_ending_in_a_newline_is_no_job_id(job_id: str) -> None:
    """`$` matched before a final newline: `nl-1\\n` was taken, its result key was one no store
    writes, and the worker that ran it died at every delivery."""
    from shared.jobs import JOB_ID_RE, limit_problem
    from shared.settings import Settings

    assert not JOB_ID_RE.match(job_id)
    assert not tenants.STORED_JOB_ID_RE.match(tenants.job_id(A, job_id))
    assert limit_problem(Settings(), "p", None, job_id) is not None
    with pytest.raises(ValueError, match="job_id"):
        Job.model_validate(
            {"image_uri": "s3://m/x.jpg", "prompt": "p", "max_new_tokens": 1, "job_id": job_id}
        )


def test_mrcs_own_folders_are_never_a_source_and_owner_folders_ignore_case() -> None:
    """With `*=s3://bucket/` allowed, bob named `results/<alice>~order-42.json`: it failed
    `unsupported_image_format` where a missing one failed `image_not_found`, telling her job ids."""
    wide = tenants.parse_sources("*=s3://mrc/")
    for key in (f"results/{A}~order-42.json", f"files/{A}/file-1.jsonl", "runs/batch_1/input.jsonl",
                f"RESULTS/{A}~x.json", f"inputs/{A.upper()}/{'0' * 64}.jpg"):  # fmt: skip
        assert tenants.source_problem(f"s3://mrc/{key}", B, "mrc", "", wide) is not None, key
    for key in (f"p/results/{A}~x.json", f"p/inputs/{A}/{'0' * 64}.jpg"):  # under MRC_S3_PREFIX too
        assert tenants.source_problem(f"s3://mrc/{key}", B, "mrc", "p/", wide) is not None, key
    assert tenants.source_problem(f"s3://mrc/inputs/{A.upper()}/x.jpg", A, "mrc", "", {}) is None  # own


def test_the_cache_key_keeps_tenants_apart() -> None:
    """A hit told bob that someone sent the same photo and question (`cached_tokens`)."""
    from types import SimpleNamespace

    from shared.settings import Settings
    from workers.cache import job_cache_key

    backend: Any = SimpleNamespace(model_id="m", revision="r", quantization="nf4")
    plan: Any = SimpleNamespace(text="p", ids=[1, 2, 3])
    keys = {
        owner: job_cache_key(backend, Settings(), 4, "ab" * 32, plan, None, owner) for owner in (A, B, None)
    }
    assert len(set(keys.values())) == 3
    assert keys[None] == job_cache_key(backend, Settings(), 4, "ab" * 32, plan)  # keyless: as before
