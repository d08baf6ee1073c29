"""`rediss://` end to end against a real TLS-only redis-server (certificates made by the test): the
producer's publish, the worker's consumer (Celery's broker, which ignored the scheme and connected in
clear text before), records, claims and results all go over TLS, with the server's certificate
verified against the CA the URL names."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from scripts import devservices as services
from scripts.devservices import run_cli
from tests.support import imagegen, tls

pytestmark = pytest.mark.integration


@pytest.fixture
def tls_env(tmp_path: Path, env: dict[str, str]) -> Iterator[dict[str, str]]:
    certificates = tls.make(tmp_path / "certs")
    redis = services.start_redis(tmp_path / "redis", tls=certificates)
    # A plain rediss:// URL, the CA trusted the way a host trusts one (OpenSSL's SSL_CERT_FILE): what
    # an operator writes. (A URL with ?ssl_ca_certs= took kombu's TLS path even before the fix.)
    url = redis.url.split("?")[0]
    yield {**env, "MRC_REDIS_URL": url, "MRC_MODEL": "echo", "SSL_CERT_FILE": str(certificates.ca)}
    redis.stop()


def test_a_job_goes_through_a_tls_only_redis(tls_env: dict[str, str], tmp_path: Path) -> None:
    port = int(tls_env["MRC_REDIS_URL"].split(":")[2].split("/")[0])
    with socket.create_connection(("127.0.0.1", port), timeout=2) as plain:
        plain.sendall(b"PING\r\n")
        try:
            reply = plain.recv(16)
        except ConnectionResetError:
            reply = b""
        assert not reply.startswith(b"+PONG")  # no clear text on this port
    photo = tmp_path / "p.jpg"
    photo.write_bytes(imagegen.photo(64, 48, seed=5))
    worker = services.start_worker(tls_env, tmp_path / "worker.log")
    try:
        done = run_cli(
            tls_env, "submit", "--image", str(photo), "--prompt", "Refund?", "--wait", "--timeout", "60"
        )
        assert done.returncode == 0, (done.stderr, worker.log_path.read_text()[-3000:])
        assert json.loads(done.stdout)["status"] == "succeeded"
    finally:
        worker.stop()
    untrusted = {k: v for k, v in tls_env.items() if k != "SSL_CERT_FILE"}
    unverified = run_cli(untrusted, "submit", "--image", str(photo), "--prompt", "Refund?")
    assert unverified.returncode == 5, unverified.stderr  # a certificate nobody vouched for: refused
