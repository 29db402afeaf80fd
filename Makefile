# The commands a newcomer needs: `make serve` and `make test`. CI runs `make test` (see .ci/run).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
SERVE_STAMP := $(VENV)/.installed-serve
DEV_STAMP   := $(VENV)/.installed-dev
DOCS_STAMP  := $(VENV)/.installed-docs
WHEELHOUSE  := $(VENV)/wheelhouse
WHEELHOUSE_STAMP := $(WHEELHOUSE)/simple/index.html

.DEFAULT_GOAL := all
.PHONY: all install install-serve browser nginx serve test floors-test lint format typecheck bench crash-matrix demo demo-learn docs clean

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
	touch $(DEV_STAMP) $(SERVE_STAMP) $(DOCS_STAMP)

$(DOCS_STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[docs]'
	touch $(DOCS_STAMP) $(SERVE_STAMP)

# verifiers' harness runs `uv sync --script` in every worker process with UV_OFFLINE=false forced: the tests
# point it (UV_DEFAULT_INDEX) at this local PEP 503 index of its script's dependencies, built once here.
$(WHEELHOUSE_STAMP): rollout_client/verifiers/wheelhouse.py | $(DEV_STAMP)
	$(BIN)/python -m rollout_client.verifiers.wheelhouse $(WHEELHOUSE)

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

# tests/integration/test_deploy.py runs deploy/nginx.conf with Debian's nginx, installed here like chromium. The test
# starts an nginx of its own; the package's service starts only where the init system lets it (not in containers
# whose policy-rc.d forbids it, as these machines' does).
nginx:
	@if ! command -v nginx >/dev/null && [ ! -x /usr/sbin/nginx ]; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q nginx; \
	  else \
	    echo "the deploy/ test needs nginx: sudo apt-get install nginx" >&2; \
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
test: install browser nginx  ## every test: unit, API, store contract, integration (real server processes, SQLite, headless chromium), schemathesis against /openapi.json
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadgroup -m "not pg_cluster"
	$(BIN)/python -m pytest -m pg_cluster
	$(MAKE) --no-print-directory floors-test
	$(MAKE) --no-print-directory image-test

# The floor tier: the service's direct dependencies at the lowest versions pyproject.toml allows (uv's
# lowest-direct resolution), in a venv of their own, made again when pyproject.toml changes; tests/floors.py checks
# that each is at exactly its declared floor. On it: the unit and API tiers, the store contract on PostgreSQL
# (psycopg's) and two real `rollbuf serve` processes (uvicorn's, and the flags pydantic-settings reads), with
# `--floors` (tests/conftest.py: one store each, few hypothesis examples). tests/README.md: "Floors".
FLOORS       := .venv-floors
FLOORS_STAMP := $(FLOORS)/.installed
FLOORS_TESTS := tests/unit tests/api tests/store/test_contract.py tests/store/test_postgres.py \
	tests/integration/test_server_process.py::test_atropos_flow_over_tcp \
	tests/integration/test_front_door.py::test_slow_heads_time_out

$(FLOORS_STAMP): pyproject.toml | $(DEV_STAMP)
	rm -rf $(FLOORS)
	$(BIN)/uv venv --quiet --python $(BIN)/python $(FLOORS)
	$(BIN)/uv pip install --quiet --python $(FLOORS)/bin/python --resolution lowest-direct -e .
	$(BIN)/uv pip install --quiet --python $(FLOORS)/bin/python 'pytest>=8' 'hypothesis>=6.100' pytest-xdist==3.8.0
	touch $(FLOORS_STAMP)

floors-test: export PYTHONDONTWRITEBYTECODE =
floors-test: $(FLOORS_STAMP)  ## the unit and API tiers on the lowest versions of the dependencies that pyproject.toml allows (.venv-floors)
	$(FLOORS)/bin/python -m tests.floors
	$(FLOORS)/bin/python -m pytest --floors -n 2 $(FLOORS_TESTS)

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

# The docs site from docs/ (mkdocs.yml): offline, no CDN or web font; the HTTP API reference is rendered from the
# app's own OpenAPI and the build prints each page's words per sentence. `make test` builds it too, with --strict
# (tests/test_docs_site.py). Open site/index.html, or serve it as you edit: .venv/bin/mkdocs serve
docs: $(DOCS_STAMP)  ## the docs site into site/ (a broken link or anchor fails it)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

clean:
	rm -rf site $(VENV) $(FLOORS) .pytest_cache .ruff_cache .mypy_cache .hypothesis

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
