// The fixed-order column totals of a (rows x columns) float32 matrix of partial sums: the last
// step of the deterministic weight gradients (the fused norm's dweight and dbias, conv1d's
// dweight and dbias), so their bits never change from run to run.
#pragma once

#include <cstdint>

namespace ssm {

constexpr int kMaxColumnSumWarps = 32;

// Warps a block of column_total for `rows` partial rows: a power of two, each warp summing at
// least 16 rows, at most kMaxColumnSumWarps. Launched with 32 warps whatever the rows, 15
// partial rows of 65536 columns took 82 us (4096 blocks of 1024 threads, most warps with
// nothing to add), a third of the norm backward's own 266 us (one H200).
inline int column_sum_warps(int64_t rows) {
  int warps = 1;
  while (warps < kMaxColumnSumWarps && int64_t(warps) * 32 <= rows) warps <<= 1;
  return warps;
}

// Column j's total, j = blockIdx.x * 32 + lane: each of the block's warps sums every warps-th
// row in row order, then the warp totals are added in warp order. Called by every thread of a
// block of 32 * column_sum_warps(rows) threads; the result is meant for warp 0 (every warp
// gets it).
__device__ __forceinline__ float column_total(const float* partial, int64_t rows,
                                              int64_t columns, int64_t j) {
  __shared__ float totals[kMaxColumnSumWarps][33];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  float s = 0.f;
  if (j < columns) {
#pragma unroll 4
    for (int64_t r = warp; r < rows; r += warps) s += partial[r * columns + j];
  }
  if (warps == 1) return s;
  totals[warp][lane] = s;
  __syncthreads();
  float total = 0.f;
  for (int q = 0; q < warps; ++q) total += totals[q][lane];
  return total;
}

}  // namespace ssm
