"""The one Settings object. This module is the only reader of the environment (prefix MRC_)."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict, SettingsError

from shared import setting_rules as rules
from shared import tenants, url_hosts

Quantization = Literal["nf4", "bf16", "fp16", "fp32"]
LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]
# The shortest socket timeout of mrc's Redis clients (shared/records.py; the broker's is 30 s), and the
# longest WAIT allowed below it: a command past its socket timeout is retried, a WAIT must never be.
REDIS_SOCKET_TIMEOUT_S = 10
WAIT_TIMEOUT_CEILING_MS = 5000


def _default_home() -> str:
    return str(Path.home() / ".cache" / "mrc")


class Settings(BaseSettings):
    """Every knob of mrc, typed. Documented one by one in README.md."""

    model_config = SettingsConfigDict(env_prefix="MRC_", extra="ignore", frozen=True)

    # --- services (docs/contract.md) ---
    redis_url: str = "redis://127.0.0.1:6379/0"
    # Sentinel: `host:port,host:port,...`; when set, every Redis user finds the master through them and
    # follows a failover (MRC_REDIS_URL's host is then not used; its db number, user and password are).
    redis_sentinels: str = ""
    redis_sentinel_master: str = "mymaster"
    redis_sentinel_password: str = ""  # the Sentinels' own `requirepass` (Redis's is in MRC_REDIS_URL)
    redis_sentinel_username: str = ""
    redis_sentinel_tls: bool = False  # TLS to the Sentinels (to Redis itself: a rediss:// MRC_REDIS_URL)
    # Durability: after a publish, wait for this many replicas to acknowledge it (Redis WAIT) for at
    # most redis_wait_timeout_ms; a publish not replicated in time is answered as enqueued but not
    # replicated (exit 6 / 202 with "replicated": false; the same job id again is the same job). 0: off.
    redis_wait_replicas: int = Field(default=0, ge=0)
    # At most WAIT_TIMEOUT_CEILING_MS: a WAIT that outlasted a client's socket timeout would be retried.
    redis_wait_timeout_ms: int = Field(default=1000, ge=1)
    s3_endpoint_url: str = ""
    s3_bucket: str = "mrc"
    s3_prefix: str = ""
    s3_region: str = "us-east-1"
    # Buckets besides s3_bucket that jobs may read images from; anything else is image_source_forbidden.
    allowed_buckets: list[str] = Field(default_factory=list)
    # S3-compatible stores (MinIO, Ceph, R2): boto3 >= 1.36 sends CRC checksums on every request by
    # default, which some of them reject; "when_required" sends them only where S3 requires one.
    s3_checksums: Literal["when_required", "when_supported"] = "when_required"
    # "auto": path-style with a custom endpoint (MinIO, Ceph), virtual-hosted on AWS.
    s3_addressing_style: Literal["auto", "path", "virtual"] = "auto"

    # --- HTTP intake (mrc-api) ---
    api_host: str = "127.0.0.1"
    api_port: int = Field(default=8000, ge=0, le=65535)
    api_workers: int = Field(default=1, ge=1, le=256)  # uvicorn worker processes (CPU-bound Python)
    # Comma-separated `SHA256HEX` or `SHA256HEX@scope+scope` (the hex sha256 of each key; scopes: the
    # lanes it may submit to, and `all-tenants` to read every key's jobs); empty: no auth.
    api_keys: str = ""
    # Where keys may name s3:// images from besides their own uploads (shared/tenants.py): comma-
    # separated `WHO=s3://bucket/[prefix]`, WHO a key's sha256 (or its first 12 hex) or `*` for every
    # key. Empty: a key names only what it uploaded.
    api_key_sources: str = ""
    # Hosts whose http(s) image URLs mrc-api fetches (chat `image_url` parts; producer/intake/fetch.py):
    # comma-separated names, `*.example.com` for the names below it, each with `:port` to allow that
    # port only (shared/url_hosts.py). Empty: no URL is fetched.
    image_url_hosts: str = ""
    # Fetch from private, loopback and link-local addresses too (a lab's own image server). Off: such an
    # address is refused whatever the allowed name resolves to.
    image_url_private: bool = False
    image_url_timeout_s: float = Field(default=10.0, gt=0, le=120)  # one fetch, redirects included
    api_max_body_bytes: int = Field(default=0, ge=0)  # 0: MRC_MAX_IMAGE_BYTES + 1 MiB for the form
    api_rate_per_s: float = Field(default=50.0, ge=0)  # per key (or per client address without keys); 0: off
    api_rate_burst: int = Field(default=100, ge=1)
    api_result_wait_max_s: float = Field(default=30.0, ge=0)  # the longest ?wait= a request may hold
    # Request bodies read at once per process (a quarter of them at most chat bodies past 1 MiB, which
    # cost ~3.75x their size to read); more wait, then 503. README sizes the memory this takes.
    api_max_bodies: int = Field(default=8, ge=1)
    # A body must arrive within this of its turn to be read, or 408 (a trickling client holds a turn).
    api_body_timeout_s: float = Field(default=120.0, gt=0)
    # A request's line and headers must all arrive within this of its first byte, or the connection is
    # closed (a client trickling headers held a connection, before any key was asked for, for ever).
    api_header_timeout_s: float = Field(default=15.0, gt=0)
    # Past the body limit, this much more is read and dropped before closing, so a client that writes
    # its whole body before reading (urllib, requests) sees the 413 instead of a reset connection.
    api_drain_bytes: int = Field(default=128 * 1024 * 1024, ge=0)
    # Threads (and Redis connections) per API process for long-polls, apart from the request pool: each
    # waiting request holds one; more waiters queue for one, submissions never do.
    api_wait_threads: int = Field(default=256, ge=1)
    events_max: int = Field(default=100_000, ge=100)  # completion events kept in the Redis stream
    # --- the OpenAI-compatible routes of mrc-api (producer/openai/) ---
    # POST /v1/chat/completions waits this long for the answer (less when the client says it gives up
    # sooner), then answers 504 `answer_timeout` naming the job id; the job goes on.
    openai_wait_s: float = Field(default=60.0, gt=0, le=3600)
    # A chat request sent again by the same key within this many seconds, byte for byte and without
    # an Idempotency-Key (an SDK's retry after a 5xx or a lost answer), is the same job: it waits for
    # the first one's answer instead of queueing a second.
    openai_retry_window_s: float = Field(default=900.0, ge=0, le=86_400)
    # Streamed answers (`stream: true`): a worker publishes each streaming row's new text at most this
    # often (all its streaming rows in one Redis round trip), into a Redis stream per job that lives
    # this long after its last write.
    stream_interval_s: float = Field(default=0.05, ge=0.005, le=5)
    stream_ttl_s: int = Field(default=600, ge=10, le=86_400)
    ops_refresh_s: float = Field(
        default=5.0, ge=0.5, le=300
    )  # the ops page (GET /ops) reloads its data this often
    # Largest file POST /v1/files takes (OpenAI's own limit for batch input: 200 MB); at most 5 GiB,
    # what one S3 copy takes.
    openai_file_max_bytes: int = Field(default=200 * 1024 * 1024, ge=1, le=5 * 1024**3)
    openai_batch_max_lines: int = Field(default=50_000, ge=1)  # requests in one batch (OpenAI's: 50,000)
    # The completion window `24h` stands for: past it, a batch's unfinished requests end `expired`.
    # At most 7 days: a job's record lives that long after it ends, a batch's counts are read from them.
    openai_batch_window_s: float = Field(default=86_400.0, gt=0, le=7 * 86_400)
    # How often each mrc-api process looks after the batches in flight (resumes their enqueue after a
    # crash, expires them, writes their output files once every request has ended).
    openai_batch_poll_s: float = Field(default=5.0, gt=0, le=3600)
    # --- model (docs/contract.md) ---
    # `tiny` (random weights, built under `home`), `parcels` (trained, in workers/models/parcels/),
    # `echo` (no model), a local folder, or a hub id in the offline cache.
    model: str = "adept/fuyu-8b"
    quantization: Quantization = "nf4"
    device: str = "auto"
    home: str = Field(default_factory=_default_home)  # where the tiny Fuyu is built
    # MRC_MODEL=echo only: milliseconds each generated token takes (slept), a model of known speed for
    # tests and benchmarks whose premise is "this batch outlasts X" on a machine of any speed.
    echo_token_ms: float = Field(default=0.0, ge=0, le=10_000)
    # MRC_MODEL=echo only: a step with a prompt holding this text raises a device fault (a CUDA
    # error's text), for fault tests of the path a broken accelerator takes: give back, exit 70.
    echo_device_fault_on: str = Field(default="", max_length=200)

    # --- worker ---
    metrics_port: int = Field(default=9400, ge=0, le=65535)
    cache_ttl_s: int = Field(default=86400, ge=0)
    # A job taken by a worker that went silent (died) is delivered again this many seconds after the
    # worker's last heartbeat (shared/transport.py); a live worker keeps its jobs however long it runs.
    visibility_timeout_s: int = Field(default=900, ge=1)
    # How often each worker looks for messages whose visibility timeout ran out (kombu's default ~100 s).
    restore_interval_s: float = Field(default=10.0, gt=0)
    # Jobs per delivered batch (celery-batches flush_every, and the prefetch bound): the unit of claims,
    # cache look-ups and acks. The engine takes rows from every delivery in hand, not one at a time.
    batch_max_jobs: int = Field(default=16, ge=1)
    # The engine (workers/engine/): most rows in its running batch at once.
    model_batch_max_jobs: int = Field(default=16, ge=1)
    # Of those rows, how many backlog rows never take (kept for tickets, so none waits for a pause).
    engine_reserved_rows: int = Field(default=2, ge=0)
    # Backlog rows sit out decode steps (their cache kept) while tickets are in the engine: on the CPU a
    # step costs in proportion to its rows, so a ticket beside 14 backlog rows decodes ~2x slower
    # (docs/benchmarks.md); on a GPU a decode step is bound by reading the weights, so extra rows are
    # expected to cost little (not measured: no GPU yet). auto: on for the CPU, off for CUDA.
    engine_hold_backlog: Literal["auto", "on", "off"] = "auto"
    # Most prefill positions the engine computes at one step, all lanes: a longer prefill runs in chunks
    # (each attending to the positions already in its slot) with decode steps between them, so a ticket
    # that arrives waits for at most one step's chunk, not a 12 MP photo's whole prefill. Also the most
    # backlog prefill positions admitted at one step (one row always may). auto: 512 on the CPU, 1024
    # on CUDA (workers/engine/capacity.py prefill_tokens; docs/benchmarks.md).
    engine_prefill_tokens: Literal["auto"] | Annotated[int, Field(ge=16)] = "auto"
    # A job whose leading positions (the same photo from the same key, and the prompt's start) are in
    # the cache already (a running row's, or a finished row's slot not needed since) reuses them
    # instead of computing them again (workers/engine/prefix_index.py). off: every prefill is whole.
    engine_prefix_cache: Literal["on", "off"] = "on"
    # Decoded photos a worker keeps (MiB of the CPU's memory) for their next question: a photo asked
    # several things is fetched by each job but decoded and fitted once while kept (workers/
    # decoded_images.py; a tensor in a GPU's memory is not kept). 0: every job decodes its own.
    decoded_image_cache_mb: int = Field(default=256, ge=0)
    # The backlog's guaranteed share of the engine's slots and steps while tickets are in (workers/engine/
    # scheduler.py): up to that share of the slots its rows join running tickets and go before waiting
    # ones, and once admitted so are not paused for tickets; at that share of the steps (when it does
    # not move on its own) its held rows decode beside the tickets. 0: strict priority, under which a
    # steady stream of tickets starved the backlog. Default measured (docs/benchmarks.md).
    engine_backlog_share: float = Field(default=0.25, ge=0, le=1)
    # How a decode step runs (workers/engine/runner.py): `rows` as they are, each attending to its own
    # length (no padding); `fixed`, one call of bucketed shape over a prefix of the cache's slots of the
    # longest job (capturable); `pool`, one call of bucketed shape over the used part of a pool of
    # slots by need, each row masked to its own (capturable); auto: fixed on CUDA, rows on the CPU.
    engine_decode: Literal["auto", "rows", "fixed", "pool"] = "auto"
    # CUDA graphs for the fixed-shape steps, captured at warm-up (auto: on CUDA); off: eager steps.
    engine_cuda_graphs: Literal["auto", "off"] = "auto"
    # Full deliveries' worth of messages a worker holds: at most this many x MRC_BATCH_MAX_JOBS (one
    # thread each, so a ticket's delivery never waits for a thread), of which backlog ones never take
    # the last MRC_BATCH_MAX_JOBS (shared/transport.py, lane_limits).
    worker_deliveries: int = Field(default=3, ge=2, le=64)
    # celery-batches flush_interval: how long a lone job may wait for company
    batch_wait_ms: int = Field(default=50, ge=0, le=60_000)
    # Most cache positions the engine's running batch may reach (rows x the longest row at its limit,
    # image + prompt + new tokens); below it, what the free memory measured at warm-up holds.
    batch_token_budget: int = Field(default=65536, ge=1)
    # Not used by the engine (prefills are unpadded: alone, or with rows of the same length; decode
    # padding is a few positions per row): accepted so existing deployments keep starting.
    batch_max_padding: float = Field(default=0.20, ge=0.0, le=1.0)
    # Not used by the engine (it admits rows by cache room, not by per-length batch caps): accepted so
    # existing deployments keep starting.
    batch_calibrate: bool = True
    fetch_threads: int = Field(default=4, ge=1)
    # OpenMP threads of a model call on the CPU; 0: by the call's size, one for a small call, every
    # usable core for a large one but a core for each photo being decoded beside it (workers/
    # cpu_threads.py, measured in docs/benchmarks.md).
    cpu_threads: int = Field(default=0, ge=0, le=1024)
    # /healthz answers 503 after this long without progress while there is work (workers/liveness.py).
    # Above the longest engine step (a prefill, a decode step): each one is progress.
    stuck_after_s: float = Field(default=300.0, gt=0)
    # Jobs in a row the model may fail (model_error) before the worker calls itself unusable: it exits
    # without acking and its delivery goes to another worker, instead of failing the whole lane.
    model_failure_streak: int = Field(default=5, ge=1)
    max_attempts: int = Field(default=3, ge=1)  # deliveries of a job before a retryable fault is final
    retry_base_s: float = Field(default=1.0, ge=0)  # first retry delay; doubles per attempt, +-50 % jitter
    retry_max_s: float = Field(default=60.0, ge=0)
    # How long a job's S3 faults are waited out (retried without counting an attempt) from its first:
    # S3 away is no fault of the job's, and its result can only be stored there (shared/store_faults.py).
    store_outage_s: float = Field(default=900.0, ge=0, le=7 * 24 * 3600)
    # Default deadlines per lane, in seconds after submission (0: none); past it a job is `expired`.
    deadline_interactive_s: float = Field(default=0.0, ge=0)
    deadline_backlog_s: float = Field(default=0.0, ge=0)
    # Refuse to become ready unless a fast SDPA kernel (flash, memory-efficient, cuDNN) runs attention.
    require_fast_attention: bool = False
    attention: Literal["sdpa", "eager", "flash_attention_2"] = "sdpa"  # transformers' attn_implementation

    # --- job limits ---
    max_new_tokens_default: int = Field(default=64, ge=1)
    max_new_tokens_limit: int = Field(default=512, ge=1)
    max_prompt_chars: int = Field(default=8000, ge=1)
    # Structured answers (response_format): the largest schema or choice list, as compact JSON bytes,
    # and the most choices; compiled grammars kept per worker (by the format's hash).
    max_response_format_bytes: int = Field(default=16384, ge=64)
    max_choices: int = Field(default=64, ge=1)
    grammar_cache_size: int = Field(default=256, ge=1)
    grammar_cache_bytes: int = Field(default=512 * 2**20, ge=2**20)  # and at most this many bytes of them
    # The most characters one token of the served model's vocabulary decodes to: an answer of N tokens
    # holds at most N x this many, and a schema bound past that is refused at submission
    # (shared/schema_bounds.py). The worker logs MRC_TOKEN_CHARS_EXCEEDED when its vocabulary has a
    # longer token (then a few schemas an answer could just meet are refused, never the reverse).
    max_token_chars: int = Field(default=32, ge=1)
    # How long a job waits for its grammar's compile to run (workers/grammar_compiles.py) before it
    # fails `invalid_job`; the compile cannot be interrupted and finishes off the delivery's path.
    grammar_compile_timeout_s: float = Field(default=10.0, gt=0)
    max_prompt_tokens: int = Field(default=512, ge=1)
    truncate_prompts: bool = True
    max_image_bytes: int = Field(default=32 * 1024 * 1024, ge=1)
    max_image_pixels: int = Field(default=40_000_000, ge=1)
    # Cap on each side (pixels) after Fuyu's resize-to-fit; fewer patches = faster. 0 = Fuyu's own limits.
    max_image_side: int = Field(default=0, ge=0)

    # --- producer ---
    wait_poll_s: float = Field(default=0.1, gt=0)
    # Backpressure: submissions to the backlog lane wait (or fail with queue_full) above this depth, so a
    # million-line backlog never sits in Redis memory at once. Interactive submissions never wait.
    backlog_max_depth: int = Field(default=10_000, ge=1)
    # While several keys hold backlog jobs, each may hold the depth / their number, and one under its
    # share is let in over a full lane (shared/backlog_share.py); false: one depth, first come first in.
    backlog_key_shares: bool = True
    # A key holding fewer backlog jobs than this while another key has some has its next ones taken
    # ahead of the lane's others (shared/names.py AHEAD_STEP), while fewer than this many wait ahead in
    # all: its first job does not wait behind the depth of another's batch. 0: first in, first out.
    backlog_ahead_jobs: int = Field(default=8, ge=0, le=10_000)
    # How long `mrc backlog` waits out each outage of Redis or S3 once its run has begun (its enqueue
    # resumes where it was, its --wait goes on): a restart never ends a nightly run.
    backlog_outage_s: float = Field(default=300.0, ge=0, le=24 * 3600)
    # How long a command or a starting worker waits for Redis or S3 before it says which one it cannot
    # reach (exit 5), instead of retrying for half a minute.
    connect_timeout_s: float = Field(default=3.0, gt=0, le=300)

    log_level: LogLevel = "INFO"
    log_format: Literal["pipe", "json"] = "pipe"

    @field_validator("*")
    @classmethod
    def _number_bounded(cls, value: object, info: ValidationInfo) -> object:
        name = info.field_name or ""
        return rules.bounded_number(
            value, name, cls.model_fields[name].metadata if name in cls.model_fields else []
        )

    @field_validator("s3_region")
    @classmethod
    def _region_usable(cls, value: str) -> str:
        return rules.region(value)

    @field_validator("s3_bucket")
    @classmethod
    def _bucket_usable(cls, value: str) -> str:
        return rules.bucket(value)

    @field_validator("allowed_buckets")
    @classmethod
    def _buckets_usable(cls, value: list[str]) -> list[str]:
        return [rules.bucket(bucket) for bucket in value]

    @field_validator("s3_prefix")
    @classmethod
    def _prefix_ends_with_slash(cls, value: str) -> str:
        return value if not value or value.endswith("/") else value + "/"

    @field_validator("log_level", mode="before")
    @classmethod
    def _level_upper(cls, value: object) -> object:
        return value.upper() if isinstance(value, str) else value

    @field_validator("redis_url")
    @classmethod
    def _redis_url_usable(cls, value: str) -> str:
        return rules.redis_url(value)

    @field_validator("redis_sentinels")
    @classmethod
    def _sentinels_usable(cls, value: str) -> str:
        return rules.sentinels(value)

    @field_validator("api_key_sources")
    @classmethod
    def _key_sources_usable(cls, value: str) -> str:
        tenants.parse_sources(value)  # ValueError names the bad entry
        return value

    @property
    def key_sources(self) -> dict[str, tuple[tenants.Source, ...]]:
        """MRC_API_KEY_SOURCES read: owner (12 hex, or `*`) -> the sources it may name images from."""
        return tenants.parse_sources(self.api_key_sources)

    @field_validator("image_url_hosts")
    @classmethod
    def _url_hosts_usable(cls, value: str) -> str:
        url_hosts.parse(value)  # ValueError names the bad entry
        return value

    @field_validator("s3_endpoint_url")
    @classmethod
    def _endpoint_usable(cls, value: str) -> str:
        return rules.s3_endpoint(value)

    @field_validator("device")
    @classmethod
    def _device_known(cls, value: str) -> str:
        return rules.device(value)

    @model_validator(mode="after")
    def _limits_consistent(self) -> Settings:
        if not 1 <= self.max_new_tokens_default <= self.max_new_tokens_limit:
            raise ValueError("need 1 <= MRC_MAX_NEW_TOKENS_DEFAULT <= MRC_MAX_NEW_TOKENS_LIMIT")
        if self.retry_base_s > self.retry_max_s:
            raise ValueError("need MRC_RETRY_BASE_S <= MRC_RETRY_MAX_S")
        if self.redis_wait_timeout_ms > WAIT_TIMEOUT_CEILING_MS:
            raise ValueError(
                f"need MRC_REDIS_WAIT_TIMEOUT_MS <= {WAIT_TIMEOUT_CEILING_MS}: a longer WAIT outlasts the "
                f"Redis clients' socket timeout ({REDIS_SOCKET_TIMEOUT_S} s), whose retry would wait again"
            )
        if self.engine_decode in ("fixed", "pool") and self.attention == "flash_attention_2":
            # The fixed-shape steps hide each row's columns with a 4-D float mask; flash-attention's path
            # in transformers reads a mask as 2-D padding (1 = keep) and would attend to the hidden ones.
            raise ValueError(
                f"MRC_ENGINE_DECODE={self.engine_decode} cannot run with MRC_ATTENTION=flash_attention_2 "
                "(the step's 4-D mask); use rows, or auto (rows with flash-attention)"
            )
        if self.retry_max_s * 1.5 >= self.visibility_timeout_s:
            # A retry waits out its countdown unacked in a worker: past the visibility timeout it
            # would be handed out a second time. 1.5: the jitter's upper end.
            raise ValueError("need MRC_RETRY_MAX_S x 1.5 < MRC_VISIBILITY_TIMEOUT_S")
        return self

    @property
    def readable_buckets(self) -> frozenset[str]:
        return frozenset([self.s3_bucket, *self.allowed_buckets])

    @property
    def image_url_host_patterns(self) -> tuple[url_hosts.HostPattern, ...]:
        return url_hosts.parse(self.image_url_hosts)

    @property
    def image_sources(self) -> dict[str, str]:
        """Bucket -> the key prefix images must lie under: MRC_S3_PREFIX in our own bucket (so a job
        cannot read another tenant's objects there), anywhere in the further allowed buckets."""
        return {**{bucket: "" for bucket in self.allowed_buckets}, self.s3_bucket: self.s3_prefix}


ENV_PREFIX = "MRC_"


def unknown_variables(environ: Mapping[str, str] | None = None) -> list[str]:
    """MRC_ variables that name no setting: a misspelt one would otherwise be silently ignored."""
    known = {ENV_PREFIX + name.upper() for name in Settings.model_fields}
    env = os.environ if environ is None else environ
    return sorted(name for name in env if name.upper().startswith(ENV_PREFIX) and name.upper() not in known)


class BadSettings(ValueError):
    """The environment's settings cannot be used: one line naming each bad variable."""


def load() -> Settings:
    """The settings from the environment; BadSettings (one line) when a value is refused or cannot even
    be parsed (a JSON setting that is not JSON: review, a traceback from `mrc` and `mrc-worker`)."""
    try:
        return Settings()
    except ValidationError as exc:
        raise BadSettings(describe_error(exc)) from None
    except SettingsError as exc:
        field = re.search(r'field "(\w+)"', str(exc))
        name = ENV_PREFIX + field.group(1).upper() if field else "a setting"
        raise BadSettings(f'{name}: not valid JSON (a JSON list, e.g. ["photos"])') from None


def describe_error(exc: ValidationError) -> str:
    """One line per bad setting, named as the operator set it: `MRC_X=value: why`."""
    return rules.describe_error(exc, ENV_PREFIX)
