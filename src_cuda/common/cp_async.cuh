// cp.async (sm_80 and later): the kernels of every op family that stage rows in shared memory
// (conv1d's, the fused norm's staged forward) copy with these.
#pragma once

namespace ssm {

// Asynchronous 16-byte copies from global to shared memory (cp.async, sm_80 on): in flight
// without holding registers. A group is the copies a thread issued between commits; waiting
// leaves at most N of its latest groups pending.
__device__ __forceinline__ void cp_async_16(void* smem, const void* global) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(
                   unsigned(__cvta_generic_to_shared(smem))),
               "l"(global)
               : "memory");
}
// The same, copying the 16 bytes at `global` when `copy`, else filling with zeros and reading
// nothing (the address must still be a valid one).
__device__ __forceinline__ void cp_async_16_or_zero(void* smem, const void* global, bool copy) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(
                   unsigned(__cvta_generic_to_shared(smem))),
               "l"(global), "r"(copy ? 16 : 0)
               : "memory");
}
// The same for 4, 8 or 16 bytes (through L1: the 16-byte-only .cg form skips it).
template <int kBytes>
__device__ __forceinline__ void cp_async_ca(void* smem, const void* global) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(
                   unsigned(__cvta_generic_to_shared(smem))),
               "l"(global), "n"(kBytes)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

}  // namespace ssm
