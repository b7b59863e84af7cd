# Everything a fresh machine needs: `make run` (generate with the embedded model) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: setup run serve test lint typecheck unit test-slow test-gpu clean

$(PY):
	python3 -m venv $(VENV)

# torch, only when the venv has none: the CPU build from PyTorch's CPU index (PyPI's Linux
# wheel is the multi-GB CUDA build). The `+cpu` pin means pip fails, rather than fetching
# the CUDA wheel, when that index is out of reach. macOS has no `+cpu` build: PyPI's wheel
# is the CPU one there. `--no-deps` keeps the extra index to this one package: torch's own
# dependencies come from PyPI with the package's, in the next command.
TORCH_VERSION ?= 2.13.0
TORCH_INDEX_URL ?= https://download.pytorch.org/whl/cpu
UNAME_S ?= $(shell uname -s)
TORCH_REQUIREMENT ?= torch==$(TORCH_VERSION)$(if $(filter Darwin,$(UNAME_S)),,+cpu)

$(STAMP): pyproject.toml | $(PY)
	$(PY) -c "import torch" 2>/dev/null || \
	  $(PY) -m pip install -q --retries 1 --timeout 10 --no-deps '$(TORCH_REQUIREMENT)' --extra-index-url $(TORCH_INDEX_URL)
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

# The CPU tests on TEST_WORKERS processes (pytest-xdist; 0 runs them in this one), a test file to a
# worker so that a module's server fixture starts once: on two cores about half the serial time.
TEST_WORKERS ?= 2
unit: setup
	HF_HUB_OFFLINE=1 $(VENV)/bin/pytest -m "not gpu and not slow" -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# The exhaustive model checkers and the Triton interpreter suites that take over ten seconds each
# (marked `slow`): outside `make test`, which CI must finish on two cores within fifteen minutes.
test-slow: setup
	HF_HUB_OFFLINE=1 $(VENV)/bin/pytest -m "slow and not gpu" $(PYTEST_ARGS)

test: lint typecheck unit

# GPU tests. On the device machine (no venv, no index) it runs the image's python3 on the
# working tree, with the wheels of scripts/fetch_device_wheels.sh installed first when .whl/ is there.
WHEELS ?= .whl
GPU_PY ?= $(if $(wildcard $(PY)),$(PY),python3)
test-gpu:
	@if [ ! -x "$(PY)" ] && ls $(WHEELS)/*.whl >/dev/null 2>&1; then \
	  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $(WHEELS)/*.whl; fi
	PYTHONPATH=/tmp/site:$(CURDIR):$$PYTHONPATH HF_HUB_OFFLINE=1 $(GPU_PY) -m pytest -m gpu $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
