// The validated description of one causal-conv1d call (libssm/conv1d.h), shared by the C entry
// points (which fill it), the CPU reference and the CUDA launchers. Strides are in elements, in
// the axis order the header documents: x, out, dout, dx (batch, dim, seqlen); weight and dweight
// (dim, width); bias and dbias (dim,); the states and their gradients (batch, dim, width-1);
// seq_idx (batch, seqlen). seq_idx's dtype is I32 or I64.
#pragma once

#include <cstddef>
#include <cstdint>

#include "../common/tensor_ref.h"
#include "libssm/core.h"

namespace ssm {

constexpr int kConv1dMinWidth = 2;
constexpr int kConv1dMaxWidth = 8;

struct Conv1dArgs {
  int64_t batch = 0, dim = 0, seqlen = 0;
  int width = 0;
  bool silu = false;

  // Forward inputs (the backward takes them too).
  TensorRef x, weight, bias, initial_states, seq_idx;
  // Forward outputs.
  TensorRef out, final_states;
  // Backward inputs beyond the forward's.
  TensorRef dout, dfinal_states;
  // Backward outputs, each optional.
  TensorRef dx, dweight, dbias, dinitial_states;
};

// The decode step. x and out are (batch, dim, seqlen) with stride[2] 0 when they came 2-d
// (seqlen 1); conv_state (batch_state, dim, state_len); cache_seqlens and conv_state_indices
// (batch,), I32 or I64.
struct Conv1dUpdateArgs {
  int64_t batch = 0, dim = 0, seqlen = 0, batch_state = 0, state_len = 0;
  int width = 0;
  bool silu = false;
  TensorRef x, conv_state, weight, bias, cache_seqlens, conv_state_indices, out;
};

// CPU reference (conv1d_cpu.cpp): float64 sums, deterministic. The update checks the indices
// (below batch_state, distinct) before writing anything.
ssm_status conv1d_fwd_cpu(const Conv1dArgs& a);
ssm_status conv1d_bwd_cpu(const Conv1dArgs& a);
ssm_status conv1d_update_cpu(const Conv1dUpdateArgs& a);

// CUDA (conv1d_cuda.cu). `device` is the CUDA ordinal every tensor lives on; `stream` a
// cudaStream_t. The backward's workspace (256-byte aligned) holds per-block partial sums of
// dweight and dbias; its size depends only on the sizes, x's strides and the device.
size_t conv1d_bwd_cuda_workspace(const Conv1dArgs& a, int device);
ssm_status conv1d_fwd_cuda(const Conv1dArgs& a, int device, void* stream);
ssm_status conv1d_bwd_cuda(const Conv1dArgs& a, int device, void* workspace, void* stream);
ssm_status conv1d_update_cuda(const Conv1dUpdateArgs& a, int device, void* stream);

}  // namespace ssm
