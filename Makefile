# Two entry points, both working on a fresh machine with no GPU:
#   make demo   -- the embedded demo: `serve run deploy/config.yaml` on http://127.0.0.1:8000
#   make test   -- install everything into .venv and run the test suite; any skip but a gpu test's fails it
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch, pinned, goes in first: an unpinned torch would pull a
# multi-GB CUDA build. The package itself asks only for torch>=2.4.
TORCH_CPU ?= torch==2.13.0

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_CPU)
	$(PY) -m pip install -q -e '.[test]'
	touch $@

.PHONY: install test demo
install: $(VENV)/.installed

# -rs prints every skip's reason; --strict-skips (tests/skip_gate.py) fails the run on any skip but a gpu
# test's on a machine without CUDA, so a missing dependency or server binary cannot pass as a green skip.
# --durations=25 lists the slowest tests, so that CI's log shows where its time goes (the aim: under 20 min).
test: $(VENV)/.installed
	$(PY) -m pytest -q -rs --strict-skips -p no:cacheprovider --durations=25 tests

demo: $(VENV)/.installed
	$(VENV)/bin/serve run deploy/config.yaml
