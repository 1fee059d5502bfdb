#!/usr/bin/env bash
# The JAX package (jax/) on the GPU machine, from a wheel built elsewhere:
#     bash jax/run-gpu-tests.sh path/to/kernels_jax-*.whl [--tests-only | --bench-only] [-- PYTEST ARGS]
#
# Installs the wheel into a temporary folder (`pip install --no-deps --no-index --target`, or
# unzipped if pip is missing; nothing is installed for the system; jax with CUDA must be there
# already), then
#  1. unless --bench-only: pytest on jax/tests with KERNELS_REQUIRE_GPU=1 (a missing GPU or JAX
#     fails instead of skipping); log $OUT/jax-tests.log;
#  2. unless --tests-only: jax/bench.py (KERNELS_JAX_BENCH_ARGS, e.g. --quick, passed on), writing
#     $OUT/jax-bench.json (else ./jax-bench.json); log $OUT/jax-bench.log.
# PYTHON picks the interpreter (default python3). The last line is `jax: N passed, N failed, N
# skipped`. Exit status 1 if the install or a test failed; a bench failure does not change it.
set -uo pipefail

J="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
wheel="${1:-}"
if [ -z "$wheel" ] || [ ! -f "$wheel" ]; then
  echo "usage: bash jax/run-gpu-tests.sh path/to/kernels_jax-*.whl [--tests-only | --bench-only] [-- PYTEST ARGS]" >&2
  exit 2
fi
shift
TESTS=1; BENCH=1; ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --tests-only) BENCH=0 ;;
    --bench-only) TESTS=0 ;;
    --) shift; ARGS+=("$@"); break ;;
    *) ARGS+=("$1") ;;
  esac
  shift
done
PYTHON="${PYTHON:-python3}"
export KERNELS_REQUIRE_GPU=1 PYTHONDONTWRITEBYTECODE=1
if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT"; RES="$OUT"; TLOG="$OUT/jax-tests.log"; BLOG="$OUT/jax-bench.log"
else
  RES="."; TLOG=/dev/null; BLOG=/dev/null
fi
SITE="$(mktemp -d)"; TMP="$(mktemp)"
trap 'rm -rf "$SITE" "$TMP"' EXIT

echo "== jax: installing $(basename "$wheel") into $SITE" | tee -a "$TLOG"
if ! "$PYTHON" -m pip install --quiet --disable-pip-version-check --no-deps --no-index --target "$SITE" "$wheel" 2>&1 | tee -a "$TLOG"; then
  echo "pip failed; unzipping the wheel instead" | tee -a "$TLOG"
  "$PYTHON" -m zipfile -e "$wheel" "$SITE" 2>&1 | tee -a "$TLOG"
fi
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
if ! "$PYTHON" -c "import jax, kernels_jax; print('jax', jax.__version__, jax.devices(), 'kernels_jax', kernels_jax.__version__, kernels_jax.cuda_status(), 'FFI API', kernels_jax.ffi_api_version())" 2>&1 | tee -a "$TLOG"; then
  echo "jax: 0 passed, 1 failed, 0 skipped (the package does not import)"
  exit 1
fi

P=0; F=0; S=0; STATUS=0
if [ "$TESTS" -eq 1 ]; then
  echo "== jax: pytest $J/tests" | tee -a "$TLOG"
  "$PYTHON" -m pytest -q -rs -p no:cacheprovider "$J/tests" ${ARGS[@]+"${ARGS[@]}"} 2>&1 | tee -a "$TLOG" "$TMP"
  rc=${PIPESTATUS[0]}
  last="$(grep -E '[0-9]+ (passed|failed|skipped|error)' "$TMP" | tail -n 1)"
  num() { echo "$last" | grep -oE "[0-9]+ $1" | grep -oE '[0-9]+' | head -n 1; }
  P=$(num passed); F=$(num failed); S=$(num skipped); E=$(num error)
  P=${P:-0}; F=$(( ${F:-0} + ${E:-0} )); S=${S:-0}
  if [ "$rc" -ne 0 ] && [ "$F" -eq 0 ]; then F=1; echo "(pytest exit status $rc with no failed test: counted as 1 failure)"; fi
  [ "$F" -eq 0 ] || STATUS=1
fi
if [ "$BENCH" -eq 1 ]; then
  json="$RES/jax-bench.json"
  echo "== jax: bench.py $json ${KERNELS_JAX_BENCH_ARGS:-}" | tee -a "$BLOG"
  # Run from a copy beside the installed package: Python puts the script's folder first on the
  # path, and jax/ holds the package's sources without the native module.
  cp "$J/bench.py" "$SITE/kernels_jax_bench.py"
  # shellcheck disable=SC2086
  "$PYTHON" "$SITE/kernels_jax_bench.py" "$json" ${KERNELS_JAX_BENCH_ARGS:-} 2>&1 | tee -a "$BLOG"
  rc=${PIPESTATUS[0]}
  [ "$rc" -eq 0 ] || echo "jax: bench.py FAILED (exit status $rc; not counted)"
fi
[ "$TESTS" -eq 0 ] || echo "jax: $P passed, $F failed, $S skipped"
exit "$STATUS"
