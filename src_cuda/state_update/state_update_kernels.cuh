// Device code of the selective-state decode step (libssm/state_update.h). Each row (b, h, p) of
// the state, dstate values long, is owned by a group of `lanes` consecutive lanes of a warp
// (a power of two up to 32); its out value is their sum, reduced with shuffles.
//
// Two kernels. state_update_vec_kernel reads and writes state in 16-byte chunks and is
// templated on state's dtype (the chunk's conversion must be compile-time) and on kChunks, the
// chunks each lane owns (its registers must be compile-time): float32 needs 2 only past
// dstate 128, so 4 instantiations cover every dtype and dstate. state_update_strided_kernel
// takes any strides and dtype element by element: dstate not a multiple of a chunk, state not
// contiguous along dstate, or unaligned rows. Everything else (operand dtypes, z, D, dt_bias,
// indices, A constant along dstate) is a warp-uniform run-time branch: decode is bound by
// latency and bytes, not by those instructions, and each template flag would double the
// instantiations.
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
  int64_t rows = 0;              // batch * nheads * headdim
  int lanes = 32;                // lanes per row: a power of two, 1..32
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

// out[b, h, p] from the lanes' summed y: zero for padding, NaN for an index out of range.
__device__ __forceinline__ void store_out(const StateUpdateArgs& a, RowIndex i, int64_t slot,
                                          float y, const RowInputs& v) {
  float o;
  if (slot == -1) {
    o = 0.f;
  } else if (slot == -2) {
    o = __int_as_float(0x7fffffff);
  } else {
    o = y;
    if (a.D.present()) o += v.D * v.x;
    if (a.z.present()) o *= silu(v.z);
  }
  const TensorRef& t = a.out;
  store_from_float(t.data, i.b * t.stride[0] + i.h * t.stride[1] + i.p * t.stride[2], t.dtype,
                   o);
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
// The kernels. Rows are walked with a block-stride loop whose condition is uniform across the
// block, so every lane reaches the shuffles; lanes of rows past the end compute on zeros and
// store nothing.

// Blocks per SM the vector kernel is compiled for. 8 (at most 64 registers: half the SM's
// threads resident) holds one chunk a lane without spilling (54 registers for float32 states,
// 56 for 16-bit ones, which take 68 when left free). Two chunks a lane keep twice the A, B and
// C pieces in registers and spilled at 64, so they get 6 (71 used; 76 when left free).
template <int kChunks>
constexpr int vec_min_blocks() {
  return kChunks == 1 ? 8 : 6;
}

template <typename T, int kChunks>
__global__ void __launch_bounds__(kThreads, vec_min_blocks<kChunks>())
    state_update_vec_kernel(const StateUpdateArgs a, const StateUpdatePlan plan) {
  constexpr int V = ChunkOf<T>::kElems;
  const int lanes = plan.lanes;
  const int lane = int(threadIdx.x) & (lanes - 1);
  const int64_t rows_per_block = kThreads / lanes;
  const int64_t N = a.dstate;
  const TensorRef& st = a.state;
  for (int64_t first = int64_t(blockIdx.x) * rows_per_block; first < plan.rows;
       first += int64_t(gridDim.x) * rows_per_block) {
    const int64_t r = first + int64_t(threadIdx.x) / lanes;
    const bool valid = r < plan.rows;
    const RowIndex i = split_row(valid ? r : 0, a);

    // Every load of the row is issued before any arithmetic; only the state's address waits
    // for the slot.
    const RowInputs v = valid ? load_row_inputs(a, plan, i) : RowInputs();
    float Ab[kChunks][V], Bb[kChunks][V], Cb[kChunks][V];
    uint4 raw[kChunks];
    const int64_t a_row = i.h * a.A.stride[0] + i.p * a.A.stride[1];
    const int64_t b_row = i.b * a.B.stride[0] + i.g * a.B.stride[1];
    const int64_t c_row = i.b * a.C.stride[0] + i.g * a.C.stride[1];
    const int64_t slot = valid ? state_slot(a, i.b) : -1;
    const int64_t state_row =
        slot * st.stride[0] + i.h * st.stride[1] + i.p * st.stride[2];
    const bool live = slot >= 0;
#pragma unroll
    for (int j = 0; j < kChunks; ++j) {
      const int64_t n0 = int64_t(lane + j * lanes) * V;
      raw[j] = make_uint4(0, 0, 0, 0);
      if (!valid || n0 >= N) {
#pragma unroll
        for (int k = 0; k < V; ++k) Ab[j][k] = Bb[j][k] = Cb[j][k] = 0.f;
        continue;
      }
      if (plan.a_per_row) {
#pragma unroll
        for (int k = 0; k < V; ++k) Ab[j][k] = 0.f;  // unused: the row's one decay applies
      } else {
        load_piece<V>(a.A, a_row + n0 * a.A.stride[2], a.A.stride[2], plan.a_contiguous, Ab[j]);
      }
      load_piece<V>(a.B, b_row + n0 * a.B.stride[2], a.B.stride[2], plan.b_contiguous, Bb[j]);
      load_piece<V>(a.C, c_row + n0 * a.C.stride[2], a.C.stride[2], plan.c_contiguous, Cb[j]);
      if (live) raw[j] = *reinterpret_cast<const uint4*>(static_cast<const T*>(st.data) +
                                                         state_row + n0);
    }

    float dt = v.dt;
    if (a.dt_softplus) dt = softplus(dt);
    const float dtx = dt * v.x;
    const float row_decay = plan.a_per_row ? __expf(v.A * dt) : 0.f;
    float y = 0.f;
#pragma unroll
    for (int j = 0; j < kChunks; ++j) {
      const int64_t n0 = int64_t(lane + j * lanes) * V;
      float s[V];
      chunk_to_floats<T>(raw[j], s);
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const float decay = plan.a_per_row ? row_decay : __expf(Ab[j][k] * dt);
        s[k] = s[k] * decay + Bb[j][k] * dtx;
        y += s[k] * Cb[j][k];
      }
      if (live && n0 < N)
        *reinterpret_cast<uint4*>(static_cast<T*>(st.data) + state_row + n0) =
            floats_to_chunk<T>(s);
    }
    y = row_sum(y, lanes);
    if (valid && lane == 0) store_out(a, i, slot, y, v);
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
    if (valid && lane == 0) store_out(a, i, slot, y, v);
  }
}

}  // namespace state_update_detail
}  // namespace ssm
