// Peer top-k kernels for the selection benchmarks, behind a small C ABI (loaded with ctypes).
//
// Two peers, each called the way FlashInfer 0.7.4 calls it for a dense [rows, cols] fp32 table
// (flashinfer.top_k -> csrc/topk.cu radix_topk, csrc/cub_topk.cu cub_topk), minus the TVM-FFI
// tensor plumbing, which is the only part of those files not used here:
//
//   peer_flashinfer_topk  flashinfer::sampling::TopKDispatch<float, int32_t> (include/flashinfer/
//                         topk.cuh): FlashInfer's own heuristic between FilteredTopK and the
//                         multi-CTA radix select, with its deterministic and tie-break modes.
//   peer_cub_topk         cub::DeviceBatchedTopK::MaxPairs (CCCL >= 3.5) over uniform segments of
//                         `cols` keys, with the same requirement configs and bound tiers as
//                         FlashInfer's cub_topk.
//
// Every entry point returns a cudaError_t as int (0 = success) and never throws: the C++ that
// could throw (FlashInfer's dispatch macros) is wrapped in try/catch.
//
// Build: build.sh (nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -shared
//   -Xcompiler -fPIC --cudart=static -I<cccl>/cub -I<cccl>/libcudacxx/include -I<cccl>/thrust
//   -I<flashinfer>/include ...). FLASHINFER_TOPK_ALGO=filtered|multi_cta in the environment
//   overrides TopKDispatch's heuristic (read on every call), as in FlashInfer.

// Only sm_90a is compiled, so CUB's compile-time "every target must serve this config" check
// would pass anyway; defining it keeps a multi-arch build (as FlashInfer does) possible, with the
// unsupported case reported at run time as cudaErrorNotSupported.
#define CUB_DISABLE_TOPK_UNSUPPORTED_ARCH_ASSERT

#include <cuda/__execution/determinism.h>
#include <cuda/__execution/output_ordering.h>
#include <cuda/__execution/require.h>
#include <cuda/__execution/tie_break.h>
#include <cuda/std/__execution/env.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cub/device/device_batched_topk.cuh>
#include <cuda/argument>
#include <cuda/iterator>
#include <cstring>             // topk.cuh uses std::strcmp without including it
#include <flashinfer/math.cuh>  // topk.cuh uses math::ptx_rcp but leaves the include to its
#include <flashinfer/topk.cuh>  // includer (FlashInfer's csrc/topk.cu gets it via sampling.cuh)

namespace {

// ---------------------------------------------------------------- FlashInfer radix / filtered
// flashinfer.top_k hands the radix kernels a 1 MiB row-state buffer (topk.py,
// _ROW_STATES_NBYTES): per-group histograms and inter-CTA counters for the multi-CTA path, plus
// the deterministic collect scratch after them. It must be zeroed once when allocated; every
// launch leaves it zeroed again, so one buffer serves all launches ordered on one stream (two
// launches that may overlap need two buffers).
constexpr size_t kFlashInferRowStatesBytes = size_t{1} << 20;

// ---------------------------------------------------------------- CUB DeviceBatchedTopK
// DeviceBatchedTopK needs a compile-time bound on the segment size. As in FlashInfer's
// cub_topk: <= 8192 may use the single-block backend; above that the SM90 cluster backend,
// up to CUB's own per-segment limit of 2^21.
constexpr int64_t kCubSmallBound = 8192;
constexpr int64_t kCubMaxLen = int64_t{1} << 21;

// FlashInfer's cub_topk returns int64 indices (torch.topk contract) while CUB carries int32
// values internally; the widening happens only at the final store.
struct CastIndexToInt64 {
  __device__ int64_t operator()(int32_t idx) const { return idx; }
};

// One MaxPairs call: workspace query when query_bytes != nullptr (nothing launched, no pointer
// dereferenced), else the run against the caller's workspace. Both go through the same
// instantiation so the queried size is the one the run needs.
template <int64_t kBound, typename Requirements>
cudaError_t CubRun(const float* scores, int64_t row_stride, int64_t rows, int64_t cols, int64_t k,
                   int64_t* out_idx, float* out_val, void* workspace, size_t workspace_bytes,
                   size_t* query_bytes, Requirements requirements, cudaStream_t stream) {
  // Segment i's keys are scores + i * row_stride; its values are the positions 0..cols-1,
  // synthesized by a counting iterator (CUB then writes the winning positions as the values).
  auto keys_in = cuda::make_strided_iterator(cuda::make_counting_iterator(scores), row_stride);
  auto keys_out = cuda::make_strided_iterator(cuda::make_counting_iterator(out_val), k);
  auto values_in = cuda::make_constant_iterator(cuda::make_counting_iterator(int32_t{0}));
  auto idx_out = cuda::make_transform_output_iterator(out_idx, CastIndexToInt64{});
  auto values_out = cuda::make_strided_iterator(cuda::make_counting_iterator(idx_out), k);

  const auto segment_sizes = cuda::args::immediate{cols, cuda::args::bounds<int64_t{1}, kBound>()};
  const auto k_arg = cuda::args::immediate{k, cuda::args::bounds<int64_t{1}, kBound>()};
  const auto num_segments = cuda::args::immediate{rows};
  const auto env = cuda::std::execution::env{requirements, cuda::stream_ref{stream}};

  size_t needed = 0;
  cudaError_t status = cub::DeviceBatchedTopK::MaxPairs(nullptr, needed, keys_in, keys_out,
                                                        values_in, values_out, segment_sizes,
                                                        k_arg, num_segments, env);
  if (status != cudaSuccess) return status;
  if (query_bytes != nullptr) {
    *query_bytes = needed;
    return cudaSuccess;
  }
  if (workspace_bytes < needed || (needed > 0 && workspace == nullptr)) {
    return cudaErrorInvalidValue;
  }
  return cub::DeviceBatchedTopK::MaxPairs(workspace, needed, keys_in, keys_out, values_in,
                                          values_out, segment_sizes, k_arg, num_segments, env);
}

// The runtime tie_break flag picks a compile-time requirement config (each is its own kernel
// instantiation), exactly FlashInfer's mapping: 1 = deterministic across GPUs with ties to the
// lowest index, 2 = ties to the highest index, 0 = no guarantee. Output is always unsorted
// (the only ordering CUB implements). cols picks the bound tier.
cudaError_t CubDispatch(const float* scores, int64_t row_stride, int64_t rows, int64_t cols,
                        int64_t k, int64_t* out_idx, float* out_val, void* workspace,
                        size_t workspace_bytes, size_t* query_bytes, int tie_break,
                        cudaStream_t stream) {
  namespace exec = cuda::execution;
  auto run = [&](auto requirements) {
    if (cols <= kCubSmallBound) {
      return CubRun<kCubSmallBound>(scores, row_stride, rows, cols, k, out_idx, out_val,
                                    workspace, workspace_bytes, query_bytes, requirements,
                                    stream);
    }
    return CubRun<kCubMaxLen>(scores, row_stride, rows, cols, k, out_idx, out_val, workspace,
                              workspace_bytes, query_bytes, requirements, stream);
  };
  switch (tie_break) {
    case 0:
      return run(exec::require(exec::determinism::not_guaranteed, exec::tie_break::unspecified,
                               exec::output_ordering::unsorted));
    case 1:
      return run(exec::require(exec::determinism::gpu_to_gpu,
                               exec::tie_break::prefer_smaller_index,
                               exec::output_ordering::unsorted));
    case 2:
      return run(exec::require(exec::determinism::gpu_to_gpu,
                               exec::tie_break::prefer_larger_index,
                               exec::output_ordering::unsorted));
    default:
      return cudaErrorInvalidValue;
  }
}

bool CubArgsOk(int64_t row_stride, int64_t rows, int64_t cols, int64_t k, int tie_break) {
  return rows >= 0 && rows <= INT32_MAX && cols > 0 && cols <= kCubMaxLen && k > 0 &&
         k <= cols && row_stride >= cols && tie_break >= 0 && tie_break <= 2;
}

}  // namespace

// build.sh compiles with -fvisibility=hidden: only these entry points are exported, so the
// library's CUB/FlashInfer template instances cannot interpose on (or be interposed by) other
// copies of those headers in the process, e.g. torch's CUB.
#define PEER_API __attribute__((visibility("default")))

extern "C" {

// Bytes of zero-initialized scratch peer_flashinfer_topk needs (the row-state buffer).
PEER_API size_t peer_flashinfer_topk_workspace_bytes(void) { return kFlashInferRowStatesBytes; }

// FlashInfer top-k of each row of a contiguous [rows, cols] fp32 table.
//   out_idx [rows, k] int32, out_val [rows, k] fp32 (both required, contiguous).
//   workspace: >= peer_flashinfer_topk_workspace_bytes(), zeroed once at allocation, not shared
//     by launches that may overlap.
//   deterministic: FlashInfer's deterministic mode (the same output, order included, on every
//     run; its FilteredTopK path writes each row's winners in ascending index order).
//   tie_break: 0 none, 1 prefer the lowest index, 2 prefer the highest; a tie-break forces
//     FlashInfer's FilteredTopK and so k <= 2048 (else cudaErrorNotSupported).
//   sorted: also sort each row by value, descending, on the device (FlashInfer's stable block
//     sort, k <= 2048); flashinfer.top_k itself uses it only with deterministic and otherwise
//     sorts with torch.sort.
PEER_API int peer_flashinfer_topk(const float* scores, int64_t rows, int64_t cols, int64_t k,
                                  int32_t* out_idx, float* out_val, void* workspace,
                                  size_t workspace_bytes, int deterministic, int tie_break,
                                  int sorted, cudaStream_t stream) {
  if (rows < 0 || rows > UINT32_MAX || cols <= 0 || cols > INT32_MAX || k <= 0 || k > cols ||
      tie_break < 0 || tie_break > 2 || out_idx == nullptr || out_val == nullptr ||
      workspace == nullptr || workspace_bytes < kFlashInferRowStatesBytes ||
      (sorted && k > 2048)) {
    return cudaErrorInvalidValue;
  }
  if (rows == 0) return cudaSuccess;
  try {
    // TopKDispatch takes non-const input but only reads it.
    return flashinfer::sampling::TopKDispatch<float, int32_t>(
        const_cast<float*>(scores), out_idx, out_val, static_cast<uint32_t>(rows),
        static_cast<uint32_t>(k), static_cast<uint32_t>(cols),
        static_cast<flashinfer::sampling::RadixRowState*>(workspace), sorted != 0,
        deterministic != 0, static_cast<flashinfer::sampling::TopKTieBreak>(tie_break), stream,
        /*dsa_graph_safe=*/false);
  } catch (...) {
    return cudaErrorUnknown;
  }
}

// Workspace bytes peer_cub_topk needs for this shape and tie_break (host-only: launches nothing,
// touches no device memory). It depends on rows, cols (via the bound tier) and tie_break.
PEER_API int peer_cub_topk_workspace_bytes(int64_t rows, int64_t cols, int64_t k,
                                           int tie_break, size_t* bytes) {
  if (bytes == nullptr || !CubArgsOk(cols, rows, cols, k, tie_break)) return cudaErrorInvalidValue;
  *bytes = 0;
  if (rows == 0) return cudaSuccess;
  try {
    return CubDispatch(nullptr, cols, rows, cols, k, nullptr, nullptr, nullptr, 0, bytes,
                       tie_break, nullptr);
  } catch (...) {
    return cudaErrorUnknown;
  }
}

// CUB DeviceBatchedTopK (largest k) of each row of a [rows, cols] fp32 table whose rows start
// row_stride elements apart (row_stride >= cols; rows individually contiguous), cols <= 2^21.
//   out_idx [rows, k] int64, out_val [rows, k] fp32 (both required, contiguous), unsorted.
//   workspace: >= peer_cub_topk_workspace_bytes(rows, cols, k, tie_break); no init needed.
//   tie_break: 1 = deterministic (gpu_to_gpu) with ties to the lowest index (the config for
//     comparing exact selections), 2 = the same with ties to the highest, 0 = no guarantee
//     (FlashInfer's default for CUB). 1 and 2, and any cols > 8192, run CUB's SM90 cluster
//     backend.
PEER_API int peer_cub_topk(const float* scores, int64_t row_stride, int64_t rows, int64_t cols,
                           int64_t k, int64_t* out_idx, float* out_val, void* workspace,
                           size_t workspace_bytes, int tie_break, cudaStream_t stream) {
  if (!CubArgsOk(row_stride, rows, cols, k, tie_break) || scores == nullptr ||
      out_idx == nullptr || out_val == nullptr) {
    return cudaErrorInvalidValue;
  }
  if (rows == 0) return cudaSuccess;
  try {
    return CubDispatch(scores, row_stride, rows, cols, k, out_idx, out_val, workspace,
                       workspace_bytes, nullptr, tie_break, stream);
  } catch (...) {
    return cudaErrorUnknown;
  }
}

}  // extern "C"
