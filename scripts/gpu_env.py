"""The GPU proving ground's first step (scripts/gpu_checks.sh): install gpu-bundle/ into a folder of its
own, then report what the run really has (Python, torch, CUDA, the GPU, where each package came from)
and whether the bundle's requirements hold with the machine's own packages. Standard library only
until the bundle is installed (`packaging` comes with transformers on the machine).

    python3 scripts/gpu_env.py install SITE gpu-bundle        pip --target, or unzip where pip is missing
    PYTHONPATH=SITE:. python3 scripts/gpu_env.py report --bundle gpu-bundle --json F
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata as md
import json
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

# What the proving ground's steps import, checked here so a missing piece fails first, by name.
MODULES = (
    "torch", "torchvision", "transformers", "bitsandbytes", "xgrammar", "pydantic_settings", "structlog",
    "jsonschema", "pynvml", "shared.settings", "workers.backends.fuyu", "workers.grammar",
    "workers.engine.runner", "workers.images", "workers.gpu_metrics", "tests.support.imagegen",
)  # fmt: skip
# Without these no step can run; without the others (bitsandbytes, xgrammar, NVML) some still can.
ESSENTIAL = {"torch", "transformers", "shared.settings", "workers.backends.fuyu", "workers.engine.runner"}
PARTLY_READY = 3
VERSIONS = (
    "torch", "torchvision", "transformers", "huggingface-hub", "tokenizers", "safetensors", "accelerate",
    "bitsandbytes", "xgrammar", "apache-tvm-ffi", "pydantic", "numpy", "pillow", "pytest", "triton",
)  # fmt: skip


def install(site: Path, bundle: Path) -> None:
    wheels = sorted((bundle / "wheels").glob("*.whl"))
    if not wheels:
        raise SystemExit(f"no wheels in {bundle}/wheels: run `make gpu-bundle` and bring gpu-bundle/ along")
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps"]
    done = subprocess.run([*command, "--target", str(site), *map(str, wheels)], check=False)
    if done.returncode == 0:
        print(f"installed {len(wheels)} wheels into {site} with pip")
        return
    print("pip did not install the bundle: unpacking the wheels instead", flush=True)
    for wheel in wheels:  # a wheel is a zip of its installed files (none here carries .data/ payloads)
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(site)
    print(f"unpacked {len(wheels)} wheels into {site}")


def _origin(name: str, site: Path | None) -> dict[str, str]:
    try:
        dist = md.distribution(name)
    except md.PackageNotFoundError:
        return {"version": "absent"}
    where = str(dist.locate_file(""))
    bundled = site is not None and Path(where).resolve() == site.resolve()
    return {"version": dist.version, "from": "bundle" if bundled else "machine"}


def unmet(bundle: Path) -> list[str]:
    """The bundled wheels' requirements that the run's packages (bundle and machine) do not meet."""
    from packaging.requirements import Requirement

    env = {"extra": ""}
    manifest = json.loads((bundle / "manifest.json").read_text())
    problems = []
    for wheel in manifest["wheels"]:
        try:
            dist = md.distribution(wheel["name"])
        except md.PackageNotFoundError:
            problems.append(f"{wheel['name']}: bundled but not installed")
            continue
        if dist.version != wheel["version"]:
            problems.append(f"{wheel['name']}: {dist.version} found first, the bundle has {wheel['version']}")
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate(env):
                continue
            try:
                have = md.version(req.name)
            except md.PackageNotFoundError:
                problems.append(f"{wheel['name']} needs {line}: not installed")
                continue
            if not req.specifier.contains(have, prereleases=True):
                problems.append(f"{wheel['name']} needs {line}: {have} installed")
    return problems


def _imports() -> dict[str, str]:
    out = {}
    for module in MODULES:
        try:
            importlib.import_module(module)
            out[module] = "ok"
        except Exception as exc:  # every failure is reported, not the first only
            out[module] = f"{type(exc).__name__}: {exc}"[:300]
    return out


def _gpu() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"cuda_available": torch.cuda.is_available(), "torch_cuda": torch.version.cuda}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(
            name=props.name,
            capability=f"{props.major}.{props.minor}",
            memory_gib=round(props.total_memory / 2**30, 1),
            multiprocessors=props.multi_processor_count,
            devices=torch.cuda.device_count(),
        )
    try:
        from bitsandbytes import cextension

        info["bitsandbytes_backend"] = cextension.BNB_BACKEND
        info["bitsandbytes_library"] = type(cextension.lib).__name__
    except Exception as exc:
        info["bitsandbytes_library"] = f"{type(exc).__name__}: {exc}"[:300]
    return info


def report(bundle: Path, site: Path | None) -> dict[str, Any]:
    figures: dict[str, Any] = {
        "python": sys.version.split()[0],
        "executable": sys.executable,
        "packages": {name: _origin(name, site) for name in VERSIONS},
        "imports": _imports(),
        "bundle_unmet": unmet(bundle),
    }
    figures["gpu"] = _gpu() if figures["imports"]["torch"] == "ok" else {}
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    put = sub.add_parser("install")
    put.add_argument("site", type=Path)
    put.add_argument("bundle", type=Path)
    show = sub.add_parser("report")
    show.add_argument("--bundle", type=Path, default=Path("gpu-bundle"))
    show.add_argument("--site", type=Path)
    show.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.command == "install":
        install(args.site, args.bundle)
        return
    figures = report(args.bundle, args.site)
    print(json.dumps(figures, indent=2))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    failed = [m for m, status in figures["imports"].items() if status != "ok"]
    if set(failed) & ESSENTIAL:
        raise SystemExit(f"not ready: imports failed {failed}")
    if failed or figures["bundle_unmet"]:  # the steps that need none of it still run
        print(f"partly ready: imports failed {failed}, unmet {figures['bundle_unmet']}", file=sys.stderr)
        sys.exit(PARTLY_READY)


if __name__ == "__main__":
    main()
