# Two commands do all set-up: `make demo` and `make test` (each installs into .venv first).
VENV ?= .venv
PYTHON ?= python3
# A CPU build of torch that lies on this machine's disk; GPU users install their own torch first.
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install test test-fast demo bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

test: install
	$(PY) -m pytest --durations=15

test-fast: install
	$(PY) -m pytest -m "not slow" --durations=10

demo: install
	$(VENV)/bin/gasloc-demo

bench: install
	$(PY) benchmarks/overhead.py

clean:
	rm -rf $(VENV) outputs multirun *.egg-info
