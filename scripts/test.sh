#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite, slow end-to-end tests included.
# The tests run in EPD_TEST_WORKERS pytest-xdist processes (default 2), a whole module each at a
# time (--dist loadfile: a module's started cluster is shared by its tests), the longest modules
# first (tests/module_seconds.txt); EPD_TEST_WORKERS=0 runs them in this process.
set -euo pipefail
cd "$(dirname "$0")/.."
start_s=$(date +%s)
bash scripts/setup.sh test
workers="${EPD_TEST_WORKERS:-2}"
parallel=()
if [ "$workers" != 0 ]; then
  parallel=(-n "$workers" --dist loadfile --no-loadscope-reorder)
fi
rc=0
.venv/bin/python -m pytest -q "${parallel[@]}" "$@" || rc=$?
echo "scripts/test.sh: $(( $(date +%s) - start_s )) s wall, setup included (exit code $rc)"
exit "$rc"
