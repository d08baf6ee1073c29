"""The producer side installed as its users install it: `pip install '.[producer,api]'` into a fresh
virtualenv (no torch, no test packages), then every producer and shared module imported and the
commands run against a real Redis and S3 (`make producer-smoke`; CI runs it after the tests).

The test suite runs in .venv, which holds the worker's packages too: a module the producer needs but
does not declare (kombu's Redis transport imports `packaging`, declared only under kombu's `redis`
extra) is there by chance, and the tests never see it missing (review: every `mrc` command but two,
`Client` and `mrc-api` failed on import in a producer-only install).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

from scripts import devservices as services
from tests.support import imagegen

ROOT = Path(__file__).resolve().parents[1]
_IMPORT_ALL = """
import importlib, importlib.util, pkgutil, sys
assert importlib.util.find_spec("torch") is None, "torch is installed: not a producer-only install"
names = []
for package in ("shared", "producer"):
    module = importlib.import_module(package)
    names += [m.name for m in pkgutil.walk_packages(module.__path__, package + ".")]
for name in names:
    importlib.import_module(name)
print(len(names))
"""


def _run(cmd: list[str], env: dict[str, str] | None = None, code: int = 0, timeout: float = 120) -> str:
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    if done.returncode != code:
        raise SystemExit(f"{' '.join(cmd[:3])}: exit {done.returncode}, wanted {code}\n{done.stderr[-2000:]}")
    return done.stdout if code == 0 else done.stderr


def main(where: str) -> int:
    venv = Path(where).resolve()
    shutil.rmtree(venv, ignore_errors=True)
    _run([sys.executable, "-m", "venv", str(venv)])
    bin_ = venv / "bin"
    _run(
        [str(bin_ / "pip"), "install", "-q", "-c", str(ROOT / "constraints.txt"), f"{ROOT}[producer,api]"],
        timeout=900,
    )
    print(
        f"imported {_run([str(bin_ / 'python'), '-c', _IMPORT_ALL], env={'PATH': str(bin_)}).strip()} modules"
    )
    work = Path(tempfile.mkdtemp(prefix="mrc-producer-smoke-"))
    with services.local_stack("mrc-producer-smoke-", "mrc-smoke", work / "home") as env:
        env = {**env, "PATH": f"{bin_}:/usr/bin:/bin", "MRC_API_PORT": str(services.free_port())}
        photo = work / "parcel.jpg"
        photo.write_bytes(imagegen.photo(64, 48))
        job = _run([str(bin_ / "mrc"), "submit", "--image", str(photo), "--prompt", "Damaged?"], env).split()[
            0
        ]
        status = json.loads(_run([str(bin_ / "mrc"), "status", job], env))
        assert status["state"] == "queued", status
        manifest = work / "night.jsonl"
        lines = [{"custom_id": f"q{n}", "image": str(photo), "prompt": f"Question {n}?"} for n in range(2)]
        manifest.write_text("".join(json.dumps(line) + "\n" for line in lines))
        _run([str(bin_ / "mrc"), "backlog", str(manifest), "--run-id", "smoke-1"], env)
        said = _run([str(bin_ / "mrc-worker")], env, code=2)
        assert "'.[worker]'" in said, said
        api = subprocess.Popen(
            [str(bin_ / "mrc-api")], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        try:
            url = f"http://127.0.0.1:{env['MRC_API_PORT']}/readyz"
            services.wait_for(
                lambda: urllib.request.urlopen(url, timeout=2).status == 200, 60, "mrc-api", api
            )
        finally:
            api.terminate()
            api.wait(timeout=30)
    shutil.rmtree(work, ignore_errors=True)
    print(
        "producer-only install: mrc submit, status, backlog and mrc-api work; mrc-worker says what to install"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else ".cache/producer-smoke"))
