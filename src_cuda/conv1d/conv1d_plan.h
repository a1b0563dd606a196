// How the conv1d kernels cut the work, and the launchers that the instantiation files compile.
//
// Two kernel families serve the two layouts of x:
//  - "seq" (x contiguous along seqlen): a row (batch, channel) is cut into slices of 8
//    positions; `seg` consecutive lanes (a power of two up to 32) take consecutive slices of one
//    row, so a warp reads 512 contiguous bytes of bf16 per access, and get the width-1 inputs
//    before their slice (and, in the backward, the gradients after it) from the neighbouring
//    lane, or the segment's other end in the previous iteration, by a shuffle (see
//    conv1d_seq_kernels.cuh). A unit is a chunk of `iters` * `seg` slices of one row, done by
//    one segment, `iters` slices a lane.
//  - "chan" (any other strides; coalesced when x is contiguous along dim, channel-last): a
//    thread walks a chunk of `chunk_len` positions of a group of conv1d_chan_group(kTaps)
//    neighbouring channels of one batch row with the last kTaps inputs of each in registers;
//    neighbouring threads take neighbouring groups, so channel-last rows move as 8- or 16-byte
//    vectors.
// The backward of either writes each unit's dweight/dbias sums (width + 1 floats a channel) to
// the workspace as partial row (batch * nchunks + chunk); a last kernel adds the partial rows of
// every channel in a fixed order.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "conv1d_args.h"

namespace ssm {

constexpr int kConv1dBlock = 128;

// Channels a chan-kernel thread takes: 4 at 4 taps, 2 at 8, so the windows, taps and
// gradient sums (4 x taps floats a channel in the backward) fit without spilling. 4 channels of
// a 16-bit dtype are one 8-byte access a position, of float32 one 16-byte access.
constexpr int conv1d_chan_group(int taps) { return taps == 4 ? 4 : 2; }

// Blocks an SM the fast chan kernels are compiled for: the forward 6 (80 registers) for 16-bit
// x (float32's 48 KB of pipeline slots allow 4 anyway); the backward 4 (128), where its four
// channels' windows, taps and sums fit (float32's spills 52 bytes; at 5 blocks bf16's spilled
// 360). The general ones take what they need (up to 210 registers, 2 blocks of four-channel
// threads, as many channels in flight as 6 blocks of the single-channel threads they replaced;
// at 4 blocks they spilled 120-210 bytes).
template <int kDt, bool kFast>
constexpr int kConv1dFwdChanMinBlocks = !kFast ? 1 : kDt == int(Dtype::F32) ? 4 : 6;
template <bool kFast>
constexpr int kConv1dBwdChanMinBlocks = kFast ? 4 : 1;

// Blocks an SM the seq backward without packed sequences is compiled for: its loads wait in
// shared memory (cp.async) rather than in registers: 5 (96 registers) at 4 taps and 4 (128) at
// 8 fit the general one without spilling, where 6 and 5 spilled; the fast one at 4 taps fits 7
// (72) for 16-bit x, whose 24 KB of slots allow 9 (float32's 36 KB allow 6).
template <int kDt, int kTaps, bool kMasked, bool kFast>
constexpr int kConv1dBwdSeqMinBlocks =
    kMasked ? 1 : kTaps == 4 ? (kFast && kDt != int(Dtype::F32) ? 7 : 5) : 4;

struct SeqPlan {
  int seg = 32;               // lanes a unit, a power of two <= 32
  int iters = 1;              // slices a lane
  int64_t nslices = 0;        // slices a row: ceil(seqlen / 8)
  int64_t chunk_slices = 32;  // slices a unit: seg * iters
  int64_t nchunks = 1;        // units a row
  int64_t units = 0;          // batch * dim * nchunks
  bool vec = false;           // every row-shaped operand is contiguous along seqlen with 16-byte
                              // aligned rows: full slices move as 16-byte vectors
  float* partial = nullptr;   // backward: (batch * nchunks, dim, width + 1) partial sums
};

struct ChanPlan {
  int64_t chunk_len = 1;     // positions a thread
  int64_t nchunks = 1;       // chunks a (batch, channel)
  int64_t groups = 0;        // channel groups a batch row: ceil(dim / conv1d_chan_group)
  int64_t threads = 0;       // batch * nchunks * groups
  bool vec = false;          // every row-shaped operand is contiguous along dim with aligned
                             // groups: a full group moves as one vector a position
  float* partial = nullptr;  // backward: as SeqPlan::partial
};

// Launchers, one explicit instantiation per file under instantiations/ (written by
// generate_instantiations.py). kDt: x's Dtype (x, out, dout and dx share it); kTaps: 4 for
// widths 2..4, 8 for widths 5..8; each launches the kernel with or without packed sequences
// (see generate_instantiations.py for why these variants).
template <int kDt, int kTaps>
cudaError_t launch_conv1d_fwd_seq(const Conv1dArgs& a, const SeqPlan& p, cudaStream_t stream);
template <int kDt, int kTaps>
cudaError_t launch_conv1d_bwd_seq(const Conv1dArgs& a, const SeqPlan& p, cudaStream_t stream);
template <int kDt, int kTaps>
cudaError_t launch_conv1d_fwd_chan(const Conv1dArgs& a, const ChanPlan& p, cudaStream_t stream);
template <int kDt, int kTaps>
cudaError_t launch_conv1d_bwd_chan(const Conv1dArgs& a, const ChanPlan& p, cudaStream_t stream);

}  // namespace ssm
