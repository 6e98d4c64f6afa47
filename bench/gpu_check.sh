#!/usr/bin/env bash
# The one thing to run on a GPU host (sized for an H200, under 8 minutes):
#   installs the wheels carried in .whl/ (KvikIO, webdataset, DALI if present) into /tmp/site,
#   runs the GPU-marked tests, then bench/gpu_bench.py (KvikIO reads, raw tier into CUDA
#   tensors, device ring, DALI mixed decode), printing a short table; JSON goes to $OUT (or
#   bench/results/). See bench/README.md for preparing .whl/.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
python3 -m gdsload doctor || true
echo "=== GPU-marked tests"
timeout 180 python3 -m pytest -q -p no:cacheprovider -m "gpu or gds or dali_gpu" tests 2>&1 | tail -25
echo "=== GPU benchmark"
timeout 300 python3 bench/gpu_bench.py "$@"
