// The library-wide C entry points: status names, versions and CUDA device discovery. The CUDA
// runtime is linked statically, so these must work (and report no devices) on a machine that has
// no driver at all.
#include <cstring>

#include "error.h"
#include "libssm/core.h"

#ifdef SSM_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

#ifndef SSM_VERSION_STRING
#error "SSM_VERSION_STRING must come from the build (CMake reads it from pyproject.toml)"
#endif

namespace {

#ifdef SSM_WITH_CUDA
// Errors that mean "this process has no usable GPU" rather than "something broke": a missing or
// too old driver, no device nodes, all devices taken. Device discovery reports them as 0 devices.
bool means_no_gpu(cudaError_t e) {
  switch (e) {
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorStubLibrary:
    case cudaErrorInitializationError:
    case cudaErrorDevicesUnavailable:
    case cudaErrorSystemDriverMismatch:
    case cudaErrorCompatNotSupportedOnDevice:
      return true;
    default:
      return false;
  }
}

ssm_status device_count(int* count) {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    cudaGetLastError();  // so the failure does not surface in an unrelated later CUDA call
    if (means_no_gpu(e)) {
      *count = 0;
      return SSM_SUCCESS;
    }
    return ssm::fail(SSM_ERROR_CUDA, "cudaGetDeviceCount failed: %s (%s)", cudaGetErrorName(e),
                     cudaGetErrorString(e));
  }
  *count = n;
  return SSM_SUCCESS;
}
#endif

}  // namespace

extern "C" {

SSM_API const char* ssm_status_string(ssm_status status) {
  switch (status) {
    case SSM_SUCCESS: return "SSM_SUCCESS";
    case SSM_ERROR_INVALID_ARGUMENT: return "SSM_ERROR_INVALID_ARGUMENT";
    case SSM_ERROR_SHAPE: return "SSM_ERROR_SHAPE";
    case SSM_ERROR_DTYPE: return "SSM_ERROR_DTYPE";
    case SSM_ERROR_DEVICE: return "SSM_ERROR_DEVICE";
    case SSM_ERROR_LAYOUT: return "SSM_ERROR_LAYOUT";
    case SSM_ERROR_UNSUPPORTED: return "SSM_ERROR_UNSUPPORTED";
    case SSM_ERROR_WORKSPACE: return "SSM_ERROR_WORKSPACE";
    case SSM_ERROR_CUDA: return "SSM_ERROR_CUDA";
    case SSM_ERROR_INTERNAL: return "SSM_ERROR_INTERNAL";
    default: return "unknown status";
  }
}

SSM_API const char* ssm_version(void) { return SSM_VERSION_STRING; }

SSM_API int ssm_abi_version(void) { return SSM_ABI_VERSION; }

SSM_API ssm_status ssm_cuda_device_count(int* count) {
  ssm::clear_error();
  if (count == nullptr) return ssm::fail(SSM_ERROR_INVALID_ARGUMENT, "count: must not be NULL");
#ifdef SSM_WITH_CUDA
  return device_count(count);
#else
  *count = 0;
  return SSM_SUCCESS;
#endif
}

SSM_API ssm_status ssm_cuda_device_name(int device, char* name, size_t capacity) {
  ssm::clear_error();
#ifdef SSM_WITH_CUDA
  if (name == nullptr && capacity > 0)
    return ssm::fail(SSM_ERROR_INVALID_ARGUMENT, "name: must not be NULL when capacity is %zu",
                     capacity);
  int n = 0;
  const ssm_status s = device_count(&n);
  if (s != SSM_SUCCESS) return s;
  if (n == 0)
    return ssm::fail(SSM_ERROR_CUDA,
                     "device: %d, but this process sees no CUDA device (no GPU or no driver)",
                     device);
  if (device < 0 || device >= n)
    return ssm::fail(SSM_ERROR_INVALID_ARGUMENT,
                     "device: %d is not a CUDA device ordinal (this process sees %d device%s)",
                     device, n, n == 1 ? "" : "s");
  cudaDeviceProp prop;
  const cudaError_t e = cudaGetDeviceProperties(&prop, device);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return ssm::fail(SSM_ERROR_CUDA, "cudaGetDeviceProperties(%d) failed: %s (%s)", device,
                     cudaGetErrorName(e), cudaGetErrorString(e));
  }
  if (capacity > 0) {
    const size_t len = strnlen(prop.name, sizeof prop.name);
    const size_t copied = len < capacity - 1 ? len : capacity - 1;
    std::memcpy(name, prop.name, copied);
    name[copied] = '\0';
  }
  return SSM_SUCCESS;
#else
  (void)device;
  (void)name;
  (void)capacity;
  return ssm::fail(SSM_ERROR_CUDA, "libssm was built without CUDA support");
#endif
}

}  // extern "C"
