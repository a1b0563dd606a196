// Device code of the selective-state decode step (libssm/state_update.h).
//
// state_update_vec_kernel reads and writes state in 16-byte chunks. A group of `lanes`
// consecutive lanes of a warp (a power of two up to 32) owns a tile: kRows consecutive rows
// (b, h, p0 .. p0 + kRows - 1) of one head, each lane the same chunks of every row. So B and C
// are loaded once a tile, every state load of the tile is issued before any arithmetic (kRows
// chunks a lane in flight), and each row's scalars (x, dt, softplus, D, z, one decay) are
// loaded and computed by one lane and handed to the others by shuffles. The kernel is templated
// on state's dtype (the chunk's conversion must be compile-time), on kChunks, the chunks a lane
// owns in a row (float32 needs 2 only past dstate 128), on kRows (registers must be
// compile-time), and on whether A is constant along dstate (one decay a row: the Mamba-2 tile
// then needs far fewer registers): 8 instantiations cover every dtype and dstate.
//
// state_update_strided_kernel takes any strides and dtype element by element, one row a lane
// group: dstate not a multiple of a chunk, state not contiguous along dstate, or unaligned rows.
//
// Everything else (operand dtypes, z, D, dt_bias, indices) is a warp-uniform run-time branch:
// decode is bound by latency and bytes, not by those instructions, and each template flag
// would double the instantiations.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "../common/device_dtype.cuh"
#include "state_update_args.h"

namespace ssm {

// What the launcher decides once per call (state_update_cuda.cu).
struct StateUpdatePlan {
  int64_t rows = 0;              // batch * nheads * headdim (strided kernel)
  int64_t tiles = 0;             // batch * nheads * head_tiles (vector kernel)
  int64_t head_tiles = 0;        // tiles a head: headdim / kRows, rounded up
  bool index32 = false;          // tiles fit in int32 (and so every extent the split uses)
  int lanes = 32;                // lanes per row or tile: a power of two, 1..32
  bool a_per_row = false;        // A constant along dstate: one exponential per row
  bool a_contiguous = false;     // A, B, C: contiguous along dstate and aligned for chunk loads
  bool b_contiguous = false;
  bool c_contiguous = false;
};

namespace state_update_detail {

constexpr int kThreads = 128;

__device__ __forceinline__ float softplus(float v) { return v <= 20.f ? log1pf(expf(v)) : v; }
__device__ __forceinline__ float silu(float v) { return v / (1.f + __expf(-v)); }

__device__ __forceinline__ int64_t load_index(const TensorRef& t, int64_t b) {
  const int64_t i = b * t.stride[0];
  return t.dtype == Dtype::I32 ? int64_t(static_cast<const int32_t*>(t.data)[i])
                               : static_cast<const int64_t*>(t.data)[i];
}

// Row r as (b, h, p), p fastest, and h's group g of B and C. 32-bit division when r fits (the
// extents then do too): 64-bit division is a long software sequence, and decode runs it on the
// critical path of every row.
struct RowIndex {
  int64_t b, h, p, g;
};

__device__ __forceinline__ RowIndex split_row(int64_t r, const StateUpdateArgs& a) {
  if (r <= INT32_MAX) {
    const uint32_t ru = uint32_t(r), P = uint32_t(a.headdim), H = uint32_t(a.nheads);
    const uint32_t t = ru / P, h = t % H;
    return {int64_t(t / H), int64_t(h), int64_t(ru % P),
            int64_t(h / uint32_t(a.heads_per_group))};
  }
  const int64_t t = r / a.headdim, h = t % a.nheads;
  return {t / a.nheads, h, r % a.headdim, h / a.heads_per_group};
}

// Tile t as its first row (b, h, p0), p0 = kRows * (t's place in the head), and h's group.
template <int kRows>
__device__ __forceinline__ RowIndex split_tile(int64_t t, const StateUpdateArgs& a,
                                               const StateUpdatePlan& plan) {
  if (plan.index32) {
    const uint32_t tu = uint32_t(t), T = uint32_t(plan.head_tiles), H = uint32_t(a.nheads);
    const uint32_t bh = tu / T, h = bh % H;
    return {int64_t(bh / H), int64_t(h), int64_t(tu % T) * kRows,
            int64_t(h / uint32_t(a.heads_per_group))};
  }
  const int64_t bh = t / plan.head_tiles, h = bh % a.nheads;
  return {bh / a.nheads, h, (t % plan.head_tiles) * kRows, h / a.heads_per_group};
}

// The per-row scalars, loaded before anything that depends on the state slot.
struct RowInputs {
  float x = 0.f, dt = 0.f, D = 0.f, z = 0.f, A = 0.f;
};

__device__ __forceinline__ RowInputs load_row_inputs(const StateUpdateArgs& a,
                                                     const StateUpdatePlan& plan, RowIndex i) {
  RowInputs v;
  auto row = [&](const TensorRef& t) {
    return load_as_float(t.data, i.b * t.stride[0] + i.h * t.stride[1] + i.p * t.stride[2],
                         t.dtype);
  };
  auto channel = [&](const TensorRef& t) {
    return load_as_float(t.data, i.h * t.stride[0] + i.p * t.stride[1], t.dtype);
  };
  v.x = row(a.x);
  v.dt = row(a.dt);
  if (a.dt_bias.present()) v.dt += channel(a.dt_bias);
  if (a.D.present()) v.D = channel(a.D);
  if (a.z.present()) v.z = row(a.z);
  if (plan.a_per_row) v.A = load_as_float(a.A.data, i.h * a.A.stride[0] + i.p * a.A.stride[1],
                                          a.A.dtype);
  return v;
}

// The row's slot in state: -1 for a padding row, -2 for an index past batch_state.
__device__ __forceinline__ int64_t state_slot(const StateUpdateArgs& a, int64_t b) {
  if (!a.state_batch_indices.present()) return b;
  const int64_t s = load_index(a.state_batch_indices, b);
  return s < 0 ? -1 : s >= a.batch_state ? -2 : s;
}

// What out[b, h, p] needs besides the row's sum y, taken from the row's scalars as soon as
// they arrive so that only these stay live while the state is read: out's offset, D x and the
// gate silu(z).
struct RowOut {
  int64_t offset = 0;
  float dx = 0.f, gate = 1.f;
};

__device__ __forceinline__ RowOut row_out(const StateUpdateArgs& a, RowIndex i,
                                          const RowInputs& v) {
  const TensorRef& t = a.out;
  RowOut o;
  o.offset = i.b * t.stride[0] + i.h * t.stride[1] + i.p * t.stride[2];
  if (a.D.present()) o.dx = v.D * v.x;
  if (a.z.present()) o.gate = silu(v.z);
  return o;
}

// out[b, h, p] from the lanes' summed y: zero for padding, NaN for an index out of range.
__device__ __forceinline__ void store_out(const StateUpdateArgs& a, const RowOut& r,
                                          int64_t slot, float y) {
  const float o = slot == -1   ? 0.f
                  : slot == -2 ? __int_as_float(0x7fffffff)
                               : (y + r.dx) * r.gate;
  store_from_float(a.out.data, r.offset, a.out.dtype, o);
}

__device__ __forceinline__ float row_sum(float v, int lanes) {
  for (int offset = lanes >> 1; offset > 0; offset >>= 1)
    v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// ---------------------------------------------------------------------------------------------
// 16-byte chunks of state, and V-element pieces of A, B and C beside them.

template <typename T>
struct ChunkOf {
  static constexpr int kElems = 16 / int(sizeof(T));
};

__device__ __forceinline__ float2 half2_bits_to_float2(uint32_t w, Dtype d) {
  if (d == Dtype::F16) {
    __half2 h;
    memcpy(&h, &w, 4);
    return __half22float2(h);
  }
  __nv_bfloat162 h;
  memcpy(&h, &w, 4);
  return __bfloat1622float2(h);
}

template <typename T>
__device__ __forceinline__ void chunk_to_floats(const uint4& raw, float* v) {
  const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
  if constexpr (sizeof(T) == 4) {
#pragma unroll
    for (int k = 0; k < 4; ++k) v[k] = __uint_as_float(w[k]);
  } else {
    constexpr Dtype d = std::is_same_v<T, __half> ? Dtype::F16 : Dtype::BF16;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float2 f = half2_bits_to_float2(w[k], d);
      v[2 * k] = f.x;
      v[2 * k + 1] = f.y;
    }
  }
}

template <typename T>
__device__ __forceinline__ uint4 floats_to_chunk(const float* v) {
  uint32_t w[4];
  if constexpr (sizeof(T) == 4) {
#pragma unroll
    for (int k = 0; k < 4; ++k) w[k] = __float_as_uint(v[k]);
  } else {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      if constexpr (std::is_same_v<T, __half>) {
        const __half2 h = __floats2half2_rn(v[2 * k], v[2 * k + 1]);
        memcpy(&w[k], &h, 4);
      } else {
        const __nv_bfloat162 h = __floats2bfloat162_rn(v[2 * k], v[2 * k + 1]);
        memcpy(&w[k], &h, 4);
      }
    }
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// One chunk of state from its floats, in one 16-byte store instruction (store_16_bytes).
template <typename T>
__device__ __forceinline__ void store_chunk(T* p, const float* v) {
  store_16_bytes(p, floats_to_chunk<T>(v));
}

// V consecutive (along dstate) elements of A, B or C at element offset `off`, as floats. With
// `contiguous` the host has checked stride 1 and alignment to V elements (capped at 16 bytes),
// so they come in one or two vector loads; otherwise element by element.
template <int V>
__device__ __forceinline__ void load_piece(const TensorRef& t, int64_t off, int64_t stride,
                                           bool contiguous, float (&v)[V]) {
  if (contiguous && t.dtype == Dtype::F32) {
    const float4* q = reinterpret_cast<const float4*>(static_cast<const float*>(t.data) + off);
#pragma unroll
    for (int k = 0; k < V / 4; ++k) {
      const float4 f = q[k];
      v[4 * k] = f.x;
      v[4 * k + 1] = f.y;
      v[4 * k + 2] = f.z;
      v[4 * k + 3] = f.w;
    }
  } else if (contiguous) {
    const uint16_t* base = static_cast<const uint16_t*>(t.data) + off;
    uint32_t w[V / 2];
    if constexpr (V == 8) {
      const uint4 q = *reinterpret_cast<const uint4*>(base);
      w[0] = q.x, w[1] = q.y, w[2] = q.z, w[3] = q.w;
    } else {
      const uint2 q = *reinterpret_cast<const uint2*>(base);
      w[0] = q.x, w[1] = q.y;
    }
#pragma unroll
    for (int k = 0; k < V / 2; ++k) {
      const float2 f = half2_bits_to_float2(w[k], t.dtype);
      v[2 * k] = f.x;
      v[2 * k + 1] = f.y;
    }
  } else {
#pragma unroll
    for (int k = 0; k < V; ++k) v[k] = load_as_float(t.data, off + k * stride, t.dtype);
  }
}

// ---------------------------------------------------------------------------------------------
// The kernels. Rows or tiles are walked with a block-stride loop whose condition is uniform
// across the block, so every lane reaches the shuffles; lanes past the end compute on zeros
// and store nothing.

// The kRows sums y of a tile's rows, each spread over the group's lanes, reduced so that lane
// l ends with the total of row l / (lanes / kRows). Each halving step sends half of a lane's
// sums to its partner and keeps the other half (kRows - 1 shuffles for the first log2(kRows)
// offsets instead of kRows each); the single sum left is then reduced as usual. Needs lanes >=
// kRows.
template <int kRows>
__device__ __forceinline__ float tile_row_sums(float (&y)[kRows], int lane, int lanes) {
  int offset = lanes;
#pragma unroll
  for (int n = kRows; n > 1; n /= 2) {
    offset >>= 1;
    const bool upper = (lane & offset) != 0;
#pragma unroll
    for (int j = 0; j < n / 2; ++j) {
      const float send = upper ? y[j] : y[j + n / 2];
      const float keep = upper ? y[j + n / 2] : y[j];
      y[j] = keep + __shfl_xor_sync(0xffffffffu, send, offset);
    }
  }
  float v = y[0];
  for (offset >>= 1; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Blocks per SM the vector kernel is compiled for: the most that hold a tile in registers
// without spilling (ptxas -v, sm_90a; tiles as rows_per_tile in state_update_cuda.cu sets
// them): float32 one chunk a row, 8 rows with one decay a row 86 registers (5 blocks), 4 rows
// with A along dstate, whose kRows x V values take registers of their own, 80 (6); 16-bit
// states 76 and 112; float32 two chunks a row 80 and 96.
template <typename T, int kChunks, bool kAPerRow>
constexpr int vec_min_blocks() {
  if (kChunks == 2) return 5;
  if (sizeof(T) == 4) return kAPerRow ? 5 : 6;
  return kAPerRow ? 6 : 4;
}

template <typename T, int kChunks, int kRows, bool kAPerRow>
__global__ void __launch_bounds__(kThreads, vec_min_blocks<T, kChunks, kAPerRow>())
    state_update_vec_kernel(const StateUpdateArgs a, const StateUpdatePlan plan) {
  constexpr int V = ChunkOf<T>::kElems;
  const int lanes = plan.lanes;
  const int lane = int(threadIdx.x) & (lanes - 1);
  // Lane j * row_lanes loads row j's scalars and ends with its sum (tile_row_sums).
  const int row_lanes = lanes / kRows;
  const int own = lane / row_lanes;
  const int64_t tiles_per_block = int64_t(blockDim.x) / lanes;
  const int64_t N = a.dstate;
  const TensorRef& st = a.state;
  for (int64_t first = int64_t(blockIdx.x) * tiles_per_block; first < plan.tiles;
       first += int64_t(gridDim.x) * tiles_per_block) {
    const int64_t t = first + int64_t(threadIdx.x) / lanes;
    const bool valid = t < plan.tiles;
    const RowIndex tile = split_tile<kRows>(valid ? t : 0, a, plan);
    const int64_t rows = valid ? a.headdim - tile.p : 0;  // the tile's rows are those < rows
    RowIndex mine = tile;
    mine.p += own;
    const bool owner = (lane & (row_lanes - 1)) == 0 && own < rows;

    // Every load of the tile is issued before any arithmetic; only the state's address waits
    // for the slot.
    const RowInputs v = owner ? load_row_inputs(a, plan, mine) : RowInputs();
    const RowOut out = row_out(a, mine, v);
    const int64_t slot = valid ? state_slot(a, tile.b) : -1;
    const bool live = slot >= 0;
    const int64_t state_row0 =
        slot * st.stride[0] + tile.h * st.stride[1] + tile.p * st.stride[2];
    const int64_t a_row0 = tile.h * a.A.stride[0] + tile.p * a.A.stride[1];
    const int64_t b_row = tile.b * a.B.stride[0] + tile.g * a.B.stride[1];
    const int64_t c_row = tile.b * a.C.stride[0] + tile.g * a.C.stride[1];
    float Ab[kRows][kChunks][V], Bb[kChunks][V], Cb[kChunks][V];
    uint4 raw[kRows][kChunks];
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const int64_t n0 = int64_t(lane + c * lanes) * V;
      const bool here = valid && n0 < N;
      if (here) {
        load_piece<V>(a.B, b_row + n0 * a.B.stride[2], a.B.stride[2], plan.b_contiguous, Bb[c]);
        load_piece<V>(a.C, c_row + n0 * a.C.stride[2], a.C.stride[2], plan.c_contiguous, Cb[c]);
      }
#pragma unroll
      for (int j = 0; j < kRows; ++j) {
        const bool row_here = here && j < rows;
        raw[j][c] = make_uint4(0, 0, 0, 0);
        if (row_here && live)
          raw[j][c] = *reinterpret_cast<const uint4*>(
              static_cast<const T*>(st.data) + state_row0 + j * st.stride[2] + n0);
        if (row_here && !kAPerRow) {
          load_piece<V>(a.A, a_row0 + j * a.A.stride[1] + n0 * a.A.stride[2], a.A.stride[2],
                        plan.a_contiguous, Ab[j][c]);
        } else {
#pragma unroll
          for (int k = 0; k < V; ++k) Ab[j][c][k] = 0.f;  // unused: the row's one decay applies
        }
      }
      if (!here) {
#pragma unroll
        for (int k = 0; k < V; ++k) Bb[c][k] = Cb[c][k] = 0.f;
      }
    }

    float dt = v.dt;
    if (a.dt_softplus) dt = softplus(dt);
    const float dtx = dt * v.x;
    const float decay = kAPerRow ? __expf(v.A * dt) : 0.f;
    float y[kRows];
#pragma unroll
    for (int j = 0; j < kRows; ++j) {
      const int src = j * row_lanes;
      const float dtx_j = __shfl_sync(0xffffffffu, dtx, src, lanes);
      const float decay_j = kAPerRow ? __shfl_sync(0xffffffffu, decay, src, lanes) : 0.f;
      const float dt_j = kAPerRow ? 0.f : __shfl_sync(0xffffffffu, dt, src, lanes);
      y[j] = 0.f;
#pragma unroll
      for (int c = 0; c < kChunks; ++c) {
        const int64_t n0 = int64_t(lane + c * lanes) * V;
        float s[V];
        chunk_to_floats<T>(raw[j][c], s);
#pragma unroll
        for (int k = 0; k < V; ++k) {
          const float d = kAPerRow ? decay_j : __expf(Ab[j][c][k] * dt_j);
          s[k] = s[k] * d + Bb[c][k] * dtx_j;
          y[j] += s[k] * Cb[c][k];
        }
        if (live && j < rows && n0 < N)
          store_chunk<T>(static_cast<T*>(st.data) + state_row0 + j * st.stride[2] + n0, s);
      }
    }
    const float sum = tile_row_sums<kRows>(y, lane, lanes);
    if (owner) store_out(a, out, slot, sum);
  }
}

__global__ void __launch_bounds__(kThreads) state_update_strided_kernel(
    const StateUpdateArgs a, const StateUpdatePlan plan) {
  const int lanes = plan.lanes;
  const int lane = int(threadIdx.x) & (lanes - 1);
  const int64_t rows_per_block = kThreads / lanes;
  const TensorRef& st = a.state;
  for (int64_t first = int64_t(blockIdx.x) * rows_per_block; first < plan.rows;
       first += int64_t(gridDim.x) * rows_per_block) {
    const int64_t r = first + int64_t(threadIdx.x) / lanes;
    const bool valid = r < plan.rows;
    const RowIndex i = split_row(valid ? r : 0, a);
    const RowInputs v = valid ? load_row_inputs(a, plan, i) : RowInputs();
    const int64_t slot = valid ? state_slot(a, i.b) : -1;
    float dt = v.dt;
    if (a.dt_softplus) dt = softplus(dt);
    const float dtx = dt * v.x;
    float y = 0.f;
    if (slot >= 0) {
      const int64_t state_row = slot * st.stride[0] + i.h * st.stride[1] + i.p * st.stride[2];
      const int64_t a_row = i.h * a.A.stride[0] + i.p * a.A.stride[1];
      const int64_t b_row = i.b * a.B.stride[0] + i.g * a.B.stride[1];
      const int64_t c_row = i.b * a.C.stride[0] + i.g * a.C.stride[1];
      for (int64_t n = lane; n < a.dstate; n += lanes) {
        const int64_t si = state_row + n * st.stride[3];
        const float A = load_as_float(a.A.data, a_row + n * a.A.stride[2], a.A.dtype);
        const float B = load_as_float(a.B.data, b_row + n * a.B.stride[2], a.B.dtype);
        const float C = load_as_float(a.C.data, c_row + n * a.C.stride[2], a.C.dtype);
        const float s = load_as_float(st.data, si, st.dtype) * __expf(A * dt) + B * dtx;
        store_from_float(st.data, si, st.dtype, s);
        y += s * C;
      }
    }
    y = row_sum(y, lanes);
    if (valid && lane == 0) store_out(a, row_out(a, i, v), slot, y);
  }
}

}  // namespace state_update_detail
}  // namespace ssm
