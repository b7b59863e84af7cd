# Everything a fresh machine needs: `make run` (generate with the embedded model) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: setup run serve test lint typecheck unit test-gpu clean

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

serve: setup
	$(VENV)/bin/tokenspeed serve

lint: setup
	$(VENV)/bin/ruff check tokenspeed tests $(wildcard benchmarks scripts)

typecheck: setup
	$(VENV)/bin/mypy --strict --follow-imports=silent tokenspeed/scheduler tokenspeed/kvcache tokenspeed/spec tokenspeed/placement

unit: setup
	HF_HUB_OFFLINE=1 $(VENV)/bin/pytest -m "not gpu" $(PYTEST_ARGS)

test: lint typecheck unit

# GPU tests. On the device machine (no venv, no index) it runs the image's python3 on the
# working tree, with the wheels of scripts/fetch_device_wheels.sh installed first when .whl/ is there.
GPU_PY ?= $(if $(wildcard $(PY)),$(PY),python3)
test-gpu:
	@if [ ! -x "$(PY)" ] && ls .whl/*.whl >/dev/null 2>&1; then \
	  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl; fi
	PYTHONPATH=/tmp/site:$(CURDIR):$$PYTHONPATH HF_HUB_OFFLINE=1 $(GPU_PY) -m pytest -m gpu $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
