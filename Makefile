# Two commands are all the set-up there is: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export OMP_NUM_THREADS ?= 1
# mkdocs-material prints a banner about its successor on every build: not ours to act on.
export NO_MKDOCS_2_WARNING ?= 1

.PHONY: demo test test-slow docs install clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# torch first, pinned to the CPU wheel (a looser spec pulls a multi-GB CUDA build).
# constraints.txt: releases pinned for reproducible figures (not the package's requirements).
$(STAMP): pyproject.toml constraints.txt | $(BIN)/python
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -c constraints.txt -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/rlboost demo

# pyflakes first: unused imports and undefined names fail the build before the slow part.
# Then the docs, --strict: the CLI and settings pages are generated from the code at build time
# (docs/gen_reference.py), and a flag the hand-written pages or the README name after
# `rlboost COMMAND` must exist: a renamed flag or a dead link fails here. No -q: it hides the
# warnings that --strict counts, and the build would pass with them.
test: $(STAMP)
	$(BIN)/python -m pyflakes rlboost workers trainer benchmarks tests infra docs
	$(BIN)/python -m mkdocs build --strict -d build/site
	$(BIN)/python -m pytest -q -m "not slow"

# The process-heavy tests (`@pytest.mark.slow`: whole training runs, SIGKILL + resume, chaos,
# server clusters). CI runs both targets (.ci/run): `make test` stays a few minutes.
test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

# The documentation site, into site/ (open site/index.html).
docs: $(STAMP)
	$(BIN)/python -m mkdocs build --strict

clean:
	rm -rf $(VENV) build site *.egg-info
