// Compile-time shape of the selective-scan kernels and the host-side grid that goes with it.
//
// kNpad (dstate rounded up to a power of two >= 4), kNS (states a thread owns) and kT (steps a
// chunk) fix everything: kP = kNpad / kNS lanes cover a channel's states, a block of kThreads
// holds kK channels and walks the sequence chunk by chunk, staging B, C, u and dt of a chunk in
// float32 shared memory. dtype, optional tensors and B/C forms are run-time branches.
// Instantiations: forward and backward, wide for the 7 sizes and narrow (more threads a channel,
// for grids too small to fill the GPU) for the 5 sizes up to 64: 24 kernels.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "scan_args.h"

namespace ssm {

// Steps per backward chunk, which is also the checkpoint interval the backward workspace is
// sized for: the wide backward keeps h of a whole chunk in registers, kT * kNS = 64 floats.
__host__ __device__ constexpr int scan_chunk_steps(int npad) { return npad <= 128 ? 16 : 8; }

// 4 states a thread read B and C as one 16-byte shared-memory vector each; at 256 states 8 keep
// a channel within one warp (32 lanes).
__host__ __device__ constexpr int wide_states(int npad) { return npad <= 128 ? 4 : 8; }
// One state a thread (two at 64) quadruples the threads of a channel: for a batch of 1 that turns
// 128 blocks (one per SM, nothing to hide latency behind) into 512.
__host__ __device__ constexpr int narrow_states(int npad) { return npad <= 32 ? 1 : npad / 32; }

template <int kNpad_, int kThreads_, int kNS_, int kT_>
struct ScanTraits {
  static constexpr int kNpad = kNpad_;
  static constexpr int kNS = kNS_;
  static constexpr int kP = kNpad / kNS;
  static constexpr int kThreads = kThreads_;
  static constexpr int kWarps = kThreads / 32;
  static constexpr int kK = kThreads / kP;
  static constexpr int kW = 32 / kP;  // channels sharing a warp
  static constexpr int kT = kT_;
  // Row pitches in floats. B/C rows stay 16-byte aligned for vector reads and the +4 spreads the
  // staging writes (consecutive steps) over banks; the +1 pitches make column walks conflict-free.
  static constexpr int kBCPitch = kNpad + 4;
  static constexpr int kChanPitch = kT + 1;
  static constexpr int kPartPitch = kThreads + 1;

  static_assert(kNpad >= 4 && kNpad <= 256 && (kNpad & (kNpad - 1)) == 0,
                "kNpad must be a power of two in [4, 256]");
  static_assert(kP >= 1 && kP <= 32, "a channel's states must fit in one warp");
  static_assert(kThreads % 32 == 0 && kThreads >= kP, "blocks are whole warps of whole channels");
  static_assert(kT % 4 == 0, "chunks are flushed as float4 along the sequence");
};

// Blocks never mix channels of different B or C groups, so a block's B/C chunk is one slice.
// Channels are cut into cells of `cell` channels that lie inside one group of B and of C; a
// cell is covered by tiles of kK channels.
struct ScanGrid {
  int64_t cell = 1;
  int64_t tiles_per_cell = 1;
  int64_t nchunks = 1;
};

// Float32 accumulators in the backward workspace, zeroed before the backward kernel.
// dB/dC: variable forms as (batch, groups, dstate, seqlen_padded), fixed forms as (dim, dstate).
struct BwdAccumulators {
  float* dA = nullptr;
  float* dD = nullptr;
  float* ddelta_bias = nullptr;
  float* dB = nullptr;
  float* dC = nullptr;
  int64_t seqlen_padded = 0;
};

inline int scan_npad(int64_t dstate) {
  int n = 4;
  while (n < dstate) n *= 2;
  return n;
}



ScanGrid make_scan_grid(const ScanArgs& a, int channels_per_block, int chunk_steps);

// kNS: wide_states(kNpad) or narrow_states(kNpad). The checkpoints written for the backward come
// from the wide kernel, whose chunks match the backward's.
template <int kNpad, int kNS>
cudaError_t launch_selective_scan_fwd(const ScanArgs& a, float* checkpoints, cudaStream_t stream);

template <int kNpad, int kNS>
cudaError_t launch_selective_scan_bwd(const ScanArgs& a, const float* checkpoints,
                                      const BwdAccumulators& acc, cudaStream_t stream);

}  // namespace ssm
