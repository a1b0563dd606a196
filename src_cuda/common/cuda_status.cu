// CUDA error mapping, the cached device facts and the device guard of cuda_status.h.
#include "cuda_status.h"

#include <atomic>

namespace ssm {

ssm_status cuda_status(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return SSM_SUCCESS;
  // Clear the non-sticky "last error" so a later unrelated check does not report this one.
  cudaGetLastError();
  return fail(SSM_ERROR_CUDA, "%s: %s (%s)", what, cudaGetErrorString(err), cudaGetErrorName(err));
}

namespace {
// A device attribute, asked once per device (of the first 64) and kept in `cache` (zero: not asked
// yet); 0 if the query fails.
int cached_attribute(std::atomic<int> (&cache)[64], cudaDeviceAttr attr, int device) {
  int n = device >= 0 && device < 64 ? cache[device].load(std::memory_order_relaxed) : 0;
  if (n == 0) {
    if (cudaDeviceGetAttribute(&n, attr, device) != cudaSuccess) {
      cudaGetLastError();  // or the next launch would report this failure as its own
      return 0;
    }
    if (device >= 0 && device < 64) cache[device].store(n, std::memory_order_relaxed);
  }
  return n;
}
}  // namespace

int multiprocessor_count(int device) {
  static std::atomic<int> cached[64];
  return cached_attribute(cached, cudaDevAttrMultiProcessorCount, device);
}

int l2_cache_bytes(int device) {
  static std::atomic<int> cached[64];
  return cached_attribute(cached, cudaDevAttrL2CacheSize, device);
}

double dram_bytes_per_second(int device) {
  static std::atomic<int> clock_khz[64], bus_bits[64];
  const int khz = cached_attribute(clock_khz, cudaDevAttrMemoryClockRate, device);
  const int bits = cached_attribute(bus_bits, cudaDevAttrGlobalMemoryBusWidth, device);
  return 2.0 * 1e3 * khz * (bits / 8);
}

namespace {
// Compiled for the same architectures as every kernel of the library, so the code the device
// picks for it has the architecture the device picks for the others.
__global__ void architecture_probe() {}
}  // namespace

bool cluster_kernels_run(int device) {
  static std::atomic<int> cached[64];  // 0: not asked yet, 1: no, 2: yes
  const bool keep = device >= 0 && device < 64;
  const int known = keep ? cached[device].load(std::memory_order_relaxed) : 0;
  if (known != 0) return known == 2;
  cudaFuncAttributes attr;
  if (cudaFuncGetAttributes(&attr, architecture_probe) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  // ptxVersion is the virtual architecture the code was compiled for (its __CUDA_ARCH__), also
  // when the driver compiled it from PTX for a newer device.
  const bool yes = attr.ptxVersion >= 90;
  if (keep) cached[device].store(yes ? 2 : 1, std::memory_order_relaxed);
  return yes;
}

CudaDeviceGuard::CudaDeviceGuard(int device) {
  status_ = cuda_status(cudaGetDevice(&previous_), "cudaGetDevice");
  if (status_ == SSM_SUCCESS && previous_ != device) {
    status_ = cuda_status(cudaSetDevice(device), "cudaSetDevice");
    if (status_ != SSM_SUCCESS) previous_ = -1;
  } else {
    previous_ = -1;  // nothing to restore
  }
}

CudaDeviceGuard::~CudaDeviceGuard() {
  if (previous_ >= 0) cudaSetDevice(previous_);
}

}  // namespace ssm
