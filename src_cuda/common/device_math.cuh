// The special-function-unit forms of 2^x, 1/x, sigmoid and silu that the kernels of every op
// family share.
#pragma once

namespace ssm {

// 2^x and 1/x on the special-function unit alone, flushing subnormals. The non-flushing forms
// (what exp2f, __expf and __fdividef compile to without -ftz) add a test and two scalings each,
// ~6 more instructions a sigmoid, and the kernels that call these are issue-bound. Flushing
// changes only results below 2^-126: a state contribution already below float32's normal range,
// or the 2^x beside 1 in 1 + 2^x.
__device__ __forceinline__ float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float rcp_ftz(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// A few ulp, against an IEEE division's dozen instructions an element; for z far below 0 the
// denominator overflows and the result is 0, the limit.
__device__ __forceinline__ float sigmoid(float z) {
  return rcp_ftz(1.f + exp2_ftz(-1.44269504f * z));
}
__device__ __forceinline__ float silu(float z) { return z * sigmoid(z); }
// d silu / dz = sigmoid(z) (1 + z (1 - sigmoid(z))).
__device__ __forceinline__ float dsilu(float z) {
  const float s = sigmoid(z);
  return s * (1.f + z * (1.f - s));
}

}  // namespace ssm
