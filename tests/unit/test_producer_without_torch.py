"""The producer side must run where torch is not installed."""

from __future__ import annotations

import subprocess
import sys

BLOCK = """
import sys
class _NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "torchvision", "transformers", "kornia", "bitsandbytes"):
            raise ImportError("blocked: " + name)
        return None
sys.meta_path.insert(0, _NoTorch())
import producer.cli, producer.client, shared.stores.s3, shared.celery_app, shared.logs
import producer.backlog.run, producer.backlog.cli, producer.backlog.manifest, shared.runs
import producer.backlog.progress
import producer.server, producer.openai.routes, shared.usage  # mrc-api ('.[producer,api]'), its OpenAI routes
rc = producer.cli.main(["submit", "--image", "/no/such/file.jpg", "--prompt", "hi"])
print("rc", rc)
rc = producer.cli.main(["backlog", "/no/such/manifest.jsonl"])
print("rc", rc)
"""


def test_producer_imports_and_validates_without_torch() -> None:
    done = subprocess.run(
        [sys.executable, "-c", BLOCK], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["rc", "2", "rc", "2"]
    assert "image file not found" in done.stderr
    assert "manifest not found" in done.stderr
