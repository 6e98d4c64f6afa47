#!/usr/bin/env bash
# The one check to run on a GPU host, sized for a 15-minute device budget (about 6 minutes of
# commands): bash bench/gpu_check.sh [--dry-run]
#
#  1. install   the wheels carried in .whl/ (bench/gpu_wheels.json: KvikIO + libkvikio +
#               rapids-logger, webdataset, braceexpand) and, when reassembled, DALI's from
#               /tmp/dali-whl (bench/gpu_wheels.py split/receive/assemble), into /tmp/site
#  2. import    `import kvikio, cupy, torch`: stops at once (exit 3) with a clear message if it fails
#  3. doctor    `gdsload doctor --json` -> $OUT/doctor.json
#  4. pytest    the GPU test files by name (-m "gpu or gds or dali_gpu"), under a timeout
#  5. bench     bench/gpu_bench.py: device_path (FAIL unless KvikIO + device ring), kvikio_rows,
#               raw_tier, mixed_vs_cpu, mixed_busy (see its docstring)
# Every step adds a row (step | status | figure | ratio | seconds) to $OUT/gpu-check.json at once;
# the log is $OUT/gpu-check.log. The table is printed at the end; the exit status is non-zero on
# any FAIL. `--dry-run` prints what would be installed and run, and changes nothing.
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0
if [[ ${1:-} == --dry-run ]]; then DRY=1; shift; fi
OUT=${OUT:-bench/results/tmp}
SITE=${SITE:-/tmp/site}
PY=${PY:-python3}
PYTEST_TIMEOUT_S=${PYTEST_TIMEOUT_S:-120}
BENCH_TIMEOUT_S=${BENCH_TIMEOUT_S:-240}
GPU_TESTS=(tests/test_gpu_path.py tests/test_ring.py tests/test_loader.py tests/io/test_conformance.py)
export PYTHONUNBUFFERED=1

carried() {  # the pinned wheel names, from bench/gpu_wheels.json
  "$PY" -c 'import json,sys; print(" ".join(json.load(open(sys.argv[1]))[sys.argv[2]]["pins"]))' bench/gpu_wheels.json "$1"
}
row() { "$PY" bench/gpu_table.py add "$OUT" "$@" >/dev/null; echo "[gpu_check] $1: $2 $3"; }

if (( DRY )); then
  echo "gpu_check --dry-run (nothing is installed or run)"
  echo "would install into $SITE (pip --no-index --no-deps) from .whl/: $(carried carry)"
  for name in $(carried carry); do
    if ls .whl/"${name//-/_}"-*.whl >/dev/null 2>&1; then echo "  present: $(ls .whl/"${name//-/_}"-*.whl)"; else echo "  MISSING: $name (python3 bench/gpu_wheels.py download)"; fi
  done
  echo "would also install DALI's wheels from /tmp/dali-whl when reassembled: $(carried dali)"
  echo "would stop at once unless: $PY -c 'import kvikio, cupy, torch'"
  echo "would run: $PY -m gdsload doctor --json > $OUT/doctor.json"
  echo "would run: timeout -k 10 $PYTEST_TIMEOUT_S $PY -m pytest -q -p no:cacheprovider -m 'gpu or gds or dali_gpu' ${GPU_TESTS[*]} --junitxml=$OUT/pytest.xml"
  echo "would run: timeout -k 10 $BENCH_TIMEOUT_S $PY bench/gpu_bench.py --out $OUT (steps: data device_path kvikio_rows raw_tier mixed_vs_cpu mixed_busy)"
  echo "would write: $OUT/gpu-check.json (after each step), $OUT/gpu-check.log, $OUT/doctor.json, $OUT/pytest.log, $OUT/pytest.xml"
  exit 0
fi

mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu-check.log") 2>&1
rm -f "$OUT/gpu-check.json"
t0=$SECONDS

# 1. install -------------------------------------------------------------------------------------
missing=()
for name in $(carried carry); do
  ls .whl/"${name//-/_}"-*.whl >/dev/null 2>&1 || missing+=("$name")
done
wheels=(.whl/*.whl)
[[ -d /tmp/dali-whl ]] && wheels+=(/tmp/dali-whl/*.whl)
if (( ${#missing[@]} )); then
  row install FAIL "missing in .whl/: ${missing[*]}" "" $((SECONDS - t0))
  "$PY" bench/gpu_table.py print "$OUT"; exit 2
fi
if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${wheels[@]}"; then
  row install PASS "${#wheels[@]} wheels" "" $((SECONDS - t0))
else
  row install FAIL "pip install failed (see log)" "" $((SECONDS - t0))
  "$PY" bench/gpu_table.py print "$OUT"; exit 2
fi
export PYTHONPATH=$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}

# 2. import: nothing below means anything if this fails --------------------------------------------
t=$SECONDS
if ver=$("$PY" -c 'import kvikio, cupy, torch; print("kvikio", kvikio.__version__, "cupy", cupy.__version__, "torch", torch.__version__, "cuda", torch.cuda.is_available())' 2>"$OUT/import.err"); then
  row import PASS "$ver" "" $((SECONDS - t))
else
  row import FAIL "$(tail -1 "$OUT/import.err")" "" $((SECONDS - t))
  echo "[gpu_check] STOP: 'import kvikio, cupy, torch' failed; the GPU path cannot be tested. Details:"
  cat "$OUT/import.err"
  "$PY" bench/gpu_table.py print "$OUT"; exit 3
fi

# 3. doctor --------------------------------------------------------------------------------------
t=$SECONDS
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
if "$PY" -m gdsload doctor --json >"$OUT/doctor.json" 2>"$OUT/doctor.err"; then
  fig=$("$PY" -c 'import json,sys; d=json.load(open(sys.argv[1])); print("io", d["io_path"], "decode", d["decode_device"], "cufile", d["cufile"]["loaded"])' "$OUT/doctor.json")
  row doctor INFO "$fig" "" $((SECONDS - t))
else
  row doctor FAIL "$(tail -1 "$OUT/doctor.err")" "" $((SECONDS - t))
fi

# 4. the GPU test files, by name -------------------------------------------------------------------
t=$SECONDS
timeout -k 10 "$PYTEST_TIMEOUT_S" "$PY" -m pytest -q -p no:cacheprovider -m "gpu or gds or dali_gpu" \
  "${GPU_TESTS[@]}" --junitxml="$OUT/pytest.xml" >"$OUT/pytest.log" 2>&1
rc=$?
summary=$(tail -1 "$OUT/pytest.log")
tail -30 "$OUT/pytest.log"
case $rc in
  0) row pytest PASS "$summary" "" $((SECONDS - t)) ;;
  124|137) row pytest FAIL "timed out after ${PYTEST_TIMEOUT_S}s" "" $((SECONDS - t)) ;;
  *) row pytest FAIL "rc=$rc $summary" "" $((SECONDS - t)) ;;
esac

# 5. measurements and end-to-end checks --------------------------------------------------------------
t=$SECONDS
timeout -k 10 "$BENCH_TIMEOUT_S" "$PY" bench/gpu_bench.py --out "$OUT" "$@"
rc=$?
if (( rc == 124 || rc == 137 )); then row bench FAIL "timed out after ${BENCH_TIMEOUT_S}s" "" $((SECONDS - t)); fi

echo
"$PY" bench/gpu_table.py print "$OUT"
status=$?
echo "[gpu_check] total $((SECONDS - t0)) s; exit $status"
exit $status
