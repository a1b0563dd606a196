// The validated description of one selective-state decode step (libssm/state_update.h), shared
// by the C entry point (which fills it), the CPU reference and the CUDA launcher. Both layouts
// arrive normalised to Mamba-2's axes: a Mamba-1 call has nheads = ngroups = 1, headdim = dim
// and stride 0 on the axes its tensors lack. Strides are in elements, in the axis order given
// beside each tensor.
#pragma once

#include <cstdint>

#include "../common/tensor_ref.h"
#include "libssm/core.h"

namespace ssm {

struct StateUpdateArgs {
  int64_t batch = 0, batch_state = 0, nheads = 0, headdim = 0, dstate = 0, ngroups = 1;
  int64_t heads_per_group = 1;  // nheads / ngroups: head h reads group h / heads_per_group
  bool dt_softplus = false;

  TensorRef state;                // (batch_state, nheads, headdim, dstate), read and written
  TensorRef x, dt, z;             // (batch, nheads, headdim); z optional
  TensorRef A;                    // (nheads, headdim, dstate)
  TensorRef B, C;                 // (batch, ngroups, dstate)
  TensorRef D, dt_bias;           // (nheads, headdim), optional
  TensorRef state_batch_indices;  // (batch,) int32 or int64, optional
  TensorRef out;                  // (batch, nheads, headdim)

};

// CPU reference (state_update_cpu.cpp): float64 arithmetic. It first checks the indices (range,
// no repeats) and fails with nothing written.
ssm_status selective_state_update_cpu(const StateUpdateArgs& a);

// CUDA (state_update_cuda.cu). `device` is the CUDA ordinal every tensor lives on; `stream` a
// cudaStream_t.
ssm_status selective_state_update_cuda(const StateUpdateArgs& a, int device, void* stream);

}  // namespace ssm
