"""mrc-api's peak memory (VmHWM of a real mrc-api process) at the default limits, under the loads that
cost it most: chat requests each carrying a largest image as a base64 `data:` URL (MRC_MAX_IMAGE_BYTES,
32 MiB: a 43 MiB body), image URL fetches of the largest image held open by the server, and both at
once, from four keys (each key takes at most half of the body turns and 4 fetches); and the hostile
shapes: chat bodies of 15 million `{}` (45 MB, refused for their count of values since review
helper-97; 3.4 GB each before) and a batch whose input lines are such bodies. Printed beside the limit
deploy/k8s/api.yaml gives the API. No worker: each chat ends 504 once its job is queued.

    .venv/bin/python tests/bench/bench_api_memory.py [--only WORDS]   # loads whose name holds WORDS
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from scripts import devservices as services  # noqa: E402 - after sys.path is set
from tests.support import imagegen  # noqa: E402 - after sys.path is set

KEYS = [f"k-bench-memory-{i}" for i in range(4)]
IMAGE_BYTES = 32 * 1024 * 1024  # MRC_MAX_IMAGE_BYTES's default
LIMIT_MIB = 1536  # deploy/k8s/api.yaml


def _image() -> bytes:
    photo = imagegen.photo(640, 480)
    return photo + b"\0" * (IMAGE_BYTES - len(photo))  # a JPEG whose trailing bytes nobody reads


class _Held(BaseHTTPRequestHandler):
    """The image, all but its last byte at once, the last once the bench lets go: every fetch holds
    its body in memory at the same moment."""

    image = b""
    arrived: ClassVar[list[str]] = []
    release = threading.Event()

    def log_message(self, *_: Any) -> None:
        pass

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.image)))
        self.end_headers()
        self.wfile.write(self.image[:-1])
        self.wfile.flush()
        self.arrived.append(self.path)
        self.release.wait(120)
        self.wfile.write(self.image[-1:])


def _peak_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _chat(url: str, key: str, body: Path) -> str:
    done = subprocess.run(
        ["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "-H", f"Authorization: Bearer {key}",
         "-H", "Content-Type: application/json", "--data-binary", f"@{body}", f"{url}/v1/chat/completions"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    return done.stdout


def _batch(url: str, key: str, lines: Path) -> str:
    """Upload the file, create a batch of it, and wait until its lines are read (it fails: none valid)."""
    auth = ["-H", f"Authorization: Bearer {key}"]
    upload = ["-F", "purpose=batch", "-F", f"file=@{lines}"]
    sent = subprocess.run(["curl", "-s", *auth, *upload, f"{url}/v1/files"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    create = {"input_file_id": json.loads(sent.stdout)["id"], "endpoint": "/v1/chat/completions",
              "completion_window": "24h"}  # fmt: skip
    as_json = ["-H", "Content-Type: application/json", "-d", json.dumps(create)]
    made = subprocess.run(["curl", "-s", *auth, *as_json, f"{url}/v1/batches"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    batch_id = json.loads(made.stdout)["id"]

    def status() -> str:
        done = subprocess.run(["curl", "-s", *auth, f"{url}/v1/batches/{batch_id}"],
                              capture_output=True, text=True, check=True)  # fmt: skip
        return str(json.loads(done.stdout)["status"])

    services.wait_for(
        lambda: status() not in ("validating", "in_progress", "finalizing"), 600, "the batch read"
    )
    return status()


def _run(env: dict[str, str], load: Callable[[str], list[str]]) -> tuple[float, list[str]]:
    port = services.free_port()
    settings = {
        **env,
        "MRC_API_PORT": str(port),
        "MRC_API_KEYS": ",".join(hashlib.sha256(k.encode()).hexdigest() for k in KEYS),
        "MRC_API_RATE_PER_S": "0",
        "MRC_OPENAI_WAIT_S": "1",
    }
    api = subprocess.Popen(
        [str(services.BIN / "mrc-api")], env=settings, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    url = f"http://127.0.0.1:{port}"
    try:
        services.wait_for(lambda: _up(url), 60, "mrc-api", api)
        codes = load(url)
        return _peak_mib(api.pid), sorted(codes)
    finally:
        api.terminate()
        api.wait(30)


def _up(url: str) -> bool:
    done = subprocess.run(["curl", "-sf", f"{url}/healthz"], capture_output=True, check=False)
    return done.returncode == 0


def _parallel(calls: list[Callable[[], str]]) -> list[str]:
    out: list[str] = []
    threads = [threading.Thread(target=lambda c=call: out.append(c())) for call in calls]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", default="", help="run only the loads whose name holds this")
    only = parser.parse_args().only
    image = _image()
    _Held.image = image
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Held)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    fetch_url = f"http://localhost:{server.server_address[1]}/parcel.jpg"
    work = Path(tempfile.mkdtemp(prefix="bench-api-memory-"))

    def chat_body(url: str, name: str) -> Path:
        content = [{"type": "text", "text": "Refund?"}, {"type": "image_url", "image_url": {"url": url}}]
        path = work / name
        path.write_text(json.dumps({"model": "tiny", "messages": [{"role": "user", "content": content}]}))
        return path

    inline = chat_body("data:image/jpeg;base64," + base64.b64encode(image).decode(), "inline.json")
    hostile = work / "hostile.json"
    hostile.write_bytes(b'{"model": "tiny", "messages": [' + b"{}," * 14_999_999 + b"{}]}")
    hostile_lines = work / "hostile.jsonl"
    with hostile_lines.open("wb") as out:
        for n in range(4):
            line = b'{"custom_id": "c%d", "method": "POST", "url": "/v1/chat/completions", "body": ' % n
            out.write(line + hostile.read_bytes() + b"}\n")
    by_url = chat_body(fetch_url, "url.json")
    del image

    def chats(url: str) -> list[Callable[[], str]]:
        return [lambda k=KEYS[i % 4]: _chat(url, k, inline) for i in range(8)]

    def fetches(url: str) -> list[Callable[[], str]]:
        return [lambda k=KEYS[i % 4]: _chat(url, k, by_url) for i in range(16)]

    def held(calls: list[Callable[[], str]], expected: int) -> list[str]:
        _Held.arrived.clear()
        _Held.release.clear()
        result: list[str] = []
        runner = threading.Thread(target=lambda: result.extend(_parallel(calls)))
        runner.start()
        services.wait_for(lambda: len(_Held.arrived) >= expected, 120, "every fetch under way")
        _Held.release.set()
        runner.join()
        return result

    loads: dict[str, Callable[[str], list[str]]] = {
        "8 chats, 32 MiB data: URL each": lambda url: _parallel(chats(url)),
        "16 image URL fetches of 32 MiB": lambda url: held(fetches(url), 16),
        "both at once": lambda url: held([*chats(url), *fetches(url)], 16),
        "hostile: 8 chats of 15 million {}": lambda url: _parallel(
            [lambda k=KEYS[i % 4]: _chat(url, k, hostile) for i in range(8)]
        ),
        "hostile: a batch of 4 such lines": lambda url: [_batch(url, KEYS[0], hostile_lines)],
    }
    with services.local_stack("bench-api-memory-", "bench-api-memory", work / "home") as env:
        env = {**env, "MRC_IMAGE_URL_HOSTS": "localhost", "MRC_IMAGE_URL_PRIVATE": "true"}
        print(f"{'load':<36} {'peak RSS (MiB)':>15} {'of the limit':>13}  answers")
        for name, load in loads.items():
            if only not in name:
                continue
            peak, codes = _run(env, load)
            print(f"{name:<36} {peak:>15.0f} {peak / LIMIT_MIB:>12.0%}  {' '.join(codes)}")
    server.shutdown()


if __name__ == "__main__":
    main()
