# Everything a fresh machine needs: `make run` (generate with the embedded model) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: setup run test lint typecheck unit test-gpu clean

$(PY):
	python3 -m venv $(VENV)

# torch is pinned to the local CPU build only when no torch is present: an
# unpinned torch would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml | $(PY)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

setup: $(STAMP)

run: setup
	$(VENV)/bin/tokenspeed generate "def fib(n):" --max-tokens 32

lint: setup
	$(VENV)/bin/ruff check tokenspeed tests $(wildcard benchmarks scripts)

typecheck: setup
	$(VENV)/bin/mypy --strict --follow-imports=silent tokenspeed/scheduler tokenspeed/kvcache

unit: setup
	HF_HUB_OFFLINE=1 $(VENV)/bin/pytest -m "not gpu" $(PYTEST_ARGS)

test: lint typecheck unit

test-gpu: setup
	HF_HUB_OFFLINE=1 $(VENV)/bin/pytest -m gpu $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
