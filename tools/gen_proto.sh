#!/usr/bin/env bash
# Regenerate the committed gRPC code in gdsload/v1/ from proto/gdsload/v1/*.proto.
#
#   tools/gen_proto.sh            # writes gdsload/v1/ in this checkout
#   tools/gen_proto.sh OUTDIR     # writes OUTDIR/gdsload/v1/ (the test compares it with ours)
#
# Needs grpcio-tools (pip install 'gdsload[test]'); PYTHON selects the interpreter. The proto path
# gdsload/v1/feed.proto mirrors the Python package, so protoc's imports (`from gdsload.v1 import
# feed_pb2`) are already right and nothing is patched. The output depends only on the .proto files
# and the grpcio-tools version (which fixes protoc's; the generated files check their runtime).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="$(cd "${1:-$here}" && pwd)"
py="${PYTHON:-python}"
cd "$here"
mkdir -p "$out/gdsload/v1"
rm -f "$out"/gdsload/v1/*_pb2.py "$out"/gdsload/v1/*_pb2.pyi "$out"/gdsload/v1/*_pb2_grpc.py
"$py" -m grpc_tools.protoc -I proto \
    --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" \
    proto/gdsload/v1/*.proto
cat > "$out/gdsload/v1/__init__.py" <<'PY'
"""Generated gRPC code for the gdsload.v1 protocol (proto/gdsload/v1/). Do not edit by hand:
regenerate with tools/gen_proto.sh (tests/service/test_generated.py checks it is up to date)."""
PY
