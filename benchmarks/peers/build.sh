#!/usr/bin/env bash
# Build the peer top-k library (FlashInfer radix top-k + CUB DeviceBatchedTopK behind a C ABI).
#
#   benchmarks/peers/build.sh [EXTRACT_DIR] [OUT]
#
# EXTRACT_DIR holds FlashInfer's headers: include/flashinfer/*.cuh and cccl/{cub,libcudacxx/include,
# thrust} (the layout of the wheel's flashinfer/data/, which is also accepted as is). Defaults:
# .peers/flashinfer and .peers/peer_topk.so under the repo root. NVCC picks the compiler (default:
# nvcc on PATH, else /usr/local/cuda/bin/nvcc). Needs nvcc >= 12.8 (CUDA 13 tested); no GPU.
# The result links the CUDA runtime statically, so it needs only the driver (libcuda) at run time.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
extract="${1:-$root/.peers/flashinfer}"
out="${2:-$root/.peers/peer_topk.so}"
if [[ -d "$extract/data/include/flashinfer" ]]; then extract="$extract/data"; fi
if [[ ! -f "$extract/include/flashinfer/topk.cuh" ]]; then
  echo "build.sh: no include/flashinfer/topk.cuh under $extract" >&2
  exit 2
fi
nvcc="${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}"
mkdir -p "$(dirname "$out")"

# The vendored CCCL (>= 3.5, for DeviceBatchedTopK) goes first with -I so it wins over the copy
# bundled with the toolkit, as FlashInfer's JIT does. FlashInfer's JIT flags otherwise:
# C++17, relaxed constexpr, no static template stubs. sm_90a only (H100/H200). Symbols hidden but
# for the peer_* entry points (see PEER_API in peer_topk.cu).
set -x
"$nvcc" -std=c++17 -O3 -DNDEBUG --expt-relaxed-constexpr -static-global-template-stub=false \
  -gencode=arch=compute_90a,code=sm_90a -Xfatbin=-compress-all \
  -shared -Xcompiler -fPIC,-fvisibility=hidden --cudart=static \
  -I"$extract/cccl/cub" -I"$extract/cccl/libcudacxx/include" -I"$extract/cccl/thrust" \
  -I"$extract/include" \
  "$here/peer_topk.cu" -o "$out"
