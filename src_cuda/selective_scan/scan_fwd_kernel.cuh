// Selective-scan forward kernel (formula in libssm/selective_scan.h) and its launcher.
//
// A block runs kK channels of one batch through the sequence chunk by chunk: stage B, C and
// (dt, dt * u) of kT steps in shared memory; each thread advances its kNS states with exp2 on the
// special function unit and writes its partial <C, h> per step; the epilogue sums the kP partials
// of a channel, adds D*u, applies the z gate and stores out. With `checkpoints` set (wide kernel
// only: its chunks are the backward's) it instead records h at every chunk start, the backward's
// restart points, and reads no C and writes no output.
#pragma once

#include "scan_common.cuh"

namespace ssm {

// Narrow blocks take 256 threads (8 channels of 32 lanes): B/C staging is shared by twice the
// channels of a 128-thread block, and at batch 1 that took (1, 2048, 512, 32) from 0.085 to
// 0.072 ms (16 steps a chunk: 0.079).
template <int kNpad, int kNS>
using FwdTraits = ScanTraits<kNpad, kNS < wide_states(kNpad) ? 256 : 128, kNS,
                             kNS < wide_states(kNpad) ? 32 : scan_chunk_steps(kNpad)>;

// Wide: 4 resident blocks (16 warps) per SM cap registers at 128; the unrolled chunk would take
// ~170 for hoisted loads and leave 3 blocks to hide exp and load latency (measured 15-25% slower).
// Below 16 and at 256 states a thread's slots or states need more than 128 registers. Narrow:
// 2 blocks of 256 threads, the same 128-register cap.
template <int kNpad, int kNS>
constexpr int fwd_min_blocks() {
  if (kNS < wide_states(kNpad)) return 2;
  return kNpad >= 16 && kNpad <= 128 ? 4 : 2;
}

// Partial <C, h> sums, [kT][kYPitch]: a step's row is written by consecutive threads, and the
// epilogue reads a channel's kP partials as float4s where kP allows (pitch kThreads + 4 keeps
// them 16-byte aligned and spreads a quarter-warp's reads over all banks).
template <typename Tr>
constexpr int fwd_y_pitch() { return Tr::kThreads + 4; }

// One batch of one block. kVarBC: B and C both variable, so every step reads both from shared
// memory with no fixed-form branch (those branches kept the fixed values in registers and moved
// them into the load targets at every step: 8 instructions of ~35). kReplay: the backward's
// checkpoint pass, which needs neither C nor <C, h>.
template <typename Tr, bool kVarBC, bool kReplay>
__device__ __forceinline__ void scan_fwd_batch(const ScanArgs& a, const ScanGrid& g,
                                               float* __restrict__ checkpoints, int64_t batch,
                                               float* sB, float* sC, float2* sdtu, float* sy) {
  constexpr int kYPitch = fwd_y_pitch<Tr>();
  const BlockPlace<Tr> pl(a, g, batch);
  const StateConsts<Tr> k(a, pl);
  const int n0 = pl.p * Tr::kNS;

  float h[Tr::kNS];
#pragma unroll
  for (int j = 0; j < Tr::kNS; ++j)
    h[j] = a.initial_state.data && pl.cvalid && n0 + j < a.dstate
               ? load_as_float(a.initial_state.data, pl.state_index(a.initial_state, n0 + j),
                               a.initial_state.dtype)
               : 0.f;

  using In = ChunkInputs<Tr>;
  float bias[In::kSlots], Dv[In::kSlots], zc[In::kSlots], uc[In::kSlots];
  In::slot_consts(a, pl, bias, Dv);
  In in;
  in.load(a, pl, 0, !kReplay, false);

  for (int64_t t0 = 0, chunk = 0; t0 < a.seqlen; t0 += Tr::kT, ++chunk) {
    if (kReplay && pl.cvalid) {
      store_states(checkpoints + ((pl.b * a.dim + pl.d) * g.nchunks + chunk) * Tr::kNpad + n0, h);
    }
    __syncthreads();  // the previous chunk's readers are done with shared memory
    in.store(a, pl, t0, bias, sB, kReplay ? nullptr : sC, nullptr, nullptr, nullptr, sdtu);
    if (!kReplay) {
#pragma unroll
      for (int m = 0; m < In::kSlots; ++m) {
        zc[m] = in.z_at(a, m);
        uc[m] = in.u_at(a, m);
      }
    }
    __syncthreads();
    if (t0 + Tr::kT < a.seqlen) in.load(a, pl, t0 + Tr::kT, !kReplay, false);

#pragma unroll
    for (int s = 0; s < Tr::kT; ++s) {
      const float2 dd = sdtu[pl.c * Tr::kChanPitch + s];
      float bv[Tr::kNS], cv[Tr::kNS];
      if (kVarBC || !a.B_fixed) {
        load_states(bv, sB + s * Tr::kBCPitch + n0);
      } else {
#pragma unroll
        for (int j = 0; j < Tr::kNS; ++j) bv[j] = k.Bfix[j];
      }
      if (!kReplay) {
        if (kVarBC || !a.C_fixed) {
          load_states(cv, sC + s * Tr::kBCPitch + n0);
        } else {
#pragma unroll
          for (int j = 0; j < Tr::kNS; ++j) cv[j] = k.Cfix[j];
        }
      }
      float y = 0.f;
#pragma unroll
      for (int j = 0; j < Tr::kNS; ++j) {
        h[j] = fmaf(exp2_ftz(dd.x * k.A2[j]), h[j], dd.y * bv[j]);
        if (!kReplay) y = fmaf(cv[j], h[j], y);
      }
      if (!kReplay) sy[s * kYPitch + threadIdx.x] = y;
    }

    if (kReplay) continue;
    __syncthreads();
#pragma unroll
    for (int m = 0; m < In::kSlots; ++m) {
      if (!In::slot_valid(a, pl, m, t0)) continue;
      const int c = In::slot_channel(m), s = In::slot_step(m);
      const float* part = sy + s * kYPitch + c * Tr::kP;
      float y = 0.f;
      if constexpr (Tr::kP % 4 == 0) {
#pragma unroll
        for (int q = 0; q < Tr::kP; q += 4) {
          const float4 v = *reinterpret_cast<const float4*>(part + q);
          y += (v.x + v.y) + (v.z + v.w);
        }
      } else {
#pragma unroll
        for (int q = 0; q < Tr::kP; ++q) y += part[q];
      }
      y = fmaf(Dv[m], uc[m], y);
      if (a.z.data) y *= zc[m] * sigmoid(zc[m]);
      store_from_float(a.out.data, pl.seq_index(a.out, pl.chan0 + c, t0 + s), a.out.dtype, y);
    }
  }

  if (!kReplay && a.last_state.data && pl.cvalid) {
#pragma unroll
    for (int j = 0; j < Tr::kNS; ++j)
      if (n0 + j < a.dstate)
        store_from_float(a.last_state.data, pl.state_index(a.last_state, n0 + j),
                         a.last_state.dtype, h[j]);
  }
}

template <int kNpad, int kNS>
__global__ void __launch_bounds__(FwdTraits<kNpad, kNS>::kThreads, fwd_min_blocks<kNpad, kNS>())
selective_scan_fwd_kernel(const ScanArgs a, const ScanGrid g, float* __restrict__ checkpoints) {
  using Tr = FwdTraits<kNpad, kNS>;
  static_assert((2 * Tr::kT * Tr::kBCPitch + 2 * Tr::kK * Tr::kChanPitch) % 4 == 0,
                "the partial sums start 16-byte aligned");
  extern __shared__ float4 smem4[];
  float* sB = reinterpret_cast<float*>(smem4);
  float* sC = sB + Tr::kT * Tr::kBCPitch;
  float2* sdtu = reinterpret_cast<float2*>(sC + Tr::kT * Tr::kBCPitch);
  float* sy = reinterpret_cast<float*>(sdtu + Tr::kK * Tr::kChanPitch);

  // The replay only runs wide (its chunks are the backward's), so narrow kernels skip its code.
  const bool replay = checkpoints != nullptr && kNS == wide_states(kNpad);
  const bool var_bc = !a.B_fixed && !a.C_fixed;
  for (int64_t batch = blockIdx.y; batch < a.batch; batch += gridDim.y) {
    if (replay) {
      if (!a.B_fixed) scan_fwd_batch<Tr, true, true>(a, g, checkpoints, batch, sB, sC, sdtu, sy);
      else scan_fwd_batch<Tr, false, true>(a, g, checkpoints, batch, sB, sC, sdtu, sy);
    } else if (var_bc) {
      scan_fwd_batch<Tr, true, false>(a, g, checkpoints, batch, sB, sC, sdtu, sy);
    } else {
      scan_fwd_batch<Tr, false, false>(a, g, checkpoints, batch, sB, sC, sdtu, sy);
    }
    __syncthreads();  // the next batch restages shared memory
  }
}

template <int kNpad, int kNS>
size_t selective_scan_fwd_smem_bytes() {
  using Tr = FwdTraits<kNpad, kNS>;
  return sizeof(float) * (2 * Tr::kT * Tr::kBCPitch + 2 * Tr::kK * Tr::kChanPitch +
                          Tr::kT * fwd_y_pitch<Tr>());
}

template <int kNpad, int kNS>
cudaError_t launch_selective_scan_fwd(const ScanArgs& a, float* checkpoints, cudaStream_t stream) {
  using Tr = FwdTraits<kNpad, kNS>;
  const ScanGrid g = make_scan_grid(a, Tr::kK, Tr::kT);
  const size_t smem = selective_scan_fwd_smem_bytes<kNpad, kNS>();
  if (smem > 48 * 1024) {
    cudaError_t err = cudaFuncSetAttribute(selective_scan_fwd_kernel<kNpad, kNS>,
                                           cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
    if (err != cudaSuccess) return err;
  }
  const dim3 grid(unsigned(g.tiles_per_cell * (a.dim / g.cell)),
                  unsigned(a.batch < 65535 ? a.batch : 65535));
  selective_scan_fwd_kernel<kNpad, kNS><<<grid, Tr::kThreads, smem, stream>>>(a, g, checkpoints);
  return cudaGetLastError();
}

}  // namespace ssm
