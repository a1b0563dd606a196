// float16 / bfloat16 <-> float32 conversions for host code (the CPU reference), written on the
// bit patterns so the CPU path needs neither CUDA headers nor C++23 extended float types.
// Rounding is to nearest even, as the GPU's conversion instructions do.
#pragma once

#include <cstdint>
#include <cstring>

#include "tensor_ref.h"

namespace ssm {

inline float bits_to_float(uint32_t b) { float f; std::memcpy(&f, &b, 4); return f; }
inline uint32_t float_to_bits(float f) { uint32_t b; std::memcpy(&b, &f, 4); return b; }

inline float bf16_to_float(uint16_t h) { return bits_to_float(uint32_t(h) << 16); }

inline uint16_t float_to_bf16(float f) {
  uint32_t b = float_to_bits(f);
  if ((b & 0x7fffffffu) > 0x7f800000u) return uint16_t((b >> 16) | 0x40);  // quiet NaN
  b += 0x7fffu + ((b >> 16) & 1u);
  return uint16_t(b >> 16);
}

float f16_to_float(uint16_t h);
uint16_t float_to_f16(float f);

// Reads element `i` (in elements) of a tensor of dtype `d` as float.
inline float load_float(const void* p, int64_t i, Dtype d) {
  switch (d) {
    case Dtype::F32: return static_cast<const float*>(p)[i];
    case Dtype::F16: return f16_to_float(static_cast<const uint16_t*>(p)[i]);
    default: return bf16_to_float(static_cast<const uint16_t*>(p)[i]);
  }
}

// Writes `v`, rounded to dtype `d`, to element `i`.
inline void store_float(void* p, int64_t i, Dtype d, float v) {
  switch (d) {
    case Dtype::F32: static_cast<float*>(p)[i] = v; break;
    case Dtype::F16: static_cast<uint16_t*>(p)[i] = float_to_f16(v); break;
    default: static_cast<uint16_t*>(p)[i] = float_to_bf16(v); break;
  }
}

}  // namespace ssm
