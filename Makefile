# Two commands are all the set-up there is: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export OMP_NUM_THREADS ?= 1

.PHONY: demo test install clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# torch first, pinned to the CPU wheel (a looser spec pulls a multi-GB CUDA build).
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/rlboost demo

# pyflakes first: unused imports and undefined names fail the build before the slow part.
test: $(STAMP)
	$(BIN)/python -m pyflakes rlboost workers trainer tests infra
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) build *.egg-info
