"""The one Settings object. This module is the only reader of the environment (prefix MRC_)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

Quantization = Literal["nf4", "bf16", "fp16", "fp32"]


def _default_home() -> str:
    return str(Path.home() / ".cache" / "mrc")


class Settings(BaseSettings):
    """Every knob of mrc, typed. Documented one by one in README.md."""

    model_config = SettingsConfigDict(env_prefix="MRC_", extra="ignore", frozen=True)

    # --- services (CONTRACT.md) ---
    redis_url: str = "redis://127.0.0.1:6379/0"
    s3_endpoint_url: str = ""
    s3_bucket: str = "mrc"
    s3_prefix: str = ""
    s3_region: str = "us-east-1"
    # Buckets besides s3_bucket that jobs may read images from; anything else is image_source_forbidden.
    allowed_buckets: list[str] = Field(default_factory=list)

    # --- model (CONTRACT.md) ---
    model: str = "adept/fuyu-8b"
    quantization: Quantization = "nf4"
    device: str = "auto"
    home: str = Field(default_factory=_default_home)  # where the tiny Fuyu is built

    # --- worker ---
    metrics_port: int = 9400
    cache_ttl_s: int = 86400
    # A job taken by a worker that died is delivered again after this many seconds. It must exceed the
    # longest batch (batch_max_jobs x max_new_tokens_limit decode steps of Fuyu-8B is well under 5 min on
    # a 24 GB card), or a slow batch is delivered twice; larger only slows recovery from a dead worker.
    visibility_timeout_s: int = 900
    # How often each worker looks for messages whose visibility timeout ran out (kombu's default ~100 s).
    restore_interval_s: float = 10.0
    # Jobs per delivered batch (celery-batches flush_every, and the prefetch bound). Two model batches
    # worth, so the pool decodes the second and writes the first's results while the model runs.
    batch_max_jobs: int = 16
    model_batch_max_jobs: int = 8  # jobs per model batch, within the token budget
    batch_wait_ms: int = 50  # celery-batches flush_interval: how long a lone job may wait for company
    # Most padded sequence positions (jobs x longest job, image + prompt + new tokens) in one model batch.
    batch_token_budget: int = 65536
    fetch_threads: int = 4
    max_attempts: int = 3  # deliveries of a job before a retryable fault becomes its result
    retry_base_s: float = 1.0  # first retry delay; doubles per attempt, with +-50 % jitter
    retry_max_s: float = 60.0
    # Default deadlines per lane, in seconds after submission (0: none); past it a job is `expired`.
    deadline_interactive_s: float = 0.0
    deadline_backlog_s: float = 0.0
    # Refuse to become ready unless a fast SDPA kernel (flash, memory-efficient, cuDNN) runs attention.
    require_fast_attention: bool = False
    attention: Literal["sdpa", "eager", "flash_attention_2"] = "sdpa"  # transformers' attn_implementation

    # --- job limits ---
    max_new_tokens_default: int = 64
    max_new_tokens_limit: int = 512
    max_prompt_chars: int = 8000
    max_prompt_tokens: int = 512
    truncate_prompts: bool = True
    max_image_bytes: int = 32 * 1024 * 1024
    max_image_pixels: int = 40_000_000
    # Cap on each side (pixels) after Fuyu's resize-to-fit; fewer patches = faster. 0 = Fuyu's own limits.
    max_image_side: int = 0

    # --- producer ---
    wait_poll_s: float = 0.1
    # Backpressure: submissions to the backlog lane wait (or fail with queue_full) above this depth, so a
    # million-line backlog never sits in Redis memory at once. Interactive submissions never wait.
    backlog_max_depth: int = 10_000

    log_level: str = "INFO"

    @field_validator("s3_prefix")
    @classmethod
    def _prefix_ends_with_slash(cls, value: str) -> str:
        return value if not value or value.endswith("/") else value + "/"

    @field_validator("device")
    @classmethod
    def _device_known(cls, value: str) -> str:
        if value in ("auto", "cpu", "cuda") or (value.startswith("cuda:") and value[5:].isdigit()):
            return value
        raise ValueError("MRC_DEVICE must be auto, cpu, cuda or cuda:N")

    @model_validator(mode="after")
    def _limits_consistent(self) -> Settings:
        if not 1 <= self.max_new_tokens_default <= self.max_new_tokens_limit:
            raise ValueError("need 1 <= MRC_MAX_NEW_TOKENS_DEFAULT <= MRC_MAX_NEW_TOKENS_LIMIT")
        if self.batch_max_jobs < 1 or self.batch_wait_ms < 0:
            raise ValueError("MRC_BATCH_MAX_JOBS must be >= 1 and MRC_BATCH_WAIT_MS >= 0")
        return self

    @property
    def readable_buckets(self) -> frozenset[str]:
        return frozenset([self.s3_bucket, *self.allowed_buckets])

    @property
    def image_sources(self) -> dict[str, str]:
        """Bucket -> the key prefix images must lie under: MRC_S3_PREFIX in our own bucket (so a job
        cannot read another tenant's objects there), anywhere in the further allowed buckets."""
        return {**{bucket: "" for bucket in self.allowed_buckets}, self.s3_bucket: self.s3_prefix}
