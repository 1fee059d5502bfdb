#!/usr/bin/env bash
# The PyTorch package (python/) on the GPU machine, from a bundle made by `cargo xtask gpu-bundle`:
#     bash .bundle/run-python-tests.sh [--tests-only | --bench-only] [-- PYTEST ARGS]
#
# Installs the bundle's wheel into a temporary folder (`pip install --no-deps --no-index
# --target`, or unzipped if pip is missing; nothing is installed for the system), then
#  1. unless --bench-only: pytest on the bundle's python/tests, with KERNELS_REQUIRE_GPU=1 (a
#     missing GPU fails instead of skipping); log $OUT/python-tests.log;
#  2. unless --tests-only: python/bench.py (KERNELS_PY_BENCH_ARGS, e.g. --quick, passed on),
#     writing $OUT/python-bench.json (else ./python-bench.json); python/bench_attention.py
#     (attention against PyTorch's SDPA; --quick passed on), writing
#     $OUT/python-bench-attention.json; then the bundle's torch_paired.py (the small sizes, ours
#     and PyTorch's kernels paired in one process), writing $OUT/torch-paired.json; log
#     $OUT/python-bench.log.
# PYTHON picks the interpreter (default python3). The last line is `python: N passed, N failed,
# N skipped` (the test counts). Exit status 1 if the install or a test failed; a bench failure
# is reported but does not change it.
set -uo pipefail

B="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
TESTS=1; BENCH=1; ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --tests-only) BENCH=0 ;;
    --bench-only) TESTS=0 ;;
    -h|--help) sed -n '2,17p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    --) shift; ARGS+=("$@"); break ;;
    *) ARGS+=("$1") ;;
  esac
  shift
done
PYTHON="${PYTHON:-python3}"
export KERNELS_REQUIRE_GPU=1 PYTHONDONTWRITEBYTECODE=1
# NCCL for kernels::dist (tests/dist.rs, benches/dist.rs): the copy in PyTorch's pip wheels
# (nvidia-nccl-cu12), unless KERNELS_NCCL_LIB already names one; NVLink multicast stays off in
# every program started from here.
if [ -z "${KERNELS_NCCL_LIB:-}" ]; then
  NCCL_LIB="$(python3 -c 'import nvidia.nccl as m, os; print(os.path.join(list(m.__path__)[0], "lib", "libnccl.so.2"))' 2>/dev/null || true)"
  if [ -n "$NCCL_LIB" ] && [ -f "$NCCL_LIB" ]; then export KERNELS_NCCL_LIB="$NCCL_LIB"; fi
fi
export NCCL_NVLS_ENABLE=0
if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT"; RES="$OUT"; TLOG="$OUT/python-tests.log"; BLOG="$OUT/python-bench.log"
else
  RES="."; TLOG=/dev/null; BLOG=/dev/null
fi
SITE="$(mktemp -d)"; TMP="$(mktemp)"
trap 'rm -rf "$SITE" "$TMP"' EXIT

wheel="$(ls "$B"/python/*.whl 2>/dev/null | head -n 1)"
if [ -z "$wheel" ]; then
  echo "python: no wheel under $B/python (was the bundle built without maturin?)" | tee -a "$TLOG"
  echo "python: 0 passed, 1 failed, 0 skipped"
  exit 1
fi
echo "== python: installing $(basename "$wheel") into $SITE" | tee -a "$TLOG"
if ! "$PYTHON" -m pip install --quiet --disable-pip-version-check --no-deps --no-index --target "$SITE" "$wheel" 2>&1 | tee -a "$TLOG"; then
  echo "pip failed; unzipping the wheel instead" | tee -a "$TLOG"
  "$PYTHON" -m zipfile -e "$wheel" "$SITE" 2>&1 | tee -a "$TLOG"
fi
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
if ! "$PYTHON" -c "import kernels_torch, sys; print('kernels_torch', kernels_torch.__version__, kernels_torch.cuda_status())" 2>&1 | tee -a "$TLOG"; then
  echo "python: 0 passed, 1 failed, 0 skipped (the package does not import)"
  exit 1
fi

P=0; F=0; S=0; STATUS=0
if [ "$TESTS" -eq 1 ]; then
  echo "== python: pytest $B/python/tests" | tee -a "$TLOG"
  "$PYTHON" -m pytest -q -rs -p no:cacheprovider "$B/python/tests" ${ARGS[@]+"${ARGS[@]}"} 2>&1 | tee -a "$TLOG" "$TMP"
  rc=${PIPESTATUS[0]}
  # pytest's last line: "N failed, N passed, N skipped, N errors in 12.3s" (any order, any subset).
  last="$(grep -E '[0-9]+ (passed|failed|skipped|error)' "$TMP" | tail -n 1)"
  num() { echo "$last" | grep -oE "[0-9]+ $1" | grep -oE '[0-9]+' | head -n 1; }
  P=$(num passed); F=$(num failed); S=$(num skipped); E=$(num error)
  P=${P:-0}; F=$(( ${F:-0} + ${E:-0} )); S=${S:-0}
  if [ "$rc" -ne 0 ] && [ "$F" -eq 0 ]; then F=1; echo "(pytest exit status $rc with no failed test: counted as 1 failure)"; fi
  [ "$F" -eq 0 ] || STATUS=1
fi
if [ "$BENCH" -eq 1 ]; then
  json="$RES/python-bench.json"
  echo "== python: bench.py $json ${KERNELS_PY_BENCH_ARGS:-}" | tee -a "$BLOG"
  # shellcheck disable=SC2086
  "$PYTHON" "$B/python/bench.py" "$json" ${KERNELS_PY_BENCH_ARGS:-} 2>&1 | tee -a "$BLOG"
  rc=${PIPESTATUS[0]}
  [ "$rc" -eq 0 ] || echo "python: bench.py FAILED (exit status $rc; not counted)"
  if [ -f "$B/python/bench_attention.py" ]; then
    json="$RES/python-bench-attention.json"
    quick=""; case " ${KERNELS_PY_BENCH_ARGS:-} " in *" --quick "*) quick="--quick" ;; esac
    echo "== python: bench_attention.py $json $quick" | tee -a "$BLOG"
    # shellcheck disable=SC2086
    "$PYTHON" "$B/python/bench_attention.py" "$json" $quick 2>&1 | tee -a "$BLOG"
    rc=${PIPESTATUS[0]}
    [ "$rc" -eq 0 ] || echo "python: bench_attention.py FAILED (exit status $rc; not counted)"
  fi
  if [ -f "$B/torch_paired.py" ]; then
    json="$RES/torch-paired.json"
    echo "== python: torch_paired.py $json" | tee -a "$BLOG"
    "$PYTHON" "$B/torch_paired.py" "$json" 2>&1 | tee -a "$BLOG"
    rc=${PIPESTATUS[0]}
    [ "$rc" -eq 0 ] || echo "python: torch_paired.py FAILED (exit status $rc; not counted)"
  fi
fi
[ "$TESTS" -eq 0 ] || echo "python: $P passed, $F failed, $S skipped"
exit "$STATUS"
