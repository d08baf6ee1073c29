# mrc: `make demo` runs the whole path locally, `make test` runs the tests. Both install first.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
PYTEST_ARGS ?=
# Test processes (one module each at a time, --dist loadfile): one more than the cores, at most 6. The
# tests partly wait on the services and workers they start, and each process's model calls take one
# thread (tests/conftest.py): on two cores 3 processes ran the suite in 7:10 (CPU 94 % busy) where 2
# took 7:44-8:03 (78-80 %). 1 turns it off.
TEST_PROCS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); echo $$(( n + 1 < 6 ? n + 1 : 6 )))
XDIST = $(if $(filter 1,$(TEST_PROCS)),,-n $(TEST_PROCS) --dist loadfile)

.PHONY: install demo test test-fast test-unit test-integration test-kombu lint bench gpu-bundle gpu-smoke producer-smoke clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt
	@command -v redis-server >/dev/null || { $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq redis-server; }
	@# promtool checks deploy/prometheus (tests/unit/test_deploy.py); the server the package starts is not
	@# wanted: stopped only where no prometheus ran before (one a person runs is never touched)
	@command -v promtool >/dev/null || { ran=$$(pgrep -x prometheus || true); $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends prometheus >/dev/null && { [ -n "$$ran" ] || $(SUDO) pkill -x prometheus || true; }; }
	@# the ops page's test opens it in a real browser: Debian's headless chromium and its driver
	@command -v chromedriver >/dev/null || { $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends chromium chromium-driver >/dev/null; }
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[worker,api,dev]'
	@touch $@

demo: install
	$(PY) scripts/demo.py

# kombu's own tests (make test-kombu: ~40 s, mostly waiting on timers) run beside pytest, their report
# printed after it: one after the other took make test past 8 minutes on two cores.
test: install
	@mkdir -p .cache && kombu_log=$$(mktemp .cache/kombu-suite.XXXXXX) && \
	trap 'kill -INT $$kombu 2>/dev/null; wait $$kombu; rm -f "$$kombu_log"; exit 130' INT TERM && \
	{ $(PY) tests/kombu/run_suite.py > "$$kombu_log" 2>&1 & } && kombu=$$! && \
	{ $(PY) -m pytest $(XDIST) $(PYTEST_ARGS); tests=$$?; } && \
	{ wait $$kombu; suite=$$?; } && cat "$$kombu_log" && rm -f "$$kombu_log" && \
	exit $$(( tests != 0 ? tests : suite ))

# kombu's own Redis transport tests against ours (downloads kombu's released source; skipped offline).
test-kombu: install
	$(PY) tests/kombu/run_suite.py

test-unit: install
	$(PY) -m pytest tests/unit $(PYTEST_ARGS)

# The edit-test loop: unit tests only (no services, no worker processes), under a minute.
test-fast: test-unit

test-integration: install
	$(PY) -m pytest tests/integration tests/faults $(XDIST) $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy shared producer workers
	$(VENV)/bin/lint-imports

bench: install
	$(PY) tests/bench/bench_cpu_contention.py
	$(PY) tests/bench/bench_preprocess.py
	$(PY) tests/bench/bench_png_check.py
	$(PY) tests/bench/bench_jpeg_decode.py
	$(PY) tests/bench/bench_throughput.py
	$(PY) tests/bench/bench_structured.py
	$(PY) tests/bench/bench_attention_paths.py
	$(PY) tests/bench/bench_step_cost.py
	$(PY) tests/bench/bench_memory.py
	$(PY) tests/bench/bench_paged_attention.py
	$(PY) tests/bench/bench_priority.py
	$(PY) tests/bench/bench_broker.py
	$(PY) tests/bench/bench_durability.py
	$(PY) tests/bench/bench_enqueue.py
	$(PY) tests/bench/bench_key_shares.py
	$(PY) tests/bench/bench_api.py
	$(PY) tests/bench/bench_submit.py
	$(PY) tests/bench/bench_chat_s3.py
	$(PY) tests/bench/bench_api_memory.py
	$(PY) tests/bench/bench_waits.py
	$(PY) tests/bench/bench_streaming.py
	$(PY) tests/bench/bench_parcel_accuracy.py
	$(PY) tests/bench/bench_parcel_fidelity.py
	$(PY) tests/bench/bench_throughput.py --model parcels --parts system,naive

# The producer side as its users install it: `.[producer,api]` in a fresh virtualenv (no torch), every
# module imported, mrc submit / status / backlog and mrc-api run against real services (~1 min).
producer-smoke: install
	$(PY) -m scripts.producer_smoke .cache/producer-smoke

# The GPU proving ground (scripts/gpu_checks.sh; docs/benchmarks.md, "GPU, H200"). gpu-bundle: the wheels
# the GPU machine lacks, for its Python 3.12 (prints the size; at most 56 MiB with the working tree).
# gpu-smoke: the same script at tiny sizes on this CPU, in a stand-in for that machine's Python (made
# once under .cache/, ~3.5 GB of downloads), with only the bundle: no .venv.
gpu-bundle:
	python3 scripts/gpu_bundle.py

gpu-smoke: gpu-bundle
	bash scripts/gpu_checks.sh --cpu-smoke .cache/gpu-smoke

clean:
	rm -rf $(VENV) .cache .mypy_cache .ruff_cache .pytest_cache build *.egg-info
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
