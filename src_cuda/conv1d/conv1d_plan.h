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
//    thread walks a chunk of `chunk_len` positions of one (batch, channel) with the last kTaps
//    inputs in registers; neighbouring threads take neighbouring channels.
// The backward of either writes each unit's dweight/dbias sums (width + 1 floats a channel) to
// the workspace as partial row (batch * nchunks + chunk); a last kernel adds the partial rows of
// every channel in a fixed order.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "conv1d_args.h"

namespace ssm {

constexpr int kConv1dBlock = 128;

// Blocks an SM the backward kernels without packed sequences are compiled for: 6 (at most 80
// registers) at 4 taps and 5 (96) at 8 fit them without spilling, where left alone they take
// 110 and keep a block an SM fewer. The packed-sequence kernels, the rarer case, take what they
// need.
template <int kTaps, bool kMasked>
constexpr int kConv1dBwdMinBlocks = kMasked ? 1 : kTaps == 4 ? 6 : 5;

// The same for the seq backward, whose loads wait in shared memory (cp.async) rather than in
// registers, so fewer threads keep as many bytes in flight: 5 (96 registers) at 4 taps and 4
// (128) at 8 fit it without spilling, where 6 and 5 spilled.
template <int kTaps, bool kMasked>
constexpr int kConv1dBwdSeqMinBlocks = kMasked ? 1 : kTaps == 4 ? 5 : 4;

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
  int64_t threads = 0;       // batch * nchunks * dim
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
