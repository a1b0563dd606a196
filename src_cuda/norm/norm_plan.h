// How the fused-norm kernels cut the work. A "segment" is one (row, group) pair: group_size
// contiguous columns normalised together. `threads` consecutive threads of a block (a power of
// two; any whole warps in the plain forward, one segment a block) work on one segment, each
// holding slices v = lane, lane + threads, ... of 8 columns; a block holds blockDim / threads
// such segments side by side, all of the same group, and walks down the rows.
//
// Each thread keeps its first K slices in registers between the passes a norm needs (statistics,
// then output), so the row is read from memory once. Segments longer than threads * K * 8 columns
// read the remaining slices again in the later passes; those come back from L1/L2 (a block works
// on one segment at a time at those lengths), not from DRAM.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "norm_args.h"

namespace ssm {

constexpr int kNormMaxThreads = 512;

struct NormPlan {
  int threads = 1;            // threads per segment, a power of two (the plain forward: whole
                              // warps)
  int block = 128;            // threads per block
  int64_t row_blocks = 1;     // blocks along the rows of each group; grid = row_blocks * ngroups
  int nslices = 1;            // ceil(group_size / 8)
  int cluster = 1;            // CTAs of one thread-block cluster sharing each segment (the lean
                              // kernels past 8192 16-bit columns); row_blocks counts clusters
  int cta_slices = 1;         // consecutive slices of a segment each of those CTAs takes
                              // (nslices when cluster == 1)
  bool vec = false;           // every row-shaped operand is 16-byte aligned and group_size % 8 == 0
  float* partial = nullptr;   // backward: (row_blocks, hidden) dweight then dbias partial sums,
                              // or nullptr when neither is wanted or the column kernel sums them
};

// Launchers, one explicit instantiation per file under instantiations/ (written by
// generate_instantiations.py). K: slices a thread keeps in registers; kDt: the Dtype every
// row-shaped operand has, or -1 for the generic kernels that read each operand's dtype at run
// time (mixed dtypes, such as a float32 residual stream beside bfloat16 x); kTail: whether
// segments may be longer than the kept slices (the loops over the rest hold ~35 more registers
// while the kept slices are live, so the kernels for shorter segments leave them out).
template <int K, int kDt, bool kTail>
cudaError_t launch_norm_fwd(const NormArgs& a, const NormPlan& p, cudaStream_t stream);
template <int K, int kDt, bool kTail>
cudaError_t launch_norm_bwd(const NormArgs& a, const NormPlan& p, cudaStream_t stream);

// The lean kernels (norm_fast.cuh). kDt: the dtype of x, y, z, dy and dx; kRt: that of the residual
// stream (residual and residual_out forward; x, dresidual_out and dresidual backward), kDt too or
// float32 beside 16-bit kDt. Both take a gate where kDt == kRt. The forward takes segments of up to
// `slices` * kFastFwdSlices slices, `slices` (1; 2, 3 or 4 for 16-bit rows, lean_fwd_slices in
// norm_cuda.cu) a lane and fast_fwd_rows rows a lane at once, in blocks of kFastFwdBlock threads
// (one warp where lean_fwd_block says), not persistent: p.row_blocks row groups of
// p.block / p.threads * fast_fwd_rows rows. One H100, % of copy, direct timing (GPU time only),
// bf16 rows of 256 columns, against the persistent kernel it replaced (one row a lane at a time,
// the next row's loads in flight, ~850 bytes of parameters): the norm alone RMSNorm 86.8 / 95.8,
// LayerNorm 70.6 / 80.3, RMSNorm + residual 80.6 / 81.7, gated 75.6 / 77.3. One row a lane ran at
// 84.4 / 70.5 / 79.9 / 78.3, four at 87.9 / 72.8 / 81.2 / 74.6 (80-96 registers). More slices a
// lane instead of rows lost at every width to 1024 columns in that persistent kernel (rows of 512
// columns, two slices a lane: 79.0 against 80.1 for the held forward, RMSNorm alone); this one, its
// options compiled in, takes them (lean_fwd_slices gives the measurements). Two slices a lane as
// well as two rows (`slices`, 70 registers) take 16-bit rows beside a residual of their dtype up to
// 2 * kFastFwdSlices slices: one H100, direct timing, against the held forward's 2 slices a thread
// in one warp a row, RMSNorm of bf16 beside bf16, 85.2-86.0 / 86.5-86.8 at 384 columns,
// 88.9-89.9 / 90.2-90.6 at 512 (compile 91.3-92.0), LayerNorm 83.5 / 84.8 at 384, 87.9 / 89.2 at
// 512 (compile 90.4). Four slices a lane, one row (as torch.compile's kernel at 1024 columns), did
// not beat it there in the residual kernel: 95.1-95.6 / 95.1-95.3 at 1024, 93.4 / 93.1-93.6 at 768;
// the prenorm kernel, its weight fetched with x, takes them (lean_fwd_slices). Before the GPU-time
// windows (one H200), against the staged forward: 72 / 64 at 256 columns (bf16 with a bf16
// residual), 81 / 82 at 512, 85 / 90 at 1024, 86 / 93 for gated groups of 1024. The backward with
// kCluster (norm_fast_bwd.cuh) shares a segment among the p.cluster CTAs of a thread-block
// cluster (sm_90 and later), p.cta_slices slices each, that add their partial sums through
// distributed shared memory; without it one CTA holds a segment. Its launcher lowers p.row_blocks
// to the clusters that run at once with kCluster (without, the fused plan has sized it): the
// partial sums have p.row_blocks rows. With kCluster it returns cudaErrorInvalidClusterSize,
// launching nothing, when not one cluster of p.cluster CTAs fits on the device.
constexpr int kFastFwdSlices = 32, kFastFwdBlock = 128;
// What a lean forward reads beside x, each in a kernel of its own (norm_fast.cuh says why):
// nothing, a residual and/or residual_out, a gate z (and a residual where given) before the norm
// (y = norm(s silu(z)), Mamba-2's) or after it (y = norm(s) silu(z)), or the prenorm call of
// RMSNorm: residual in and residual_out out, all of x's dtype, segments of a whole warp, a
// weight of float32 or x's dtype, no bias, not zero-centred (fast_fwd_inputs in norm_cuda.cu
// decides).
enum FastFwdInputs { kFwdAlone, kFwdResidual, kFwdGateFirst, kFwdGateAfter, kFwdPrenorm };
// Rows a lane takes at once: four in the prenorm kernel for 16-bit rows at one slice a lane (60
// registers) and one at two (48-52), one at three or four slices a lane (lean_fwd_slices in
// norm_cuda.cu has three's measurements against two rows), two elsewhere. One H100, % of copy,
// direct timing, RMSNorm + residual (bf16) at 256 columns, two rows / four: 83.2-83.7 / 84.6-85.5
// (384 columns, two slices a lane: 87.4-88.0 / 86.9-87.4); in the residual kernel four rows (72-80
// registers) lost 0-1 point at 128-512 columns, and so did float32 rows in the prenorm kernel (79
// registers): 84.7 / 82.5-83.0 at 256. At four slices a lane, one row / two (110 registers): one
// H200, 1024 columns, 91.1-91.2 / 91.2-91.3, 640 88.7-88.8 / 88.0-88.3. The norm alone at two
// slices a lane, one row / two (H100, bf16): RMSNorm 74.7 / 77.9-78.2 at 320 columns, 76.4-77.1 /
// 79.1-79.6 at 384; LayerNorm 60.8-61.3 / 68.3-68.4 and 67.8-67.9 / 73.5-73.7. The prenorm kernel
// at two slices a lane, two rows / one / three (70 / 48-52 / 92-98 registers), one H200, direct
// timing, warm, bf16: 88.3-88.6 / 89.4-89.6 / 87.9-88.3 at 512 columns (torch.compile 90.6-90.7),
// 86.3-86.6 / 87.4-87.6 / 85.7-86.1 at 448 (88.8-89.1), 89.1-89.4 / 89.7-89.8 / 87.9-88.5 at 384
// (87.4-87.5), 84.9-85.2 / 84.2-84.6 / 82.7-83.4 at 264 (81.6).
__host__ __device__ constexpr int fast_fwd_rows(FastFwdInputs inputs, int slices, int dt) {
  if (slices >= 3) return 1;
  if (inputs == kFwdPrenorm && Dtype(dt) != Dtype::F32) return slices == 1 ? 4 : 1;
  return 2;
}
// norm_fwd_alone_kernel (norm_fast.cuh) takes two rows a lane, but four for a LayerNorm at one
// slice a lane. At three and four slices a lane, one row / two (44-64 / 76-112 registers, no
// spills), one H200, % of copy, C harness, bf16, float32 weight, warm on 32768 rows: RMSNorm
// 88.1-88.2 / 89.1-89.5 at 768 columns, 85.6-85.8 / 84.8-85.2 at 1016; LayerNorm 83.7-83.8 /
// 85.8-86.2, 82.0-82.2 / 82.2-82.6; past the L2 (65536 rows) RMSNorm 89.8-89.9 / 91.1-91.3, 89.0 /
// 89.0-89.2, LayerNorm 86.0-86.1 / 88.4-88.6, 86.6 / 87.5-87.6. At one slice a lane, one row /
// two / four (RMSNorm 30 / 40 / 59 registers, LayerNorm 39 / 47 / 64), direct timing, warm:
// RMSNorm 95.0-96.2 / 107.8-108.9 / 97.6-102.3 at 256 columns, 91.2-92.3 / 101.5-102.0 /
// 97.2-97.4 at 248; LayerNorm 72.0-72.7 / 88.6-89.5 / 98.1-98.5 at 256 (torch.compile 90.3-90.9),
// 69.0-69.8 / 82.7-82.8 / 89.0-89.2 at 248, 58.4-58.8 / 69.5-70.0 / 75.6-75.8 at 200 (77.2-77.7).
// The LayerNorm's second reduction, over the deviations from the mean, waits on the first: more
// rows a lane keep more of x in flight across it. Held to 40 registers by launch bounds (12
// CTAs an SM), the LayerNorm at two rows spilled 28-36 bytes and fell to 73.2-76.4 at 256.
__host__ __device__ constexpr int alone_fwd_rows(int slices, bool layer_norm) {
  return layer_norm && slices == 1 ? 4 : 2;
}
// Whether the weight and bias of a call on 16-bit rows of dtype d are those norm_fwd_alone_kernel
// and norm_fwd_stream_kernel take: a weight of x's dtype or float32, a bias of the weight's dtype
// with a LayerNorm only.
inline bool lean_weight_takes(const NormArgs& a, Dtype d) {
  const Dtype w = a.weight.dtype;
  return a.weight.present() && (w == Dtype::F32 || w == d) &&
         (!a.bias.present() || (a.layer_norm && a.bias.dtype == w));
}
// Whether norm_fwd_alone_kernel takes a lean forward (inputs, 16-bit rows of dtype d): the norm
// alone in whole-warp segments, the weight and bias of lean_weight_takes.
inline bool alone_kernel_takes(const NormArgs& a, const NormPlan& p, FastFwdInputs inputs,
                               Dtype d) {
  return inputs == kFwdAlone && d != Dtype::F32 && p.threads == 32 && lean_weight_takes(a, d);
}
// Whether norm_fwd_stream_kernel takes a lean forward at `slices` slices a lane: 16-bit x of
// dtype d beside a float32 residual stream (a residual in and/or residual_out), whole-warp
// segments, the weight and bias of lean_weight_takes, and at one slice a lane only a segment
// with no lane idle. One H200, % of copy, direct timing (bf16 x, float32 weight, 32768
// rows, warm), norm_fwd_fast_kernel / this one at 200 columns (25 slices): RMSNorm 79.9 / 78.1,
// LayerNorm 77.5 / 77.8.
inline bool stream_kernel_takes(const NormArgs& a, const NormPlan& p, FastFwdInputs inputs, Dtype d,
                                Dtype stream, int slices) {
  return inputs == kFwdResidual && d != Dtype::F32 && stream == Dtype::F32 && p.threads == 32 &&
         (slices > 1 || p.nslices == 32) && lean_weight_takes(a, d);
}
// Whether every element offset into the call's row-shaped tensors fits 32 bits: their rows run
// forward (inputs may have a negative row stride; the kernel's unsigned arithmetic would wrap it)
// and their last row ends within INT_MAX elements of their start (norm_fwd_stream_kernel's
// kNarrow). One H200, % of copy, direct timing, bf16 x beside a float32 stream and weight, 32768
// rows, warm, offsets in 64 / 32 bits: LayerNorm 83.9 / 84.5 at 256 columns, 87.4 / 88.8 at 384,
// 90.9 / 92.0 at 512, 94.2 / 94.2 at 768, 95.0 / 95.7 at 1024; RMSNorm 84.0 / 84.7 at 256, 90.5 /
// 91.7 at 512, 95.9 / 96.2 at 1024.
inline bool offsets_fit_32(const NormArgs& a) {
  auto fits = [&](const TensorRef& t) {
    return !t.present() || (t.stride[0] >= 0 && (a.rows - 1) * t.stride[0] + a.hidden <= INT32_MAX);
  };
  return fits(a.x) && fits(a.residual) && fits(a.residual_out) && fits(a.y);
}
// Rows a lane of norm_fwd_stream_kernel takes at once at `slices` slices a lane. One H200, % of
// copy, direct timing (bf16 x, float32 stream and weight, 32768 rows, warm / each call issued
// alone): at 256 columns two rows / four (blocks of one warp) LayerNorm 83.9 / 83.4, 80.0 / 81.0,
// RMSNorm 85.0 / 82.9, 82.5 / 78.9; a standalone LayerNorm of the kernel's plan at 512 and 768
// columns, two rows / one, 92.5 / 90.6 and 94.9 / 92.5; at 1024 one row (64-128 registers;
// torch.compile's kernel there holds 122). A LayerNorm at one slice a lane takes three: one H200,
// direct timing, warm, blocks of 64 (lean_fwd_block), two rows / three / four (54 / 64 / 72
// registers): 84.4-84.6 / 85.0-85.2 / 83.5-84.0 at 256 columns (torch.compile 86.6-86.7),
// 80.8 / 80.6-81.0 / 80.7 at 248, 77.3 / 77.2-77.4 / 77.3 at 200 (81.4-81.6).
__host__ __device__ constexpr int stream_fwd_rows(int slices, bool layer_norm) {
  if (layer_norm && slices == 1) return 3;
  return slices < 4 ? 2 : 1;
}
// The lean forward's block (norm_fwd_cuda; its kernels take a segment's row from blockDim): one
// warp where that measured faster, kFastFwdBlock threads elsewhere. A finer grid ends with a
// shorter tail. One H200, % of copy, bf16, float32 weight, 32768 rows, blocks of 128 / 32:
// - the norm alone's kernel from three slices a lane (C harness, warm): RMSNorm 87.1-87.2 /
//   88.2-88.5 at 1024 columns, LayerNorm 84.6 / 85.3-85.6 at 1024, 82.3-82.5 / 82.9 at 1016,
//   85.8-86.0 / 86.3-86.4 at 768 (78.5-78.6 / 83.7-83.9 on 16896 rows, each call issued alone).
//   At two slices it lost (direct timing, RMSNorm at 512: 91.3-91.4 / 90.0-90.1), and at one
//   blocks of 64 lost 9 points (RMSNorm at 256, 108.6-109.6 / 99.7-100.2);
// - norm_fwd_stream_kernel: one warp, but 64 threads for a LayerNorm at one slice a lane
//   (direct timing, 256 columns, blocks of 32 / 64 / 128, warm then each call issued alone):
//   LayerNorm 83.6-84.0 / 84.3-84.6 / 83.9-84.3, 79.7-80.1 / 82.0-82.3 / 81.3-81.9; RMSNorm
//   84.9-85.1 / 84.2-84.5 / 84.1-84.7, 82.2-82.8 / 80.5-80.7 / 79.8-81.0;
// - the calls beside a float32 stream it leaves (norm_fwd_fast_kernel: no weight, a bias beside
//   RMSNorm) from two slices a lane where the segment leaves no lane idle (direct timing, warm):
//   LayerNorm 87.8 / 89.0 at 512, 93.3-93.4 / 93.6-93.8 at 1024, 91.9 / 91.6-91.7 at 768;
//   RMSNorm 89.5-89.6 / 90.7 at 512, 92.7 / 94.6 at 1024. At one slice (256) 82.3-82.4 /
//   81.9-82.0. The prenorm RMSNorm (a 16-bit residual) lost 14 points at 1024 (95.1 / 80.6), so
//   it keeps kFastFwdBlock, and so do the gated calls (level at 768: 90.1 / 89.7).
inline int lean_fwd_block(const NormArgs& a, const NormPlan& p, FastFwdInputs inputs, Dtype d,
                          Dtype stream, int slices) {
  if (stream_kernel_takes(a, p, inputs, d, stream, slices))
    return slices == 1 && a.layer_norm ? 64 : 32;
  const bool alone = alone_kernel_takes(a, p, inputs, d) && slices >= 3;
  const bool f32_stream = inputs == kFwdResidual && d != Dtype::F32 && stream == Dtype::F32 &&
                          p.threads == 32 && slices >= 2 && p.nslices == 32 * slices;
  return alone || f32_stream ? 32 : kFastFwdBlock;
}
// The prenorm kernel fetches into L2 (a bulk prefetch a row share) the rows kPrenormAheadBytes of
// x ahead of its own, so a block that starts later finds its x and residual there rather than
// waiting a DRAM latency. One H100, % of copy, direct timing, RMSNorm + residual (bf16, float32
// weight, 32768 rows), none / about 1 MB of x ahead: 84.0-84.3 / 85.4-85.7 at 256 columns,
// 87.6 / 88.6-88.9 at 384, 90.8-90.9 / 92.1 at 512, 93.5 / 94.7-94.9 at 768, 95.5-95.9 / 96.7 at
// 1024 (torch.compile 86.9-87.2, 87.3, 91.7, 94.7, 96.3-96.7). Farther lost: 4 MB 84.8 at 256,
// 85.2 at 512 and 86.4 at 1024; 8 MB (about a wave of blocks) 79.2, 71.7 and 70.9. The other
// lean kernels lost with it, up to 6 points at 256 columns (the norm alone, gated), whose inputs
// stay in L2 between calls there; the norm alone takes it where its x and y outgrow the L2
// (kAloneAheadBytes).
constexpr int64_t kPrenormAheadBytes = int64_t(1) << 20;
// The norm alone's lean kernel fetches 4 MB of x ahead where x and y together (16-bit) are more
// bytes than the L2 holds, and loads x without allocating it in L1 (in a window of sizes on the
// H200: lean_fwd_fetch, norm_cuda.cu); where they fit, they stay in L2 from one call to the next
// and fetching ahead pushed them out (one H100, % of copy, direct timing, bf16, float32 weight,
// 32768 rows, none / 4 MB: RMSNorm alone 104.7-105.5 / 106.1-108.6 at 256 columns but 89.2-89.8 /
// 85.1-85.5 at 384). Past the L2: RMSNorm alone 79.6-80.5 / 80.8-82.7 at 448 columns, 78.8-79.2 /
// 82.1-83.0 at 512, 82.6-83.6 / 83.5-84.6 at 640, 84.5-85.4 / 87.1-87.5 at 768; LayerNorm alone
// 75.7-76.3 / 78.1-79.7, 76.2-77.8 / 80.1-80.8, 79.7-80.5 / 81.8-82.3, 82.0-82.7 / 85.1-85.4. 8 MB
// ahead lost to 4 (78.5-78.7 at 512, 83.3 at 768), 16 MB to none (76.3-76.5, 71.0-71.1); 1 MB and
// 256 KB gained about half as much. On 131072 rows: 94.6 / 96.1 at 512, 96.9 / 97.5 at 768.
constexpr int64_t kAloneAheadBytes = int64_t(4) << 20;
// The plain gated call past twice the L2 fetches x and z into L2 kGatedAheadBytes of x ahead of
// its rows at two slices a lane up to 48 slices and, on a device whose DRAM is not past kFastDram,
// at three, and there caps its CTAs at kGatedCtasPerSm an SM (lean_fwd_fetch, norm_cuda.cu, has
// the measurements).
constexpr int64_t kGatedAheadBytes = int64_t(2) << 20;
constexpr int kGatedCtasPerSm = 5;
// How a lean forward fetches its inputs (lean_fwd_fetch, norm_cuda.cu): how far ahead of its rows
// the prenorm kernel, the norm alone's or the plain gated ones fetch x (and the residual or z)
// into L2, 0 for not at all; whether x (and z or the residual) are loaded without allocating
// them in L1; the most CTAs an SM may hold, 0 for as many as fit.
struct LeanFwdFetch {
  int64_t ahead_bytes = 0;
  bool no_l1 = false;
  int ctas_per_sm = 0;
};
// Whether a gated call has none of the options Mamba-2's RMSNormGated leaves out: no residual in
// or out, a weight of float32 or x's dtype, no bias, not zero-centred (norm_cuda.cu). Its lean
// forward compiles them out (kWt, norm_fast.cuh).
bool plain_gated_call(const NormArgs& a);
template <int kDt, int kRt>
cudaError_t launch_norm_fwd_fast(const NormArgs& a, NormPlan& p, int slices, FastFwdInputs inputs,
                                 LeanFwdFetch fetch, cudaStream_t stream);
// The lean backward keeps kFastBwdSlices slices a thread, like the fused general one. Its
// dynamic shared memory (bwd_stash_bytes) holds, per thread:
// - with LayerNorm, a bias gradient or a gate, beside a stream of x's dtype
//   (bwd_stashes_scale), the scale of its slices, widened once: those kernels have no
//   registers left to keep it for the whole walk, and reloading it from global memory each row
//   left every row waiting on it (27% of the stall samples). One H200, % of copy, direct timing,
//   reloaded against kept here: LayerNorm of bf16 rows without a residual 56 / 75 at 8192
//   columns, 48 / 69 at 16384; beside a bf16 residual 73 / 88 at 8192; gated RMSNorm in groups
//   of 1024, 86 / 92. Beside a float32 stream it lost (bench, LayerNorm at 8192 columns: 93-94
//   / 81; its registers spilled 20 bytes more), so those reload it;
// - with the gate first, two floats for each element of those 8-column slices (64 KB for 512
//   threads).
// Both leave the CTAs an SM as they were: 128 registers a thread already hold them to
// 65536 / (128 * block).
constexpr int kFastBwdSlices = 2;
// The lean backward loads x, dy and z and stores dx and dz without allocating them in L1
// (ld/st.global.L1::no_allocate), beside dresidual_out only up to kBwdNoL1StreamSlices (256
// 16-bit columns). One H100, % of copy, direct timing, bf16, float32 weight, 32768 rows, one
// process each, allocated / not: RMSNorm alone 49.8-49.9 / 56.8-57.6 at 256 columns, 65.7-66.3 /
// 67.1-67.6 at 512, 73.1-73.2 / 77.2-77.3 at 1024, 79.8-80.4 / 85.4-85.6 at 2048, 85.8-85.9 /
// 90.8-90.9 at 4096, level at 8192; LayerNorm alone 43.1-43.2 / 49.7-50.0, 62.6-62.8 / 63.0,
// 69.1-69.6 / 72.5-72.6, 74.9-75.0 / 81.8-82.0, 81.8-82.1 / 88.2; gated RMSNorm, x and dy (z
// and dz too) 59.5-59.7 / 59.7-60.0 (60.9-61.2) at 256, 70.8-71.2 / 73.0-73.1 (74.8-75.2) at 512,
// 79.1-79.2 / 83.7-83.8 (84.4-84.5) at 1024, 86.1 / 88.8-89.0 at 2048, 90.0-90.3 / 92.5-92.8 at
// 4096 and 8192. RMSNorm + residual (bf16, with dresidual_out) 56.8-57.0 / 71.3-72.5 at 256,
// but 73.5-73.8 / 72.4-72.5 at 512, 85.1 / 83.9-84.0 at 1024, 93.4 / 91.7 at 2048, 97.0 /
// 95.4-95.7 at 8192. dresidual_out loaded and dresidual stored so too lost 1-4 points more
// there. Where a call fits the L2 (4096 rows) level, but for gated rows of 1024 columns
// (44.4-44.5 / 46.5-46.7). Beside a float32 stream (bf16 x): with dresidual_out within half a
// point at every width; without it (bench_norm.py's LayerNorm row, TB/s, two runs) 2.06 / 2.12
// at 256 columns, 2.41 / 2.45 at 512, 2.59 / 2.65 at 1024, 2.16-2.18 / 2.16-2.17 at 2048 and
// 2.31 / 2.32 at 4096.
constexpr int kBwdNoL1StreamSlices = 32;
inline bool bwd_stashes_scale(const NormArgs& a, bool same_dtype) {
  return same_dtype && (a.layer_norm || a.dbias.present() || a.z.present());
}
inline size_t bwd_stash_bytes(const NormArgs& a, const NormPlan& p, bool same_dtype) {
  const size_t per_value = size_t(p.block) * kFastBwdSlices * 8 * sizeof(float);
  return (bwd_stashes_scale(a, same_dtype) ? per_value : 0) +
         (a.z.present() && !a.norm_before_gate ? 2 * per_value : 0);
}
// Beside a float32 stream (16-bit dy, no cluster) up to kBwdOneSliceMaxSlices slices (4096
// columns) it keeps one slice a thread instead: 90 registers (RMSNorm) or 102 (LayerNorm)
// against 128, five or four CTAs of 128 threads an SM, its persistent grid lowered to those that
// fit (the workspace is sized for the threads an SM can hold, kBwdOneSliceSmThreads). One H100,
// kernel time (torch.profiler), LayerNorm of bf16 x beside a float32 stream, 32768 rows, two
// slices / one:
// 98.3-99.3 / 74.8-74.9 us at 384 columns, 187.0-187.2 / 141.3 at 768, 241.7-242.3 / 193.1-193.3
// at 1024 (torch.compile's backward: 75.5 + 17.5 and 203.2 + 21.1 us for its two reductions).
// A grid of six or eight CTAs an SM instead of the five that fit: 92.4 and 82.2 us at 384, 227.4
// and 200.4 at 1024. Wider rows, at the CTAs that fit (bench_norm.py's LayerNorm row, TB/s, two
// slices / one, two runs): 2.15-2.17 / 2.75-2.76 at 2048 columns, 2.32 / 2.41 at 3072, 2.31 /
// 2.61 at 4096 (torch.compile 2.51 and 2.67); with the limit at 256 slices, 4096 read 2.30-2.34.
// Grids of four to eight CTAs an SM's worth of rows lost there, 3-26 points of copy at 1024-4096.
constexpr int kBwdOneSliceMaxSlices = 512, kBwdOneSliceSmThreads = 2048;
// rows: dy's dtype (the lean backward's kDt); stream: that of x, the stream s (kRt).
inline bool bwd_one_slice(Dtype rows, Dtype stream, int64_t nslices, int cluster) {
  return rows != Dtype::F32 && stream == Dtype::F32 && nslices <= kBwdOneSliceMaxSlices &&
         cluster <= 1;
}
template <int kDt, int kRt, bool kCluster>
cudaError_t launch_norm_bwd_fast(const NormArgs& a, NormPlan& p, int sms, cudaStream_t stream);
// The lean backward's clusters: up to 8 CTAs (the portable cluster size), 2 slices a thread, of
// 256 threads while 8 of those hold the segment (32768 16-bit columns), of 512 beyond. Chosen on
// one H200, bf16, when the CTAs of a cluster still met at a barrier each row (TB/s backward):
// 256 threads beat 512 at 16384 and 32768 columns (1.71 against 1.63 at 16384), but not below:
// at 8192 one 512-thread CTA without a cluster (2.51) beat two clustered ones (1.84). The staged
// forward's clusters are up to kMaxCluster CTAs too (norm_cuda.cu sizes them).
constexpr int kMaxCluster = 8;
constexpr int kClusterThreads = 256;

// The staged forward (norm_staged.cuh): the lean forward's calls with each CTA's share of its
// rows copied to shared memory first. One CTA a row block (p.row_blocks * ngroups blocks, or
// clusters of p.cluster CTAs with kCluster); each thread takes up to kStagedSlices slices of
// its segment (p.cta_slices <= kStagedSlices * p.threads), unrolled, so the weight of all of
// them is loaded before any is used. Not persistent, clusters included: persistent clusters with
// two stages (the next row's copy in flight while the cluster adds its sums) ran at 79% of copy
// against 84% at 32768 columns (one H200, bf16 with a bf16 residual), the second stage costing
// a CTA an SM. staged_fwd_bytes: its dynamic shared memory; sms: the device's multiprocessors.
// Returns cudaErrorInvalidClusterSize, launching nothing, when not one cluster fits on the
// device.
constexpr int kStagedSlices = 4;
template <int kDt, int kRt, bool kCluster>
cudaError_t launch_norm_fwd_staged(const NormArgs& a, NormPlan& p, int sms, cudaStream_t stream);

// The held forward (norm_held.cuh): the lean forward's calls without a gate past
// kFastFwdSlices slices that held_plan (norm_cuda.cu) gives it, each thread holding `slices`
// slices in registers, one block a segment, in one of four shapes:
// - clusters of p.cluster > 1 CTAs of up to kNormMaxThreads threads, held_slices(x's dtype)
//   slices a thread, two CTAs an SM, p.cta_slices slices each (sm_90 and later; it returns
//   cudaErrorInvalidClusterSize, launching nothing, when not one cluster fits on the device).
//   64 bytes of x a thread: eight 16-bit slices held 100-106 registers, one 512-thread CTA an
//   SM, and ran at 84% of copy against 92 with four at 32768 columns (one H200, bf16 with a bf16
//   residual); four float32 slices spilled 172 bytes at 64 registers.
// - one plain CTA of up to held_wide_threads threads, 4 slices a thread, rows beside a stream
//   of their dtype or none: 16-bit ones up to kHeldMaxThreads in 60 registers (one CTA of 1024
//   threads an SM, two of 512, four of 256), float32 ones up to 256 threads in 88 (two CTAs an
//   SM; held to one 1024-thread CTA they would spill).
// - one plain CTA of up to kHeldMaxThreads threads, 3 slices a thread, 16-bit rows beside a
//   stream of their dtype or none past one stage (to 24576 columns), in 50 registers.
// - one plain CTA of up to kNormMaxThreads threads, 2 slices a thread, held_narrow_blocks of
//   them an SM: three for 16-bit rows beside a stream of their dtype (40 registers), else as
//   many as 2 * kNormMaxThreads threads allow (48 registers for 16-bit x beside a float32
//   stream, 56 for float32: two CTAs an SM). Held to three CTAs those spilled 16-32 bytes and
//   lost (one H200, % of copy, 8192 columns): 92 against 97 for LayerNorm, bf16 beside a float32
//   stream; 81 against 96 for RMSNorm in float32. Unheld, the 16-bit rows beside their own dtype
//   took 42 registers, two CTAs an SM, and lost 88 against 96 (LayerNorm, 8192).
// `slices` is the launcher's argument, not the plan's: a field more in NormPlan, which every
// norm kernel takes, changed the registers of kernels that never read it (40 -> 52 for a staged
// cluster).
__host__ __device__ constexpr int held_slices(Dtype x) { return x == Dtype::F32 ? 2 : 4; }
__host__ __device__ constexpr int held_narrow_blocks(bool same_16bit) { return same_16bit ? 3 : 1; }
constexpr int kHeldMaxThreads = 1024;
__host__ __device__ constexpr int held_wide_threads(Dtype x) {
  return x == Dtype::F32 ? 256 : kHeldMaxThreads;
}
// How the held forward moves its rows (held_fwd_fetch, norm_cuda.cu, says where and why): x
// and the residual loaded without allocating them in L1; 16-bit y and residual_out stored so;
// the rows ahead_rows past a CTA's own fetched into L2, 0 for none. Only plain CTAs of 16-bit x
// take one (of 2 slices a thread, or of 3 or 4 for a prenorm call), and only where out_no_l1 (which
// picks its kernel: norm_fwd_held_kernel's kFetch). A kernel argument of its own rather than fields
// of NormPlan, for the reason `slices` is one.
struct HeldFwdFetch {
  int64_t ahead_rows = 0;
  bool no_l1 = false, out_no_l1 = false;
};
template <int kDt, int kRt>
cudaError_t launch_norm_fwd_held(const NormArgs& a, NormPlan& p, int slices, HeldFwdFetch f,
                                 int sms, cudaStream_t stream);

// The plain forward (norm_plain.cuh): whole rows of 16-bit x without a residual or a gate from
// kPlainMinSlices slices (1024 columns; the lean forward takes shorter ones, and the norm alone at
// 1024 columns: lean_fwd_slices in norm_cuda.cu), weight given in
// float32 or x's dtype, bias (if any) in the weight's. One block a row of p.threads threads up to
// kPlainCtaSlices slices; past that the ceil(nslices / kPlainCtaSlices) CTAs of a cluster share a
// row (p.cluster, p.cta_slices each; sm_90 and later, up to kMaxCluster: 131072 columns), adding
// their statistics through distributed shared memory; past two of those, a LayerNorm's CTAs hold
// up to kPlainShortCtaSlices (65536 columns on eight), and so do an RMSNorm's on a device past 4
// TB/s of DRAM (fast_dram, norm_cuda.cu): one H200, % of copy, direct timing, 2^27 elements,
// CTAs of 2048 / 1024 slices (torch.compile): 86.1 / 91.6 at 49152 columns (64.3), 87.0 / 90.2
// at 65536 (63.6); at 32768, two CTAs of 2048, 94.3 / 93.8 (96.7).
// `slices` a thread (the launcher's argument, as for the held forward; plain_slices):
// - 4 below 512 slices a CTA, and for an RMSNorm whose CTA share is a power of two (every lane
//   of a power-of-two block full), in up to kPlainNarrowThreads threads four blocks an SM (64
//   registers), beyond that in up to 512 threads two blocks an SM;
// - 8 otherwise, in up to 128 threads six blocks an SM or 256 threads three (80 registers):
//   more rows in flight an SM, and fewer idle lanes where a share is not a power of two. One
//   H200, % of copy, direct timing, 4 slices a thread against 8: LayerNorm 85-86 / 87-92 at 8192
//   columns, 74 / 80-84 at 12288, 81 / 81-83 at 16384, 71 / 81 at 5120, 78 / 86 at 6144, 82 /
//   90 at 7168, 90 / 94 at 4096; but 80 / 60 at 1024; RMSNorm 88 / 97 at 5120, 94 / 96 at 6144,
//   in clusters 81 / 90 at 20480 (two CTAs of 1280 slices), 76 / 85 at 40960; but where a share
//   of 4 a thread fills its lanes, 94 / 88-91 at 8192 and 93 / 80 at 32768 (two CTAs of 2048).
// Blocks are whole warps, not a power of two (segment_reduce's kWholeWarps pads the warp
// partials with zeros to one): 640 slices of 8 a thread take 96 threads, eight blocks an SM,
// where 128 took six. One H200, % of copy, power of two / whole warps: LayerNorm 86 / 88 at 3072
// columns, 84 / 88 at 5120, 89 / 92 at 6144, 87 / 92 at 10240, 91 / 93 at 12288, level at 7168
// and 14336; RMSNorm on clusters 91 / 95 at 20480 (two CTAs of 1280 slices in 160 threads), 92
// / 94 at 24576, level elsewhere.
// From kPlainAheadSlices (and below them past the L2) each block also fetches into L2 its share
// of a row ahead (a bulk prefetch): where the kernel streams x and y past the caches (a
// LayerNorm's wide blocks) the row one wave of blocks ahead will take, else the row
// kPlainAheadBytes of x ahead (at most a wave). One H200, % of copy,
// none / a wave ahead: LayerNorm 83 / 86 at 12288 and 84 / 86 at 16384, RMSNorm 92 / 95 at 16384,
// and in clusters 66-82 / 81-93 (RMSNorm, 20480 to 65536 columns); at 8192 columns it lost (91 /
// 87), and two waves ahead lost everywhere (67-77). On one H100 (direct timing, three runs;
// benchmarks/NOTES_norm.md) a wave ahead (8-12 MB of x) lost the RMSNorm up to 21 points against
// none, and 2-6 MB ahead ran best: RMSNorm none / a wave / 4 MB 94.5 / 78.0 / 99.2 at 28672
// columns, 98.9 / 95.4 / 99.4 at 16384, 97.2 / 91.0 / 98.2 at 14336, and 98.4-99.3 (4 MB) against
// 87.9-91.8 (the ring forward that took them) from 36864 to 65536; 7-9 MB lost 3-11 points. The
// LayerNorm in wide blocks, which streams x and y past the caches, stayed within a point at none,
// half a wave or a wave ahead; its CTAs of 1024 slices (128 threads, not streaming) ran 71.5-85.3 a
// wave ahead and 91.0-96.9 4 MB ahead. A distance in bytes holds the prefetched rows while they can
// still be in L2 at any width; the H200's wave (8-12 MB) is 2-3 times 4 MB and was not measured
// against it.
// The clusters against the forward that took those rows before (held clusters, or one plain
// held CTA of 1024 threads for an RMSNorm): LayerNorm 45-57 / 60-77 from 20480 to 65536 columns,
// RMSNorm 63-76 / 85-92 (one H200, a wave ahead). One H100, 4 MB ahead (a wave for the streaming
// CTAs), against the ring forward, which took the LayerNorm from 2049 slices and the RMSNorm from
// 4097 (direct timing, three runs): LayerNorm 93.2-96.2 / 87.0-90.0 from 18432 to 32768 columns
// (two CTAs of up to 2048 slices), 90.8-96.9 / 86.5-92.6 from 32776 to 65536 (CTAs of 1024;
// those of 2048 ran 82.7-92.6 there); RMSNorm 98.4-99.3 / 87.9-91.8 from 36864 to 65536.
// From 512 slices rather than past 1024, 4 MB ahead (one H100, direct, none / 4 MB): RMSNorm
// 98.1 / 99.0 at 4096 columns, 97.4 / 97.9 at 6144, 98.6 / 99.3 at 8192; LayerNorm 96.5 / 97.3,
// 96.2 / 97.1, 96.8 / 97.6.
// Below kPlainAheadSlices, where x and y outgrow the device's L2, 4 MB ahead too: one H100, %
// of copy, direct timing, bf16, float32 weight, 32768 rows, none / 4 MB (1, 2 and 8 MB within
// half a point of 4): RMSNorm 88.8-89.1 / 90.5-90.6 at 1024 columns, 95.2-95.7 / 96.7 at 2048,
// 96.9-97.1 / 97.6-97.9 at 3072; LayerNorm 87.0 / 88.6-88.7, 94.0-94.4 / 95.4-95.5, 96.4-96.6 /
// 97.5-97.6. Where they fit (6144 rows) it moved -0.8 to +1.5. Loading x without allocating it
// in L1 as well (as the lean kernel does past the L2) lost 3-5 points.
constexpr int kPlainMinSlices = 128, kPlainNarrowThreads = 256, kPlainCtaSlices = 2048;
constexpr int kPlainAheadSlices = 512;
constexpr int kPlainShortCtaSlices = 1024;
constexpr int64_t kPlainAheadBytes = int64_t(4) << 20;
inline int plain_slices(bool layer_norm, int share) {
  if (share < 512 || (!layer_norm && (share & (share - 1)) == 0)) return 4;
  return 8;
}
// `ahead_bytes`: how far ahead of its row a block fetches x into L2, 0 for not at all (a kernel
// that streams x and y fetches a wave of blocks ahead instead).
template <int kDt>
cudaError_t launch_norm_fwd_plain(const NormArgs& a, NormPlan& p, int slices, int sms,
                                  int64_t ahead_bytes, cudaStream_t stream);

// The ring backward (norm_ring.cuh): whole rows of 16-bit x and dy without a residual stream or a
// gate from kRingAloneMinSlices slices (past 4096 columns), beside a float32 stream from
// kRingMinSlices (past the 8192 columns one lean CTA holds) but for kFull (below) past kFastDram
// from kRingAloneMinSlices, kRingSlices a thread in one CTA of p.threads, the rows copied by the
// bulk-copy engine into a ring of kRingStages shared-memory stages (ring_bytes), each row's copies
// issued two rows ahead. Up to ring_max_slices (16384 columns, whose three stages fill an SM's
// shared memory) one CTA holds a row; past that the CTAs of a cluster share it (p.cluster,
// p.cta_slices each; it returns cudaErrorInvalidClusterSize, launching nothing, when not one
// cluster fits on the device): ceil(nslices / ring_max_slices) of them, but for kFull (a LayerNorm,
// or a dbias wanted) CTAs of at most kRingFullCtaSlices, or twice that, ..., the fewest slices a
// CTA that kMaxCluster CTAs hold. The CTAs are whole warps, as many an SM as their registers allow
// (up to kRingCtasPerSm): 160 threads and three CTAs at 5120 columns, 256 and two at 8192, 128 and
// four in the kFull clusters up to 32768 columns. One H200, bf16, float32 weight, % of copy:
// - one CTA up to 8192 columns, against one lean CTA (512 threads, one an SM, 320 of them
//   holding slices at 5120 columns; bench, four to six runs): LayerNorm 62-63 / 93-94 at 5120
//   columns, 71 / 90-92 at 6144, 78 / 91-94 at 7168, 82-83 / 91-92 at 8192; RMSNorm 75-76 / 90-91
//   at 5120, 84-85 / 91-92 at 6144. The lean CTA stays ahead at 4096 (LayerNorm 85 / 80, four
//   ring CTAs of 128 threads an SM). The ring had lost those widths (LayerNorm 81 / 67 at 8192)
//   while its partial sums had the general kernel's rows, one CTA an SM.
// - one CTA past that, against the lean clusters (direct timing): LayerNorm 70 / 81 at 12288
//   columns, 71 / 84 at 16384; RMSNorm 78 / 90 at 16384.
// - beside a float32 stream, one CTA against one lean CTA (bench, bf16 prenorm with dresidual,
//   two runs): LayerNorm 78 / 96 at 4608 columns, 78-81 / 91 at 6144, 78 / 87-88 at 8192; RMSNorm
//   98-99 / 96 at 4608, 95-96 / 88 at 8192, so it keeps the lean CTA to 8192. The H100, where the
//   lean CTA read 83-94 from 4608 to 8192 (LayerNorm, several machines), keeps it too. The cluster
//   kernel must not run a cluster of one: its CTA wrote to shared memory past its own (memcheck).
// - clusters, against the lean clusters up to 32768 columns and the general kernels beyond:
//   LayerNorm 67-71 / 72-78 from 20480 to 32768, 60-67 / 69-75 from 40960 to 65536; RMSNorm
//   76-79 / 81-89 from 24576 to 32768, 69-77 / 83 from 49152 to 65536, level at 20480 (78 / 76)
//   and 40960 (72 / 74), where a CTA's share is least (1280 and 1707 slices): each row waits
//   on its cluster's sums, and the less a share holds, the more of a row's time that wait is.
// - kFull clusters of kRingFullCtaSlices and up, against those of ring_max_slices (direct timing,
//   one run, the stages lined up in both): LayerNorm 86 / 73 at 20480, 85 / 75 at 24576, 87 / 81
//   at 28672, 85 / 83 at 32768, 83 / 76 at 40960, 83 / 79 at 49152, 83 / 78 at 65536; RMSNorm
//   with a bias 88 / 77, 89 / 80, 89 / 84, 88 / 85, 83 / 74, 85 / 81, 80 / 75. While one CTA
//   waits on its cluster's sums, the others of its SM work. The RMSNorm without a bias (one sum
//   a row) lost with them (87 / 92 at 20480, 87 / 90 at 24576), so it keeps the larger CTAs.
// - past kFastDram, an RMSNorm without a dbias gated (z staged after dy) from kRingAloneMinSlices,
//   one CTA up to kRingGateOneCtaSlices, past that CTAs of 512 slices while eight suffice (as
//   kFull's), then of 1024 in kRingGateWideStages stages (ring_stages); and beside a stream of x's
//   dtype (2 slices a thread, dresidual_out fetched into L2 as beside a float32 one) up to
//   kRingStream16MaxSlices. One H200, bf16, bench, 2^27 elements, % of copy, the lean CTA or
//   clusters / the ring with CTAs of up to 1024 slices / of 512 past 768: the gate after 64 / 97 /
//   96 at 5120 columns, 93 / 93 at 6144, 88 / 95 at 7168, 80 / 92 / 91 at 8192, 73 / 80 / 90 at
//   16384, 71 / 89 at 24576, 71 / 88 at 32768, 60 / 64-66 at 49152 (six CTAs of 1024 either way);
//   the gate first 73 / 87 at 4608, 78 / 90 at 5120, 86 / 92 at 6144, 90 / 75 / 90 at 7168, 87-88 /
//   79 / 90 at 8192, 83 / 72 / 85 at 16384, 84 / 85 at 24576, 85 / 84 at 32768, but 82 / 64 at
//   40960 and 78 / 62 at 49152 (five and six CTAs of 1024, three stages: one an SM). In two stages
//   (two an SM; libssm alone, two runs) the gate after 66 / 92 at 40960, 66 / 91 at 49152, 70 / 91
//   at 65536, the gate first (against the lean clusters) 82 / 87, 78 / 88, 85 / 88; CTAs of 512 in
//   two stages changed nothing (the gate after 91 / 92 at 8192 and 91 / 89 at 16384, the gate first
//   91 / 90 and 86 / 88). Splitting below 769 slices changed nothing (the gate after 97 / 96 at
//   5120); CTAs of 256 lost (80 at 8192). The prenorm RMSNorm beside its stream 78 / 81 at 4608, 83
//   / 85 at 5120, 89 / 92 at 6144, 95 / 95 at 7168, 96 / 97 at 8192, but 86 / 57 at 10240 and 83 /
//   57 at 49152 (two CTAs and more). The H100 and the LayerNorm keep the lean kernels: not
//   measured.
// p.row_blocks: the plan's (ring_bwd_plan, norm_cuda.cu), which the workspace covers; the
// launcher lowers it to the CTAs (clusters) that run at once.
constexpr int kRingSlices = 4, kRingStages = 3, kRingCtasPerSm = 4, kRingFullCtaSlices = 512;
constexpr int kRingMinSlices = 2 * kNormMaxThreads + 1, kRingAloneMinSlices = 513;
constexpr int kRingGateOneCtaSlices = 768, kRingGateWideStages = 2;
constexpr int kRingStream16MaxSlices = 1024;
template <int kDt, int kRt>
cudaError_t launch_norm_bwd_ring(const NormArgs& a, NormPlan& p, int sms, cudaStream_t stream);

// The ring forward (norm_ring.cuh): whole rows of 16-bit x in one group, the norm alone on a
// device past kFastDram (a LayerNorm from kRingLayerMinSlices, an RMSNorm from
// kRingRmsMinSlices), gated (an RMSNorm without a residual) or beside a residual (its stream in
// x's dtype or float32, no gate), in persistent clusters of at least
// ceil(nslices / kRingFwdCtaSlices) CTAs (one up to 8192 columns; ring_fwd_cluster, below),
// ring_slices(stream dtype) slices a thread, x and the second operand copied by the bulk-copy
// engine into kRingFwdStages stages (ring_fwd_bytes: 96 KB a 1024-slice CTA of 16-bit x and z,
// two CTAs an SM in 104-113 registers; 48 KB a slice beside a float32 stream, 2 slices a thread
// in 512 threads, one CTA an SM). Returns cudaErrorInvalidClusterSize, launching
// nothing, when not one cluster fits on the device. One H200, bf16, % of copy, the forward that
// took those rows before against this one:
// - the norm alone, which it took until the plain forward's clusters passed it on one H100
//   (above): a LayerNorm from 2049 slices (68 / 72 at 20480 columns, 72 / 83 at 24576, 78 / 86
//   at 32768, 75 / 81 at 40960 and 49152, 78 / 82 at 65536 against the plain forward's clusters
//   a wave ahead below 4097 slices and a ring forward holding x in registers from there), an
//   RMSNorm from 4097 (91-93). Where the DRAM passes kFastDram (the H200) the plain clusters,
//   occupancy-bound (80 registers, three 256-thread CTAs an SM), still trail it, and a LayerNorm
//   alone takes it again from kRingLayerMinSlices. One H200, bf16, float32 weight and bias, 2^27
//   elements, direct timing, % of copy, the plain clusters / the ring forward (torch.compile):
//   73.8 / 90.6 (66.8) at 18432 columns, 77.5 / 89.1 (67.9) at 20480, 81.6 / 91.9 (67.8) at
//   24576, 79.7 / 90.9 (66.0) at 32768, 77.6 / 92.2 (55.2) at 49152, 75.9 / 92.4 (54.4) at 65536;
//   the bench 3.74-3.82 TB/s from 20480 to 65536 (89.7-91.5% of copy), the plain clusters'
//   3.03-3.27 from 24576. An RMSNorm alone from kRingRmsMinSlices, past 32768 columns (the plain
//   forward's two CTAs of 512 threads an SM), the plain forward / the ring (same tensors, the
//   bench's timing): 91.4 / 88.5 at 32768, 91.1 / 92.2 at 36864, 89.2 / 88.6-89.4 at 40960,
//   89.9 / 92.2 at 45056, 88.9-89.1 / 91.2-91.3 at 49152, 87.8 / 91.1-92.7 at 65536; the ring
//   lost from 20480 to 28672 (94.1-95.9 / 86.2-89.1).
// - the gate from kRingGatedMinSlices, against the staged forward: 85 / 94 at 5120 columns, 91
//   / 93 at 6144, 79 / 96 at 10240, 83 / 93-94 at 12288, 88 / 92 at 16384, 61 / 86 at 20480,
//   60-66 / 91-94 from 24576 to 65536. The staged forward stays ahead at 4096 (97 / 93) and
//   8192 (95 / 93); the ring takes 8192 for one rule.
// - a residual from kRingFwdMinSlices, against the held or staged clusters: LayerNorm beside a
//   float32 stream 83 / 87, 83 / 86, 82 / 87 at 40960, 49152, 65536 columns; RMSNorm beside a
//   bf16 stream 85 / 93, 90 / 92, 91 / 92. Below that it lost at most widths (RMSNorm 95-99 /
//   87-93 from 10240 to 20480 columns; LayerNorm 87-89 / 83-87 from 16384 to 24576, though
//   86 / 90 at 12288). A LayerNorm beside a float32 stream from kRingStreamLayerMinSlices, once
//   the ring's one-round statistics (norm_ring.cuh) made it faster there: 86-87 / 90 at 12288,
//   88-89 / 91 at 14336, 88 / 90-91 at 16384, 88 / 89-90 at 20480; from 24576 to 32768 level
//   in one run (88) and up to 3 lower in two others (85-86 at 24576 and 28672, both under the
//   target either way); it lost at 10240 (93 / 88).
// Clusters of kRingBalancedFrom CTAs and more take, up to kMaxCluster, the count that leaves the
// fewest thread slots idle (ring_fwd_cluster), not the fewest CTAs: at 20480 columns three CTAs
// of 854 slices in 256 threads left a sixth of the slots idle, five of 512 in 128 threads none.
// LayerNorm alone 68 / 86-87 at 20480 and 74 / 87-88 at 28672 (seven CTAs), gated 84 / 91-94 at
// 20480. From two CTAs it lost (gated 95 / 90 at 10240, three CTAs of 427 slices).
// Beside a float32 stream, clusters of kMaxCluster CTAs instead, while those hold at most
// kRingStreamWideCtaSlices slices each (up to 32768 columns): CTAs of up to 256 threads, three an
// SM (registers), and the device fits enough clusters of eight to fill 91% of its CTA slots
// (cudaOccupancyMaxActiveClusters on the H200, clusters of c CTAs three an SM: 69 of five, 47 of
// seven, 45 of eight in 396 slots; one an SM: 39 of three, 30 of four in 132). The balanced
// counts filled 83-89%: three CTAs of 512 threads at 22528 and 24576 columns, five or seven of
// 256 at 20480, 26624 and 28672. One H200, bf16, direct timing, two runs in one process, balanced
// against eight: 89.2 / 91.6-92.0 at 20480 columns, 88.1 / 91.5 at 22528, 88.0 / 91.1 at 24576,
// 89.4 / 91.4 at 26624, 89.5 / 91.6 at 28672; level at 30720 and 32768 (four CTAs, 91.0 / 91.3
// and 90.0 / 90.3). Past that eight CTAs hold 512 threads each, one an SM, and lost at 40960
// (90.8 / 86.8), so the balanced count stays there; but past kRingStreamEightAfter slices (40960
// columns), where the balanced count takes six or seven CTAs of 512 threads (one an SM: 102 or
// 105 of 132 SMs), eight again: one H200, 90.7 / 93.0 at 49152 columns; one H100 (direct timing,
// three runs), 88.3 / 96.2 at 45056, 88.7 / 96.4 at 49152, 96.3 / 96.8 at 57344, and level at
// 40960 (95.3 / 95.3).
constexpr int kRingFwdStages = 3, kRingFwdCtaSlices = 1024, kRingFwdMinSlices = 4097;
constexpr int kRingGatedMinSlices = 513, kRingLayerMinSlices = 2049, kRingRmsMinSlices = 4097;
constexpr int kRingStreamLayerMinSlices = 1281, kRingBalancedFrom = 3;
constexpr int kRingStreamWideCtaSlices = 512, kRingStreamEightAfter = 5120;
template <int kDt, int kRt>
cudaError_t launch_norm_fwd_ring(const NormArgs& a, NormPlan& p, int sms, cudaStream_t stream);

// Bytes of one 8-column slice of dtype d.
__host__ __device__ constexpr int slice_bytes(Dtype d) { return d == Dtype::F32 ? 32 : 16; }

// Bytes of one stage of a ring whose stages hold two regions (x, then dy or the second operand)
// of these sizes. Each region starts up to 112 bytes late, so that it stands
// a set distance past a 128-byte line from where its rows do in global memory (ring_regions,
// norm_ring.cuh): the ring kernels ran at 76-79% of copy where the two stood 48 or 80 bytes
// apart, 83-93 elsewhere (one H200, bf16), and the stages had begun wherever the kernel's static
// shared memory ended. A multiple of 128, so that every stage lines up as the first.
__host__ __device__ constexpr unsigned ring_stage_bytes(unsigned first, unsigned second) {
  return (first + 112u + second + 112u + 127u) / 128u * 128u;
}

// The ring backward's slices a thread beside a stream of dtype r (kRingSlices for the norm
// alone, 2 beside a float32 stream, whose dresidual_out of every slice a thread holds in
// registers through the second pass), and the most a CTA takes: 2048 slices of 16-bit x and dy
// (three stages of 64 KB), 1024 beside a float32 stream (48 KB) or with a gate (x, dy and z:
// 48 KB). Its dynamic shared memory: the stages of p.cta_slices slices of x and of dy (and z);
// ring_gated_second: the bytes past x of a gated stage whose dy share is dy_bytes (dy, then z
// lined up as its rows are, ring_stage_bytes).
constexpr int ring_slices(Dtype r) { return r == Dtype::F32 ? 2 : kRingSlices; }
// The backward's beside a stream of x's dtype too (`stream`: its gradients wanted): 2, for the
// dresidual_out a thread holds as beside a float32 one.
constexpr int ring_bwd_slices(Dtype r, bool stream) { return stream ? 2 : ring_slices(r); }
constexpr int ring_max_slices(Dtype r, bool gate = false, bool stream = false) {
  return (gate ? 2 : ring_bwd_slices(r, stream)) * kNormMaxThreads;
}
static_assert(kRingStream16MaxSlices <= ring_max_slices(Dtype::BF16, false, true),
              "beside a stream of x's dtype, one CTA a row");
__host__ __device__ constexpr unsigned ring_gated_second(unsigned dy_bytes) {
  return 2 * dy_bytes + 112u;
}
// The ring backward's stages: kRingGateWideStages for a gated CTA of more slices than
// kRingGateOneCtaSlices (a cluster's CTAs of 1024: 96 KB, two an SM, where three stages' 144 KB
// let one), kRingStages otherwise.
constexpr int ring_stages(int cta_slices, bool gate) {
  return gate && cta_slices > kRingGateOneCtaSlices ? kRingGateWideStages : kRingStages;
}
inline size_t ring_bytes(const NormPlan& p, Dtype r, bool gate) {
  const unsigned dy = unsigned(p.cta_slices) * 16u;
  return ring_stages(p.cta_slices, gate) *
         ring_stage_bytes(unsigned(p.cta_slices) * slice_bytes(r),
                          gate ? ring_gated_second(dy) : dy);
}

// The ring forward's dynamic shared memory: the stages of p.cta_slices slices of x and of the
// second operand (z, or the residual in the stream's dtype r; none for the norm alone).
inline size_t ring_fwd_bytes(const NormArgs& a, const NormPlan& p, Dtype r) {
  const unsigned second = a.z.present() || a.residual.present() ? slice_bytes(r) : 0;
  return kRingFwdStages * ring_stage_bytes(unsigned(p.cta_slices) * 16u,
                                           unsigned(p.cta_slices) * second);
}

// Bytes the staged forward keeps of one slice: x (and z), then the residual.
inline int staged_slice_bytes(const NormArgs& a, Dtype dt, Dtype rt) {
  return slice_bytes(dt) * (a.z.present() ? 2 : 1) + (a.residual.present() ? slice_bytes(rt) : 0);
}

inline size_t staged_fwd_bytes(const NormArgs& a, const NormPlan& p, Dtype dt, Dtype rt) {
  return size_t(p.block / p.threads) * size_t(p.cta_slices) * size_t(staged_slice_bytes(a, dt, rt));
}

// How many blocks of `block` threads of the backward kernel fit on one SM.
template <int K, int kDt, bool kTail>
int norm_bwd_blocks_per_sm(int block);

}  // namespace ssm
