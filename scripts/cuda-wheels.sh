#!/usr/bin/env bash
# The CUDA 13.0 compiler from PyPI's wheels, for building the `candle` feature (candle's CUDA
# backend compiles its kernels with nvcc) on a machine without a CUDA toolkit:
#
#   eval "$(bash scripts/cuda-wheels.sh [--link] [DIR])"
#
# installs nvcc, its headers and the CUDA runtime into DIR (default target/cuda-wheels) and
# prints the environment that points candle's build at them. 13.0, not newer: the PTX nvcc
# writes must load on the driver of the GPU machine (580, CUDA 13.0).
#
# --link also makes link-time stubs of the libraries candle (through cudarc) links: the driver,
# cuBLAS, cuBLASLt, cuRAND, NVRTC and NCCL, each a shared library of the real one's soname that
# defines the functions cudarc declares (from cudarc's sources in cargo's registry; `cargo fetch`
# first). Enough to link a test binary here; the real libraries are loaded where it runs (the
# driver's, and PyTorch's CUDA 13 wheels' `site-packages/nvidia/cu13/lib`).
set -euo pipefail

LINK=0
if [[ "${1:-}" == "--link" ]]; then
  LINK=1
  shift
fi
DIR="${1:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/target/cuda-wheels}"
mkdir -p "$DIR"
DIR="$(cd "$DIR" && pwd)"
if python3 -m pip --version >/dev/null 2>&1; then PIP=(python3 -m pip); else PIP=(pip3); fi
PIP_ROOT_USER_ACTION=ignore "${PIP[@]}" install --quiet --disable-pip-version-check --upgrade --target "$DIR" \
  'nvidia-cuda-nvcc==13.0.*' 'nvidia-cuda-crt==13.0.*' 'nvidia-nvvm==13.0.*' \
  'nvidia-cuda-runtime==13.0.*' 'nvidia-cuda-cccl==13.0.*' >&2
ROOT="$DIR/nvidia/cu13"
chmod +x "$ROOT"/bin/* "$ROOT"/nvvm/bin/* 2>/dev/null || true
# candle's kernels link the runtime by its development name.
ln -sf libcudart.so.13 "$ROOT/lib/libcudart.so"

if [[ "$LINK" == 1 ]]; then
  CUDARC="$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/cudarc-0.19.* 2>/dev/null | sort -V | tail -n 1)"
  if [[ -z "$CUDARC" ]]; then
    echo "cudarc 0.19's sources are not in cargo's registry: run 'cargo fetch' first" >&2
    exit 1
  fi
  STUBS="$ROOT/lib/stubs"
  mkdir -p "$STUBS"
  for spec in driver:cuda:libcuda.so.1 cublas:cublas:libcublas.so.13 cublaslt:cublasLt:libcublasLt.so.13 \
    curand:curand:libcurand.so.10 nvrtc:nvrtc:libnvrtc.so.13 nccl:nccl:libnccl.so.2; do
    IFS=: read -r module lib soname <<<"$spec"
    grep -A1 'extern "C" {' "$CUDARC/src/$module/sys/mod.rs" |
      grep -oE '^\s+(pub )?fn [A-Za-z0-9_]+\(' | sed -E 's/.*fn ([A-Za-z0-9_]+)\(/void \1(void) {}/' |
      sort -u >"$STUBS/$lib.c"
    cc -shared -fPIC -o "$STUBS/lib$lib.so" -Wl,-soname,"$soname" "$STUBS/$lib.c"
  done
fi

echo "export PATH=\"$ROOT/bin:\$PATH\""
echo "export CUDA_ROOT=\"$ROOT\""
# candle's kernels for the H100 (compute capability 9.0); without it the build asks nvidia-smi.
echo "export CUDA_COMPUTE_CAP=\"\${CUDA_COMPUTE_CAP:-90}\""
# cudaforge (candle's kernel builder) uses half the cores unless told; here all of them.
echo "export CUDAFORGE_THREADS=\"\${CUDAFORGE_THREADS:-$(nproc)}\""
