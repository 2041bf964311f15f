#!/usr/bin/env bash
# Create .venv and install EPD with epd bench's plots, the demo presets' tokenizer and the encoder
# cache store's Mooncake client (the bench, presets and mooncake extras). Usage: scripts/setup.sh [extra]
# (extra: test, ray, cuda)
# cuda: cupy + NCCL for the GPU transports, as extra cuda12 or cuda13 after the installed torch's CUDA.
# Without a GPU, torch is pinned to the CPU build (constraints/cpu.txt) so pip does not pull a
# multi-GB CUDA wheel; with nvidia-smi present, pip picks the default (CUDA) torch.
# The install goes through uv (pip installs it into .venv first) with pip's own indexes, find-links
# and constraints: the same versions as pip resolves, in a third of the time (most of what is left
# is compiling the bytecode, which pip does too). Where uv cannot be had, pip installs.
set -euo pipefail
cd "$(dirname "$0")/.."
extra="${1:-}"
python3 -m venv .venv
constraint=()
if ! command -v nvidia-smi >/dev/null 2>&1 && [ -z "${EPD_GPU:-}" ]; then
  constraint=(-c constraints/cpu.txt)
fi
# pip's setting KEY (pip config or PIP_KEY in the environment), empty where it has none
pip_setting() {
  local env_name="PIP_$(echo "$1" | tr 'a-z-' 'A-Z_')"
  if [ -n "${!env_name:-}" ]; then echo "${!env_name}"; else .venv/bin/pip config get "global.$1" 2>/dev/null || true; fi
}
installer=(.venv/bin/pip install -q --disable-pip-version-check)
if .venv/bin/pip install -q --disable-pip-version-check uv >/dev/null 2>&1; then
  # pip takes the best version over every index; uv's default takes the first index that has one
  installer=(.venv/bin/uv pip install -q --python .venv/bin/python --compile-bytecode --index-strategy unsafe-best-match)
  for url in $(pip_setting index-url); do installer+=(--index-url "$url"); done
  for url in $(pip_setting extra-index-url); do installer+=(--extra-index-url "$url"); done
  for dir in $(pip_setting find-links); do installer+=(--find-links "$dir"); done
  for file in $(pip_setting constraint); do installer+=(-c "$file"); done
  cert=$(pip_setting cert)
  if [ -n "$cert" ]; then export SSL_CERT_FILE="${SSL_CERT_FILE:-$cert}"; fi
fi
spec=".[bench,presets,mooncake]"
[ -n "$extra" ] && [ "$extra" != cuda ] && spec=".[bench,presets,mooncake,$extra]"
"${installer[@]}" "${constraint[@]}" -e "$spec"
if [ "$extra" = cuda ]; then  # cupy's wheel is per CUDA major: follow the torch pip chose
  major=$(.venv/bin/python -c "import torch; print((torch.version.cuda or 'none').split('.')[0])")
  case "$major" in
    12|13) "${installer[@]}" -e ".[cuda$major]" ;;
    *) echo "setup.sh: torch has no CUDA ($major): the cuda extra needs the CUDA build of torch" >&2; exit 1 ;;
  esac
fi
# Mooncake's transfer engine (the encoder cache store) links libibverbs and librdmacm even over TCP;
# the tests use promtool (the prometheus package) to lint every /metrics
if [ "$extra" = test ]; then
  bash scripts/debian_packages.sh libibverbs1 librdmacm1 prometheus
else
  bash scripts/debian_packages.sh libibverbs1 librdmacm1
fi
