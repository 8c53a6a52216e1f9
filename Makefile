# The two commands of the README: `make demo` and `make test` do all set-up from nothing.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench venv clean

$(BIN)/python:
	$(PY) -m venv $(VENV) || python3 -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(STAMP): pyproject.toml setup.py src/stoker/_kernels.c | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[dev,tf,torch,jax,ray,remote,bench]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/stoker bench

test: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/mypy
	$(BIN)/python -m pytest -q tests

bench: $(STAMP)
	$(BIN)/python benchmarks/w1.py
	$(BIN)/python benchmarks/compare.py

clean:
	rm -rf $(VENV) .stoker-cache .pytest_cache .mypy_cache .ruff_cache
