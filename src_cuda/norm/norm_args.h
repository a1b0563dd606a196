// The validated description of one fused-norm call (libssm/norm.h), shared by the C entry points
// (which fill it), the CPU reference and the CUDA launchers. Row-shaped tensors are (rows, hidden)
// with the row stride in stride[0] (the hidden axis is contiguous); weight, bias and their
// gradients are contiguous (hidden,); mean and rstd are (rows, ngroups) with strides in
// stride[0..1] (stride[1] is 0 when they came 1-d).
#pragma once

#include <cstdint>

#include "../common/tensor_ref.h"
#include "libssm/core.h"

namespace ssm {

struct NormArgs {
  int64_t rows = 0, hidden = 0;
  int64_t group_size = 0, ngroups = 1;  // group_size * ngroups == hidden
  bool layer_norm = false;
  bool zero_centered_weight = false;
  bool norm_before_gate = true;
  float eps = 0.f;

  // Forward inputs (the backward takes weight, bias and z too; its x is the forward's s).
  TensorRef x, residual, z;     // (rows, hidden); residual and z optional
  TensorRef weight, bias;       // (hidden,); bias optional

  // Forward outputs.
  TensorRef y, residual_out;    // (rows, hidden); residual_out optional
  TensorRef mean, rstd;         // (rows, ngroups) float32; optional in the forward

  // Backward inputs: mean and rstd above, and these.
  TensorRef dy, dresidual_out;  // (rows, hidden); dresidual_out optional

  // Backward outputs, each optional.
  TensorRef dx, dresidual, dz;  // (rows, hidden)
  TensorRef dweight, dbias;     // (hidden,)

  // The backward takes the residual stream's gradients (dresidual_out in, or dresidual out).
  bool stream_grads() const { return dresidual_out.present() || dresidual.present(); }
};

// CPU reference (norm_cpu.cpp): float64 reductions, deterministic.
ssm_status norm_fwd_cpu(const NormArgs& a);
ssm_status norm_bwd_cpu(const NormArgs& a);

// CUDA (norm_cuda.cu). `device` is the CUDA ordinal every tensor lives on; `stream` a
// cudaStream_t. The backward workspace is 256-byte aligned and holds the per-block partial sums
// of dweight and dbias.
size_t norm_bwd_cuda_workspace(const NormArgs& a, int device);
ssm_status norm_fwd_cuda(const NormArgs& a, int device, void* stream);
ssm_status norm_bwd_cuda(const NormArgs& a, int device, void* workspace, void* stream);

}  // namespace ssm
