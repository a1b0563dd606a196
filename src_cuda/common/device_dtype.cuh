// Device-side loads and stores of the three float element types, chosen at run time. Ops stage
// their inputs through these into float32 shared memory, so one kernel serves every dtype mix
// with a uniform branch per load instead of a template instantiation per dtype combination.
// Also the 16-byte store the vectorised kernels write packed elements with.
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

// 16 bytes at p (16-byte aligned) in one store instruction. nvcc lowers the assignment of a
// uint4 through a pointer to four 4-byte stores, and ptxas merges them back only where it can
// prove the alignment (the norm forward lost 20% at 8192 columns where it could not), so the
// store is written out. Without a "memory" clobber: the kernels that use it never load what
// they store in the same launch (outputs do not overlap inputs; a state updated in place is
// loaded before it is stored), and a clobber would pin every later load behind the store
// (the general norm backward lost 10% to that).
__device__ __forceinline__ void store_16_bytes(void* p, uint4 w) {
  asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(w.x), "r"(w.y), "r"(w.z),
               "r"(w.w));
}
// The same, marked streaming (st.global.cs): first out of L1 and L2, for an output nothing reads
// back, so that it does not push out what the kernel reads again.
__device__ __forceinline__ void store_16_bytes_streaming(void* p, uint4 w) {
  asm volatile("st.global.cs.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(w.x), "r"(w.y),
               "r"(w.z), "r"(w.w));
}
// The same, not allocated in L1 (st.global.L1::no_allocate): one H100, the lean norm forward's
// 16-bit y at 256-384 columns (norm_fast.cuh says what it bought).
__device__ __forceinline__ void store_16_bytes_no_l1(void* p, uint4 w) {
  asm volatile("st.global.L1::no_allocate.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(w.x),
               "r"(w.y), "r"(w.z), "r"(w.w));
}
// 16 bytes from p (16-byte aligned) in one load not allocated in L1 (ld.global.L1::no_allocate):
// the lean norm forward's x where the call outgrows the L2 (norm_fast.cuh says what it bought).
__device__ __forceinline__ uint4 load_16_bytes_no_l1(const void* p) {
  uint4 w;
  asm("ld.global.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(w.x), "=r"(w.y), "=r"(w.z), "=r"(w.w)
      : "l"(p));
  return w;
}

}  // namespace ssm
