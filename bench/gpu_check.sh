#!/usr/bin/env bash
# The check to run on a GPU host, in two parts that each fit a device call (bench/gpu_plan.py):
#   bash bench/gpu_check.sh --dry-run     the plan: each call, what it sends (MiB), its time; non-zero if over budget
#   bash bench/gpu_check.sh --part 1      no DALI: install .whl/, import, doctor, pytest -m "gpu or gds",
#                                         gpu_bench data,device_path,kvikio_rows,raw_tier,ring_safety
#   bash bench/gpu_check.sh --part 2      DALI: assemble its parts (bench/gpu_wheels.py), install, import
#                                         nvidia.dali, gpu_bench data,mixed_vs_cpu,mixed_busy,resnet50,
#                                         then bench/media_gpu_check.py on the carried .media/ clips
# An install already done (same wheels) is skipped: a marker file in $SITE. Every step adds a row
# (step | status | figure | ratio | seconds) to $OUT/gpu-check.json at once; the log is
# $OUT/gpu-check.log. The verdict: FAIL on any FAIL row, on a step with no row ("NOT EXERCISED":
# gpu_bench crashed or stopped before it), on a gpu_bench exit other than 0/1 (a native crash,
# 134/139, is named), and on a DALI that was carried but does not import. Exit 0 only when every
# expected step has a PASS/INFO row (SKIP only for what was not carried).
set -uo pipefail
cd "$(dirname "$0")/.."
PART=""
case ${1:-} in
  --dry-run) exec "${PY:-python3}" bench/gpu_plan.py ;;
  --part) PART=${2:-}; shift 2 ;;
  *) echo "usage: bash bench/gpu_check.sh --dry-run | --part 1 | --part 2" >&2; exit 2 ;;
esac
[[ $PART == 1 || $PART == 2 ]] || { echo "--part takes 1 or 2, got '$PART'" >&2; exit 2; }
OUT=${OUT:-bench/results/tmp}
SITE=${SITE:-/tmp/site}
PY=${PY:-python3}
BENCH=${GPU_BENCH:-bench/gpu_bench.py}
DALI_WHL=${GDSLOAD_DALI_WHEELS:-/tmp/dali-whl}
WHL=${GDSLOAD_WHL_DIR:-.whl}
PYTEST_TIMEOUT_S=${PYTEST_TIMEOUT_S:-75}
BENCH_TIMEOUT_S=${BENCH_TIMEOUT_S:-$([[ $PART == 1 ]] && echo 150 || echo 80)}
MEDIA_TIMEOUT_S=${MEDIA_TIMEOUT_S:-20}
MEDIA_DIR=${GDSLOAD_MEDIA_DIR:-.media}
GPU_TESTS=(tests/test_gpu_path.py tests/ring/test_ring.py tests/loader/test_dataloader.py tests/io/test_conformance.py)
STEPS1=data,device_path,kvikio_rows,raw_tier,ring_safety
STEPS2=data,mixed_vs_cpu,mixed_busy,resnet50
export PYTHONUNBUFFERED=1

mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu-check.log") 2>&1
rm -f "$OUT/gpu-check.json"
t0=$SECONDS
row() { "$PY" bench/gpu_table.py add "$OUT" "$@" >/dev/null; echo "[gpu_check] $1: $2 $3"; }
verdict() {  # print the table, FAIL for every expected step without a row; exit with its status
  echo
  "$PY" bench/gpu_table.py print "$OUT" --expect "$1"
  local status=$?
  echo "[gpu_check] part $PART: total $((SECONDS - t0)) s; exit $status"
  exit $status
}
carried() { "$PY" -c 'import json,sys; print(" ".join(json.load(open(sys.argv[1]))[sys.argv[2]]["pins"]))' bench/gpu_wheels.json "$1"; }

# install: pip only when these exact wheels are not installed yet (a rerun on a warm machine) ------
install() {  # install STEP WHEEL...
  local step=$1; shift
  local t=$SECONDS marker="$SITE/.gdsload-installed-$step" want
  want=$(for w in "$@"; do basename "$w"; done | sort | sha256sum | cut -c1-16)
  if [[ -f $marker && $(cat "$marker") == "$want" ]]; then
    row "$step" PASS "already installed ($# wheels, marker)" "" $((SECONDS - t)); return 0
  fi
  if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$@"; then
    echo "$want" >"$marker"
    row "$step" PASS "$# wheels" "" $((SECONDS - t))
  else
    row "$step" FAIL "pip install failed (see log)" "" $((SECONDS - t)); return 1
  fi
}
missing=()
for name in $(carried carry); do ls "$WHL/${name//-/_}"-*.whl >/dev/null 2>&1 || missing+=("$name"); done
if (( ${#missing[@]} )); then
  row install FAIL "missing in .whl/: ${missing[*]} (carry .whl)" "" 0
  verdict install
fi
install install "$WHL"/*.whl || verdict install
export PYTHONPATH=$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}

# bench: a crash is a FAIL row, steps it never reached are NOT EXERCISED (gpu_table --expect) -----
bench() {  # bench STEPS
  local t=$SECONDS rc
  timeout -k 10 "$BENCH_TIMEOUT_S" "$PY" "$BENCH" --out "$OUT" --steps "$1"
  rc=$?
  case $rc in
    0|1) ;;
    124|137) row bench FAIL "timed out after ${BENCH_TIMEOUT_S}s (rc=$rc)" "" $((SECONDS - t)) ;;
    134) row bench FAIL "native crash: SIGABRT (rc=134)" "" $((SECONDS - t)) ;;
    139) row bench FAIL "native crash: SIGSEGV (rc=139)" "" $((SECONDS - t)) ;;
    *) row bench FAIL "gpu_bench exited rc=$rc" "" $((SECONDS - t)) ;;
  esac
}

if [[ $PART == 1 ]]; then
  t=$SECONDS
  if ver=$("$PY" -c 'import kvikio, cupy, torch; print("kvikio", kvikio.__version__, "cupy", cupy.__version__, "torch", torch.__version__, "cuda", torch.cuda.is_available())' 2>"$OUT/import.err"); then
    row import PASS "$ver" "" $((SECONDS - t))
  else
    row import FAIL "$(tail -1 "$OUT/import.err")" "" $((SECONDS - t))
    echo "[gpu_check] STOP: 'import kvikio, cupy, torch' failed; the GPU path cannot be tested:"
    cat "$OUT/import.err"
    verdict "install,import,doctor,pytest,$STEPS1"
  fi
  t=$SECONDS
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  if "$PY" -m gdsload doctor --json >"$OUT/doctor.json" 2>"$OUT/doctor.err"; then
    fig=$("$PY" -c 'import json,sys; d=json.load(open(sys.argv[1])); print("io", d["io_path"], "decode", d["decode_device"], "cufile", d["cufile"]["loaded"])' "$OUT/doctor.json")
    row doctor INFO "$fig" "" $((SECONDS - t))
  else
    row doctor FAIL "$(tail -1 "$OUT/doctor.err")" "" $((SECONDS - t))
  fi
  t=$SECONDS
  timeout -k 10 "$PYTEST_TIMEOUT_S" "$PY" -m pytest -q -p no:cacheprovider -m "gpu or gds" \
    "${GPU_TESTS[@]}" --junitxml="$OUT/pytest.xml" >"$OUT/pytest.log" 2>&1
  rc=$?
  summary=$(tail -1 "$OUT/pytest.log")
  tail -30 "$OUT/pytest.log"
  case $rc in
    0) row pytest PASS "$summary" "" $((SECONDS - t)) ;;
    5) row pytest FAIL "no GPU test collected: $summary" "" $((SECONDS - t)) ;;
    124|137) row pytest FAIL "timed out after ${PYTEST_TIMEOUT_S}s" "" $((SECONDS - t)) ;;
    *) row pytest FAIL "rc=$rc $summary" "" $((SECONDS - t)) ;;
  esac
  bench "$STEPS1"
  verdict "install,import,doctor,pytest,$STEPS1"
fi

# part 2: DALI -------------------------------------------------------------------------------------
t=$SECONDS
if ! ls "$DALI_WHL"/*.whl >/dev/null 2>&1; then
  if ! "$PY" bench/gpu_wheels.py assemble; then
    row dali_install FAIL "DALI's parts are not all here (the machine went cold? send .dali1.. again)" "" $((SECONDS - t))
    verdict "install,dali_install,dali_import,$STEPS2"
  fi
fi
install dali_install "$DALI_WHL"/*.whl || verdict "install,dali_install,dali_import,$STEPS2"
export GDSLOAD_DALI_CARRIED=1  # gpu_bench: a DALI that does not import is a FAIL, not a SKIP
t=$SECONDS
if ver=$("$PY" -c 'import nvidia.dali as d, torch; print("dali", d.__version__, "cuda", torch.cuda.is_available())' 2>"$OUT/dali-import.err"); then
  row dali_import PASS "$ver" "" $((SECONDS - t))
else
  row dali_import FAIL "DALI carried but does not import: $(tail -1 "$OUT/dali-import.err")" "" $((SECONDS - t))
  cat "$OUT/dali-import.err"
fi
bench "$STEPS2"
# video (NVDEC against PyAV's frames by PSNR) and audio: clips made here by
# `python bench/media_gpu_check.py make .media` and carried (no PyAV on the GPU host) -------------
t=$SECONDS
MEDIA_STEPS=video_h264,video_hevc,video_vp9,audio_flac,audio_wav
if [[ -f $MEDIA_DIR/ref.npz ]]; then
  timeout -k 5 "$MEDIA_TIMEOUT_S" "$PY" bench/media_gpu_check.py check "$MEDIA_DIR" --device mixed >"$OUT/media.jsonl" 2>"$OUT/media.err"
  rc=$?
  while IFS= read -r line; do
    set -- $("$PY" -c 'import json,sys; r=json.loads(sys.argv[1]); print(r["step"], r["status"])' "$line")
    row "$1" "$2" "$("$PY" -c 'import json,sys; print(json.loads(sys.argv[1])["figure"])' "$line")" "" $((SECONDS - t))
  done <"$OUT/media.jsonl"
  case $rc in 0|1) ;; *) row media FAIL "media_gpu_check rc=$rc: $(tail -1 "$OUT/media.err")" "" $((SECONDS - t)) ;; esac
else
  for s in ${MEDIA_STEPS//,/ }; do row "$s" SKIP "$MEDIA_DIR/ not carried" "" 0; done
fi
verdict "install,dali_install,dali_import,$STEPS2,$MEDIA_STEPS"
