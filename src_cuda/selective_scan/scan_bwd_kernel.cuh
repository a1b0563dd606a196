// Selective-scan backward kernel and its launcher.
//
// A block walks its kK channels' chunks from last to first. For a chunk it restarts h from the
// checkpoint the forward-in-checkpoint-mode pass left at the chunk start, recomputes the kT
// states of every step into registers, then runs the adjoint recurrence backwards:
//   mu_t = exp(dt_(t+1) A) mu_(t+1) + C_t dy_t   (`mu` carries the first term between steps)
// and emits each step's gradient terms. Sums over states (ddt, du, and y for dz) go through
// per-step partials in shared memory; sums over channels (variable dB, dC) are first reduced
// across the warp's channels with shuffles, then across warps in shared memory, then added to
// float32 accumulators with one atomic per (state, step) and block. Per-channel sums over steps
// (dA, dD, ddelta_bias, fixed dB/dC) stay in registers until the end.
#pragma once

#include "scan_common.cuh"

namespace ssm {

// Sums v over the kW lanes of a warp that hold the same lanes-within-channel position (the
// warp's channels), halving the values each lane keeps at every step. Returns the index of the
// first original value the lane now holds in v[0 .. kOut). When kW > kV the last steps are
// plain all-reduces and only lanes with those channel bits clear should publish.
template <int kW, int kP, int kV>
struct WarpChannelReduce {
  static constexpr int kOut = kV / kW > 0 ? kV / kW : 1;
  static constexpr int kPublishMask = kW > kV ? kW / kV - 1 : 0;

  template <int kO, int kCount>
  __device__ static __forceinline__ void step(float (&v)[kV], int cw, int& first) {
    if constexpr (kO >= 1) {
      if constexpr (kCount > 1) {
        constexpr int kHalf = kCount / 2;
        const bool upper = cw & kO;
#pragma unroll
        for (int i = 0; i < kHalf; ++i) {
          const float send = upper ? v[i] : v[i + kHalf];
          const float keep = upper ? v[i + kHalf] : v[i];
          v[i] = keep + __shfl_xor_sync(0xffffffffu, send, kO * kP);
        }
        if (upper) first += kHalf;
        step<kO / 2, kHalf>(v, cw, first);
      } else {
        v[0] += __shfl_xor_sync(0xffffffffu, v[0], kO * kP);
        step<kO / 2, 1>(v, cw, first);
      }
    }
  }

  __device__ static __forceinline__ int run(float (&v)[kV], int cw) {
    int first = 0;
    step<kW / 2, kV>(v, cw, first);
    return first;
  }
};

__device__ __forceinline__ void atomic_add4(float* dst, float4 v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  atomicAdd(reinterpret_cast<float4*>(dst), v);
#else
  atomicAdd(dst, v.x); atomicAdd(dst + 1, v.y); atomicAdd(dst + 2, v.z); atomicAdd(dst + 3, v.w);
#endif
}

template <int kNpad, int kNS>
using BwdTraits = ScanTraits<kNpad, 128, kNS, scan_chunk_steps(kNpad)>;

// The whole backward of a block. kVarBC: B and C both variable, so the steps read both from
// shared memory with no fixed-form branch and keep no fixed-form sums (the branches cost
// predicated moves at every step, the sums two adds a state update and 8 registers).
template <int kNpad, int kStates, bool kVarBC>
__device__ __forceinline__ void scan_bwd_block(const ScanArgs& a, const ScanGrid& g,
                                               const float* __restrict__ checkpoints,
                                               const BwdAccumulators& acc) {
  using Tr = BwdTraits<kNpad, kStates>;
  constexpr int kNS = Tr::kNS, kT = Tr::kT, kV = 2 * kNS;
  using Reduce = WarpChannelReduce<Tr::kW, Tr::kP, kV>;
  // Each thread owns the (channel, step) slots i = threadIdx.x + m * kThreads of the epilogue.
  constexpr int kSlots = (Tr::kK * kT + Tr::kThreads - 1) / Tr::kThreads;

  extern __shared__ float4 smem4[];
  float* sB = reinterpret_cast<float*>(smem4);
  float* sC = sB + kT * Tr::kBCPitch;
  float* su = sC + kT * Tr::kBCPitch;
  float* sdt = su + Tr::kK * Tr::kChanPitch;
  float* sdy = sdt + Tr::kK * Tr::kChanPitch;
  float* sddt = sdy + Tr::kK * Tr::kChanPitch;   // [kT][kPartPitch] partial sums over states
  float* sdu = sddt + kT * Tr::kPartPitch;
  float* sy = sdu + kT * Tr::kPartPitch;
  float* sbc = sy + kT * Tr::kPartPitch;         // [warp][kT][2][kNpad] dB, dC over the warp's channels

  // The shuffle reduction of variable dB/dC runs only when one of them is requested.
  const bool var_bc = (!a.B_fixed && acc.dB) || (!a.C_fixed && acc.dC);
  const int warp = threadIdx.x / 32, cw = (threadIdx.x % 32) / Tr::kP;

  for (int64_t batch = blockIdx.y; batch < a.batch; batch += gridDim.y) {
    const BlockPlace<Tr> pl(a, g, batch);
    const StateConsts<Tr> k(a, pl);
    const int n0 = pl.p * kNS;

    // Sums over steps: per chunk first, then into the totals, so float32 rounding grows with
    // kT + nchunks terms rather than seqlen.
    float mu[kNS], dA[kNS], dBfix[kNS], dCfix[kNS], dA_c[kNS], dBfix_c[kNS], dCfix_c[kNS];
#pragma unroll
    for (int j = 0; j < kNS; ++j) {
      mu[j] = a.dlast_state.data && pl.cvalid && n0 + j < a.dstate
                  ? load_as_float(a.dlast_state.data, pl.state_index(a.dlast_state, n0 + j),
                                  a.dlast_state.dtype)
                  : 0.f;
      dA[j] = dBfix[j] = dCfix[j] = 0.f;
    }
    using In = ChunkInputs<Tr>;
    float bias[kSlots], Dv[kSlots], zc[kSlots], doutc[kSlots], deltac[kSlots];
    float sum_dyu[kSlots], sum_ddelta[kSlots];
    In::slot_consts(a, pl, bias, Dv);
#pragma unroll
    for (int m = 0; m < kSlots; ++m) sum_dyu[m] = sum_ddelta[m] = 0.f;
    In in;
    in.load(a, pl, (g.nchunks - 1) * kT, true, true);
    // h at the start of a chunk, loaded a chunk ahead like the inputs.
    auto load_checkpoint = [&](int64_t chunk, float (&dst)[kNS]) {
      if (pl.cvalid) {
        load_states(dst, checkpoints + ((pl.b * a.dim + pl.d) * g.nchunks + chunk) * kNpad + n0);
      } else {
#pragma unroll
        for (int j = 0; j < kNS; ++j) dst[j] = 0.f;
      }
    };
    float hstart[kNS];
    load_checkpoint(g.nchunks - 1, hstart);

    for (int64_t chunk = g.nchunks - 1; chunk >= 0; --chunk) {
      const int64_t t0 = chunk * kT;
      __syncthreads();
      in.store(a, pl, t0, bias, sB, sC, su, sdt, sdy);
#pragma unroll
      for (int m = 0; m < kSlots; ++m) {
        zc[m] = in.z_at(a, m);
        doutc[m] = in.dout_at(a, m);
        deltac[m] = in.delta_at(a, m);
      }
      __syncthreads();
      if (chunk > 0) in.load(a, pl, t0 - kT, true, true);

#pragma unroll
      for (int j = 0; j < kNS; ++j) dA_c[j] = dBfix_c[j] = dCfix_c[j] = 0.f;

      // Recompute the states of the chunk: hs[s] = h before step s, hs[kT] the chunk end, so
      // the adjoint reads h_t as hs[s + 1] instead of updating the state again.
      float hs[kT + 1][kNS];
#pragma unroll
      for (int j = 0; j < kNS; ++j) hs[0][j] = hstart[j];
      if (chunk > 0) load_checkpoint(chunk - 1, hstart);
#pragma unroll
      for (int s = 0; s < kT; ++s) {
        const float dt = sdt[pl.c * Tr::kChanPitch + s];
        const float dtu = dt * su[pl.c * Tr::kChanPitch + s];
        float bv[kNS];
        if (!kVarBC && a.B_fixed) {
#pragma unroll
          for (int j = 0; j < kNS; ++j) bv[j] = k.Bfix[j];
        } else {
          load_states(bv, sB + s * Tr::kBCPitch + n0);
        }
#pragma unroll
        for (int j = 0; j < kNS; ++j)
          hs[s + 1][j] = fmaf(exp2_ftz(dt * k.A2[j]), hs[s][j], dtu * bv[j]);
      }

#pragma unroll
      for (int s = kT - 1; s >= 0; --s) {
        const float dt = sdt[pl.c * Tr::kChanPitch + s];
        const float u = su[pl.c * Tr::kChanPitch + s];
        const float dy = sdy[pl.c * Tr::kChanPitch + s];
        const float dtu = dt * u;
        float bv[kNS], cv[kNS];
        if (!kVarBC && a.B_fixed) {
#pragma unroll
          for (int j = 0; j < kNS; ++j) bv[j] = k.Bfix[j];
        } else {
          load_states(bv, sB + s * Tr::kBCPitch + n0);
        }
        if (!kVarBC && a.C_fixed) {
#pragma unroll
          for (int j = 0; j < kNS; ++j) cv[j] = k.Cfix[j];
        } else {
          load_states(cv, sC + s * Tr::kBCPitch + n0);
        }
        // ddt = sum_n m (B u + h_(t-1) exp(dt A) A) = u * dus + sum_n w A with
        // w = m h_(t-1) exp(dt A), the factor dA shares: the epilogue adds u * dus once a step.
        float ddtA = 0.f, dus = 0.f, y = 0.f;
        float v[kV];
#pragma unroll
        for (int j = 0; j < kNS; ++j) {
          const float da = exp2_ftz(dt * k.A2[j]);
          const float h = hs[s + 1][j];
          const float m = fmaf(cv[j], dy, mu[j]);  // dL/dh_t
          const float w = m * (hs[s][j] * da);
          ddtA = fmaf(w, k.A[j], ddtA);
          dus = fmaf(m, bv[j], dus);
          dA_c[j] = fmaf(w, dt, dA_c[j]);
          y = fmaf(cv[j], h, y);
          v[j] = m * dtu;      // dB
          v[kNS + j] = dy * h; // dC
          if (!kVarBC) {
            dBfix_c[j] += v[j];
            dCfix_c[j] += v[kNS + j];
          }
          mu[j] = m * da;
        }
        sddt[s * Tr::kPartPitch + threadIdx.x] = ddtA;
        sdu[s * Tr::kPartPitch + threadIdx.x] = dus;
        sy[s * Tr::kPartPitch + threadIdx.x] = y;
        if (var_bc) {
          const int first = Reduce::run(v, cw);
          if ((cw & Reduce::kPublishMask) == 0) {
#pragma unroll
            for (int i = 0; i < Reduce::kOut; ++i) {
              const int idx = first + i, which = idx / kNS, n = n0 + idx % kNS;
              sbc[((warp * kT + s) * 2 + which) * kNpad + n] = v[i];
            }
          }
        }
      }
#pragma unroll
      for (int j = 0; j < kNS; ++j) {
        dA[j] += dA_c[j];
        dBfix[j] += dBfix_c[j];
        dCfix[j] += dCfix_c[j];
      }
      __syncthreads();

      // Variable dB/dC: sum the warps' partials, one float4 atomic per 4 steps of a state.
      if (var_bc) {
        for (int i = threadIdx.x; i < 2 * kNpad * (kT / 4); i += Tr::kThreads) {
          const int s4 = (i % (kT / 4)) * 4, n = (i / (kT / 4)) % kNpad, which = i / (kT / 4) / kNpad;
          const bool skip = which == 0 ? a.B_fixed || !acc.dB : a.C_fixed || !acc.dC;
          if (skip || n >= a.dstate) continue;
          float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
          for (int w = 0; w < Tr::kWarps; ++w) {
            const float* src = sbc + ((w * kT + s4) * 2 + which) * kNpad + n;
            sum.x += src[0];
            sum.y += src[2 * kNpad];
            sum.z += src[4 * kNpad];
            sum.w += src[6 * kNpad];
          }
          const int64_t grp = which == 0 ? pl.gB : pl.gC;
          const int64_t groups = which == 0 ? a.B_groups : a.C_groups;
          float* dst = (which == 0 ? acc.dB : acc.dC) +
                       ((pl.b * groups + grp) * a.dstate + n) * acc.seqlen_padded + t0 + s4;
          atomic_add4(dst, sum);
        }
      }

      // Per (channel, step): finish du, ddelta, dz from the state sums.
#pragma unroll
      for (int m = 0; m < kSlots; ++m) {
        if (!In::slot_valid(a, pl, m, t0)) continue;
        const int c = In::slot_channel(m), s = In::slot_step(m);
        const int64_t d = pl.chan0 + c;
        float ddtA = 0.f, dus = 0.f, y = 0.f;
#pragma unroll
        for (int q = 0; q < Tr::kP; ++q) {
          const int src = s * Tr::kPartPitch + c * Tr::kP + q;
          ddtA += sddt[src];
          dus += sdu[src];
          y += sy[src];
        }
        const float dt = sdt[c * Tr::kChanPitch + s], u = su[c * Tr::kChanPitch + s];
        const float ddt = fmaf(u, dus, ddtA);
        const float dy = sdy[c * Tr::kChanPitch + s];
        if (a.du.data)
          store_from_float(a.du.data, pl.seq_index(a.du, d, t0 + s), a.du.dtype, fmaf(dt, dus, Dv[m] * dy));
        if (a.dz.data) {
          const float sg = sigmoid(zc[m]);
          store_from_float(a.dz.data, pl.seq_index(a.dz, d, t0 + s), a.dz.dtype,
                           doutc[m] * fmaf(Dv[m], u, y) * sg * fmaf(zc[m], 1.f - sg, 1.f));
        }
        const float ddelta = a.delta_softplus ? ddt * sigmoid(deltac[m] + bias[m]) : ddt;
        if (a.ddelta.data)
          store_from_float(a.ddelta.data, pl.seq_index(a.ddelta, d, t0 + s), a.ddelta.dtype, ddelta);
        sum_dyu[m] = fmaf(dy, u, sum_dyu[m]);
        sum_ddelta[m] += ddelta;
      }
    }

    // Per-channel sums over the sequence: reduce the slots of each channel through shared
    // memory (sddt/sdu are free now), then one atomic per channel into the accumulators.
    __syncthreads();
#pragma unroll
    for (int m = 0; m < kSlots; ++m) {
      const int i = threadIdx.x + m * Tr::kThreads;
      if (i < Tr::kK * kT) {
        sddt[i] = sum_dyu[m];
        sdu[i] = sum_ddelta[m];
      }
    }
    __syncthreads();
    if (threadIdx.x < pl.nvalid) {
      float s_dyu = 0.f, s_ddelta = 0.f;
      for (int s = 0; s < kT; ++s) {
        s_dyu += sddt[threadIdx.x * kT + s];
        s_ddelta += sdu[threadIdx.x * kT + s];
      }
      const int64_t d = pl.chan0 + threadIdx.x;
      if (acc.dD) atomicAdd(acc.dD + d, s_dyu);
      if (acc.ddelta_bias) atomicAdd(acc.ddelta_bias + d, s_ddelta);
    }

    if (pl.cvalid) {
#pragma unroll
      for (int j = 0; j < kNS; ++j) {
        const int n = n0 + j;
        if (n >= a.dstate) continue;
        if (a.dinitial_state.data)
          store_from_float(a.dinitial_state.data, pl.state_index(a.dinitial_state, n),
                           a.dinitial_state.dtype, mu[j]);
        if (acc.dA) atomicAdd(acc.dA + pl.d * a.dstate + n, dA[j]);
        if (!kVarBC && a.B_fixed && acc.dB) atomicAdd(acc.dB + pl.d * a.dstate + n, dBfix[j]);
        if (!kVarBC && a.C_fixed && acc.dC) atomicAdd(acc.dC + pl.d * a.dstate + n, dCfix[j]);
      }
    }
  }
}

template <int kNpad, int kStates>
__global__ void __launch_bounds__(BwdTraits<kNpad, kStates>::kThreads)
selective_scan_bwd_kernel(const ScanArgs a, const ScanGrid g, const float* __restrict__ checkpoints,
                          const BwdAccumulators acc) {
  if (!a.B_fixed && !a.C_fixed) scan_bwd_block<kNpad, kStates, true>(a, g, checkpoints, acc);
  else scan_bwd_block<kNpad, kStates, false>(a, g, checkpoints, acc);
}

template <int kNpad, int kNS>
size_t selective_scan_bwd_smem_bytes() {
  using Tr = BwdTraits<kNpad, kNS>;
  return sizeof(float) * (2 * Tr::kT * Tr::kBCPitch + 3 * Tr::kK * Tr::kChanPitch +
                          3 * Tr::kT * Tr::kPartPitch + Tr::kWarps * Tr::kT * 2 * kNpad);
}

template <int kNpad, int kNS>
cudaError_t launch_selective_scan_bwd(const ScanArgs& a, const float* checkpoints,
                                      const BwdAccumulators& acc, cudaStream_t stream) {
  using Tr = BwdTraits<kNpad, kNS>;
  const ScanGrid g = make_scan_grid(a, Tr::kK, Tr::kT);
  const size_t smem = selective_scan_bwd_smem_bytes<kNpad, kNS>();
  if (smem > 48 * 1024) {
    cudaError_t err = cudaFuncSetAttribute(selective_scan_bwd_kernel<kNpad, kNS>,
                                           cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
    if (err != cudaSuccess) return err;
  }
  const dim3 grid(unsigned(g.tiles_per_cell * (a.dim / g.cell)),
                  unsigned(a.batch < 65535 ? a.batch : 65535));
  selective_scan_bwd_kernel<kNpad, kNS><<<grid, Tr::kThreads, smem, stream>>>(a, g, checkpoints, acc);
  return cudaGetLastError();
}

}  // namespace ssm
