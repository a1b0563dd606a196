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

// Columns one block of column_totals covers: 128 from kColumnSumWideColumns columns, else 32; where
// every row of `partial` starts 16-byte aligned a lane reads four of them as one float4 (a warp
// then reads one row of 128 columns, or four rows of 32 at once), else one. One H200, a LayerNorm
// backward's dweight and dbias, 128 columns a block, one float a lane / four: 17.6 / 9.9 us for 132
// partial rows of 16384 columns, beside the 205 us of the row kernel; 10.6 / 8.8 us at 8192
// columns. Narrower, 128 columns a block leave most SMs idle: ncu, the gate after's backward at 896
// columns (528 partial rows), 11.2 us in 7 blocks beside the row kernel's 87.6 (torch.compile's own
// column sums: 12.0). Backwards (bench_norm.py, TB/s, two runs each), 128 / 32 columns a block with
// four a lane: RMSNorm + residual 2.19-2.21 / 2.24-2.26 at 256 columns, 2.67-2.69 / 2.71-2.73 at
// 512, 3.30 / 3.32-3.33 at 1024, 3.79 / 3.80 at 2048, but 4.05-4.06 / 4.04 at 4096 and 4.02 /
// 4.00-4.01 at 8192; the gate after at 896 3.01-3.02 / 3.04-3.05, LayerNorm beside float32 at 1024
// 3.40 / 3.43.
constexpr int64_t kColumnSumWideColumns = 4096;
__host__ __device__ inline bool column_sum_float4(int64_t columns, const float* partial) {
  return columns % 4 == 0 && reinterpret_cast<uintptr_t>(partial) % 16 == 0;
}
__host__ __device__ inline int column_sum_block_columns(int64_t columns, const float* partial) {
  return columns >= kColumnSumWideColumns && column_sum_float4(columns, partial) ? 128 : 32;
}

// The totals of the columns of block blockIdx.x (column_sum_block_columns): each of the block's
// warps sums every warps-th group of rows in row order (a group: the rows it reads at once, one
// for each set of lanes that spans the block's columns), adds its groups' sums in a fixed order,
// then warp 0 adds the warp totals in warp order and calls store(j, total) for each of its
// columns j. Called by every thread of a block of 32 * column_sum_warps(rows) threads.
template <class Store>
__device__ __forceinline__ void column_totals(const float* partial, int64_t rows,
                                              int64_t columns, Store store) {
  __shared__ float4 totals[kMaxColumnSumWarps][32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const int per_lane = column_sum_float4(columns, partial) ? 4 : 1;
  const int row_lanes = column_sum_block_columns(columns, partial) / per_lane;  // 32 or 8
  const int groups = 32 / row_lanes;
  const int64_t j = int64_t(blockIdx.x) * row_lanes * per_lane + (lane % row_lanes) * per_lane;
  const int64_t first = int64_t(warp) * groups + lane / row_lanes, step = int64_t(warps) * groups;
  float4 s = make_float4(0.f, 0.f, 0.f, 0.f);
  if (per_lane == 4 && j < columns) {
#pragma unroll 4
    for (int64_t r = first; r < rows; r += step) {
      const float4 v = *reinterpret_cast<const float4*>(partial + r * columns + j);
      s.x += v.x, s.y += v.y, s.z += v.z, s.w += v.w;
    }
  } else if (j < columns) {
#pragma unroll 4
    for (int64_t r = first; r < rows; r += step) s.x += partial[r * columns + j];
  }
  for (int offset = 16; offset >= row_lanes; offset >>= 1) {
    s.x += __shfl_down_sync(0xffffffffu, s.x, offset);
    s.y += __shfl_down_sync(0xffffffffu, s.y, offset);
    s.z += __shfl_down_sync(0xffffffffu, s.z, offset);
    s.w += __shfl_down_sync(0xffffffffu, s.w, offset);
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
  if (lane >= row_lanes) return;
  const float total[4] = {s.x, s.y, s.z, s.w};
  for (int i = 0; i < per_lane; ++i) {
    if (j + i < columns) store(j + i, total[i]);
  }
}

}  // namespace ssm
