// CUDA launcher of the selective-state decode step: picks the kernel (16-byte state chunks, or
// element by element for layouts they cannot read), the lanes that share a row, and which of A,
// B and C can be read in vector pieces, then launches on the caller's stream. No workspace, no
// synchronisation: the call can be captured in a CUDA graph.
#include <algorithm>
#include <climits>
#include <initializer_list>

#include "../common/cuda_status.h"
#include "state_update_kernels.cuh"

namespace ssm {
namespace {

using state_update_detail::kThreads;

int elem_bytes(Dtype d) { return d == Dtype::F32 ? 4 : 2; }

int pow2_at_least(int64_t n) {
  int p = 1;
  while (p < n) p <<= 1;
  return p;
}

// Whether t's data pointer, and its stride along each leading axis (all but dstate, extents
// `sizes`) that a kernel steps along (extent > 1), are multiples of `bytes`.
bool aligned(const TensorRef& t, std::initializer_list<int64_t> sizes, int64_t bytes) {
  if (reinterpret_cast<uintptr_t>(t.data) % uint64_t(bytes) != 0) return false;
  int axis = 0;
  for (int64_t size : sizes) {
    if (size > 1 && t.stride[axis] * elem_bytes(t.dtype) % bytes != 0) return false;
    ++axis;
  }
  return true;
}

// A, B or C (leading extents `sizes`, then dstate) read in pieces of v elements with vector
// loads: contiguous along dstate, rows aligned to a piece (at most the 16 bytes of one load).
bool piece_contiguous(const TensorRef& t, std::initializer_list<int64_t> sizes, int v) {
  return t.stride[sizes.size()] == 1 &&
         aligned(t, sizes, std::min<int64_t>(16, int64_t(v) * elem_bytes(t.dtype)));
}

template <typename T, int kChunks>
void launch_vec(const StateUpdateArgs& a, const StateUpdatePlan& p, int blocks, cudaStream_t s) {
  state_update_detail::state_update_vec_kernel<T, kChunks><<<blocks, kThreads, 0, s>>>(a, p);
}

int grid_for(const StateUpdatePlan& p) {
  const int64_t rows_per_block = kThreads / p.lanes;
  return int(std::clamp<int64_t>((p.rows + rows_per_block - 1) / rows_per_block, 1, INT_MAX));
}

}  // namespace

ssm_status selective_state_update_cuda(const StateUpdateArgs& a, int device, void* stream) {
  CudaDeviceGuard guard(device);
  if (guard.status() != SSM_SUCCESS) return guard.status();
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  const int64_t N = a.dstate;

  StateUpdatePlan p;
  p.rows = a.batch * a.nheads * a.headdim;
  p.a_per_row = a.A.stride[2] == 0 || N == 1;

  const int V = 16 / elem_bytes(a.state.dtype);
  const bool vec = N % V == 0 && a.state.stride[3] == 1 &&
                   aligned(a.state, {a.batch_state, a.nheads, a.headdim}, 16);
  if (!vec) {
    p.lanes = std::min(32, pow2_at_least(N));
    state_update_detail::state_update_strided_kernel<<<grid_for(p), kThreads, 0, s>>>(a, p);
    return cuda_status(cudaGetLastError(), "selective_state_update launch");
  }

  // One 16-byte chunk a lane (up to 32 lanes a row) covers every dtype up to dstate 256 but
  // float32 past 128, which takes two a lane.
  const int64_t chunks = N / V;
  const int per_lane = chunks > 32 ? 2 : 1;
  p.lanes = pow2_at_least((chunks + per_lane - 1) / per_lane);
  p.a_contiguous = piece_contiguous(a.A, {a.nheads, a.headdim}, V);
  p.b_contiguous = piece_contiguous(a.B, {a.batch, a.ngroups}, V);
  p.c_contiguous = piece_contiguous(a.C, {a.batch, a.ngroups}, V);
  const int blocks = grid_for(p);
  switch (a.state.dtype) {
    case Dtype::F32:
      if (per_lane == 2) launch_vec<float, 2>(a, p, blocks, s);
      else launch_vec<float, 1>(a, p, blocks, s);
      break;
    case Dtype::F16: launch_vec<__half, 1>(a, p, blocks, s); break;
    default: launch_vec<__nv_bfloat16, 1>(a, p, blocks, s); break;
  }
  return cuda_status(cudaGetLastError(), "selective_state_update launch");
}

}  // namespace ssm
