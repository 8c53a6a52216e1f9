# The two commands of the README: `make demo` and `make test` do all set-up from nothing.
PY ?= python3.11
# What CI installs: the extras' floors, pinned to known-good releases (see constraints/ci.txt).
CONSTRAINTS := constraints/ci.txt
# The frameworks a user installs themselves (no extra names them), torchdata for the
# StatefulDataLoader test, and triton for the test of the README's TensorFlow/triton import-order
# crash (the CPU torch wheel does not bring it); versions from $(CONSTRAINTS).
FRAMEWORKS := tensorflow-cpu torchdata triton

VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# `make demo` needs numpy and isal only: its own venv, so it never pulls a framework.
DEMO_VENV := .venv-demo
DEMO_BIN := $(DEMO_VENV)/bin
DEMO_STAMP := $(DEMO_VENV)/.installed

# `make docs` needs mkdocs, its plugins and stoker (numpy) only: its own venv, so it never pulls a
# framework (the API reference is read from the source, never imported).
DOCS_VENV := .venv-docs
DOCS_BIN := $(DOCS_VENV)/bin
DOCS_STAMP := $(DOCS_VENV)/.installed
# The site from docs/ and the docstrings; --strict makes a broken link, reference or docstring, or a
# stale generated page (docs/hooks.py), fail the build. The NO_MKDOCS_2_WARNING banner is
# mkdocs-material's notice, not ours.
mkdocs_build = NO_MKDOCS_2_WARNING=1 $(1)/mkdocs build --strict --site-dir site

.PHONY: demo test docs lint bench venv wheel clean

$(BIN)/python:
	$(PY) -m venv $(VENV) || python3 -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(STAMP): pyproject.toml setup.py src/stoker/_kernels.c $(CONSTRAINTS) | $(BIN)/python
	$(BIN)/python -m pip install --quiet -c $(CONSTRAINTS) -e '.[dev,torch,jax,ray,keras,remote,bench]' $(FRAMEWORKS)
	touch $(STAMP)

venv: $(STAMP)

$(DEMO_BIN)/python:
	@echo "make demo: creating the lean venv $(DEMO_VENV)"
	$(PY) -m venv $(DEMO_VENV) || python3 -m venv $(DEMO_VENV)

$(DEMO_STAMP): pyproject.toml setup.py src/stoker/_kernels.c $(CONSTRAINTS) | $(DEMO_BIN)/python
	@echo "make demo: installing stoker with numpy and isal into $(DEMO_VENV), compiling its copy kernels (about a minute)"
	$(DEMO_BIN)/python -m pip install --quiet -c $(CONSTRAINTS) -e '.[fast]'
	touch $(DEMO_STAMP)

demo: $(DEMO_STAMP)
	@echo "make demo: stoker bench on a generated sample (written once into the cache, then reused)"
	$(DEMO_BIN)/stoker bench

# The test venv has the docs extra too: the strict docs build is part of the tests.
test: $(STAMP)
	$(call mkdocs_build,$(BIN))
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/mypy
	$(BIN)/lint-imports
	$(BIN)/python -m pytest -q tests

$(DOCS_BIN)/python:
	$(PY) -m venv $(DOCS_VENV) || python3 -m venv $(DOCS_VENV)

$(DOCS_STAMP): pyproject.toml setup.py src/stoker/_kernels.c $(CONSTRAINTS) | $(DOCS_BIN)/python
	$(DOCS_BIN)/python -m pip install --quiet -c $(CONSTRAINTS) -e '.[docs]'
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	$(call mkdocs_build,$(DOCS_BIN))

bench: $(STAMP)
	$(BIN)/python benchmarks/w1.py
	$(BIN)/python benchmarks/compare.py

# A wheel with the compiled kernels (STOKER_REQUIRE_KERNELS: a missing compiler fails the build
# instead of leaving them out), repaired to a manylinux tag by auditwheel where it runs.
wheel: $(STAMP)
	rm -rf dist/raw && mkdir -p dist
	STOKER_REQUIRE_KERNELS=1 $(BIN)/python -m pip wheel --quiet --no-deps --no-build-isolation -w dist/raw .
	if $(BIN)/auditwheel --version >/dev/null 2>&1; then \
		PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/auditwheel repair --wheel-dir dist dist/raw/*.whl; \
	else \
		echo "auditwheel not available: keeping the platform wheel"; cp dist/raw/*.whl dist/; \
	fi
	ls dist/*.whl

clean:
	rm -rf $(VENV) $(DEMO_VENV) $(DOCS_VENV) dist build site .stoker-cache .pytest_cache .mypy_cache .ruff_cache
