# mrc producer side: mrc-api (HTTP intake), the mrc CLI and the lane exporter. No torch.
#   docker build -f deploy/docker/api.Dockerfile -t mrc-api .
FROM python:3.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    MRC_API_HOST=0.0.0.0 \
    MRC_API_PORT=8000

# tini is the container's PID 1 (ENTRYPOINT; a `command:` that replaces it names it first): PID 1
# ignores a signal it has no handler for, and Python has none during its own start, so a SIGTERM then
# was lost; under tini each mrc command is an ordinary process and tini passes signals on. Not pinned:
# Debian's security updates replace its version within a point release.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends tini \
    && rm -rf /var/lib/apt/lists/*

RUN groupadd --system --gid 10001 mrc \
    && useradd --system --uid 10001 --gid mrc --create-home --home-dir /home/mrc mrc

WORKDIR /opt/mrc
COPY pyproject.toml constraints.txt README.md ./
COPY shared ./shared
COPY producer ./producer
COPY workers ./workers
RUN pip install -c constraints.txt ".[api]"

USER 10001:10001
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=5s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import urllib.request,sys; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=4).status == 200 else 1)"]
ENTRYPOINT ["tini", "--", "mrc-api"]
