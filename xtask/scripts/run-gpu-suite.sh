#!/usr/bin/env bash
# The GPU test suite, from a bundle made by `cargo xtask gpu-bundle`; needs no Rust.
# Run it from the repository root:
#     bash .bundle/run-gpu-suite.sh [--tests-only | --skip-tests] [--jobs N]
#                                   [-- TEST ARGS]
#
#  1. unless --skip-tests: every test binary (bin/tests/*), tests in parallel, with
#     KERNELS_REQUIRE_GPU=1 (a missing GPU fails every test instead of skipping it); TEST ARGS
#     (e.g. a name filter) are passed on; then, if the bundle has the PyTorch package
#     (python/), its pytest suite (run-python-tests.sh --tests-only), counted with the others.
#     --jobs N runs up to N of these (the binaries and pytest) at once on the one GPU, each
#     one's output printed whole when all have ended (default 3: on the H100 the same 546 /
#     0 / 1 in 81-90 s as one after another in 290 s; --jobs 1 prints each as it runs); the
#     tensor-core GEMM tests run a second time with KERNELS_PTX_ARCH=sm_80 (the Ampere kernels);
#  2. unless --tests-only: every example (bin/examples/*); every bench NAME (bin/benches/NAME
#     --bench, with KERNELS_BENCH_JSON=RES/bench-NAME.json); the bundle's torch_NAME.py for each
#     (to RES/torch-NAME.json);
#     then for each bench the bundle's compare.py: `python3 compare.py RES/bench-NAME.json
#     RES/torch-NAME.json --json RES/results.json` (the run's tables in the format of
#     docs/results/, for scripts/report.py); and the PyTorch package's
#     bench.py and the paired small sizes, torch_paired.py (run-python-tests.sh --bench-only, to
#     RES/python-bench.json and RES/torch-paired.json).
# RES is $OUT if set (with tests.log, examples.log, bench.log, torch.log and compare.log), else
# the current folder (no logs). Every PyTorch figure comes from the bundle's own scripts.
# The last line is the test summary: `N passed, N failed, N skipped`. Exit status 1 if a test
# failed (or a test binary crashed), an example or a bench failed; torch_NAME.py and compare.py
# failures are reported but do not change it.
set -uo pipefail

B="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

# The binaries travel packed (`cargo xtask gpu-bundle` writes bin.tar.xz): unpack them once.
if [ ! -d "$B/bin" ] && [ -f "$B/bin.tar.xz" ]; then
  tar -xJf "$B/bin.tar.xz" -C "$B" || { echo "error: cannot unpack $B/bin.tar.xz"; exit 1; }
fi
TESTS_ONLY=0
SKIP_TESTS=0
JOBS=3
ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --tests-only) TESTS_ONLY=1 ;;
    --skip-tests) SKIP_TESTS=1 ;;
    --jobs) shift; JOBS="${1:-}" ;;
    --jobs=*) JOBS="${1#--jobs=}" ;;
    -h|--help) sed -n '2,26p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    --) shift; ARGS+=("$@"); break ;;
    *) ARGS+=("$1") ;;
  esac
  shift
done
case "$JOBS" in
  '' | *[!0-9]* | 0) echo "error: --jobs takes a whole number of at least 1, got '$JOBS'"; exit 2 ;;
esac

export KERNELS_REQUIRE_GPU=1
# NCCL for kernels::dist (tests/dist.rs, benches/dist.rs): the copy in PyTorch's pip wheels
# (nvidia-nccl-cu12), unless KERNELS_NCCL_LIB already names one; NVLink multicast stays off in
# every program started from here.
if [ -z "${KERNELS_NCCL_LIB:-}" ]; then
  NCCL_LIB="$(python3 -c 'import nvidia.nccl as m, os; print(os.path.join(list(m.__path__)[0], "lib", "libnccl.so.2"))' 2>/dev/null || true)"
  if [ -n "$NCCL_LIB" ] && [ -f "$NCCL_LIB" ]; then export KERNELS_NCCL_LIB="$NCCL_LIB"; fi
fi
export NCCL_NVLS_ENABLE=0
# The commit the bundle was built from, for the results' data (benches/results_json.py).
if [ -z "${KERNELS_COMMIT:-}" ] && [ -f "$B/COMMIT" ]; then export KERNELS_COMMIT="$(cat "$B/COMMIT")"; fi
# cuBLAS for the GEMM bench's in-process baseline: the copy in PyTorch's pip wheels
# (nvidia-cublas-cu12), when there is no system one.
CUBLAS_DIR="$(python3 -c 'import nvidia.cublas as m, os; print(os.path.join(list(m.__path__)[0], "lib"))' 2>/dev/null || true)"
if [ -n "$CUBLAS_DIR" ] && [ -d "$CUBLAS_DIR" ]; then
  export LD_LIBRARY_PATH="$CUBLAS_DIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT"
  RES="$OUT"
  LOG="$OUT/tests.log"; XLOG="$OUT/examples.log"; BLOG="$OUT/bench.log"
  TLOG="$OUT/torch.log"; CLOG="$OUT/compare.log"
  : > "$LOG"
else
  RES="."
  LOG=/dev/null; XLOG=/dev/null; BLOG=/dev/null; TLOG=/dev/null; CLOG=/dev/null
fi
RESULTS_JSON="$RES/results.json"
TMP="$(mktemp)"
trap 'rm -f "$TMP"' EXIT

echo "== bundle: $B"
echo "== host: $(hostname 2>/dev/null || echo '?'), $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi
else
  echo "(no nvidia-smi on PATH)"
fi

# --- tests ------------------------------------------------------------------------------------
TOTAL_P=0; TOTAL_F=0; TOTAL_S=0; NBIN=0
SUMMARY=()
# Adds one test binary's counts to the totals: name, its output (a file), exit status, seconds.
tally_bin() {
  local name=$1 file=$2 rc=$3 secs=$4 p f s n note=""
  # Sum every "test result: ... N passed; N failed; N ignored; ..." line of this binary.
  read -r p f s n < <(awk '/^test result:/ {
      n++
      for (i = 2; i <= NF; i++) {
        if ($i ~ /^passed;?$/) p += $(i - 1)
        if ($i ~ /^failed;?$/) f += $(i - 1)
        if ($i ~ /^ignored;?$/) s += $(i - 1)
      }
    } END { printf "%d %d %d %d\n", p, f, s, n }' "$file")
  if [ "$n" -eq 0 ]; then
    f=$((f + 1)); note=" (no test result line: exit status $rc; counted as 1 failure)"
  elif [ "$rc" -ne 0 ] && [ "$f" -eq 0 ]; then
    f=1; note=" (exit status $rc with no failed test; counted as 1 failure)"
  fi
  TOTAL_P=$((TOTAL_P + p)); TOTAL_F=$((TOTAL_F + f)); TOTAL_S=$((TOTAL_S + s))
  SUMMARY+=("  $name: $p passed, $f failed, $s skipped in ${secs}s$note")
}
# The same for the PyTorch package's tests (its script prints `python: N passed, N failed, N
# skipped` last).
tally_python() {
  local file=$1 rc=$2 secs=$3 p f s note=""
  read -r p f s < <(awk '/^python: [0-9]+ passed/ { p = $2; f = $4; s = $6 } END { printf "%d %d %d\n", p, f, s }' "$file")
  if ! grep -q '^python: [0-9]* passed' "$file" || { [ "$rc" -ne 0 ] && [ "$f" -eq 0 ]; }; then
    f=$((f + 1)); note=" (exit status $rc; counted as 1 failure)"
  fi
  TOTAL_P=$((TOTAL_P + p)); TOTAL_F=$((TOTAL_F + f)); TOTAL_S=$((TOTAL_S + s))
  SUMMARY+=("  python (pytest): $p passed, $f failed, $s skipped in ${secs}s$note")
}
BINS=()
if [ "$SKIP_TESTS" -eq 0 ]; then
  for t in "$B"/bin/tests/*; do
    [ -f "$t" ] && [ -x "$t" ] && BINS+=("$t")
  done
fi
NBIN=${#BINS[@]}
# Binaries run a second time on the portable PTX (KERNELS_PTX_ARCH=sm_80): on an H100 the
# tensor-core GEMMs then run their Ampere kernels (mma.sync) instead of the Hopper ones.
SM80_RERUN=(gemm_tc linear_tc attention)
SM80=()
for i in $(seq 0 $((NBIN - 1))); do
  for r in "${SM80_RERUN[@]}"; do
    [ "$(basename "${BINS[$i]}")" = "$r" ] && SM80+=("$i")
  done
done
PYTESTS=0
[ "$SKIP_TESTS" -eq 0 ] && [ -f "$B/run-python-tests.sh" ] && PYTESTS=1
if [ "$JOBS" -eq 1 ]; then
  for t in ${BINS[@]+"${BINS[@]}"}; do
    name="$(basename "$t")"
    echo "== test $name" | tee -a "$LOG"
    : > "$TMP"
    start=$SECONDS
    "$t" ${ARGS[@]+"${ARGS[@]}"} 2>&1 | tee -a "$LOG" "$TMP"
    tally_bin "$name" "$TMP" "${PIPESTATUS[0]}" $((SECONDS - start))
  done
  for i in ${SM80[@]+"${SM80[@]}"}; do
    name="$(basename "${BINS[$i]}") (sm_80 PTX)"
    echo "== test $name" | tee -a "$LOG"
    : > "$TMP"
    start=$SECONDS
    KERNELS_PTX_ARCH=sm_80 "${BINS[$i]}" ${ARGS[@]+"${ARGS[@]}"} 2>&1 | tee -a "$LOG" "$TMP"
    tally_bin "$name" "$TMP" "${PIPESTATUS[0]}" $((SECONDS - start))
  done
  if [ "$PYTESTS" -eq 1 ]; then
    echo "== python tests" | tee -a "$LOG"
    : > "$TMP"
    start=$SECONDS
    bash "$B/run-python-tests.sh" --tests-only 2>&1 | tee -a "$LOG" "$TMP"
    tally_python "$TMP" "${PIPESTATUS[0]}" $((SECONDS - start))
  fi
else
  # Each job writes its output to JD/<i>.out and "<exit status> <seconds>" to JD/<i>.rc; the
  # outputs are printed and counted in the usual order once every job has ended. pytest (job
  # p) starts first: it is one of the longest.
  JD="$(mktemp -d)"
  trap 'rm -f "$TMP"; rm -rf "$JD"' EXIT
  run_job() { # id, command...
    local id=$1 start=$SECONDS
    shift
    "$@" > "$JD/$id.out" 2>&1
    echo "$? $((SECONDS - start))" > "$JD/$id.rc"
  }
  echo "== tests: $NBIN binaries$([ "$PYTESTS" -eq 0 ] || echo ' and pytest'), up to $JOBS at once" | tee -a "$LOG"
  tests_start=$SECONDS
  running=0
  IDS=()
  [ "$PYTESTS" -eq 0 ] || IDS+=(p)
  for i in $(seq 0 $((NBIN - 1))); do IDS+=("$i"); done
  for i in ${SM80[@]+"${SM80[@]}"}; do IDS+=("s$i"); done
  for id in ${IDS[@]+"${IDS[@]}"}; do
    if [ "$running" -ge "$JOBS" ]; then
      wait -n
      running=$((running - 1))
    fi
    if [ "$id" = p ]; then
      run_job p bash "$B/run-python-tests.sh" --tests-only &
    elif [ "${id#s}" != "$id" ]; then
      run_job "$id" env KERNELS_PTX_ARCH=sm_80 "${BINS[${id#s}]}" ${ARGS[@]+"${ARGS[@]}"} &
    else
      run_job "$id" "${BINS[$id]}" ${ARGS[@]+"${ARGS[@]}"} &
    fi
    running=$((running + 1))
  done
  wait
  # Prints and counts job `id` as test binary `name`.
  show_job() {
    local name=$1 id=$2 rc secs
    echo "== test $name" | tee -a "$LOG"
    tee -a "$LOG" < "$JD/$id.out"
    read -r rc secs < "$JD/$id.rc" || { rc=1; secs=0; }
    tally_bin "$name" "$JD/$id.out" "$rc" "$secs"
  }
  for i in $(seq 0 $((NBIN - 1))); do show_job "$(basename "${BINS[$i]}")" "$i"; done
  for i in ${SM80[@]+"${SM80[@]}"}; do show_job "$(basename "${BINS[$i]}") (sm_80 PTX)" "s$i"; done
  if [ "$PYTESTS" -eq 1 ]; then
    echo "== python tests" | tee -a "$LOG"
    tee -a "$LOG" < "$JD/p.out"
    read -r rc secs < "$JD/p.rc" || { rc=1; secs=0; }
    tally_python "$JD/p.out" "$rc" "$secs"
  fi
  SUMMARY+=("  (up to $JOBS at once: $((SECONDS - tests_start))s in all)")
fi
if [ "$NBIN" -eq 0 ] && [ "$SKIP_TESTS" -eq 0 ]; then
  echo "error: no test binaries under $B/bin/tests" | tee -a "$LOG"
  TOTAL_F=$((TOTAL_F + 1))
fi
TEST_LINE="$TOTAL_P passed, $TOTAL_F failed, $TOTAL_S skipped"
[ "$SKIP_TESTS" -eq 0 ] || TEST_LINE="$TEST_LINE (tests not run: --skip-tests)"
{
  echo "== test summary ($NBIN binaries)"
  for l in ${SUMMARY[@]+"${SUMMARY[@]}"}; do echo "$l"; done
  echo "$TEST_LINE"
} | tee -a "$LOG"

STATUS=0
[ "$TOTAL_F" -eq 0 ] || STATUS=1
if [ "$TESTS_ONLY" -eq 1 ]; then
  exit "$STATUS"
fi

# --- examples, benches, PyTorch's baselines --------------------------------------------------------
EXTRA=()
for e in "$B"/bin/examples/*; do
  [ -f "$e" ] && [ -x "$e" ] || continue
  name="$(basename "$e")"
  echo "== example $name" | tee -a "$XLOG"
  "$e" 2>&1 | tee -a "$XLOG"
  rc=${PIPESTATUS[0]}
  if [ "$rc" -ne 0 ]; then STATUS=1; EXTRA+=("  example $name: FAILED (exit status $rc)"); else EXTRA+=("  example $name: ok"); fi
done

# Each bench NAME writes RES/bench-NAME.json; its PyTorch baselines, the bundle's torch_NAME.py,
# write RES/torch-NAME.json.
BENCH_NAMES=()
for b in "$B"/bin/benches/*; do
  [ -f "$b" ] && [ -x "$b" ] || continue
  name="$(basename "$b")"
  BENCH_NAMES+=("$name")
  json="$RES/bench-$name.json"
  rm -f "$json"
  echo "== bench $name (KERNELS_BENCH_JSON=$json)" | tee -a "$BLOG"
  KERNELS_BENCH_JSON="$json" "$b" --bench 2>&1 | tee -a "$BLOG"
  rc=${PIPESTATUS[0]}
  if [ "$rc" -ne 0 ]; then STATUS=1; EXTRA+=("  bench $name: FAILED (exit status $rc)"); else EXTRA+=("  bench $name: ok"); fi
done

# The baselines read the op table from the PyTorch package (its native module): its wheel,
# installed into a temporary folder for them.
wheel="$(ls "$B"/python/*.whl 2>/dev/null | head -n 1)"
if [ -n "$wheel" ]; then
  PYSITE="$(mktemp -d)"
  python3 -m pip install --quiet --disable-pip-version-check --no-deps --no-index --target "$PYSITE" "$wheel" >/dev/null 2>&1 \
    || python3 -m zipfile -e "$wheel" "$PYSITE"
  export PYTHONPATH="$PYSITE${PYTHONPATH:+:$PYTHONPATH}"
fi
for name in ${BENCH_NAMES[@]+"${BENCH_NAMES[@]}"}; do
  py="$B/torch_$name.py"
  [ -f "$py" ] || continue
  json="$RES/torch-$name.json"
  rm -f "$json"
  echo "== torch baselines: python3 $py $json" | tee -a "$TLOG"
  python3 "$py" "$json" 2>&1 | tee -a "$TLOG"
  rc=${PIPESTATUS[0]}
  if [ "$rc" -ne 0 ]; then EXTRA+=("  torch_$name.py: FAILED (exit status $rc; not counted)"); else EXTRA+=("  torch_$name.py: $json"); fi
done

if [ -f "$B/run-python-tests.sh" ]; then
  echo "== python bench" | tee -a "$BLOG"
  bash "$B/run-python-tests.sh" --bench-only 2>&1 | tee -a "$BLOG"
  rc=${PIPESTATUS[0]}
  if [ "$rc" -ne 0 ]; then EXTRA+=("  python bench: FAILED (exit status $rc; not counted)"); else EXTRA+=("  python bench: $RES/python-bench.json"); fi
fi

if [ -f "$B/compare.py" ]; then
  rm -f "$RESULTS_JSON"
  for name in ${BENCH_NAMES[@]+"${BENCH_NAMES[@]}"}; do
    bj="$RES/bench-$name.json"; tj="$RES/torch-$name.json"
    if [ -f "$bj" ] && [ -f "$tj" ]; then
      CMP=("$bj" "$tj" --json "$RESULTS_JSON")
      echo "== compare $name: python3 $B/compare.py ${CMP[*]}" | tee -a "$CLOG"
      python3 "$B/compare.py" "${CMP[@]}" 2>&1 | tee -a "$CLOG"
      rc=${PIPESTATUS[0]}
      if [ "$rc" -ne 0 ]; then EXTRA+=("  compare.py $name: FAILED (exit status $rc; not counted)"); else EXTRA+=("  compare.py $name: ok"); fi
    else
      EXTRA+=("  compare.py $name: not run (needs $bj and $tj)")
    fi
  done
  [ ! -f "$RESULTS_JSON" ] || EXTRA+=("  results: $RESULTS_JSON")
fi

echo "== summary"
for l in ${EXTRA[@]+"${EXTRA[@]}"}; do echo "$l"; done
for l in ${SUMMARY[@]+"${SUMMARY[@]}"}; do echo "$l"; done
echo "$TEST_LINE"
exit "$STATUS"
