// CUDA error mapping and the device guard declared in cuda_status.h.
#include "cuda_status.h"

namespace ssm {

ssm_status cuda_status(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return SSM_SUCCESS;
  // Clear the non-sticky "last error" so a later unrelated check does not report this one.
  cudaGetLastError();
  return fail(SSM_ERROR_CUDA, "%s: %s (%s)", what, cudaGetErrorString(err), cudaGetErrorName(err));
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
