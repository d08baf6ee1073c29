"""The pipeline a team writes first, for bench_throughput.py to race against: one Celery task per job,
PIL decode and FuyuProcessor on the CPU, generate at batch 1, result JSON to S3. Same model loader,
same quantization, same images, same Redis and S3 as ours.

    celery -A tests.bench.naive_worker worker --pool solo -c 1 -Q naive
"""

from __future__ import annotations

import io
import json
import os
import time
from functools import lru_cache
from typing import Any

import boto3
import torch
from celery import Celery
from PIL import Image

from shared.settings import Settings

app = Celery("naive", broker=os.environ["MRC_REDIS_URL"])
app.conf.update(task_serializer="json", accept_content=["json"], task_ignore_result=True, task_acks_late=True)


@lru_cache(maxsize=1)
def _model() -> tuple[Any, Any]:
    from workers.backends.fuyu import FuyuBackend

    backend = FuyuBackend(Settings())
    backend.load()
    return backend.model, backend.processor


@lru_cache(maxsize=1)
def _s3() -> Any:
    return boto3.client("s3", endpoint_url=os.environ["MRC_S3_ENDPOINT_URL"], region_name="us-east-1")


@app.task(name="naive.infer")
def infer(job_id: str, bucket: str, key: str, prompt: str, max_new_tokens: int) -> None:
    model, processor = _model()
    data = _s3().get_object(Bucket=bucket, Key=key)["Body"].read()
    image = Image.open(io.BytesIO(data)).convert("RGB")
    inputs = processor(text=[prompt], images=[image], return_tensors="pt", return_legacy_image_output=False)
    inputs["pixel_values"] = inputs["pixel_values"].to(model.dtype)
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    text = processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    body = json.dumps(
        {"job_id": job_id, "status": "succeeded", "text": text, "finished_at": time.time()}
    ).encode()
    _s3().put_object(Bucket=bucket, Key=f"naive/{job_id}.json", Body=body)


if os.environ.get("NAIVE_PRELOAD"):
    _model()
