// CUDA launcher of the selective-state decode step: picks the kernel (16-byte state chunks in
// tiles of rows, or element by element for layouts they cannot read), the lanes that share a
// row, which of A, B and C can be read in vector pieces and the block size, then launches on
// the caller's stream. No workspace, no
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

// The vector kernel's rows a tile. Float32 states with one decay a row (Mamba-2) take 8: 128
// bytes of state a lane in flight at 5 blocks an SM measured 155 us against 162 us for 4 rows
// at 8 blocks (H200, 128 heads x 64 x 128 at batch 64). With A along dstate (Mamba-1) each row
// also holds its A values, and 8 rows (4 blocks) ran 1.5x slower than 4: those take 4, as do
// 16-bit states; two float32 chunks a lane take 2, so every lane keeps 64 bytes in flight.
template <typename T, int kChunks, bool kAPerRow>
constexpr int rows_per_tile() {
  if (kChunks == 2) return 2;
  return sizeof(T) == 4 && kAPerRow ? 8 : 4;
}

// Launches the vector kernel over p.tiles tiles. Blocks of kThreads, unless that leaves fewer
// blocks than two a multiprocessor (batch-1 decode): then smaller blocks, down to one warp, so
// the little work there is spreads over more multiprocessors.
template <typename T, int kChunks, bool kAPerRow>
void launch_vec(const StateUpdateArgs& a, StateUpdatePlan p, int device, cudaStream_t s) {
  constexpr int kRows = rows_per_tile<T, kChunks, kAPerRow>();
  p.lanes = std::max(p.lanes, kRows);
  p.head_tiles = (a.headdim + kRows - 1) / kRows;
  p.tiles = a.batch * a.nheads * p.head_tiles;
  p.index32 = p.tiles <= INT32_MAX;
  const int64_t want = 2 * int64_t(std::max(multiprocessor_count(device), 1));
  int threads = kThreads;
  while (threads > 32 && (p.tiles * p.lanes + threads - 1) / threads < want) threads /= 2;
  const int64_t tiles_per_block = threads / p.lanes;
  const int blocks = int(std::clamp<int64_t>((p.tiles + tiles_per_block - 1) / tiles_per_block,
                                             1, INT_MAX));
  state_update_detail::state_update_vec_kernel<T, kChunks, kRows, kAPerRow>
      <<<blocks, threads, 0, s>>>(a, p);
}

template <typename T, int kChunks>
void launch_vec(const StateUpdateArgs& a, const StateUpdatePlan& p, int device,
                cudaStream_t s) {
  if (p.a_per_row) launch_vec<T, kChunks, true>(a, p, device, s);
  else launch_vec<T, kChunks, false>(a, p, device, s);
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
  // float32 past 128, which takes two a lane. launch_vec raises lanes to a tile's rows.
  const int64_t chunks = N / V;
  const int per_lane = chunks > 32 ? 2 : 1;
  p.lanes = pow2_at_least((chunks + per_lane - 1) / per_lane);
  p.a_contiguous = piece_contiguous(a.A, {a.nheads, a.headdim}, V);
  p.b_contiguous = piece_contiguous(a.B, {a.batch, a.ngroups}, V);
  p.c_contiguous = piece_contiguous(a.C, {a.batch, a.ngroups}, V);
  switch (a.state.dtype) {
    case Dtype::F32:
      if (per_lane == 2) launch_vec<float, 2>(a, p, device, s);
      else launch_vec<float, 1>(a, p, device, s);
      break;
    case Dtype::F16: launch_vec<__half, 1>(a, p, device, s); break;
    default: launch_vec<__nv_bfloat16, 1>(a, p, device, s); break;
  }
  return cuda_status(cudaGetLastError(), "selective_state_update launch");
}

}  // namespace ssm
