#!/usr/bin/env bash
# Create .venv and install EPD with epd bench's plots, the demo presets' tokenizer and the encoder
# cache store's Mooncake client (the bench, presets and mooncake extras). Usage: scripts/setup.sh [extra]
# (extra: test, ray, cuda)
# cuda: cupy + NCCL for the GPU transports, as extra cuda12 or cuda13 after the installed torch's CUDA.
# Without a GPU, torch is pinned to the CPU build (constraints/cpu.txt) so pip does not pull a
# multi-GB CUDA wheel; with nvidia-smi present, pip picks the default (CUDA) torch.
set -euo pipefail
cd "$(dirname "$0")/.."
extra="${1:-}"
python3 -m venv .venv
constraint=()
if ! command -v nvidia-smi >/dev/null 2>&1 && [ -z "${EPD_GPU:-}" ]; then
  constraint=(-c constraints/cpu.txt)
fi
spec=".[bench,presets,mooncake]"
[ -n "$extra" ] && [ "$extra" != cuda ] && spec=".[bench,presets,mooncake,$extra]"
.venv/bin/pip install -q --disable-pip-version-check "${constraint[@]}" -e "$spec"
if [ "$extra" = cuda ]; then  # cupy's wheel is per CUDA major: follow the torch pip chose
  major=$(.venv/bin/python -c "import torch; print((torch.version.cuda or 'none').split('.')[0])")
  case "$major" in
    12|13) .venv/bin/pip install -q --disable-pip-version-check -e ".[cuda$major]" ;;
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
