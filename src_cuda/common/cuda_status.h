// Turning CUDA runtime results into libssm statuses with a message, the device facts launchers
// size grids by, and running launches on the tensors' device while leaving the caller's current
// device as it was.
#pragma once

#include <cuda_runtime_api.h>

#include "error.h"

namespace ssm {

// SSM_SUCCESS for cudaSuccess; otherwise records "<what>: <CUDA error string>" and returns
// SSM_ERROR_CUDA.
ssm_status cuda_status(cudaError_t err, const char* what);

// The device's multiprocessor count, asked once per device and cached; 0 if the query fails.
int multiprocessor_count(int device);

// The device's L2 cache in bytes, asked once per device and cached; 0 if the query fails.
int l2_cache_bytes(int device);

// The device's peak DRAM bandwidth in bytes a second (two transfers a memory clock across the
// bus), from attributes asked once per device and cached; 0 if a query fails.
double dram_bytes_per_second(int device);

// Whether the code the current device runs was compiled for sm_90 or later, so kernels that
// use thread-block clusters (compiled only there) can launch; asked once per device and cached.
// The caller makes `device` current (CudaDeviceGuard).
bool cluster_kernels_run(int device);

// Makes `device` current for the guard's lifetime and restores the previous one after.
class CudaDeviceGuard {
 public:
  explicit CudaDeviceGuard(int device);
  ~CudaDeviceGuard();
  ssm_status status() const { return status_; }

 private:
  int previous_ = -1;
  ssm_status status_ = SSM_SUCCESS;
};

}  // namespace ssm
