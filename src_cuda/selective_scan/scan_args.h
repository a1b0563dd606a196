// The validated description of one selective-scan call, shared by the C entry points (which fill
// it), the CPU reference and the CUDA launchers. Strides are in elements, in the axis order given
// beside each tensor; B and C are normalised to (batch, groups, dstate, seqlen) with batch and
// group strides of 0 where the caller's form lacks those axes.
#pragma once

#include <cstdint>

#include "../common/tensor_ref.h"
#include "libssm/core.h"

namespace ssm {

struct ScanArgs {
  int64_t batch = 0, dim = 0, seqlen = 0, dstate = 0;
  bool delta_softplus = false;

  // B and C: variable over (batch, step) with `groups` groups of dim/groups channels, or fixed
  // (dim, dstate) with strides {d, n} in stride[0..1].
  bool B_fixed = false, C_fixed = false;
  int64_t B_groups = 1, C_groups = 1;

  // Forward inputs.
  TensorRef u, delta;           // (batch, dim, seqlen)
  TensorRef A;                  // (dim, dstate), float32
  TensorRef B, C;               // (batch, groups, dstate, seqlen) or fixed (dim, dstate)
  TensorRef D, delta_bias;      // (dim,), float32, optional
  TensorRef z;                  // (batch, dim, seqlen), optional
  TensorRef initial_state;      // (batch, dim, dstate), optional

  // Forward outputs.
  TensorRef out;                // (batch, dim, seqlen)
  TensorRef last_state;         // (batch, dim, dstate), optional

  // Backward inputs.
  TensorRef dout;               // (batch, dim, seqlen)
  TensorRef dlast_state;        // (batch, dim, dstate), optional

  // Backward outputs, each optional; each shaped like its input.
  TensorRef du, ddelta, dA, dB, dC, dD, dz, ddelta_bias, dinitial_state;
};

// CPU reference (selective_scan_cpu.cpp): float32 state, float64 accumulation of reductions.
ssm_status selective_scan_fwd_cpu(const ScanArgs& a);
ssm_status selective_scan_bwd_cpu(const ScanArgs& a);

// CUDA (selective_scan_cuda.cu). `stream` is a cudaStream_t; `device` the CUDA ordinal all
// tensors live on. Workspace sizes are in bytes; the workspace is 256-byte aligned.
size_t selective_scan_fwd_cuda_workspace(const ScanArgs& a);
size_t selective_scan_bwd_cuda_workspace(const ScanArgs& a);
ssm_status selective_scan_fwd_cuda(const ScanArgs& a, int device, void* workspace,
                                   void* stream);
ssm_status selective_scan_bwd_cuda(const ScanArgs& a, int device, void* workspace,
                                   void* stream);

}  // namespace ssm
