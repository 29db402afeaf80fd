# The commands a newcomer needs: `make serve` and `make test`. CI runs `make test` (see .ci/run).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
SERVE_STAMP := $(VENV)/.installed-serve
DEV_STAMP   := $(VENV)/.installed-dev
WHEELHOUSE  := $(VENV)/wheelhouse
WHEELHOUSE_STAMP := $(WHEELHOUSE)/simple/index.html

.DEFAULT_GOAL := all
.PHONY: all install install-serve browser serve test lint format typecheck bench crash-matrix demo demo-learn clean

all: lint typecheck test

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# Serving installs what serving needs (pip install -e .); the dev tools (torch, selenium, schemathesis, ...)
# come with `make install`, which every target but serve and demo depends on.
$(SERVE_STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e .
	touch $(SERVE_STAMP)

$(DEV_STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(DEV_STAMP) $(SERVE_STAMP)

# verifiers' harness runs `uv sync --script` in every worker process with UV_OFFLINE=false forced: the tests
# point it (UV_DEFAULT_INDEX) at this local PEP 503 index of its script's dependencies, built once here.
$(WHEELHOUSE_STAMP): tests/wheelhouse.py | $(DEV_STAMP)
	$(BIN)/python -m tests.wheelhouse $(WHEELHOUSE)

install-serve: $(SERVE_STAMP)

install: $(DEV_STAMP) $(WHEELHOUSE_STAMP)

serve: install-serve  ## run the service on 127.0.0.1:8000 with the embedded durable store (Swagger UI at /docs)
	$(BIN)/rollbuf serve

# The /dashboard test drives Debian's chromium through chromium-driver; on a fresh machine (CI) they are
# installed here, with apt, as root.
browser:
	@if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver; \
	  else \
	    echo "the /dashboard test needs Debian's chromium and chromium-driver: sudo apt-get install chromium chromium-driver" >&2; \
	    exit 1; \
	  fi; \
	fi

# The suite runs on TEST_WORKERS pytest-xdist workers: most of its time is spent waiting on real processes, so
# workers overlap well even on 2 cores. The tests that stop the machine's PostgreSQL (marker pg_cluster) run
# after, alone: beside the others they would take the database from under them. tests/README.md: "In parallel".
TEST_WORKERS ?= 4

# The suite starts hundreds of Python processes (servers, trainers, stand-ins, verifiers' harness scripts): with
# PYTHONDONTWRITEBYTECODE set (some machines set it: this one does) each one compiled every
# module it imported from source, 0.2-0.6 s of CPU a process. The tests write bytecode (ignored by git).
test: export PYTHONDONTWRITEBYTECODE =
test: install browser  ## every test: unit, API, store contract, integration (real server processes, SQLite, headless chromium), schemathesis against /openapi.json
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadgroup -m "not pg_cluster"
	$(BIN)/python -m pytest -m pg_cluster
	$(MAKE) --no-print-directory image-test

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: install
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

typecheck: install
	$(BIN)/mypy

bench: install  ## hot-path benchmarks: ingest, /batch, batch formation, stores
	$(BIN)/python -m bench

# Every fault (kill -9 of the server, a replica, the trainer, a producer, a pool worker; SIGTERM and SIGSTOP of a
# producer; database connections cut; a full disk) on SQLite and on two PostgreSQL replicas, every side at once,
# counted from the clients' own records; writes docs/crash-matrix.json and the page made from it. As root for the
# full-disk row (a small tmpfs); needs the PostgreSQL `make test` uses. `make test` runs each row smaller.
crash-matrix: install  ## the crash matrix: what each fault loses, trains twice or redoes (docs/crash-matrix.md; 396 s on a 2-core VM, `nproc`)
	$(BIN)/python -m crash

demo: install-serve
	$(BIN)/rollbuf demo

demo-learn: install  ## a torch policy learns through the service; report and reward curve in ./learn/ (docs/training.md)
	mkdir -p learn
	$(BIN)/rollbuf demo --learn --report learn/report.json
	$(BIN)/python -m demos.plot learn/report.json learn/reward.png

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache .hypothesis

# The image test builds the Dockerfile and runs it with podman (no Docker daemon or registry here): podman,
# runc and mmdebstrap (for a stand-in python:3.11-slim) are installed with apt, as root, like chromium above.
.PHONY: container-tools image-test
container-tools:
	@if ! command -v podman >/dev/null || ! command -v mmdebstrap >/dev/null || ! command -v runc >/dev/null; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q podman mmdebstrap runc; \
	  else \
	    echo "the image test needs podman, mmdebstrap and runc: sudo apt-get install podman mmdebstrap runc" >&2; \
	  fi; \
	fi

image-test: install container-tools  ## build the Dockerfile and run the image with podman: health, non-root, data kept across containers, SIGTERM, size (tests/image)
	$(BIN)/python -m pytest -m image tests/image
