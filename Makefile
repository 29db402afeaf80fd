# The commands a newcomer needs: `make serve` and `make test`. CI runs `make test` (see .ci/run).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.DEFAULT_GOAL := all
.PHONY: all install serve test lint format typecheck bench demo clean

all: lint typecheck test

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

serve: install  ## run the service on 127.0.0.1:8000 with the embedded durable store (Swagger UI at /docs)
	$(BIN)/rollbuf serve

test: install  ## every test: unit, API, store contract, integration (real uvicorn, SQLite, Redis)
	$(BIN)/python -m pytest

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

demo: install
	$(BIN)/rollbuf demo

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache .hypothesis
