// Eight-element slices of a row, loaded and stored as float32 whatever the tensor's dtype. The
// norm kernels move every row-shaped operand through these: one 16-byte access per slice for
// 16-bit dtypes (two for float32) when the row is aligned for it, element by element otherwise,
// with the dtype and the alignment as uniform run-time branches instead of template switches.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "../common/device_dtype.cuh"

namespace ssm {

constexpr int kSlice = 8;

// Element `i` onward of `p` into v[0..7] in two steps, fetch_slice then widen_slice, so a caller
// can issue the fetches of several slices before waiting on any: the conversion reads the loaded
// registers, and a conversion right after each load would hold every later load back until the
// data arrives. With `vec` false only the first `n` are read and the rest are 0. `vec` promises
// 16-byte alignment and a whole slice.
//
// fetch_slice leaves float32 values in place, and 16-bit ones packed two to a register in
// v[0..3]; widen_slice unpacks those from the back, so no second buffer is needed. A `vec` slice
// is loaded as `hint` says: through L1, or not allocated in it (load_16_bytes_no_l1,
// device_dtype.cuh).
enum class LoadHint { kCached, kNoL1 };
__device__ __forceinline__ void fetch_slice(const void* p, Dtype d, int64_t i, int n, bool vec,
                                            float (&v)[kSlice],
                                            LoadHint hint = LoadHint::kCached) {
  const bool no_l1 = hint == LoadHint::kNoL1;
  if (vec) {
    if (d == Dtype::F32) {
      const float4* q = reinterpret_cast<const float4*>(static_cast<const float*>(p) + i);
      float4 a, b;
      if (no_l1) {
        const uint4 ua = load_16_bytes_no_l1(q), ub = load_16_bytes_no_l1(q + 1);
        a = make_float4(__uint_as_float(ua.x), __uint_as_float(ua.y), __uint_as_float(ua.z),
                        __uint_as_float(ua.w));
        b = make_float4(__uint_as_float(ub.x), __uint_as_float(ub.y), __uint_as_float(ub.z),
                        __uint_as_float(ub.w));
      } else {
        a = q[0], b = q[1];
      }
      v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w;
      v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
    } else {
      const uint4* q = reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(p) + i);
      const uint4 raw = no_l1 ? load_16_bytes_no_l1(q) : *q;
      v[0] = __uint_as_float(raw.x), v[1] = __uint_as_float(raw.y);
      v[2] = __uint_as_float(raw.z), v[3] = __uint_as_float(raw.w);
    }
    return;
  }
#pragma unroll
  for (int k = 0; k < kSlice; ++k) v[k] = k < n ? load_as_float(p, i + k, d) : 0.f;
}

__device__ __forceinline__ void widen_slice(Dtype d, bool vec, float (&v)[kSlice]) {
  if (!vec || d == Dtype::F32) return;
#pragma unroll
  for (int k = 3; k >= 0; --k) {
    const uint32_t w = __float_as_uint(v[k]);
    if (d == Dtype::BF16) {
      v[2 * k + 1] = __uint_as_float(w & 0xffff0000u);
      v[2 * k] = __uint_as_float(w << 16);
    } else {
      __half2 h;
      memcpy(&h, &w, sizeof h);
      const float2 f = __half22float2(h);
      v[2 * k + 1] = f.y;
      v[2 * k] = f.x;
    }
  }
}

// a and b rounded to 16-bit dtype d and packed in one word, a in the low half.
__device__ __forceinline__ uint32_t pack_pair(Dtype d, float a, float b) {
  uint32_t w;
  if (d == Dtype::BF16) {
    const __nv_bfloat162 t = __floats2bfloat162_rn(a, b);
    memcpy(&w, &t, sizeof t);
  } else {
    const __half2 t = __floats2half2_rn(a, b);
    memcpy(&w, &t, sizeof t);
  }
  return w;
}

// How store_slice stores a 16-bit `vec` slice: store_16_bytes, store_16_bytes_streaming or
// store_16_bytes_no_l1 (device_dtype.cuh).
enum class StoreHint { kCached, kStreaming, kNoL1 };

// v[0..7] (or the first `n` without `vec`) rounded to `d` and stored from element `i` onward, a
// 16-bit `vec` slice as `hint` says.
__device__ __forceinline__ void store_slice(void* p, Dtype d, int64_t i, int n, bool vec,
                                            const float (&v)[kSlice],
                                            StoreHint hint = StoreHint::kCached) {
  if (vec) {
    if (d == Dtype::F32) {
      float* q = static_cast<float*>(p) + i;
      store_16_bytes(q, make_uint4(__float_as_uint(v[0]), __float_as_uint(v[1]),
                                   __float_as_uint(v[2]), __float_as_uint(v[3])));
      store_16_bytes(q + 4, make_uint4(__float_as_uint(v[4]), __float_as_uint(v[5]),
                                       __float_as_uint(v[6]), __float_as_uint(v[7])));
      return;
    }
    uint32_t w[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) w[k] = pack_pair(d, v[2 * k], v[2 * k + 1]);
    const uint4 packed = make_uint4(w[0], w[1], w[2], w[3]);
    uint16_t* q = static_cast<uint16_t*>(p) + i;
    if (hint == StoreHint::kStreaming) store_16_bytes_streaming(q, packed);
    else if (hint == StoreHint::kNoL1) store_16_bytes_no_l1(q, packed);
    else store_16_bytes(q, packed);
    return;
  }
#pragma unroll
  for (int k = 0; k < kSlice; ++k)
    if (k < n) store_from_float(p, i + k, d, v[k]);
}

}  // namespace ssm
