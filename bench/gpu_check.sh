#!/usr/bin/env bash
# The check to run on a GPU host, in two parts over the device calls that bench/gpu_plan.py plans:
#   bash bench/gpu_check.sh --dry-run                    the plan: each call's run(...) arguments, MiB, caps,
#                                                        time, slack; non-zero when over budget
#   bash bench/gpu_check.sh --part 1 [--receive .dali1]  keep DALI's first part (.dali-parts/), install .whl/,
#        import (torch.cuda.is_available() asserted), the NVDEC probe, doctor, pytest -m "gpu or gds",
#        gpu_bench's raw-tier steps
#   bash bench/gpu_check.sh --part 2 [--receive .daliN]  keep the last part, assemble, install DALI, import it
#        and decode one JPEG through a mixed pipeline, pytest -m dali_gpu, gpu_bench's decoded-tier steps
#        (DALI's own pipeline as the baseline), bench/media_gpu_check.py (NVDEC clips/s per codec, a pass's
#        NVDEC frames/s, audio)
# Every cap comes from `bench/gpu_plan.py --caps PART` (the plan, this script and bench/README.md's summary
# share it). An install already done (same wheels) is skipped: a marker file in $SITE. Each step adds a row
# (step | status | on | figure | ratio | seconds) to $OUT/gpu-check.json as it ends; everything printed goes
# to $OUT/gpu-check.log. $OUT gets at most 4 files a part (log, json, pytest.xml; doctor.json in part 1:
# the tool returns 8). The verdict (bench/gpu_table.py) passes only when every expected step ran:
# FAIL on a FAIL row, on a step with no row ("NOT EXERCISED": a crash or a timeout before it; a native crash,
# 134/139, is named), on an expected step that SKIPped, on a row measured on the CPU where the plan expects
# the GPU, on a pytest selection that ran nothing or skipped anything, and on a missing result file.
set -uo pipefail
cd "$(dirname "$0")/.."
PART="" RECEIVE=""
usage="usage: bash bench/gpu_check.sh --dry-run | --part 1|2 [--receive .daliN]"
case ${1:-} in
  --dry-run) shift; exec "${PY:-python3}" bench/gpu_plan.py "$@" ;;
  --part) PART=${2:-}; shift; (( $# )) && shift ;;
  *) echo "$usage" >&2; exit 2 ;;
esac
while (( $# )); do
  case $1 in
    --receive) [[ -n ${2:-} ]] || { echo "--receive takes a folder (.daliN)" >&2; exit 2; }; RECEIVE=$2; shift 2 ;;
    *) echo "unknown argument '$1'; $usage" >&2; exit 2 ;;
  esac
done
[[ $PART == 1 || $PART == 2 ]] || { echo "--part takes 1 or 2, got '$PART'" >&2; exit 2; }
OUT=${OUT:-bench/results/tmp}
SITE=${SITE:-/tmp/site}
PY=${PY:-python3}
BENCH=${GPU_BENCH:-bench/gpu_bench.py}
PYTEST=${GPU_PYTEST:-$PY -m pytest}
DALI_WHL=${GDSLOAD_DALI_WHEELS:-/tmp/dali-whl}
WHL=${GDSLOAD_WHL_DIR:-.whl}
MEDIA_DIR=${GDSLOAD_MEDIA_DIR:-.media}
export PYTHONUNBUFFERED=1
caps=$("$PY" bench/gpu_plan.py --caps "$PART") || { echo "bench/gpu_plan.py --caps $PART failed" >&2; exit 2; }
eval "$caps"

mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu-check.log") 2>&1
TEE_PID=$!
rm -f "$OUT/gpu-check.json"
t0=$SECONDS
EXPECT=() FILES=pytest.xml
[[ -n $RECEIVE ]] && EXPECT+=(receive)
if [[ $PART == 1 ]]; then
  EXPECT+=(install import nvdec doctor pytest ${BENCH_STEPS//,/ }) FILES=doctor.json,pytest.xml
else
  EXPECT+=(install assemble dali_install dali_import pytest ${BENCH_STEPS//,/ } ${MEDIA_STEPS//,/ })
fi

row() { "$PY" bench/gpu_table.py add "$OUT" "$@" >/dev/null; echo "[gpu_check] $1: $2 $3"; }
verdict() {  # print the table with the verdict's rows; close the log (wait for tee) and exit with its status
  echo
  "$PY" bench/gpu_table.py print "$OUT" --expect "$(IFS=,; echo "${EXPECT[*]}")" --files "$FILES"
  local status=$?
  echo "[gpu_check] part $PART: total $((SECONDS - t0)) s; exit $status"
  exec 1>&- 2>&-
  wait "$TEE_PID" 2>/dev/null
  exit $status
}
carried() { "$PY" -c 'import json,sys; print(" ".join(json.load(open(sys.argv[1]))[sys.argv[2]]["pins"]))' bench/gpu_wheels.json "$1"; }
capped() {  # capped CAP STEP CMD...: run CMD under its cap; its output into $out; FAIL row on a timeout
  local cap=$1 step=$2; shift 2
  out=$(timeout -k 5 "$cap" "$@" 2>&1)
  local rc=$?
  if (( rc == 124 || rc == 137 )); then echo "$out"; row "$step" FAIL "timed out after ${cap}s" "" $((SECONDS - t)); fi
  return $rc
}

# receive: a DALI part kept in .dali-parts/ (git-ignored: a warm machine keeps it between calls) -------
if [[ -n $RECEIVE ]]; then
  t=$SECONDS
  if capped "$RECEIVE_CAP_S" receive "$PY" bench/gpu_wheels.py receive "$RECEIVE"; then
    row receive PASS "$(tail -1 <<<"$out")" "" $((SECONDS - t))
  else
    rc=$?; echo "$out"
    (( rc == 124 || rc == 137 )) || row receive FAIL "$RECEIVE: $(tail -1 <<<"$out")" "" $((SECONDS - t))
  fi
fi

# install: pip only when these exact wheels are not installed yet (part 2, a rerun) ----------------
install() {  # install STEP WHEEL...
  local step=$1; shift
  local t=$SECONDS marker="$SITE/.gdsload-installed-$step" want
  want=$(for w in "$@"; do basename "$w"; done | sort | sha256sum | cut -c1-16)
  if [[ -f $marker && $(cat "$marker") == "$want" ]]; then
    row "$step" PASS "already installed ($# wheels, marker)" "" $((SECONDS - t)); return 0
  fi
  local cap=$INSTALL_CAP_S; [[ $step == dali_install ]] && cap=$DALI_INSTALL_CAP_S
  if capped "$cap" "$step" "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
       --target "$SITE" "$@"; then
    echo "$want" >"$marker"
    row "$step" PASS "$# wheels" "" $((SECONDS - t))
  else
    local rc=$?; echo "$out"
    (( rc == 124 || rc == 137 )) || row "$step" FAIL "pip install failed (see log)" "" $((SECONDS - t))
    return 1
  fi
}
missing=()
for name in $(carried carry); do ls "$WHL/${name//-/_}"-*.whl >/dev/null 2>&1 || missing+=("$name"); done
if (( ${#missing[@]} )); then
  row install FAIL "missing in $WHL/: ${missing[*]} (carry .whl with call 1; part 2 on a cold machine?)" "" 0
  verdict
fi
install install "$WHL"/*.whl || verdict
export PYTHONPATH=$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}

# bench: a crash is a FAIL row, steps it never reached are NOT EXERCISED (the verdict) -----------------
bench() {  # bench STEPS CAP [ARGS: gpu_bench's arguments, the plan's PART_ARGS, word-split]
  local t=$SECONDS rc name=bench
  [[ $1 == *,* ]] || name=bench_$1
  local -a extra
  read -ra extra <<<"${3:-}"
  timeout -k 10 "$2" "$PY" "$BENCH" --out "$OUT" --steps "$1" "${extra[@]}"
  rc=$?
  local after=""
  if (( rc != 0 && rc != 1 )) && "$PY" -c 'import json,sys; rows={r["step"] for r in json.load(open(sys.argv[1]))["rows"]}; sys.exit(not set(sys.argv[2].split(",")) <= rows)' "$OUT/gpu-check.json" "$1" 2>/dev/null; then
    after=" at exit, after all its steps"
  fi
  case $rc in
    0|1) ;;
    124|137) row $name FAIL "timed out after ${2}s (rc=$rc)$after" "" $((SECONDS - t)) ;;
    134) row $name FAIL "native crash: SIGABRT (rc=134)$after" "" $((SECONDS - t)) ;;
    139) row $name FAIL "native crash: SIGSEGV (rc=139)$after" "" $((SECONDS - t)) ;;
    *) row $name FAIL "gpu_bench exited rc=$rc$after" "" $((SECONDS - t)) ;;
  esac
}

# pytest: the plan's selection; PASS only when it ran every selected test and none skipped or failed --
run_pytest() {
  local t=$SECONDS rc files
  read -ra files <<<"$PYTEST_FILES"
  timeout -k 10 "$PYTEST_CAP_S" $PYTEST -q -p no:cacheprovider --tb=short -rs -m "$PYTEST_MARK" "${files[@]}" \
    --junitxml="$OUT/pytest.xml" 2>&1 | tail -n 60
  rc=${PIPESTATUS[0]}
  if (( rc == 124 || rc == 137 )); then
    row pytest FAIL "timed out after ${PYTEST_CAP_S}s" "" $((SECONDS - t)); return
  fi
  local judged
  judged=$("$PY" bench/gpu_table.py junit "$OUT/pytest.xml" "$PYTEST_TESTS" 2>&1)
  case $? in
    0) row pytest PASS "$judged" "" $((SECONDS - t)) ;;
    *) row pytest FAIL "rc=$rc: $judged" "" $((SECONDS - t)) ;;
  esac
}

if [[ $PART == 1 ]]; then
  t=$SECONDS
  if capped "$IMPORT_CAP_S" import "$PY" -c '
import kvikio, cupy, torch
assert torch.cuda.is_available(), "torch.cuda.is_available() is False: no usable GPU for torch"
assert int(cupy.arange(5).sum()) == 10  # a CuPy kernel ran
print("kvikio", kvikio.__version__, "cupy", cupy.__version__, "torch", torch.__version__, torch.cuda.get_device_name(0))'; then
    row import PASS "$(tail -1 <<<"$out")" "" $((SECONDS - t))
  else
    rc=$?; echo "$out"
    (( rc == 124 || rc == 137 )) || row import FAIL "$(tail -1 <<<"$out")" "" $((SECONDS - t))
    echo "[gpu_check] STOP: 'import kvikio, cupy, torch' with CUDA failed; the GPU path cannot be tested"
    verdict
  fi
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  bench nvdec "$NVDEC_CAP_S"  # no DALI needed: known before DALI's parts are sent
  t=$SECONDS
  if timeout -k 5 "$DOCTOR_CAP_S" "$PY" -m gdsload doctor --json >"$OUT/doctor.json"; then
    fig=$("$PY" -c 'import json,sys; d=json.load(open(sys.argv[1])); print("io", d["io_path"], "decode", d["decode_device"], "cufile", d["cufile"]["loaded"])' "$OUT/doctor.json")
    row doctor INFO "$fig" "" $((SECONDS - t))
  else
    row doctor FAIL "gdsload doctor rc=$? (see log)" "" $((SECONDS - t))
  fi
  run_pytest
  bench "$BENCH_STEPS" "$BENCH_CAP_S" "$BENCH_ARGS"
  verdict
fi

# part 2: DALI ---------------------------------------------------------------------------------------
t=$SECONDS
if ls "$DALI_WHL"/*.whl >/dev/null 2>&1; then
  row assemble PASS "already assembled in $DALI_WHL (a rerun)" "" 0
elif capped "$ASSEMBLE_CAP_S" assemble "$PY" bench/gpu_wheels.py assemble; then
  row assemble PASS "$(tail -1 <<<"$out")" "" $((SECONDS - t))
else
  rc=$?; echo "$out"
  (( rc == 124 || rc == 137 )) || row assemble FAIL "DALI's parts are not all here: $(tail -1 <<<"$out")" "" $((SECONDS - t))
  verdict
fi
install dali_install "$DALI_WHL"/*.whl || verdict
export GDSLOAD_DALI_CARRIED=1  # gpu_bench: a DALI that does not import is a FAIL, not a SKIP
bench dali_import "$DALI_IMPORT_CAP_S"
run_pytest
bench "$BENCH_STEPS" "$BENCH_CAP_S" "$BENCH_ARGS"
# video (NVDEC against PyAV's frames by PSNR, clips/s) and audio: clips made here by
# `python bench/media_gpu_check.py make .media` and carried (no PyAV on the GPU host); rows as they end
t=$SECONDS
if [[ -f $MEDIA_DIR/ref.npz ]]; then
  timeout -k 5 "$MEDIA_CAP_S" "$PY" bench/media_gpu_check.py check "$MEDIA_DIR" --device mixed --out "$OUT"
  rc=$?
  case $rc in
    0|1) ;;
    124|137) row media FAIL "timed out after ${MEDIA_CAP_S}s" "" $((SECONDS - t)) ;;
    *) row media FAIL "media_gpu_check rc=$rc (see log)" "" $((SECONDS - t)) ;;
  esac
else
  row media FAIL "$MEDIA_DIR/ref.npz is missing: carry .media with the last call" "" 0
fi
verdict
