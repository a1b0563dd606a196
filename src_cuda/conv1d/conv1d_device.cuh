// Device helpers the conv1d kernels share: eight-element slices of a row (or a few channels)
// moved as raw bits (one 16-byte access for a slice of a 16-bit dtype, two for float32, when the
// row allows it), their conversion to and from float32, and the taps of one output and of one
// input gradient with the packed-sequence masks. Everything that depends on the run-time width W
// is written as loops over the compile-time kTaps >= W with W's taps at the top
// (k >= kTaps - W), so every array index is a constant after unrolling and the arrays stay in
// registers.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "../common/cp_async.cuh"
#include "../common/device_dtype.cuh"
#include "../common/device_math.cuh"
#include "conv1d_args.h"
#include "conv1d_plan.h"

namespace ssm {
namespace conv1d_detail {

constexpr int kSlice = 8;  // elements of a slice: 16 bytes of a 16-bit dtype

// 32-bit words that hold kN elements of kDt (kN even for the 16-bit types).
template <int kDt, int kN>
constexpr int kRawWords = kDt == int(Dtype::F32) ? kN : kN / 2;

template <int kDt>
constexpr int kWords = kRawWords<kDt, kSlice>;  // 32-bit words of a raw slice

// kN elements (by default a slice) as the bits they have in memory: float32 one element a word,
// 16-bit types two a word (element 2k in the low half of word k).
template <int kDt, int kN = kSlice>
struct Raw {
  uint32_t w[kRawWords<kDt, kN>];
};

template <int kDt, int kN>
__device__ __forceinline__ void clear(Raw<kDt, kN>& r) {
#pragma unroll
  for (int i = 0; i < kRawWords<kDt, kN>; ++i) r.w[i] = 0u;
}

// Elements i, i + stride, ... (n <= kN of them, the rest read as 0) of `p`. `vec` promises
// stride 1, alignment to the kN elements' size (at most 16 bytes) and n == kN, and makes
// accesses of up to 16 bytes: one for a slice of a 16-bit dtype, two for float32.
template <int kDt, int kN>
__device__ __forceinline__ void load_raw(const void* p, int64_t i, int64_t stride, int n,
                                         bool vec, Raw<kDt, kN>& r) {
  constexpr int kW = kRawWords<kDt, kN>;
  if (vec) {
    const char* q = static_cast<const char*>(p) + i * (kDt == int(Dtype::F32) ? 4 : 2);
    if constexpr (kW % 4 == 0) {
#pragma unroll
      for (int h = 0; h < kW / 4; ++h) {
        const uint4 v = reinterpret_cast<const uint4*>(q)[h];
        r.w[4 * h] = v.x, r.w[4 * h + 1] = v.y, r.w[4 * h + 2] = v.z, r.w[4 * h + 3] = v.w;
      }
    } else if constexpr (kW == 2) {
      const uint2 v = *reinterpret_cast<const uint2*>(q);
      r.w[0] = v.x, r.w[1] = v.y;
    } else {
      static_assert(kW == 1, "raw values of 1, 2 or a multiple of 4 words");
      r.w[0] = *reinterpret_cast<const uint32_t*>(q);
    }
    return;
  }
  if constexpr (kDt == int(Dtype::F32)) {
    const uint32_t* q = static_cast<const uint32_t*>(p);
#pragma unroll
    for (int e = 0; e < kN; ++e) r.w[e] = e < n ? q[i + e * stride] : 0u;
  } else {
    const uint16_t* q = static_cast<const uint16_t*>(p);
#pragma unroll
    for (int k = 0; k < kW; ++k) {
      const uint32_t lo = 2 * k < n ? q[i + 2 * k * stride] : 0u;
      const uint32_t hi = 2 * k + 1 < n ? q[i + (2 * k + 1) * stride] : 0u;
      r.w[k] = lo | (hi << 16);
    }
  }
}

template <int kDt, int kN>
__device__ __forceinline__ void store_raw(void* p, int64_t i, int64_t stride, int n, bool vec,
                                          const Raw<kDt, kN>& r) {
  constexpr int kW = kRawWords<kDt, kN>;
  if (vec) {
    char* q = static_cast<char*>(p) + i * (kDt == int(Dtype::F32) ? 4 : 2);
    if constexpr (kW % 4 == 0) {
#pragma unroll
      for (int h = 0; h < kW / 4; ++h)
        reinterpret_cast<uint4*>(q)[h] =
            make_uint4(r.w[4 * h], r.w[4 * h + 1], r.w[4 * h + 2], r.w[4 * h + 3]);
    } else if constexpr (kW == 2) {
      *reinterpret_cast<uint2*>(q) = make_uint2(r.w[0], r.w[1]);
    } else {
      static_assert(kW == 1, "raw values of 1, 2 or a multiple of 4 words");
      *reinterpret_cast<uint32_t*>(q) = r.w[0];
    }
    return;
  }
  if constexpr (kDt == int(Dtype::F32)) {
    uint32_t* q = static_cast<uint32_t*>(p);
#pragma unroll
    for (int e = 0; e < kN; ++e)
      if (e < n) q[i + e * stride] = r.w[e];
  } else {
    uint16_t* q = static_cast<uint16_t*>(p);
#pragma unroll
    for (int e = 0; e < kN; ++e)
      if (e < n) q[i + e * stride] = uint16_t(r.w[e / 2] >> (16 * (e & 1)));
  }
}

// Element e of raw values as float32.
template <int kDt, int kN>
__device__ __forceinline__ float element(const Raw<kDt, kN>& r, int e) {
  if constexpr (kDt == int(Dtype::F32)) {
    return __uint_as_float(r.w[e]);
  } else {
    const uint32_t bits = (r.w[e / 2] >> (16 * (e & 1))) & 0xffffu;
    if constexpr (kDt == int(Dtype::BF16)) return __uint_as_float(bits << 16);
    return __half2float(__ushort_as_half(uint16_t(bits)));
  }
}

// kN float32 values rounded to kDt, as raw values.
template <int kDt, int kN>
__device__ __forceinline__ void narrow(const float (&v)[kN], Raw<kDt, kN>& r) {
#pragma unroll
  for (int k = 0; k < kRawWords<kDt, kN>; ++k) {
    if constexpr (kDt == int(Dtype::F32)) {
      r.w[k] = __float_as_uint(v[k]);
    } else if constexpr (kDt == int(Dtype::BF16)) {
      const __nv_bfloat162 b = __floats2bfloat162_rn(v[2 * k], v[2 * k + 1]);
      memcpy(&r.w[k], &b, 4);
    } else {
      const __half2 h = __floats2half2_rn(v[2 * k], v[2 * k + 1]);
      memcpy(&r.w[k], &h, 4);
    }
  }
}

// One element of an x-dtype tensor as float32.
template <int kDt>
__device__ __forceinline__ float load_x(const void* p, int64_t i) {
  return load_as_float(p, i, Dtype(kDt));
}

// weight[c, :] as kTaps taps, W's taps at the top and zeros below.
template <int kTaps>
__device__ __forceinline__ void load_taps(const TensorRef& weight, int64_t c, int W,
                                          float (&wt)[kTaps]) {
#pragma unroll
  for (int k = 0; k < kTaps; ++k) {
    const int j = k - (kTaps - W);
    wt[k] = j >= 0 ? load_as_float(weight.data, c * weight.stride[0] + j * weight.stride[1],
                                   weight.dtype)
                   : 0.f;
  }
}

__device__ __forceinline__ float load_bias(const TensorRef& bias, int64_t c) {
  return bias.present() ? load_as_float(bias.data, c * bias.stride[0], bias.dtype) : 0.f;
}

__device__ __forceinline__ int load_seq_id(const TensorRef& seq_idx, int64_t b, int64_t t) {
  return static_cast<const int32_t*>(seq_idx.data)[b * seq_idx.stride[0] + t * seq_idx.stride[1]];
}

// Which taps count, as bits: bit k of a tap mask is tap k (input kTaps-1-k positions back). The
// W taps at the top count, those below are skipped (not multiplied by 0, which would turn an inf
// or NaN in x there into NaN), and with seq_idx so are taps reading another packed sequence.
template <int kTaps>
__device__ __forceinline__ uint32_t width_taps(int W) {
  return ((1u << W) - 1u) << (kTaps - W);
}

// The tap mask of a kernel body: with kFull (the width fills the kTaps taps) a constant, so the
// taps' predicates fold away at compile time; otherwise W's taps at the top.
template <int kTaps, bool kFull>
__device__ __forceinline__ uint32_t body_taps(int W) {
  return kFull ? (1u << kTaps) - 1u : width_taps<kTaps>(W);
}

// The tap mask of the output whose window of ids (positions kTaps-1 back .. the output) is sw.
template <int kTaps>
__device__ __forceinline__ uint32_t same_sequence_taps(const int* sw, uint32_t width_mask) {
  uint32_t m = 0u;
#pragma unroll
  for (int k = 0; k < kTaps; ++k) m |= uint32_t(sw[k] == sw[kTaps - 1]) << k;
  return m & width_mask;
}

// z = bias + sum over the taps in mask m of wt[k] * xw[k], for the output at xw[kTaps-1].
template <int kTaps>
__device__ __forceinline__ float conv_at(const float* xw, const float (&wt)[kTaps], float bias,
                                         uint32_t m) {
  float z = bias;
#pragma unroll
  for (int k = 0; k < kTaps; ++k) z = (m >> k) & 1u ? fmaf(wt[k], xw[k], z) : z;
  return z;
}

// The gradient reaching the input at dzw[0]'s position from the outputs it feeds, dzw[i] being
// dz i positions ahead: sum over the taps in mask m of wt[k] * dzw[kTaps-1-k] (bit k is the
// output kTaps-1-k ahead, which reads this input through tap k).
template <int kTaps>
__device__ __forceinline__ float input_grad_at(const float* dzw, const float (&wt)[kTaps],
                                               uint32_t m) {
  float g = 0.f;
#pragma unroll
  for (int k = 0; k < kTaps; ++k) g = (m >> k) & 1u ? fmaf(wt[k], dzw[kTaps - 1 - k], g) : g;
  return g;
}

// The input-gradient mask of the input whose window of ids (the input .. kTaps-1 ahead) is sw:
// bit k set when the output kTaps-1-k ahead is of the input's sequence.
template <int kTaps>
__device__ __forceinline__ uint32_t same_sequence_outputs(const int* sw, uint32_t width_mask) {
  uint32_t m = 0u;
#pragma unroll
  for (int k = 0; k < kTaps; ++k) m |= uint32_t(sw[kTaps - 1 - k] == sw[0]) << k;
  return m & width_mask;
}

// Eight tap masks (one an output of a slice), kTaps bits each, packed: output e at bit e*kTaps.
using SliceMasks = uint64_t;

template <int kTaps>
__device__ __forceinline__ uint32_t mask_of(SliceMasks m, int e) {
  return uint32_t(m >> (e * kTaps)) & ((1u << kTaps) - 1u);
}

template <int kTaps>
__device__ __forceinline__ SliceMasks replicate(uint32_t m) {
  SliceMasks r = 0;
#pragma unroll
  for (int e = 0; e < kSlice; ++e) r |= SliceMasks(m) << (e * kTaps);
  return r;
}

__device__ __forceinline__ int64_t at3(const TensorRef& t, int64_t b, int64_t c, int64_t j) {
  return b * t.stride[0] + c * t.stride[1] + j * t.stride[2];
}

// x at position pos of -(W-1) .. seqlen-1, initial_states (or 0) below 0.
template <int kDt>
__device__ __forceinline__ float x_or_initial(const Conv1dArgs& a, int64_t b, int64_t c,
                                              int64_t pos) {
  if (pos >= 0) return load_x<kDt>(a.x.data, at3(a.x, b, c, pos));
  const int64_t j = pos + a.width - 1;
  const TensorRef& st = a.initial_states;
  if (!st.present() || j < 0) return 0.f;
  return load_as_float(st.data, at3(st, b, c, j), st.dtype);
}

// final_states[b, c, :] of a row with seqlen >= 1, read again from x and initial_states by the
// one thread that did the row's end, after its part of the row: the kernels' main loops then
// keep no registers for it.
template <int kDt>
__device__ __forceinline__ void write_final_states(const Conv1dArgs& a, int64_t b, int64_t c) {
  const TensorRef& fs = a.final_states;
  const int64_t L = a.seqlen;
  const int last_id = a.seq_idx.present() ? load_seq_id(a.seq_idx, b, L - 1) : 0;
  for (int j = 0; j < a.width - 1; ++j) {
    const int64_t pos = L - (a.width - 1) + j;
    float v = x_or_initial<kDt>(a, b, c, pos);
    if (a.seq_idx.present() && load_seq_id(a.seq_idx, b, pos > 0 ? pos : 0) != last_id) v = 0.f;
    store_from_float(fs.data, at3(fs, b, c, j), fs.dtype, v);
  }
}

// A unit's dweight (its W live taps of the kTaps-wide kernel) and dbias sums, written as one
// partial row of W + 1 floats at `out`; the fixed-order reduce adds the rows up.
template <int kTaps>
__device__ __forceinline__ void write_tap_partials(float* out, const float (&dw)[kTaps], float db,
                                                   int W) {
#pragma unroll
  for (int k = 0; k < kTaps; ++k)
    if (k >= kTaps - W) out[k - (kTaps - W)] = dw[k];
  out[W] = db;
}

}  // namespace conv1d_detail

// Launches `masked` (the kernel for packed sequences) when seq_idx is given, else `plain`, with
// a thread for each of `threads` (rounded up to whole blocks of kConv1dBlock).
template <class Plan>
cudaError_t launch_by_seq_idx(void (*masked)(Conv1dArgs, Plan), void (*plain)(Conv1dArgs, Plan),
                              int64_t threads, const Conv1dArgs& a, const Plan& p,
                              cudaStream_t stream) {
  const unsigned blocks = unsigned((threads + kConv1dBlock - 1) / kConv1dBlock);
  (a.seq_idx.present() ? masked : plain)<<<blocks, kConv1dBlock, 0, stream>>>(a, p);
  return cudaGetLastError();
}
}  // namespace ssm
