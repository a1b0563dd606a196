// The fixed-order column totals of a (rows x columns) float32 matrix of partial sums: the last
// step of the deterministic weight gradients (the fused norm's dweight and dbias, conv1d's
// dweight and dbias), so their bits never change from run to run.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace ssm {

constexpr int kMaxColumnSumWarps = 32;

// Warps a block of column_totals for `rows` partial rows: a power of two, each warp summing at
// least 16 rows, at most kMaxColumnSumWarps. Launched with 32 warps whatever the rows, 15
// partial rows of 65536 columns took 82 us (4096 blocks of 1024 threads, most warps with
// nothing to add), a third of the norm backward's own 266 us (one H200).
inline int column_sum_warps(int64_t rows) {
  int warps = 1;
  while (warps < kMaxColumnSumWarps && int64_t(warps) * 32 <= rows) warps <<= 1;
  return warps;
}

// Columns one block of column_totals covers: 128, four a lane read as one float4 (512 bytes a
// warp a row), where every row of `partial` starts 16-byte aligned; else 32, one a lane. One
// H200, a LayerNorm backward's dweight and dbias, one float a lane (128 bytes a warp a row) /
// four: 17.6 / 9.9 us for 132 partial rows of 16384 columns, beside the 205 us of the row
// kernel; 10.6 / 8.8 us at 8192 columns.
__host__ __device__ inline int column_sum_block_columns(int64_t columns, const float* partial) {
  return columns % 4 == 0 && reinterpret_cast<uintptr_t>(partial) % 16 == 0 ? 128 : 32;
}

// The totals of the columns of block blockIdx.x (column_sum_block_columns): each of the block's
// warps sums every warps-th row in row order, then warp 0 adds the warp totals in warp order and
// calls store(j, total) for each of its columns j. Called by every thread of a block of
// 32 * column_sum_warps(rows) threads.
template <class Store>
__device__ __forceinline__ void column_totals(const float* partial, int64_t rows,
                                              int64_t columns, Store store) {
  __shared__ float4 totals[kMaxColumnSumWarps][32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const int per_lane = column_sum_block_columns(columns, partial) / 32;
  const int64_t j = int64_t(blockIdx.x) * 32 * per_lane + lane * per_lane;
  float4 s = make_float4(0.f, 0.f, 0.f, 0.f);
  if (per_lane == 4 && j < columns) {
#pragma unroll 4
    for (int64_t r = warp; r < rows; r += warps) {
      const float4 v = *reinterpret_cast<const float4*>(partial + r * columns + j);
      s.x += v.x, s.y += v.y, s.z += v.z, s.w += v.w;
    }
  } else if (j < columns) {
#pragma unroll 4
    for (int64_t r = warp; r < rows; r += warps) s.x += partial[r * columns + j];
  }
  if (warps > 1) {
    totals[warp][lane] = s;
    __syncthreads();
    if (warp != 0) return;
    s = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int q = 0; q < warps; ++q) {
      const float4 t = totals[q][lane];
      s.x += t.x, s.y += t.y, s.z += t.z, s.w += t.w;
    }
  }
  const float total[4] = {s.x, s.y, s.z, s.w};
  for (int i = 0; i < per_lane; ++i) {
    if (j + i < columns) store(j + i, total[i]);
  }
}

}  // namespace ssm
