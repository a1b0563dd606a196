// Device-side loads and stores of the three float element types, chosen at run time. Ops stage
// their inputs through these into float32 shared memory, so one kernel serves every dtype mix
// with a uniform branch per load instead of a template instantiation per dtype combination.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "tensor_ref.h"

namespace ssm {

__device__ __forceinline__ float load_as_float(const void* p, int64_t i, Dtype d) {
  if (d == Dtype::F32) return static_cast<const float*>(p)[i];
  if (d == Dtype::F16) return __half2float(static_cast<const __half*>(p)[i]);
  return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
}

__device__ __forceinline__ void store_from_float(void* p, int64_t i, Dtype d, float v) {
  if (d == Dtype::F32) static_cast<float*>(p)[i] = v;
  else if (d == Dtype::F16) static_cast<__half*>(p)[i] = __float2half_rn(v);
  else static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(v);
}

}  // namespace ssm
