// The bulk-copy engine (cp.async.bulk, sm_90 and later): contiguous global memory copied into
// shared memory, or fetched into L2, by one instruction of one thread, with no registers held
// while it is in flight. A copy into shared memory counts its bytes on an mbarrier, which the
// threads that read the copy wait on. Every address and size is a multiple of 16 bytes.
// Compiled for an older architecture (the PTX the library carries for newer GPUs) they are empty:
// the prefetch is only a hint, and the kernels that copy run only where cluster_kernels_run says
// sm_90 code was loaded.
#pragma once

#include <cstdint>

namespace ssm {

__device__ __forceinline__ unsigned shared_address(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// Fetches `bytes` into L2 without waiting (the uniform datapath issues it: one thread a warp).
__device__ __forceinline__ void prefetch_l2_bulk(const void* p, unsigned bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
#endif
}

// One thread readies `bar` for one arrival a phase; the fence makes it visible to the copy
// engine, and the block's barrier after it to the other threads.
__device__ __forceinline__ void mbarrier_init_for_copies(uint64_t* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(shared_address(bar)) : "memory");
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}

// The one arrival of the phase, announcing the bytes the copies issued for it will bring.
__device__ __forceinline__ void mbarrier_expect_bytes(uint64_t* bar, unsigned bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(shared_address(bar)),
               "r"(bytes)
               : "memory");
#endif
}

// Orders this thread's earlier stores to shared memory before bulk copies that a barrier later
// lets any thread issue into the same bytes (the copies write through the async proxy).
__device__ __forceinline__ void fence_shared_for_copies() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}

// Copies `bytes` from global `src` to shared `dst`, counted on `bar`.
__device__ __forceinline__ void bulk_copy_to_shared(void* dst, const void* src, unsigned bytes,
                                                    uint64_t* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::
          "r"(shared_address(dst)),
      "l"(src), "r"(bytes), "r"(shared_address(bar))
      : "memory");
#endif
}

// Waits until the phase of `bar` with this parity has completed (its bytes have landed).
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, unsigned parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  unsigned done = 0;
  while (!done) {
    asm volatile(
        "{\n\t.reg .pred p;\n\t"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
        "selp.u32 %0, 1, 0, p;\n\t}"
        : "=r"(done)
        : "r"(shared_address(bar)), "r"(parity)
        : "memory");
  }
#endif
}

}  // namespace ssm
