# mrc GPU worker. Build from the repository root:
#   docker build -f deploy/docker/worker.Dockerfile -t mrc-worker .
# Model weights are not baked in: mount them read-only at /models (MRC_MODEL=/models/fuyu-8b).
# The GPU driver comes from the host (NVIDIA Container Toolkit); torch's wheels carry their own CUDA
# runtime, so a python base is enough (an nvidia/cuda base would add a second copy of the CUDA libraries).
# That runtime is CUDA 13 (constraints.txt: torch 2.14.1, nvidia-cuda-runtime 13.0): the host's driver
# must be 580 or newer, or torch sees no GPU and the worker cannot load its model (exit 70).
FROM python:3.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    MRC_MODEL=/models/fuyu-8b \
    MRC_QUANTIZATION=nf4 \
    MRC_DEVICE=cuda \
    MRC_HOME=/home/mrc/.cache/mrc \
    MRC_METRICS_PORT=9400

# Triton (xgrammar's grammar-mask kernel on CUDA, which the warm-up runs) builds a small C helper with
# the system's C compiler the first time it runs, and the slim base has none: without it the worker
# stops at its warm-up (exit 70, its log line says why). tini is the container's PID 1 (ENTRYPOINT):
# PID 1 ignores a signal it has no handler for, and Python has none during its own start, so a
# SIGTERM then was lost; under tini the worker is an ordinary process and tini passes signals on.
# Not pinned: Debian's security updates replace these versions within a point release, and a pin
# would stop the build.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev tini \
    && rm -rf /var/lib/apt/lists/*

RUN groupadd --system --gid 10001 mrc \
    && useradd --system --uid 10001 --gid mrc --create-home --home-dir /home/mrc mrc

WORKDIR /opt/mrc
COPY pyproject.toml constraints.txt README.md ./
COPY shared ./shared
COPY producer ./producer
COPY workers ./workers
RUN pip install -c constraints.txt ".[worker]"

USER 10001:10001
EXPOSE 9400
# SIGTERM: the worker finishes the batch in hand, returns buffered jobs to Redis and exits 0.
STOPSIGNAL SIGTERM
HEALTHCHECK --interval=30s --timeout=5s --start-period=300s --retries=4 \
    CMD ["python", "-c", "import urllib.request,sys; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:9400/healthz', timeout=4).status == 200 else 1)"]
ENTRYPOINT ["tini", "--", "mrc-worker"]
CMD ["--lanes", "interactive,backlog"]
