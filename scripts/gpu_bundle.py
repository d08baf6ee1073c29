"""Builds gpu-bundle/: the wheels the GPU proving ground (scripts/gpu_checks.sh) needs that the GPU
machine lacks, for its Python (CPython 3.12, manylinux x86_64), small enough to travel with the working
tree (at most 56 MiB together: 64 MiB can be copied to that machine, and it has no network).

What the machine has is used from there (DEVICE_HAS: torch 2.11 + CUDA 13.0, torchvision, numpy, pillow,
tokenizers, safetensors, accelerate, prometheus-client, pytest, and what those depend on). Everything
the proving ground imports beyond that is bundled, at constraints.txt's versions, except:
- transformers is bundled although the machine has 5.17: the project's code needs 5.2x (5.17's Fuyu
  takes `image_patches`, not `pixel_values`; tried with the machine's versions on the CPU);
- huggingface-hub 1.33.0, not constraints.txt's 2.4.0: transformers 5.24 needs >= 1.31, and 2.x needs
  httpx2, a stack the machine does not have; 1.33 runs on the machine's httpx;
- bitsandbytes is cut down to its Python files, the CUDA 13.0 library and the CPU one (the CPU smoke
  run): its wheel holds ~20 CUDA / ROCm / XPU libraries (43 MB packed, 125 MB installed).
The project's own code is not bundled: it travels as the working tree, and runs from there.
celery, kombu, redis and boto3 are not needed: nothing the proving ground runs imports them.

    python3 scripts/gpu_bundle.py [--out gpu-bundle]            (make gpu-bundle)
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import re
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
except ImportError:  # pip's own copy: the builder needs nothing beyond Python and pip
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
LIMIT_MIB = 56
PYTHON = "3.12"
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_17_x86_64",
)
# The GPU machine's Python, for evaluating requirement markers.
TARGET_ENV = {
    "python_version": PYTHON,
    "python_full_version": PYTHON + ".0",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "extra": "",
}
# What the GPU machine has (its documentation), and what those packages themselves depend on.
DEVICE_HAS = frozenset(
    canonicalize_name(name)
    for name in (
        "torch", "torchvision", "triton", "numpy", "pillow", "tokenizers", "safetensors", "accelerate",
        "prometheus-client", "pytest", "iniconfig", "pluggy", "pygments", "packaging", "pyyaml", "regex",
        "tqdm", "filelock", "fsspec", "jinja2", "markupsafe", "sympy", "mpmath", "networkx", "psutil",
        "typer", "click", "httpx", "hf-xet", "setuptools",
    )
)  # fmt: skip


@dataclass(frozen=True)
class Wanted:
    name: str
    why: str
    version: str | None = None  # None: constraints.txt's
    keep: tuple[str, ...] = ()  # binary members kept when the wheel is cut down (others dropped)


BUNDLE = (
    Wanted("transformers", "Fuyu with pixel_values (the machine's 5.17 predates it)"),
    Wanted("huggingface-hub", "transformers 5.24 needs >= 1.31, on the machine's httpx", version="1.33.0"),
    Wanted(
        "bitsandbytes",
        "NF4",
        keep=("bitsandbytes/libbitsandbytes_cuda130.so", "bitsandbytes/libbitsandbytes_cpu.so"),
    ),
    Wanted("xgrammar", "structured answers: the grammar mask"),
    Wanted("apache-tvm-ffi", "xgrammar's runtime"),
    Wanted("pydantic", "shared/settings.py, shared/response_format.py"),
    Wanted("pydantic-core", "pydantic"),
    Wanted("pydantic-settings", "shared/settings.py"),
    Wanted("python-dotenv", "pydantic-settings"),
    Wanted("annotated-types", "pydantic"),
    Wanted("typing-inspection", "pydantic"),
    Wanted("typing-extensions", "pydantic needs >= 4.16"),
    Wanted("structlog", "shared/logs.py (tests/conftest.py, the capture's warning)"),
    Wanted("jsonschema", "shared/schema_rules.py"),
    Wanted("jsonschema-specifications", "jsonschema"),
    Wanted("referencing", "jsonschema"),
    Wanted("rpds-py", "jsonschema"),
    Wanted("attrs", "jsonschema"),
    Wanted("nvidia-ml-py", "GPU telemetry (tests/gpu)"),
    Wanted("simplejpeg", "JPEG decoded on the CPU (workers/jpeg_decode.py): tests/gpu, the CPU smoke"),
    Wanted("pytest-timeout", "pyproject.toml's `timeout` option (tests/gpu)"),
)


def pins(constraints: Path) -> dict[str, str]:
    """constraints.txt's `name==version` lines, by canonical name."""
    out = {}
    for line in constraints.read_text().splitlines():
        line = line.split("#")[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            out[canonicalize_name(name)] = version.strip()
    return out


def versions(wanted: tuple[Wanted, ...], pinned: dict[str, str]) -> dict[str, str]:
    """The version of each wheel to bundle: its own, else constraints.txt's (which must have it)."""
    out = {}
    for item in wanted:
        version = item.version or pinned.get(canonicalize_name(item.name))
        if version is None:
            raise SystemExit(f"{item.name}: not pinned in constraints.txt and no version given in BUNDLE")
        out[canonicalize_name(item.name)] = version
    return out


def wheel_name_version(path: Path) -> tuple[str, str]:
    name, version = path.name.split("-")[:2]
    return canonicalize_name(name), version


def requirements(wheel: Path) -> list[str]:
    """The wheel's Requires-Dist lines."""
    with zipfile.ZipFile(wheel) as archive:
        metadata = next(n for n in archive.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n))
        text = archive.read(metadata).decode()
    return [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Requires-Dist:")]


def unmet(wheel_requires: dict[str, list[str]], bundled: dict[str, str], device: frozenset[str]) -> list[str]:
    """Requirements (those that apply on the GPU machine, extras aside) that neither the bundle nor the
    machine satisfies: a missing package, or a bundled one at a version outside the range."""
    problems = []
    for owner, lines in sorted(wheel_requires.items()):
        for line in lines:
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate(TARGET_ENV):
                continue
            name = canonicalize_name(req.name)
            if name in bundled:
                if not req.specifier.contains(bundled[name], prereleases=True):
                    problems.append(f"{owner} needs {line}; the bundle has {name} {bundled[name]}")
            elif name not in device:
                problems.append(f"{owner} needs {line}: neither bundled nor on the GPU machine")
    return problems


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def cut(wheel: Path, keep: tuple[str, ...], out: Path) -> list[str]:
    """A copy of `wheel` at `out` without its shared libraries other than `keep`, RECORD rewritten to
    match. Returns the members dropped."""
    dropped, kept = [], []
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as target:
        record = next(n for n in source.namelist() if n.endswith(".dist-info/RECORD"))
        for member in source.infolist():
            name = member.filename
            if name == record:
                continue
            if name.endswith(".so") and name not in keep:
                dropped.append(name)
                continue
            data = source.read(member)
            target.writestr(member, data)
            kept.append(f"{name},{_record_hash(data)},{len(data)}")
        target.writestr(record, "\n".join([*kept, f"{record},,"]) + "\n")
    missing = set(keep) - {line.split(",")[0] for line in kept}
    if missing:
        raise SystemExit(f"{wheel.name}: {sorted(missing)} not in the wheel")
    return dropped


def download(specs: list[str], cache: Path) -> None:
    """cp312 manylinux wheels (or pure ones) into `cache`; files already there are not fetched again."""
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:"]
    command += ["--python-version", PYTHON, "--implementation", "cp", "--dest", str(cache)]
    for platform in PLATFORMS:
        command += ["--platform", platform]
    done = subprocess.run([*command, *specs], stderr=subprocess.PIPE, text=True, check=False)
    # this machine's pip names its local wheel folders in a warning per package: noise here
    sys.stderr.write("".join(f"{line}\n" for line in done.stderr.splitlines() if "is ignored" not in line))
    if done.returncode:
        raise SystemExit(f"pip download failed ({done.returncode})")


def tree_bytes(root: Path) -> int:
    """What the working tree sends: tracked files and untracked ones git does not ignore."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root, capture_output=True, check=True,
    ).stdout.decode()  # fmt: skip
    return sum((root / p).stat().st_size for p in set(listed.split("\0")) if p and (root / p).is_file())


def build(out: Path, cache: Path) -> dict[str, object]:
    wanted = versions(BUNDLE, pins(ROOT / "constraints.txt"))
    cache.mkdir(parents=True, exist_ok=True)
    download([f"{name}=={version}" for name, version in wanted.items()], cache)
    found = {wheel_name_version(p): p for p in cache.glob("*.whl")}
    shutil.rmtree(out, ignore_errors=True)
    (out / "wheels").mkdir(parents=True)
    entries, requires = [], {}
    for item in BUNDLE:
        name = canonicalize_name(item.name)
        source = found[(name, wanted[name])]
        target = out / "wheels" / source.name
        dropped = cut(source, item.keep, target) if item.keep else []
        if not item.keep:
            shutil.copyfile(source, target)
        requires[name] = requirements(target)
        entries.append(
            {"name": name, "version": wanted[name], "file": target.name, "bytes": target.stat().st_size,
             "sha256": hashlib.sha256(target.read_bytes()).hexdigest(), "why": item.why,
             "dropped": len(dropped)}
        )  # fmt: skip
    problems = unmet(requires, wanted, DEVICE_HAS)
    if problems:
        raise SystemExit("the bundle would not import on the GPU machine:\n  " + "\n  ".join(problems))
    manifest = {
        "python": PYTHON,
        "platforms": list(PLATFORMS),
        "device_has": sorted(DEVICE_HAS),
        "wheels": entries,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "gpu-bundle")
    parser.add_argument("--cache", type=Path, default=ROOT / ".cache" / "gpu-wheels", help="downloads, kept")
    args = parser.parse_args()
    manifest = build(args.out, args.cache)
    bundle = sum(p.stat().st_size for p in args.out.rglob("*") if p.is_file())
    tree = tree_bytes(ROOT)
    total = (bundle + tree) / 2**20
    print(f"{args.out}: {len(manifest['wheels'])} wheels, {bundle / 2**20:.1f} MiB")  # type: ignore[arg-type]
    print(f"working tree: {tree / 2**20:.1f} MiB; together {total:.1f} MiB (limit {LIMIT_MIB} MiB)")
    if total > LIMIT_MIB:
        raise SystemExit(f"over the limit by {total - LIMIT_MIB:.1f} MiB")


if __name__ == "__main__":
    main()
