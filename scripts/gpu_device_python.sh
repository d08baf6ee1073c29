#!/usr/bin/env bash
# A stand-in for the GPU machine's Python on this CPU machine: a Python 3.12 venv with the packages of
# scripts/gpu_device_requirements.txt (torch 2.11, transformers 5.17, ...) and none of what the machine
# lacks, made once under .cache/ and reused while that file is unchanged. Prints the venv's python.
# The first build downloads ~3.5 GB (torch 2.11 for Python 3.12 and its CUDA libraries: no such wheel
# lies on this machine's disk) and takes a few minutes; `scripts/gpu_checks.sh --cpu-smoke` calls it.
set -euo pipefail
cd "$(dirname "$0")/.."
requirements=scripts/gpu_device_requirements.txt
venv=${GPU_DEVICE_VENV:-.cache/gpu-device-python}
# What the GPU machine does not have (its documentation): taken out if pip brought any of it along.
lacks="bitsandbytes kornia xgrammar apache-tvm-ffi structlog pydantic pydantic-core pydantic-settings
  celery kombu redis boto3 jsonschema referencing rpds-py attrs nvidia-ml-py pytest-timeout"
stamp="$(sha256sum "$requirements" "$0" | sha256sum | cut -c1-16)"
if [ "$(cat "$venv/.built" 2>/dev/null)" != "$stamp" ]; then
  python=""
  for candidate in ${GPU_SMOKE_PYTHON:-} python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python /usr/bin/python3.12; do
    if "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
      python=$candidate
      break
    fi
  done
  [ -n "$python" ] || { echo "no Python 3.12 here (set GPU_SMOKE_PYTHON)" >&2; exit 2; }
  echo "making $venv from $python and $requirements (once; ~3.5 GB of downloads)" >&2
  rm -rf "$venv"
  "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r "$requirements" >&2 2> >(grep -v "^WARNING: Location" >&2)
  # shellcheck disable=SC2086 # the list splits on purpose
  "$venv/bin/python" -m pip uninstall --quiet -y $lacks >&2 2>/dev/null || true
  echo "$stamp" > "$venv/.built"
fi
echo "$(cd "$venv" && pwd)/bin/python"
