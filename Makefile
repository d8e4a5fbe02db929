# Two commands do all set-up: `make demo` and `make test` (each installs into .venv first).
VENV ?= .venv
PYTHON ?= python3
# A CPU build of torch that lies on this machine's disk; GPU users install their own torch first.
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
# pytest-xdist workers: 4 on the 2-core CI box. The suite waits more than it computes (its processes used 1.1 cores
# on average at 2 workers: quorums, timeouts, shaped links, process starts), so 4 workers fill the cores. Measured on
# an idle 2-core machine: 10:52 with 4 workers, against 17:15 with 2 before (the same change trains each
# simulator-equivalence case once and forks the cache builders: about 160 s of test time). Tests that must not run
# beside each other share an xdist_group (netlab, the session's sweep, the wheel build, the compiled kernels):
# --dist loadgroup keeps each group on one worker.
TEST_WORKERS ?= 4
XDIST := -n $(TEST_WORKERS) --dist loadgroup
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
	$(PY) -m pytest $(XDIST) --durations=15

test-fast: install
	$(PY) -m pytest $(XDIST) -m "not slow" --durations=10

demo: install
	$(VENV)/bin/gasloc-demo

bench: install
	$(PY) benchmarks/overhead.py

clean:
	rm -rf $(VENV) outputs multirun *.egg-info
