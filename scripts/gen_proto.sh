#!/usr/bin/env bash
# Regenerate the Python gRPC code in epd/v1/ from proto/epd/v1/*.proto.
# tests/test_proto_sync.py fails when the committed code differs from what this produces.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-.}"
.venv/bin/python -m grpc_tools.protoc -I proto --python_out="$out" --grpc_python_out="$out" proto/epd/v1/*.proto
touch "$out/epd/v1/__init__.py"
