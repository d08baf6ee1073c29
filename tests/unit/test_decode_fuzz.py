"""Randomly mangled images through the real decoders, in a child process so that a native crash fails
this test instead of killing the test run. Every input must decode or raise an MrcError: a segfault in
a worker would take down its batch and, redelivered, every worker after it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from scripts.devservices import ROOT

SCRIPT = """
import io, random, sys
sys.path.insert(0, {root!r})
from PIL import Image
from shared.errors import MrcError
from tests.support import imagegen
from workers import images

fmt, seed = sys.argv[1], int(sys.argv[2])
rng = random.Random(seed)
if fmt == "gif":
    out = io.BytesIO(); Image.new("RGB", (96, 64), (1, 2, 3)).save(out, format="GIF"); base = out.getvalue()
else:
    base = imagegen.photo(96, 64, fmt={{"jpg": "JPEG", "png": "PNG", "webp": "WEBP"}}[fmt])
decoded = failed = 0
for _ in range(250):
    data = bytearray(base)
    for _ in range(rng.randint(1, 8)):
        data[rng.randrange(8, len(data))] = rng.randrange(256)
    if rng.random() < 0.3:
        data = data[: rng.randrange(10, len(data))]
    try:
        images.load(bytes(data), 10**7)
        decoded += 1
    except MrcError:
        failed += 1
print(decoded, failed)
"""


@pytest.mark.parametrize("fmt", ["jpg", "png", "webp", "gif"])
def test_mangled_images_decode_or_fail_cleanly(fmt: str) -> None:
    code = SCRIPT.format(root=str(ROOT))
    done = subprocess.run(
        [sys.executable, "-c", code, fmt, "11"], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    decoded, failed = map(int, done.stdout.split())
    assert decoded + failed == 250
    assert failed > 0
