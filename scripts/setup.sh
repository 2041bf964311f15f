#!/usr/bin/env bash
# Create .venv and install EPD. Usage: scripts/setup.sh [extra]   (extra: test, ray, cuda)
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
spec="."
[ -n "$extra" ] && spec=".[$extra]"
.venv/bin/pip install -q --disable-pip-version-check "${constraint[@]}" -e "$spec"
