// Compile-time shape of the selective-scan kernels and the host-side grid that goes with it.
//
// One template parameter, kNpad (dstate rounded up to a power of two >= 4), fixes everything:
// each thread owns kNS consecutive states of one channel, kP lanes cover a channel's states, a
// block of kThreads holds kK channels and walks the sequence in chunks of kT steps, staging B, C,
// u and dt of a chunk in float32 shared memory. dtype, optional tensors and B/C forms are run-time
// branches: kNpad is the only switch, so 7 sizes x (fwd, bwd) = 14 instantiations in all.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "scan_args.h"

namespace ssm {

template <int kNpad_, int kThreads_>
struct ScanTraits {
  static constexpr int kNpad = kNpad_;
  // 4 states a thread reads B and C as one 16-byte shared-memory vector each; at 256 states 8
  // keep a channel within one warp (32 lanes).
  static constexpr int kNS = kNpad <= 128 ? 4 : 8;
  static constexpr int kP = kNpad / kNS;
  static constexpr int kThreads = kThreads_;
  static constexpr int kWarps = kThreads / 32;
  static constexpr int kK = kThreads / kP;
  static constexpr int kW = 32 / kP;  // channels sharing a warp
  // The backward keeps h of a whole chunk in registers: kT * kNS = 64 floats.
  static constexpr int kT = 64 / kNS;
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

inline int scan_chunk_steps(int npad) { return npad <= 128 ? 16 : 8; }

ScanGrid make_scan_grid(const ScanArgs& a, int channels_per_block, int chunk_steps);

template <int kNpad>
cudaError_t launch_selective_scan_fwd(const ScanArgs& a, float* checkpoints, cudaStream_t stream);

template <int kNpad>
cudaError_t launch_selective_scan_bwd(const ScanArgs& a, const float* checkpoints,
                                      const BwdAccumulators& acc, cudaStream_t stream);

}  // namespace ssm
