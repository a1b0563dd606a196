// Device code shared by the forward and backward selective-scan kernels: where a block sits
// (batch, channels, B/C groups), per-thread constants, and staging one chunk of B, C, u and dt
// into float32 shared memory (zero-padded past seqlen, past dstate and past the block's valid
// channels, so padded steps leave the state unchanged: dt = 0 gives exp(0) = 1 and no input).
#pragma once

#include <cuda_runtime.h>

#include "../common/device_dtype.cuh"
#include "scan_traits.cuh"

namespace ssm {

constexpr float kLog2e = 1.4426950408889634f;

__device__ __forceinline__ float softplus(float x) {
  return x <= 20.f ? log1pf(expf(x)) : x;
}

__device__ __forceinline__ float sigmoid(float x) { return 1.f / (1.f + expf(-x)); }

template <typename Tr>
struct BlockPlace {
  int64_t b;          // batch
  int64_t chan0;      // first channel of the block
  int nvalid;         // channels of the block inside its cell (the rest are padding)
  int64_t gB, gC;     // group of B and C (0 for fixed forms)
  int c, p;           // this thread's channel in the block and lane within the channel
  int64_t d;          // this thread's channel
  bool cvalid;

  __device__ BlockPlace(const ScanArgs& a, const ScanGrid& g, int64_t batch) {
    b = batch;
    const int64_t cell = blockIdx.x / g.tiles_per_cell, tile = blockIdx.x % g.tiles_per_cell;
    chan0 = cell * g.cell + tile * Tr::kK;
    const int64_t left = g.cell - tile * Tr::kK;
    nvalid = left < Tr::kK ? int(left) : Tr::kK;
    gB = a.B_fixed ? 0 : chan0 / (a.dim / a.B_groups);
    gC = a.C_fixed ? 0 : chan0 / (a.dim / a.C_groups);
    c = threadIdx.x / Tr::kP;
    p = threadIdx.x % Tr::kP;
    d = chan0 + c;
    cvalid = c < nvalid;
  }

  __device__ int64_t seq_index(const TensorRef& t, int64_t chan, int64_t step) const {
    return b * t.stride[0] + chan * t.stride[1] + step * t.stride[2];
  }
  __device__ int64_t state_index(const TensorRef& t, int n) const {
    return b * t.stride[0] + d * t.stride[1] + n * t.stride[2];
  }
};

// Thread-constant values of this thread's states: A pre-scaled by log2(e) for exp2, the fixed
// forms of B and C. Padded states get A = 0 and B = C = 0, so they stay at zero and add nothing.
template <typename Tr>
struct StateConsts {
  float A[Tr::kNS], A2[Tr::kNS], Bfix[Tr::kNS], Cfix[Tr::kNS];

  __device__ StateConsts(const ScanArgs& a, const BlockPlace<Tr>& pl) {
#pragma unroll
    for (int j = 0; j < Tr::kNS; ++j) {
      const int n = pl.p * Tr::kNS + j;
      const bool ok = pl.cvalid && n < a.dstate;
      A[j] = ok ? static_cast<const float*>(a.A.data)[pl.d * a.A.stride[0] + n * a.A.stride[1]] : 0.f;
      A2[j] = A[j] * kLog2e;
      Bfix[j] = ok && a.B_fixed
                    ? load_as_float(a.B.data, pl.d * a.B.stride[0] + n * a.B.stride[1], a.B.dtype)
                    : 0.f;
      Cfix[j] = ok && a.C_fixed
                    ? load_as_float(a.C.data, pl.d * a.C.stride[0] + n * a.C.stride[1], a.C.dtype)
                    : 0.f;
    }
  }
};

// Stages B[b, g, :, t0 : t0 + kT] into dst[t * kBCPitch + n]. Threads walk steps fastest so the
// global reads follow the (usually unit) sequence stride.
template <typename Tr>
__device__ void stage_bc(float* dst, const TensorRef& t, int64_t b, int64_t g, int64_t dstate,
                         int64_t seqlen, int64_t t0) {
  for (int i = threadIdx.x; i < Tr::kT * Tr::kNpad; i += Tr::kThreads) {
    const int s = i % Tr::kT, n = i / Tr::kT;
    float v = 0.f;
    if (n < dstate && t0 + s < seqlen)
      v = load_as_float(t.data,
                        b * t.stride[0] + g * t.stride[1] + n * t.stride[2] + (t0 + s) * t.stride[3],
                        t.dtype);
    dst[s * Tr::kBCPitch + n] = v;
  }
}

// Stages u and dt = (softplus)(delta + delta_bias) of the block's channels for steps
// [t0, t0 + kT) into su/sdt[c * kChanPitch + s]; with `dout` also dy = dout * silu(z) into sdy.
template <typename Tr>
__device__ void stage_channels(const ScanArgs& a, const BlockPlace<Tr>& pl, int64_t t0, float* su,
                               float* sdt, float* sdy) {
  for (int i = threadIdx.x; i < Tr::kK * Tr::kT; i += Tr::kThreads) {
    const int c = i / Tr::kT, s = i % Tr::kT;
    float u = 0.f, dt = 0.f, dy = 0.f;
    if (c < pl.nvalid && t0 + s < a.seqlen) {
      const int64_t d = pl.chan0 + c;
      u = load_as_float(a.u.data, pl.seq_index(a.u, d, t0 + s), a.u.dtype);
      dt = load_as_float(a.delta.data, pl.seq_index(a.delta, d, t0 + s), a.delta.dtype);
      if (a.delta_bias.data) dt += static_cast<const float*>(a.delta_bias.data)[d * a.delta_bias.stride[0]];
      if (a.delta_softplus) dt = softplus(dt);
      if (sdy) {
        dy = load_as_float(a.dout.data, pl.seq_index(a.dout, d, t0 + s), a.dout.dtype);
        if (a.z.data) {
          const float z = load_as_float(a.z.data, pl.seq_index(a.z, d, t0 + s), a.z.dtype);
          dy *= z * sigmoid(z);
        }
      }
    }
    su[c * Tr::kChanPitch + s] = u;
    sdt[c * Tr::kChanPitch + s] = dt;
    if (sdy) sdy[c * Tr::kChanPitch + s] = dy;
  }
}

template <int kN>
__device__ __forceinline__ void load_states(float (&v)[kN], const float* src) {
#pragma unroll
  for (int j = 0; j < kN; j += 4) {
    const float4 q = *reinterpret_cast<const float4*>(src + j);
    v[j] = q.x; v[j + 1] = q.y; v[j + 2] = q.z; v[j + 3] = q.w;
  }
}

}  // namespace ssm
