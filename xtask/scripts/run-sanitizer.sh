#!/usr/bin/env bash
# The GPU tests under compute-sanitizer, from a bundle made by `cargo xtask gpu-bundle`.
# Usage: bash .bundle/run-sanitizer.sh [--tool memcheck|racecheck|synccheck]... [--bin NAME]...
#                                      [-- TEST ARGS]
# Runs every test binary (or those named by --bin) under each tool (default: memcheck, then
# racecheck, then synccheck) with --error-exitcode 1, --test-threads=1, KERNELS_SANITIZER=1 (the
# tests shrink their sizes) and KERNELS_REQUIRE_GPU=1. TEST ARGS (e.g. a name filter) are passed
# to the test binaries. compute-sanitizer is taken from $COMPUTE_SANITIZER, PATH or
# /usr/local/cuda. Logs go to $OUT/sanitizer-TOOL-BIN.log when $OUT is set.
# Prints one line per tool and binary; exits 1 if any run reported an error or failed.
set -uo pipefail

B="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

# The binaries travel packed (`cargo xtask gpu-bundle` writes bin.tar.xz): unpack them once.
if [ ! -d "$B/bin" ] && [ -f "$B/bin.tar.xz" ]; then
  tar -xJf "$B/bin.tar.xz" -C "$B" || { echo "error: cannot unpack $B/bin.tar.xz"; exit 1; }
fi
TOOLS=()
BINS=()
ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --tool) [ $# -ge 2 ] || { echo "error: --tool needs a value" >&2; exit 2; }
            case "$2" in memcheck|racecheck|synccheck|initcheck) TOOLS+=("$2") ;;
              *) echo "error: unknown tool '$2'" >&2; exit 2 ;; esac
            shift ;;
    --bin) [ $# -ge 2 ] || { echo "error: --bin needs a value" >&2; exit 2; }
           BINS+=("$2"); shift ;;
    -h|--help) sed -n '2,10p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    --) shift; ARGS+=("$@"); break ;;
    *) echo "error: unexpected argument '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done
[ ${#TOOLS[@]} -gt 0 ] || TOOLS=(memcheck racecheck synccheck)

CS="${COMPUTE_SANITIZER:-}"
if [ -z "$CS" ]; then
  CS="$(command -v compute-sanitizer 2>/dev/null || true)"
fi
if [ -z "$CS" ]; then
  for c in /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda/compute-sanitizer/compute-sanitizer; do
    if [ -x "$c" ]; then CS="$c"; break; fi
  done
fi
if [ -z "$CS" ] || [ ! -x "$CS" ]; then
  echo "error: compute-sanitizer not found (set COMPUTE_SANITIZER or put it on PATH)" >&2
  exit 1
fi

if [ ${#BINS[@]} -eq 0 ]; then
  for t in "$B"/bin/tests/*; do
    [ -f "$t" ] && [ -x "$t" ] && BINS+=("$(basename "$t")")
  done
fi
if [ ${#BINS[@]} -eq 0 ]; then
  echo "error: no test binaries under $B/bin/tests" >&2
  exit 1
fi

export KERNELS_SANITIZER=1 KERNELS_REQUIRE_GPU=1
# NCCL for kernels::dist (tests/dist.rs, benches/dist.rs): the copy in PyTorch's pip wheels
# (nvidia-nccl-cu12), unless KERNELS_NCCL_LIB already names one; NVLink multicast stays off in
# every program started from here.
if [ -z "${KERNELS_NCCL_LIB:-}" ]; then
  NCCL_LIB="$(python3 -c 'import nvidia.nccl as m, os; print(os.path.join(list(m.__path__)[0], "lib", "libnccl.so.2"))' 2>/dev/null || true)"
  if [ -n "$NCCL_LIB" ] && [ -f "$NCCL_LIB" ]; then export KERNELS_NCCL_LIB="$NCCL_LIB"; fi
fi
export NCCL_NVLS_ENABLE=0
[ -z "${OUT:-}" ] || mkdir -p "$OUT"
TMP="$(mktemp)"
trap 'rm -f "$TMP"' EXIT
echo "== $("$CS" --version 2>/dev/null | tail -n 1)"

STATUS=0
SUMMARY=()
for tool in "${TOOLS[@]}"; do
  for name in "${BINS[@]}"; do
    bin="$B/bin/tests/$name"
    if [ ! -x "$bin" ]; then
      SUMMARY+=("$tool $name: FAILED (no such test binary)"); STATUS=1; continue
    fi
    log=/dev/null
    [ -z "${OUT:-}" ] || log="$OUT/sanitizer-$tool-$name.log"
    echo "== $tool $name"
    start=$SECONDS
    "$CS" --tool "$tool" --error-exitcode 1 "$bin" --test-threads=1 ${ARGS[@]+"${ARGS[@]}"} 2>&1 \
      | tee "$log" > "$TMP"
    rc=${PIPESTATUS[0]}
    # Show the sanitizer's own findings and the test verdicts, not every passing test line.
    grep -E '^=========|^test result:|FAILED|panicked' "$TMP" | head -n 200
    # memcheck and synccheck print "ERROR SUMMARY: N errors"; racecheck prints
    # "RACECHECK SUMMARY: N hazards displayed (E errors, W warnings)".
    errs="$(sed -nE 's/.*ERROR SUMMARY: ([0-9]+) error.*/\1/p; s/.*RACECHECK SUMMARY: .*\(([0-9]+) error.*/\1/p' "$TMP" | tail -n 1)"
    tests="$(grep -E '^test result:' "$TMP" | tail -n 1 | sed -E 's/^test result: //; s/; [0-9]+ measured.*//')"
    line="$tool $name: ${errs:-?} errors; tests: ${tests:-no result line}; $((SECONDS - start))s"
    if [ "$rc" -ne 0 ] || [ "${errs:-0}" != 0 ]; then
      SUMMARY+=("$line; FAILED (exit status $rc)"); STATUS=1
    else
      SUMMARY+=("$line; ok")
    fi
  done
done

echo "== sanitizer summary"
for l in "${SUMMARY[@]}"; do echo "  $l"; done
if [ "$STATUS" -eq 0 ]; then echo "sanitizer: all clean"; else echo "sanitizer: FAILURES"; fi
exit "$STATUS"
