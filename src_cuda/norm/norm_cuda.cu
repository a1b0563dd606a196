// CUDA side of the fused norm: the launch plan (threads per segment and slices kept in registers,
// by segment length), the backward workspace, the column kernel that sums dweight and dbias when
// a segment is too long to keep them in registers, and the fixed-order reduction of the per-block
// partial sums into the caller's dweight and dbias.
#include <algorithm>
#include <climits>
#include <initializer_list>
#include <type_traits>

#include "../common/column_sums.cuh"
#include "../common/cuda_status.h"
#include "norm_device.cuh"
#include "norm_plan.h"

namespace ssm {
namespace {

constexpr size_t kAlign = 256;
// The backward keeps xhat, dy * w and the dweight/dbias sums of each slice: 4 floats an element,
// so 2 slices a thread fit under the 128 registers a 512-thread block allows.
constexpr int kBwdMaxSlices = 2;
static_assert(kBwdMaxSlices == kFastBwdSlices, "the lean backward runs on the fused plan");
constexpr int kColumnThreads = 256;

int pow2_at_least(int64_t n) {
  int p = 1;
  while (p < n) p <<= 1;
  return p;
}

// Slices a thread keeps in registers. The forward keeps one slice while 128 threads cover the
// segment, then 2 up to 512 (more threads a segment beat more slices a thread there, 8192 columns
// ran at 58% of copy with 512 threads x 2 slices, 68% with 256 x 4). The backward always keeps
// kBwdMaxSlices: with one slice its 101 registers left too few loads in flight (27% of copy at
// 1024 columns, against 60% at 4096 with two).
int fwd_slices(int nslices) { return nslices <= 128 ? 1 : nslices <= 512 ? 2 : 4; }

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

int slices_of(const NormArgs& a) { return int(ceil_div(a.group_size, kSlice)); }

// The ring forward's CTAs a cluster for rows of nslices slices (norm_plan.h): the fewest that hold
// a row, kRingFwdCtaSlices each, and from three of them kMaxCluster beside a float32 stream while
// its CTAs then hold kRingStreamWideCtaSlices at most or past kRingStreamEightAfter slices, else,
// of the counts up to kMaxCluster, the one whose CTAs (a power of two threads each, K slices a
// thread) leave the fewest slots idle.
int ring_fwd_cluster(int nslices, Dtype stream) {
  const int K = ring_slices(stream);
  const int least = int(ceil_div(nslices, kRingFwdCtaSlices));
  if (least < kRingBalancedFrom) return least;
  if (stream == Dtype::F32 && (nslices <= kMaxCluster * kRingStreamWideCtaSlices ||
                               nslices > kRingStreamEightAfter))
    return kMaxCluster;
  int best = least;
  int64_t best_slots = INT64_MAX;
  for (int c = least; c <= kMaxCluster; ++c) {
    const int64_t slots = int64_t(c) * K * pow2_at_least(ceil_div(ceil_div(nslices, c), K));
    if (slots < best_slots) best = c, best_slots = slots;
  }
  return best;
}

// Threads that hold a CTA share of `slices` slices, K a thread, rounded up to whole warps (not
// to a power of two, as shape_plan does): fewer idle lanes, more CTAs an SM.
int whole_warps(int slices, int K) { return int(ceil_div(ceil_div(slices, K), 32) * 32); }

NormPlan shape_plan(const NormArgs& a, int K, int cluster = 1) {
  NormPlan p;
  p.nslices = slices_of(a);
  p.cluster = cluster;
  p.cta_slices = int(ceil_div(p.nslices, cluster));
  p.threads = std::min(kNormMaxThreads, pow2_at_least(ceil_div(p.cta_slices, K)));
  p.block = std::max(p.threads, 128);
  return p;
}

bool aligned(const TensorRef& t, bool rows) {
  if (!t.present()) return true;
  const int64_t bytes = t.dtype == Dtype::F32 ? 4 : 2;
  return reinterpret_cast<uintptr_t>(t.data) % 16 == 0 && (!rows || t.stride[0] * bytes % 16 == 0);
}

// The one dtype of the present operands among `ts`, kNone when none is present, or -1 when they
// differ.
constexpr int kNone = -2;
int shared_dtype(std::initializer_list<const TensorRef*> ts) {
  int dt = kNone;
  for (const TensorRef* t : ts) {
    if (!t->present()) continue;
    if (dt != kNone && dt != int(t->dtype)) return -1;
    dt = int(t->dtype);
  }
  return dt;
}

// The one dtype every row-shaped operand has (as an int for the kDt template argument), or -1
// when they differ and only the generic kernels apply.
int common_row_dtype(const NormArgs& a) {
  return shared_dtype({&a.x, &a.residual, &a.z, &a.y, &a.residual_out, &a.dy, &a.dresidual_out,
                       &a.dx, &a.dresidual, &a.dz});
}

template <int K, bool kTail>
cudaError_t fwd_by_dtype(int dt, const NormArgs& a, const NormPlan& p, cudaStream_t s) {
  switch (dt) {
    case int(Dtype::F32): return launch_norm_fwd<K, int(Dtype::F32), kTail>(a, p, s);
    case int(Dtype::F16): return launch_norm_fwd<K, int(Dtype::F16), kTail>(a, p, s);
    case int(Dtype::BF16): return launch_norm_fwd<K, int(Dtype::BF16), kTail>(a, p, s);
    default: return launch_norm_fwd<K, -1, kTail>(a, p, s);
  }
}

template <int K, bool kTail>
cudaError_t bwd_by_dtype(int dt, const NormArgs& a, const NormPlan& p, cudaStream_t s) {
  switch (dt) {
    case int(Dtype::F32): return launch_norm_bwd<K, int(Dtype::F32), kTail>(a, p, s);
    case int(Dtype::F16): return launch_norm_bwd<K, int(Dtype::F16), kTail>(a, p, s);
    case int(Dtype::BF16): return launch_norm_bwd<K, int(Dtype::BF16), kTail>(a, p, s);
    default: return launch_norm_bwd<K, -1, kTail>(a, p, s);
  }
}

bool can_vectorize(const NormArgs& a) {
  if (a.group_size % kSlice != 0) return false;
  for (const TensorRef* t : {&a.x, &a.residual, &a.z, &a.y, &a.residual_out, &a.dy,
                             &a.dresidual_out, &a.dx, &a.dresidual, &a.dz})
    if (!aligned(*t, true)) return false;
  return aligned(a.weight, false) && aligned(a.bias, false);
}

// The (kDt, kRt) of a call the lean kernels (norm_fast.cuh) take, as launch_norm_*_fast name
// them; ok is false when the call needs the general kernels.
struct LeanDtypes {
  int dt = -1, rt = -1;
  bool ok = false;
  LeanDtypes(int d, int r, bool vec) : dt(d), rt(r == kNone ? d : r) {
    const bool f32_stream = rt == int(Dtype::F32) && dt != rt;
    ok = vec && dt >= 0 && (dt == rt || f32_stream);
  }
};

// Forward: x, y and z in kDt, residual and residual_out in kRt; a gate only with one dtype.
LeanDtypes fwd_lean_dtypes(const NormArgs& a, bool vec) {
  LeanDtypes d(shared_dtype({&a.x, &a.y, &a.z}), shared_dtype({&a.residual, &a.residual_out}),
               vec);
  d.ok = d.ok && (!a.z.present() || d.dt == d.rt);
  return d;
}

// Backward: x (the forward's s), dresidual_out and dresidual in kRt, dy, dx, z and dz in kDt; a
// gate only with one dtype.
LeanDtypes bwd_lean_dtypes(const NormArgs& a, bool vec) {
  LeanDtypes d(shared_dtype({&a.dy, &a.dx, &a.z, &a.dz}),
               shared_dtype({&a.x, &a.dresidual_out, &a.dresidual}), vec);
  d.ok = d.ok && (!a.z.present() || d.dt == d.rt);
  return d;
}

// The CTAs of the cluster a lean kernel shares a segment among (norm_plan.h): 1 while one CTA of
// up to 512 threads holds it (2 slices a thread: 8192 16-bit columns; beyond, its registers
// would spill); past that, where the device runs cluster kernels, as many CTAs of
// kClusterThreads as hold it, or of 512 threads when that would take more than kMaxCluster;
// 0 when the segment needs the general kernels.
int lean_cluster(int nslices, int device) {
  constexpr int kPerCta = 2 * kNormMaxThreads, kPerSmallCta = 2 * kClusterThreads;
  if (nslices <= kPerCta) return 1;
  if (nslices > kMaxCluster * kPerCta || !cluster_kernels_run(device)) return 0;
  return int(nslices <= kMaxCluster * kPerSmallCta ? ceil_div(nslices, kPerSmallCta)
                                                   : ceil_div(nslices, kPerCta));
}

// Bytes of `rows` partial rows of dweight and of dbias.
size_t partial_bytes(int64_t rows, int64_t hidden) {
  return (2 * size_t(rows) * size_t(hidden) * sizeof(float) + kAlign - 1) / kAlign * kAlign;
}

// The backward's plan and its workspace: per-row-block partial sums of dweight and dbias, made
// by the row kernel (fused) or by the column kernel when a segment outgrows the registers of the
// general kernel. `cluster` is the lean kernel's (lean_cluster) or 0 for the general kernels;
// `one_slice`: the lean kernel's one slice a thread (bwd_one_slice, norm_plan.h).
struct BwdSetup {
  NormPlan plan;
  bool fused = true;
  int64_t partial_rows = 1;  // row blocks of partial sums
  size_t workspace = 0;

  BwdSetup(const NormArgs& a, int device, int cluster, bool one_slice = false) {
    const int nslices = slices_of(a);
    plan = shape_plan(a, one_slice ? 1 : kBwdMaxSlices, std::max(cluster, 1));
    fused = cluster > 0 || nslices <= kBwdMaxSlices * plan.threads;
    const int64_t sms = std::max(1, multiprocessor_count(device));
    const int64_t slots = plan.block / plan.threads;
    const int64_t row_blocks_needed = std::max<int64_t>(1, ceil_div(a.rows, slots));
    if (fused) {
      // Persistent: as many blocks (clusters) as fit at once, each summing its rows' dweight in
      // registers. Sized by the generic kernel whatever the dtypes: the size query, which sees
      // only x and weight, must arrive at the same workspace as the call. A cluster's launcher
      // may lower it to the clusters that fit, and the one-slice launcher to the CTAs that fit,
      // of at most the threads an SM holds.
      const int per_sm = one_slice ? kBwdOneSliceSmThreads / plan.block
                                   : norm_bwd_blocks_per_sm<kBwdMaxSlices, -1, false>(plan.block);
      plan.row_blocks = std::clamp<int64_t>(ceil_div(per_sm * sms, a.ngroups * plan.cluster), 1,
                                            row_blocks_needed);
      partial_rows = plan.row_blocks;
    } else {
      plan.row_blocks = std::min<int64_t>(row_blocks_needed, INT_MAX / a.ngroups);
      const int64_t column_blocks = ceil_div(a.ngroups * nslices, kColumnThreads);
      partial_rows = std::clamp<int64_t>(ceil_div(8 * sms, column_blocks), 1,
                                         std::min<int64_t>(std::max<int64_t>(a.rows, 1), 65535));
    }
    workspace = partial_bytes(partial_rows, a.hidden);
  }
};

// dweight and dbias partial sums over rows blockIdx.y, blockIdx.y + gridDim.y, ... for one slice
// of 8 columns a thread, when the row kernel could not keep them in registers.
__global__ void __launch_bounds__(kColumnThreads) norm_column_sums_kernel(const NormArgs a,
                                                                          const NormPlan p,
                                                                          float* partial) {
  using namespace norm_detail;
  const int64_t slice = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (slice >= a.ngroups * p.nslices) return;
  const int64_t group = slice / p.nslices;
  const int v = int(slice % p.nslices);
  Slices<1> s;
  s.vec = p.vec;
  s.col[0] = group * a.group_size + int64_t(v) * kSlice;
  const int64_t left = a.group_size - int64_t(v) * kSlice;
  s.n[0] = int(left < kSlice ? left : kSlice);
  Slice dw = {}, db = {};
#pragma unroll 4
  for (int64_t r = blockIdx.y; r < a.rows; r += gridDim.y) {
    s.row = r;
    const float mean = a.layer_norm ? load_stat(a.mean, r, group) : 0.f;
    Slice xhat[1], dye[1], wdy[1];
    backward_terms<-1>(a, s, mean, load_stat(a.rstd, r, group), xhat, dye, wdy);
#pragma unroll
    for (int e = 0; e < kSlice; ++e) {
      dw[e] += dye[0][e] * xhat[0][e];
      db[e] += dye[0][e];
    }
  }
  float* out_w = partial + int64_t(blockIdx.y) * a.hidden + s.col[0];
  float* out_b = out_w + int64_t(gridDim.y) * a.hidden;
#pragma unroll
  for (int e = 0; e < kSlice; ++e) {
    if (e >= s.n[0]) break;
    out_w[e] = dw[e];
    out_b[e] = db[e];
  }
}

// dweight (blockIdx.y 0) or dbias (1): the columns of the partial rows, added in a fixed order
// (column_totals).
__global__ void __launch_bounds__(32 * kMaxColumnSumWarps) norm_reduce_partials_kernel(
    const float* partial, int64_t partial_rows, int64_t hidden, TensorRef dweight,
    TensorRef dbias) {
  const TensorRef& out = blockIdx.y == 0 ? dweight : dbias;
  if (!out.present()) return;
  column_totals(partial + blockIdx.y * partial_rows * hidden, partial_rows, hidden,
                [&](int64_t j, float total) { store_from_float(out.data, j, out.dtype, total); });
}

}  // namespace

// f(kDt, kRt) for the lean kernels' dtypes, each an std::integral_constant, so that one switch
// serves every lean launcher.
template <class F>
cudaError_t with_lean_dtypes(LeanDtypes d, F f) {
  using F32 = std::integral_constant<int, int(Dtype::F32)>;
  using F16 = std::integral_constant<int, int(Dtype::F16)>;
  using BF16 = std::integral_constant<int, int(Dtype::BF16)>;
  if (d.rt != d.dt) return d.dt == F16::value ? f(F16{}, F32{}) : f(BF16{}, F32{});
  switch (d.dt) {
    case F32::value: return f(F32{}, F32{});
    case F16::value: return f(F16{}, F16{});
    default: return f(BF16{}, BF16{});
  }
}

// The staged forward's plan for a lean call held_plan leaves (norm_plan.h): one CTA a segment
// while its stage fits kStageBudget (two CTAs an SM), else (with a gate: held_plan takes the
// calls without one) the fewest CTAs of a cluster whose stages fit the first of
// kClusterStageBudgets that needs at most kMaxCluster of them. False where that is not enough,
// or a cluster would be needed and the device runs none, or the grid would be too large. One
// H200, bf16 with a bf16 residual (TB/s): 32 KB CTAs beat 64 KB ones at 65536 columns (3.50
// against 3.46), 16 KB ones lost there (2.57); 24 KB ones beat 32 KB ones where they still fit
// 8 CTAs (% of copy: 87 against 85 at 32768 columns, 84 against 82 for float32 at 16384); a 96
// KB stage in one CTA beat two clustered 48 KB ones (3.61 against 3.12, LayerNorm with a
// float32 residual stream at 16384).
constexpr int64_t kStageBudget = 110 * 1024;
constexpr int64_t kClusterStageBudgets[] = {24 * 1024, 32 * 1024};

bool one_stage_fits(const NormArgs& a, LeanDtypes d) {
  const int nslices = slices_of(a);
  return nslices <= kStagedSlices * kNormMaxThreads &&
         nslices * staged_slice_bytes(a, Dtype(d.dt), Dtype(d.rt)) <= kStageBudget;
}

// Whether the weight is one the kernels with the options compiled out take (kWt, norm_fast.cuh):
// present, of float32 or x's dtype, no bias, not zero-centred.
bool plain_weight(const NormArgs& a) {
  const Dtype w = a.weight.dtype;
  return a.weight.present() && !a.bias.present() && !a.zero_centered_weight &&
         (w == Dtype::F32 || w == a.x.dtype);
}

// Whether a lean call is the prenorm one of RMSNorm (FastFwdInputs, norm_plan.h), whatever its
// width: residual in and residual_out out, all of x's dtype, no gate, a plain weight.
bool prenorm_call(const NormArgs& a, LeanDtypes d) {
  return !a.z.present() && d.dt == d.rt && a.residual.present() && a.residual_out.present() &&
         !a.layer_norm && plain_weight(a);
}

// plain_gated_call: norm_plan.h.
bool plain_gated_call(const NormArgs& a) {
  return a.z.present() && !a.residual.present() && !a.residual_out.present() && plain_weight(a);
}

// Whether the device's DRAM outruns kFastDram bytes a second (the H200's 4.8 TB/s by its
// attributes, not the H100's 3.35): there more bytes must be in flight, and the plans measured on
// both that differ say so.
constexpr double kFastDram = 4e12;
bool fast_dram(int device) { return dram_bytes_per_second(device) > kFastDram; }

// Two slices a thread keep half the bytes of four in flight, too few for a fast_dram device. There
// gated rows of whole pairs up to 96 slices (512 columns) take the lean forward, and the staged
// forward's narrow gated segments four slices a thread (staged_plan). One H200 (the attributes give
// 4.81 TB/s; copy 4.22), % of copy, direct timing, Mamba-2's gated RMSNorm (bf16 x and z, float32
// weight, 32768 rows), two slices in blocks of 128 / four in blocks of 128 / four in 256
// (torch.compile): 74.8-75.8 / 78.4-79.8 / 77.3-77.5 at 512 columns (88.5-88.6), 79.3-80.4 /
// 89.3-89.9 / 88.4-88.5 at 1024 (95.1-95.2), the gate after 77.6-79.1 / 87.9-89.6 / 86.1-86.3
// (93.2-93.3), 8192 columns in groups of 1024 85.6-86.7 / 102.2-103.7 / 99.5-99.6 (62.4-62.5); the
// lean forward at 512 88.2-88.3, the gate after 88.3-88.4 (staged 74.6-74.9 / 78.6-78.8). The H100
// (3.35 TB/s) keeps the plans above.
bool spread_gated_pairs(int device) { return !fast_dram(device); }

// Whether two slices a lane fill a power-of-two count of lanes: none idle.
bool whole_pairs(int nslices) {
  return nslices % 2 == 0 && pow2_at_least(nslices / 2) == nslices / 2;
}

// The lean forward's slices a lane (norm_plan.h) for a lean call, or 0 where it does not take it: 1
// up to kFastFwdSlices slices; for gated 16-bit rows 2 or 3 up to three times that, and past
// kFastDram the plain gated call in one group 4 up to four times that (the last items below); for
// 16-bit rows without a gate, 2 up to twice that and 4 up to four times that for the prenorm call,
// beside a float32 stream, and without a residual up to the plain forward's kPlainMinSlices
// (plain_plan); the norm alone and the rows beside a float32 stream take 3 instead where that
// leaves fewer lanes idle (264-384 and 520-768 columns: 16 lanes a segment at 384, none idle,
// against 32 lanes of 2 slices, 16 of them idle for the second). One H100, % of copy, direct timing
// (bf16, float32 weight, 32768 rows), 2 or 4 slices a lane / 3 at one row a lane / 3 at two rows
// (torch.compile): RMSNorm alone 78.2 / 80.8 / 79.6 at 320 columns (90.0, writing no rstd), 78.9 /
// 81.0 / 78.9 at 384 (90.6), 80.2 / 81.9 / 80.4 at 576 (86.1), 82.9 / 84.1 / 82.7 at 640 (87.5),
// 85.6 / 85.8 / 85.4 at 768 (90.0); LayerNorm alone 67.3 / 74.1 / 73.0 (80.7), 72.6 / 75.0 / 75.1
// (83.7), 71.9 / 78.4 / 77.0 (85.8), 77.3 / 81.2 / 80.1 (86.7), 83.0 / 83.9 / 83.4 (88.7);
// LayerNorm beside a float32 stream 85.9 / 86.9 / 86.0 (89.8), 88.4 / 89.9 / 89.4 (92.6), level at
// 576, 93.4 / 93.8 / 93.4 (95.5), 94.6 / 94.9 / 94.6 (96.6); RMSNorm there 0.1-0.5 points up.
// Against what took them before:
// - the prenorm call at 1024 columns, the held forward's two slices a thread in one warp / four:
//   95.2-95.6 / 95.8-96.4 (torch.compile 96.5-96.6), on 2640 rows, whose bytes stay in L2,
//   85.3-85.4 / 96.1 (compile 88.0); one H200: 640 columns 86.0-86.2 / 88.7-88.8 (the weight not
//   yet fetched early; compile 90.7), 768 89.2-89.4 / 90.3 (92.7), at 1024 with it 92.7-93.1 /
//   92.5-92.6 (compile 94.4-94.6).
// - the norm alone, held / lean (the held forward one warp a row; compile in the same runs):
//   RMSNorm 55.2 / 77.2-78.2 at 320 columns, 64.0 / 79.1-79.8 at 384 (89.7), 80.4 / 78.9-80.1 at
//   512, 73.5 / 83.7-84.2 at 640, 83.4 / 85.5-86.1 at 768 (89.8), the plain forward / lean at 1024
//   88.6 / 88.4; LayerNorm 51.6 / 68.3-68.6, 59.7 / 73.5-73.7 (83.3), 74.7 / 77.4-78.1, 62.1 /
//   76.7-76.8, 72.6 / 82.8-84.0 (88.3), at 1024 87.0 / 86.1. Since norm_fwd_alone_kernel, one
//   H200, bf16, float32 weight, the plain forward / lean at 1024 (the C harness: 16896 rows
//   issued alone, 32768 back to back, 65536 past the L2): RMSNorm 74.2-75.1 / 84.8, 87.7-87.8 /
//   88.0, 94.0-94.1 / 92.3; LayerNorm 70.7-71.6 / 80.2, 83.5-83.7 / 84.8, 90.6 / 90.2;
//   direct.py on 32768 rows RMSNorm 88.1-88.2 / 88.1-88.3, LayerNorm 83.7-83.8 / 85.1-85.3
//   (torch.compile 90.7, 87.8).
// - LayerNorm beside a float32 stream, held / lean: 86.2 / 86.4 at 320 columns, 88.2 / 88.9 at 384
//   (compile 91.8), 91.3 / 92.6 at 512, 93.5 / 94.0 at 640, 94.5 / 95.0 at 768 (96.9), 94.6 / 95.6
//   at 1024.
// - gated 16-bit rows, the gate first (Mamba-2's), up to 3 * kFastFwdSlices slices but for the
//   staged forward's whole pairs (512 columns; staged_plan) where spread_gated_pairs: 2 or 3 slices
//   a lane as for the others, the gate's order compiled in and the weight fetched late (72-80
//   registers; held to 64 by launch bounds they spilled and lost up to 11 points). One H100,
//   direct, Mamba-2's gated RMSNorm, staged / lean (torch.compile): 78.1-79.1 / 78.7-79.3 at 320
//   columns (80.3), 81.7-81.8 / 81.4-81.9 at 384 (85.4), 80.8-81.5 / 83.4-83.6 at 448 (88.2),
//   86.9-87.4 / 85.0-85.8 at 512 (90.1), 86.7-86.8 / 87.4-87.5 at 576 (92.5), 88.5-88.7 / 88.2-88.8
//   at 640 (93.4), 90.0-90.1 / 91.0-91.1 at 768 (93.9), 94.7 / 92.9-93.6 at 1024 at four (95.8).
//   Before the gate's order was compiled in (silu(z) kept in float32 beside s silu(z), 125-160
//   registers) they lost: 80.8 / 76.7-77.2 at 384, 87.2 / 67.6 at 640 at four.
// - gated 16-bit rows, the gate after the norm (y = norm(s) silu(z)), the same slices: staged /
//   lean (torch.compile), one H100, direct: 76.9-77.2 / 77.5-77.6 at 320 columns (69.7), 79.3-79.5
//   / 81.5-81.9 at 384 (77.1), 80.2-80.7 / 82.5-82.9 at 448 (82.4), 84.5-84.6 / 86.5-86.7 at 576
//   (85.4), 87.5-87.7 / 87.5-88.3 at 640 (89.3), 89.5-89.6 / 90.7-91.0 at 768 (93.7).
// - the plain gated call in one group at 97-128 slices (776-1024 columns) past kFastDram: four
//   slices a lane, the weight fetched early, against the staged forward's four slices a thread.
//   One H200, direct, Mamba-2's gated RMSNorm (the gate first unless said), staged / lean
//   (torch.compile): 83.8-84.1 / 91.3-91.7 at 896 columns (93.3), 85.6-86.1 / 92.2-92.4 at 968
//   (94.0), 90.0-90.3 / 92.9-93.3 at 1024 (95.1), the gate after 89.4-89.7 / 92.7-93.0 (93.3);
//   8192 columns in groups of 1024 lost (102.9-103.0 / 97.7-97.8), so groups keep the staged
//   forward.
// - not taken: 16-bit rows beside a residual of their dtype at four outside the prenorm call (level
//   in the residual kernel: 95.1-95.6 / 95.1-95.3 at 1024).
int lean_fwd_slices(const NormArgs& a, LeanDtypes d, int device) {
  const int nslices = slices_of(a);
  if (!d.ok) return 0;
  if (nslices <= kFastFwdSlices) return 1;
  if (Dtype(d.dt) == Dtype::F32) return 0;
  auto slots = [&](int k) { return k * pow2_at_least(ceil_div(nslices, k)); };
  if (a.z.present()) {
    const bool spread = spread_gated_pairs(device);
    if (nslices > 3 * kFastFwdSlices)
      return !spread && nslices <= 4 * kFastFwdSlices && a.ngroups == 1 && plain_gated_call(a)
                 ? 4
                 : 0;
    if (whole_pairs(nslices) && spread) return 0;
    return nslices > 2 * kFastFwdSlices || slots(3) < slots(2) ? 3 : 2;
  }
  const bool alone = !a.residual.present() && !a.residual_out.present();
  const bool four = d.rt != d.dt || (alone ? nslices <= kPlainMinSlices : prenorm_call(a, d));
  const int K = nslices <= 2 * kFastFwdSlices ? 2
                : four && nslices <= 4 * kFastFwdSlices ? 4 : 0;
  // Three slices a lane where they leave fewer lanes idle (the kernels of the norm alone and of
  // a float32 stream take them), but not in place of two in norm_fwd_stream_kernel, whose whole
  // warps gained on three in 16-lane segments (norm_fwd_fast_kernel). One H200, % of copy,
  // direct timing (bf16 x, float32 stream and weight, 32768 rows), three / two, warm then each
  // call issued alone: LayerNorm 85.4 / 86.9 and 84.5 / 84.8 at 384 columns, 82.3 / 83.7 and
  // 81.2 / 81.0 at 320; RMSNorm 87.5 / 88.9 and 86.5 / 87.1, 85.2 / 86.1 and 83.5 / 83.8.
  const bool stream_two = d.rt != d.dt && K == 2 && lean_weight_takes(a, Dtype(d.dt));
  const bool three = (alone || d.rt != d.dt) && !stream_two && K > 0 &&
                     nslices <= 3 * kFastFwdSlices && slots(3) < slots(K);
  return three ? 3 : K;
}

// The lean forward kernel (FastFwdInputs, norm_plan.h) for a lean call of `threads` lanes a
// segment. A gate comes with one dtype (fwd_lean_dtypes). Beside a float32 stream the prenorm
// kernel lost (one H200, % of copy, direct timing, bf16 RMSNorm at 256 columns: 81.2-81.5 in the
// residual kernel, 79.2-79.3 in the prenorm one at two rows a lane).
FastFwdInputs fast_fwd_inputs(const NormArgs& a, LeanDtypes d, int threads) {
  if (a.z.present()) return a.norm_before_gate ? kFwdGateAfter : kFwdGateFirst;
  const bool in = a.residual.present(), out = a.residual_out.present();
  if (d.dt != d.rt) return kFwdResidual;
  if (!in && !out) return kFwdAlone;
  return threads == 32 && prenorm_call(a, d) ? kFwdPrenorm : kFwdResidual;
}

// How many times what the device's L2 holds `tensors` tensors of x's shape and dtype take.
double l2_share(const NormArgs& a, int device, int tensors) {
  return double(tensors * a.rows * a.hidden * (slice_bytes(a.x.dtype) / kSlice)) /
         double(l2_cache_bytes(device));
}

// Whether x and y are more than the device's L2 holds. Then they do not stay there from one call
// to the next, and the norm alone's forwards fetch x ahead of the rows they take.
bool outgrows_l2(const NormArgs& a, int device) { return l2_share(a, device, 2) > 1; }

// How the lean forward fetches its inputs (norm_plan.h): x (and the residual) ahead into L2 for
// the prenorm kernel always, for the norm alone of 16-bit rows past the L2 (and x not allocated
// in L1 there, on a device past kFastDram only up to kAloneNoL1To L2s and from kAloneNoL1From:
// launch_norm_fwd_fast says what that bought on an H100). The plain gated call's x and z
// not allocated in L1 where x, z and y together are more than kGatedNoL1From and at most
// kGatedNoL1To times the L2's bytes. One H200 (60 MB of L2), % of copy, direct timing, bf16 x and
// z, float32 weight, rows sized to those bytes, allocated / not, at 0.7 / 0.85 / 1.0 / 1.15 / 1.3 /
// 1.6 / 1.9 times the L2: the gate first at 256 columns 105.1 / 84.7, 95.1 / 89.2, 87.6 / 93.6,
// 87.7 / 95.6, 88.8 / 97.3, 89.8 / 93.7, 91.9 / 89.5; at 512 105.7 / 80.9, 93.1 / 86.1, 84.0 /
// 91.0, 85.5 / 92.4, 86.5 / 95.0, 87.7 / 91.5, 90.1 / 84.9; at 768 103.0 / 83.1, 93.1 / 87.8, 86.5
// / 91.3, 86.0 / 94.8, 87.6 / 95.6, 88.9 / 94.3, 91.1 / 88.8; at 1024 91.2 / 78.5, 83.8 / 83.8,
// 80.5 / 87.3, 82.0 / 89.8, 83.8 / 92.5, 86.3 / 88.2, 88.9 / 83.0; the gate after at 768 101.8 /
// 83.6, 91.4 / 88.9, 85.2 / 92.1, 86.3 / 95.0, 87.6 / 96.9, 90.0 / 93.2, 92.0 / 87.6 (512 alike).
// Below the window, loaded through L1, the call's bytes stayed in L2 from one call to the next
// (past 100% of copy; torch.compile at 768 columns on 8448 rows: 99.4, ours 81.1 / 101.7). One H100
// (50 MB), the window's first measurements, 32768 rows, allocated / not, the gate first:
// 96.8 / 103.9-104.2 at 256 columns, 86.0 / 104.2-104.5 at 320, 86.7-86.9 / 103.9-104.1 at 384,
// 87.5-87.6 / 93.8-94.1 at 448 (torch.compile 87.4-87.9, 88.2, 88.1-88.2, 89.7-89.8); the gate
// after: 93.2-93.7 / 104.5-104.6, 85.1 / 105.1-105.3, 87.2 / 104.5-104.8, 86.0-86.1 / 90.4-90.5;
// on 16384 rows (the gate first) 85.3-85.6 / 104.6-104.7 at 640 and 86.9-87.1 / 105.2-105.3 at
// 768. Past twice the L2 it lost: 89.9-90.0 / 88.9-89.1 at 576, 91.6-91.7 / 91.4-91.6 at 640,
// 93.3 / 92.4-92.5 at 768; the gate after 89.0-89.1 / 88.8-88.9, 90.9-91.0 / 89.6-89.7, 92.9-93.0 /
// 92.3-92.4; on 65536 rows 93.4-93.5 / 93.4 at 384, 94.2-94.3 / 93.7-93.8 at 448, 96.1 / 94.6 at
// 576, 97.8 / 96.4 at 768. Fetching x and z 4 MB ahead into L2 as well lost: 100.5-100.8 at 384,
// 90.3-90.4 at 448 (1 MB: 90.5-90.7 at 384, in the kernel that reads the options at run time).
// Past twice the L2 the plain gated call fetches x and z ahead into L2, and at three slices a lane
// holds fewer CTAs an SM (kGatedAheadBytes, norm_plan.h). One H100, % of copy, direct timing,
// bf16, float32 weight, the gate first unless said; on 32768 rows, none / 2 MB ahead and 5 CTAs
// an SM (torch.compile): 89.7-89.9 / 93.1-93.2 (93.9-94.0) at 576 columns, 91.5 / 94.3-94.4
// (94.8-94.9) at 640, 93.8 / 95.3 (96.1) at 768; the gate after 92.7-92.8 / 93.5 (87.1-87.2),
// 93.7 / 94.4 (90.8-90.9), 94.5-94.6 / 95.2 (95.4-95.5). On 65536 rows 96.1 / 98.4 (98.7) at 576,
// 98.1 / 99.0-99.2 (99.2) at 768. In experiment builds (whose own figures ran 0.5-1.5 below the
// library's), against 2 MB ahead alone: 2 MB ahead gained 1.1-2.1 at 576-768, 5 CTAs a further
// 0.3-1.8, 4 and 6 CTAs ran with 5; 4 MB lost 2-5 points to 2 and 8 MB lost 9-12, 1 MB gained
// less. At two slices a lane, where 6 CTAs fit an SM (5 lost 0.1-0.9), 65536 rows, none / 2 MB:
// 91.3-91.4 / 93.7 (90.7-90.8) at 320 columns, 93.8-93.9 / 94.8-94.9 (95.4) at 384, but past
// 48 slices 93.3-93.4 / 91.9 (94.5) at 416, 93.9-94.0 / 92.5 (95.9) at 448, 94.4 / 92.9-93.0
// (95.4-95.5) at 480, where 4 MB did no better; so not there. At one slice a lane it lost too
// (131072 rows of 256 columns, none / 4 MB with 5 CTAs: 95.7-95.8 / 94.3, compile 97.1-97.2).
//
// Past kFastDram (one H200), the prenorm call past the L2 (its four tensors) fetches x and the
// residual kPrenormFarAheadBytes ahead (up to kPrenormMidSlices slices, and between the two within
// kPrenormBetweenL2s L2s of those tensors) and caps its CTAs at kPrenormCtasPerSm an SM past
// kPrenormCappedPast, and between the two past kPrenormBetweenL2s L2s keeps the H100's plan; where
// it loads them without allocating them in L1 the window below says; the plain gated call at three
// slices a lane neither fetches ahead nor caps its CTAs. % of copy, direct timing, bf16, float32
// weight, 32768 rows; RMSNorm + residual, allocated / not, 1 MB ahead (torch.compile): 81.0 /
// 92.4-93.0 at 256 columns (86.7), 82.2 / 87.8 at 320 (84.2), 84.6 / 85.8 at 384 (87.2), but 86.7 /
// 85.6 at 448, 87.4-87.7 / 85.8 at 512; x alone not allocated 88.2 at 256 and level or lost from
// 320. Within the L2 it lost (109.4 / 78.7 at 128 columns, compile 118.5). Then 2 MB ahead, two
// processes, 1 MB and not allocated up to 48 slices / not allocated, 2 MB / the same capped at 5
// CTAs / allocated, 2 MB, 5 CTAs (torch.compile): 93.4 / 94.8-95.5 at 256; 85.4-86.1 / 88.3-90.3 /
// 89.4-89.5 / 85.3-85.7 at 384 (87.4-87.8); 86.5-86.9 / 88.1-88.5 / 88.8-89.3 / 87.5-87.6 at 448
// (88.4-88.7); 88.1-88.8 / 88.5-88.9 / 89.3-89.7 / 89.1-89.4 at 512 (89.7-90.2); 88.9-89.0 /
// 89.4-89.5 / 89.2-89.3 / 90.9-91.1 at 576 (89.9-90.0); allocated, 1 MB / 2 MB, 5 CTAs: 90.5-90.7 /
// 91.4-92.1 at 640 (91.1-92.1), 92.1-92.7 / 93.5-93.8 at 768 (93.5), 93.8-93.9 / 94.6 at 896
// (94.3-94.4), 93.7-93.9 / 94.8-94.9 at 1024 (95.5-95.7). 4 and 6 CTAs ran with 5 or lower (6 do
// not fit from three slices a lane), 1.5 MB and 3 MB lost up to 1 point to 2 MB at 384-896 (3 MB:
// 95.3 at 1024), blocks of 64 threads 89.0-90.0 at 384-512. On more rows, the H100's plan / not
// allocated, 2 MB, and 5 CTAs at 512 / allocated, 2 MB, 5 CTAs at 768 (compile): 65536 rows 89.0 /
// 91.1 at 384 (94.9), 94.0 / 92.8 at 512 (95.7), 96.5 / 97.6 at 768 (96.8); 131072 rows 92.3 / 94.5
// (97.5), 96.9 / 95.1 (97.7), 98.6 / 99.5 (99.2): so 49-64 slices keep the H100's plan, which on
// 32768 rows gave up 0.5-2.8 points. Since one row a lane there (fast_fwd_rows, norm_plan.h), the
// H100's plan / 2 MB ahead, not in L1, one H200, direct timing: on 16384 rows 82.0-82.3 / 91.9-92.0
// at 512 (compile 83.7-83.8), level at 448 and 480; on 32768 rows 89.4-89.6 / 89.7-90.0 at 512,
// 87.4-87.5 / 88.0-88.4 at 480, 87.4-87.6 / 89.5-89.7 at 448 (compile 90.6-90.7 at 512, 88.7-89.1
// at 448); on 36864 rows 90.0-90.1 / 89.7-89.8, 88.2-88.4 / 87.8-88.2, 88.6-88.8 / 89.7-89.9; on
// 65536 rows (past three L2s) 94.7-94.9 / 93.1-93.2 at 512, where nothing ahead gave 94.1-94.2, 0.5
// MB 94.3 and 2 MB ahead capped at 5 CTAs 95.2-95.4 (compile 95.2-95.3). The plain gated call, 2 MB
// ahead and 5 CTAs an SM / neither: 83.6 / 83.9 at 576 columns (82.6), 87.5 / 87.5-87.8 at 640
// (88.5), 86.5 / 88.7 at 704 (92.5), 88.4-88.8 / 90.3-90.6 at 768 (95.0-95.5); the gate after 81.2
// / 84.3 at 576 (74.8), 86.6 / 87.3 at 640 (80.3), 88.9-89.1 / 90.6-90.7 at 768 (91.7). Neither the
// cap alone (83.3 at 768) nor fetching ahead alone (87.9) did as well.
constexpr int64_t kPrenormFarAheadBytes = int64_t(2) << 20;
constexpr int kPrenormMidSlices = 48, kPrenormCappedPast = 64, kPrenormCtasPerSm = 5;
constexpr int kPrenormBetweenL2s = 3;
// Past kFastDram the prenorm call and the norm alone load their inputs without L1 allocation in a
// window of footprints too (l2_share: x, residual, y and residual_out; x and y): the prenorm call's
// more than kPrenormNoL1From and at most kPrenormNoL1To L2s (at most kPrenormNarrowNoL1To up to 32
// slices), the norm alone's more than kAloneNoL1From and at most kAloneNoL1To. One H200, % of copy,
// direct timing, bf16, float32 weight, rows sized to the share, allocated / not, with the fetch
// ahead as above. RMSNorm + residual at 256 columns, 0.75 / 0.8 / 0.85 / 0.9 / 0.95 / 1.1 / 1.5 /
// 1.6 / 1.8 / 2.0 / 2.3 / 3.0 L2s: 100.4 / 100.3, 96.2 / 99.3, 94.6 / 100.5, 89.1 / 98.5, 85.7 /
// 96.3, 83.1 / 97.1, 85.1 / 88.7, 85.9 / 87.4, 88.2 / 87.5, 88.4 / 86.8, 91.1 / 88.3, 92.7 / 90.1
// (torch.compile 89.6 at 0.8, 86.5 at 0.9, 94.1 at 3.0); at 512, 0.75 / 0.8 / 0.85 / 0.9 / 1.1 /
// 2.0 / 2.3 / 2.6 / 3.0: 100.1 / 97.2, 95.5 / 95.9, 91.2 / 95.9, 87.7 / 96.3, 83.7 / 94.0, 90.4 /
// 92.1, 92.2 / 93.0, 93.4 / 92.9, 95.4 / 94.1 (compile 90.6 at 0.8, 84.6 at 0.9, 85.4 at 1.1); at
// 1024, 0.75 / 0.8 / 0.9 / 1.1 / 1.4 / 1.8 / 2.0 / 2.3 / 3.0: 101.8 / 100.4, 96.1 / 97.8, 88.0 /
// 96.9, 83.4 / 95.6, 84.6 / 91.6, 90.1 / 91.1, 90.0 / 90.8, 92.5 / 91.4, 94.6 / 92.5 (compile 86.1
// at 0.8, 82.8 at 0.9, 85.3 at 1.4); at 768, 1.1 / 1.8: 84.4 / 92.8, 90.2 / 92.5. At 5.0 L2s, 256 /
// 384 / 512 columns: 96.9 / 93.2, 98.4 / 96.4, 98.2 / 95.4 (compile 98.0 at 256). RMSNorm alone at
// 384 columns, 0.8 / 0.9 / 0.95 / 1.1 / 2.3 / 2.6 / 3.0 / 4.0: 97.7 / 86.4, 88.4 / 86.9, 82.0 /
// 87.9, 78.4 / 90.0, 90.2 / 91.3, 90.8 / 91.2, 93.3 / 92.4, 94.8 / 93.9 (compile 85.2 at 0.85, 97.2
// at 4.0); at 768: 102.8 / 88.3, 95.3 / 92.9, 90.5 / 90.5, 83.5 / 93.5, 93.0 / 93.0, 93.1 / 92.8,
// 95.5 / 94.5, 96.6 / 95.1 (compile 97.3 at 4.0). LayerNorm alone at 384: 78.9 / 78.4, 77.0 / 81.5,
// 72.7 / 80.8, 74.3 / 83.8, 87.8 / 88.8, 88.2 / 88.5, 90.9 / 91.1, 93.5 / 92.4 (compile 92.9 at
// 4.0); at 768: 91.5 / 83.9, 84.6 / 86.7, 81.2 / 85.3, 82.7 / 89.7, 92.8 / 92.9, 93.1 / 92.6, 95.2
// / 94.4, 96.5 / 95.1 (compile 95.8). Past kPrenormNarrowNoL1To the prenorm call up to 32 slices
// holds kPrenormCtasPerSm CTAs an SM: allocated in L1, uncapped / 5 CTAs, at 256 columns 91.5 /
// 93.2 at 2.5 L2s, 95.1 / 95.9 at 3.5 (compile 96.3), 96.6 / 98.4 at 5, 99.1 / 100.3 at 8 (compile
// 99.7); at 192 columns 88.7 / 90.3 at 2, 94.9 / 95.6 at 3.5 (compile 95.9), 99.6 / 100.0 at 8.
// From 320 columns 5 or 6 CTAs moved -0.7 to +0.8 at 2.5-8 L2s.
constexpr double kGatedNoL1From = 0.9, kGatedNoL1To = 1.75;
constexpr double kPrenormNoL1From = 0.78, kPrenormNoL1To = 2.25, kPrenormNarrowNoL1To = 1.75;
constexpr double kAloneNoL1From = 0.9, kAloneNoL1To = 2.5;
LeanFwdFetch lean_fwd_fetch(const NormArgs& a, FastFwdInputs inputs, int slices, int device) {
  LeanFwdFetch f;
  if (inputs == kFwdPrenorm) {
    f.ahead_bytes = kPrenormAheadBytes;
    // The H100's plan is the fetch above and nothing else.
    if (!fast_dram(device)) return f;
    const int n = slices_of(a);
    const double l2s = l2_share(a, device, 4);
    const bool between = n > kPrenormMidSlices && n <= kPrenormCappedPast;
    if (l2s > 1 && (!between || l2s <= kPrenormBetweenL2s)) {
      f.ahead_bytes = kPrenormFarAheadBytes;
      f.ctas_per_sm = n > kPrenormCappedPast ? kPrenormCtasPerSm : 0;
    }
    const bool narrow = n <= kFastFwdSlices;  // one slice a lane
    const double no_l1_to = narrow ? kPrenormNarrowNoL1To : kPrenormNoL1To;
    f.no_l1 = l2s > kPrenormNoL1From && l2s <= no_l1_to;
    if (narrow && l2s > no_l1_to) f.ctas_per_sm = kPrenormCtasPerSm;
    return f;
  }
  if (inputs == kFwdAlone && a.x.dtype != Dtype::F32) {
    const double l2s = l2_share(a, device, 2);
    if (l2s > 1) f.ahead_bytes = kAloneAheadBytes;
    f.no_l1 = fast_dram(device) ? l2s > kAloneNoL1From && l2s <= kAloneNoL1To : l2s > 1;
  }
  if (plain_gated_call(a)) {
    const double l2s = l2_share(a, device, 3);
    f.no_l1 = l2s > kGatedNoL1From && l2s <= kGatedNoL1To;
    if (l2s > 2 && ((slices == 3 && !fast_dram(device)) || (slices == 2 && slices_of(a) <= 48))) {
      f.ahead_bytes = kGatedAheadBytes;
      f.ctas_per_sm = slices == 3 ? kGatedCtasPerSm : 0;
    }
  }
  return f;
}

// The held forward's plan (norm_plan.h) for a lean call without a gate: the slices a thread
// holds in a plain CTA, or 0 where it takes clusters (or, for a segment that one CTA's stage
// holds, the staged forward). One H200, % of copy, direct timing, the staged forward or the
// clusters against the plain CTA chosen:
// - up to 8192 16-bit columns, 2 slices a thread: LayerNorm, bf16 beside a float32 stream, 83 /
//   85 at 512 columns, 86 / 90 at 1024, 92 / 94 at 2048, 94 / 96 at 4096, 92 / 95 at 8192;
//   RMSNorm 89 / 92 to 94 / 97; bf16 beside bf16, LayerNorm 74 / 89 at 1024 to 85 / 95 at 8192,
//   RMSNorm 52 / 61 at 264 columns, 82-96 / 83-96 from 512 to 4096; float32 LayerNorm 89 / 96
//   at 8192.
// - the exceptions to that: RMSNorm of 16-bit rows beside a residual of their dtype keeps the
//   staged forward from 4097 to 8192 columns (96.7 / 95.8; float16 95.6 / 94.8), but for the
//   prenorm call on a device past kFastDram (below); 16-bit rows
//   without a residual take 4 slices a thread from 1024 columns (70 / 80 at 1024, 77 / 91 at
//   4096, 71 / 89 at 8192; LayerNorm 56 / 77), a float32 RMSNorm from 2048 (88 / 95 at 2048,
//   96 / 97 at 8192; without a residual 76 / 92 at 8192, where 2 slices a thread gave 81).
// - past 8192 16-bit columns while one stage holds the row, 16-bit rows beside a residual of
//   their dtype, 4 slices a thread: LayerNorm 88 / 92 at 12288 columns, 85 / 92 at 16384,
//   RMSNorm 94.4 / 95. Without a residual or beside a float32 stream the staged forward kept
//   those (RMSNorm at 16384: 88 / 83, 90 / 88).
// - past one stage, an RMSNorm of 16-bit rows beside a stream of their dtype up to 1024 threads
//   of 4 slices (32768 columns), against a cluster of two: 93-95 / 91-93 at 32768, 92 / 83 at
//   20000, 93 / 88 at 24576. Not for the others, one CTA an SM idling while it reduces: a
//   LayerNorm's two reductions lost (80 / 84, bf16 at 32768), and so did float32 rows (96 / 97
//   at 16384) and 16-bit ones beside a float32 stream (the registers spill). 3 slices a thread
//   where 1024 threads hold them (to 24576 columns): fewer threads idle (24576 columns fill all
//   1024, 768 of them busy at 4), 50 registers against 60. bf16, float32 weight, 2^27 elements, 4
//   / 3 slices (compile): 90.3 / 91.0 (91.5) at 16400 columns, 94.9 / 96.3 (95.4) at 20480, 98.6
//   / 99.0 (95.8) at 24576; on a quarter of those rows 84.0 / 84.8 (86.0), 89.3 / 89.0 (89.8),
//   90.7 / 90.6 (89.2).
// - the prenorm RMSNorm of 16-bit rows from 4097 to 8192 columns on a device past kFastDram, 2
//   slices a thread with held_fwd_fetch's plan against the staged forward: one H200, bf16, float32
//   weight, 2^27 elements (the sweep's rows): 99.3 / 83.0 at 4160 columns (torch.compile 96.1),
//   99.8 / 87.8 at 4608 (97.9), 99.4 / 91.1 at 5120 (98.0), 100.5 / 94.3 at 5632 (97.6), 100.4 /
//   96.9 at 6144 (98.6), 99.7 / 99.4 at 7168 (98.9), 98.4 / 99.1 at 8192 (97.0); at 0.6-2.5 L2s
//   of its tensors 84-103 / 70-85 (compile 74-93).
// kHeldWideSlices: past it (4096 16-bit columns) such an RMSNorm is the staged forward's, but for
// that prenorm call.
constexpr int kHeldWideSlices = 512;
int plain_held_slices(const NormArgs& a, LeanDtypes d, int device) {
  const int nslices = slices_of(a);
  const bool f32 = Dtype(d.dt) == Dtype::F32, same16 = !f32 && d.rt == d.dt;
  const bool residual = a.residual.present();
  if (!one_stage_fits(a, d)) {
    if (a.layer_norm || !same16) return 0;
    return nslices <= 3 * kHeldMaxThreads ? 3 : nslices <= 4 * kHeldMaxThreads ? 4 : 0;
  }
  if (nslices > 2 * kNormMaxThreads)
    return same16 && residual && nslices <= 4 * kNormMaxThreads ? 4 : 0;
  if (same16 && !residual) return nslices >= 128 ? 4 : 2;
  if (same16 && !a.layer_norm && nslices > kHeldWideSlices)
    return prenorm_call(a, d) && fast_dram(device) ? 2 : 0;
  if (f32 && !a.layer_norm && nslices >= 256) return 4;
  return 2;
}

// How the held forward's plain CTA moves the rows of a prenorm call of 16-bit rows on a device
// past kFastDram (HeldFwdFetch, norm_plan.h). At 3 or 4 slices a thread (8193-32768 columns)
// only past kHeldFetchTo L2s: y and residual_out stored without L1 allocation and the rows
// kHeldAheadBytes of x ahead fetched into L2 (the last list below). At 2 slices (1025-8192
// columns), by the share of the L2 that x, the residual, y and residual_out take (l2_share): up
// to kHeldFetchTo L2s y and residual_out are stored without L1 allocation, and past
// kHeldFetchFrom x and the residual are loaded so too and the rows kHeldAheadBytes of x ahead are
// fetched into L2; past kHeldFetchTo all three only past kHeldWideSlices where at most
// kHeldBusyFetch of the CTA's threads hold a slice (the power of two of threads leaves the rest
// idle, and the fetch ahead makes up for the bytes they do not keep in flight). Up to
// kHeldFetchTo the CTA is whole warps rather than held_plan's power of two (the list before the
// last). One H200, % of copy, direct timing, bf16, float32 weight, 2 slices a thread in a CTA of
// a power of two, none / stores / stores and loads / all three (compile):
// - 2048 columns at 0.6 / 0.75 / 0.85 / 0.9 / 1.0 / 1.2 / 1.5 / 2.0 / 2.3 / 3.0 L2s: 97.1 / 103.2
//   / 76.2 / 84.5 (95.5), 84.8 / 106.3 / 79.4 / 92.1 (92.0), 79.6 / 100.2 / 84.1 / 94.3 (89.8),
//   77.3 / 93.1 / 87.3 / 92.3 (89.6), 77.9 / 84.8 / 87.8 / 91.5 (89.9), 80.7 / 81.5 / 86.6 /
//   90.0 (86.1), 84.2 / 83.8 / 84.9 / 90.2 (83.2), 88.3 / 87.4 / 88.7 / 90.5 (85.6), 90.1 / 89.8
//   / 89.5 / 90.8 (86.9), 92.2 / 92.1 / 92.1 / 92.4 (88.8);
// - 4096 columns, the same shares: 88.9 / 94.9 / 76.9 / 83.3 (84.8), 85.2 / 104.7 / 80.6 / 91.5
//   (89.7), 78.5 / 95.8 / 86.1 / 94.7 (88.1), 76.9 / 91.7 / 86.0 / 94.0 (85.9), 77.2 / 85.2 /
//   87.5 / 91.3 (89.9), 80.5 / 80.8 / 84.8 / 90.8 (84.7), 83.1 / 82.7 / 83.4 / 89.3 (82.6), 86.9 /
//   86.1 / 86.9 / 89.5 (86.0), 88.4 / 87.6 / 87.9 / 89.5 (86.9), 91.0 / 90.0 / 89.8 / 90.8 (90.2);
//   1536 and 3072 columns alike. Below one L2 the stores' bytes stay in L2 from one call to the
//   next; loads not allocated in L1 lost there (and without the fetch ahead everywhere);
// - from 5120 to 8192 columns (held_plan's rows past the staged forward's, above) alike: at 5120,
//   6144 and 8192, 0.6 / 0.75 / 1.0 / 1.2 / 2.0 L2s, none / stores / all three (compile): 84.1 /
//   89.0 / 79.3 (89.9), 78.2 / 93.6 / 83.8 (89.8), 75.3 / 79.2 / 84.6 (89.3), 77.1 / 75.9 / 85.1
//   (73.9), 85.0 / 83.4 / 87.7 (86.2); 92.9 / 98.1 / 85.1 (91.4), 79.2 / 96.0 / 86.1 (92.8), 77.1
//   / 80.9 / 89.1 (84.2), 77.9 / 76.8 / 86.1 (81.9), 85.7 / 85.5 / 86.6 (86.7); 89.0 / 94.5 / 81.2
//   (73.8), 83.8 / 102.7 / 87.2 (82.3), 74.9 / 80.4 / 87.5 (86.5), 78.2 / 77.9 / 87.3 (82.8), 85.0
//   / 84.0 / 86.6 (84.1);
// - past kHeldFetchTo, 2^27 elements, none / all three: 93.2 / 99.3 at 4160 columns (260 of 512
//   threads busy), 97.1 / 99.8 at 4608 (288), 99.4 / 99.1 at 5120 (320), 100.5 / 99.0 at 5632,
//   100.4 / 98.4 at 6144, 98.4 / 96.6 at 8192; narrower rows with threads idle lost or moved
//   little: 92.3 / 92.1 at 1040 columns (65 of 128 busy), 93.6 / 90.7 at 1160 (73), 93.7 / 96.1
//   at 2080 (130 of 256), 97.9 / 97.4 at 2304 (144);
// - up to kHeldFetchTo, the fetch plan above, a power of two / whole warps (compile), at 0.5 /
//   0.75 / 1.0 / 1.5 / 2.5 L2s, both reading the same tensors: 1040 columns (128 threads against
//   96) 83.1 / 87.3 (86.8), 87.6 / 94.6 (83.4), 87.1 / 89.2 (78.0), 87.4 / 87.1 (76.1), 87.7 /
//   87.4 (79.6); 1536 (128 against 96) 95.4 / 89.7 (107), 102.1 / 104.8 (93.3), 91.7 / 91.3
//   (87.5), 89.7 / 89.5 (83.5), 90.1 / 91.0 (88.6); 2056 (256 against 160) 83.5 / 93.3 (90.7),
//   88.9 / 100.4 (80.2), 85.4 / 89.0 (80.5), 85.8 / 86.4 (77.9), 87.2 / 86.9 (81.8); 4160 (512
//   against 288) 79.8 / 91.1 (92.7), 86.7 / 101.6 (88.6), 84.1 / 91.7 (74.8), 85.9 / 88.8 (82.6),
//   88.9 / 89.0 (87.4); 6144 (512 against 384) 84.8 / 84.0 (99.0), 95.3 / 104.6 (94.5), 88.7 /
//   89.8 (82.7), 87.4 / 88.6 (84.1), 88.0 / 88.9 (88.0). Where the counts match (1800 columns,
//   128 threads) the two ran within 0.3. At 0.5 L2s compile leads from 1536 columns either way;
// - 3 or 4 slices a thread, 2^27 elements, none / stores and 1 MB ahead (compile): 100.4 / 101.0
//   (96.2) at 9216 columns, 98.1 / 100.4 (96.2) at 12288, 97.7 / 99.9 (95.6) at 16384, 97.4 /
//   99.9 (95.7) at 20480, 98.4 / 99.8 (95.1) at 24576, 97.8 / 99.5 (95.0) at 28672, 97.3 / 98.6
//   (94.5) at 32768. Without the fetch the speed moved with where the tensors lay: 90.1 / 99.7
//   (95.3) at 24576 in another process, each call behind a spin (the bench read 0.96x compile
//   there). At 4 L2s 92.6 / 93.3 (89.7) at 9216, 90.4 / 91.2 (90.3) at 16384, 88.8 / 89.9 (87.6)
//   at 24576, 85.9 / 86.8 (82.9) at 32768; at 0.5-2 L2s from -5 (32768 columns on 119 rows) to
//   +2.5. Loading x and the residual without L1 as well lost 2-4 points.
// 16-bit rows beside a float32 stream (residual in and out) load x and the residual, and store y,
// without L1 allocation at more than kStreamFetchFrom and at most kStreamFetchTo L2s (their
// bytes: the stream's elements count twice), and fetch nothing ahead. One H200, % of copy,
// direct timing, bf16, float32 weight and bias, none / y stored not in L1 / + loads / + 1 MB ahead
// (torch.compile), LayerNorm at 2048 columns, 0.5 / 0.7 / 0.9 / 1.1 / 1.4 / 1.8 / 2.5 L2s: 77.8
// / 77.5 / 67.1 / 64.1 (74.1), 71.5 / 74.8 / 68.1 / 61.4 (78.9), 70.9 / 71.0 / 74.7 / 67.1
// (78.6), 71.6 / 71.5 / 75.3 / 67.4 (77.9), 75.5 / 74.7 / 77.0 / 68.3 (75.9), 78.6 / 79.1 / 77.2
// / 71.9 (80.9), 84.3 / 84.0 / 80.9 / 76.2 (84.9); at 4096 columns 0.9 / 1.1 / 1.4: 69.3 / 70.7
// / 73.6 / 69.6 (79.7), 68.7 / 68.0 / 73.9 / 68.2 (79.9), 73.6 / 74.0 / 75.6 / 69.4 (78.3);
// RMSNorm at 2048, 0.9 / 1.1 / 1.4: 75.0 / 75.5 / 78.4 / 71.3 (85.9), 76.2 / 76.3 / 80.8 / 70.9
// (83.6), 79.0 / 78.8 / 80.4 / 71.1 (80.2). Still behind compile there: what holds these back
// is not where the bytes are cached.
// Elsewhere, and on the H100, none of these (not measured there).
constexpr double kHeldFetchFrom = 0.9, kHeldFetchTo = 2.5;
constexpr double kStreamFetchFrom = 0.8, kStreamFetchTo = 1.5;
constexpr double kHeldBusyFetch = 0.6;
constexpr int64_t kHeldAheadBytes = int64_t(1) << 20;
HeldFwdFetch held_fwd_fetch(const NormArgs& a, LeanDtypes d, int slices, int device,
                            NormPlan& p) {
  HeldFwdFetch f;
  if (Dtype(d.dt) == Dtype::F32 || !fast_dram(device) || p.cluster > 1) return f;
  if (prenorm_call(a, d)) {
    const double l2s = l2_share(a, device, 4);
    const int64_t ahead = ceil_div(kHeldAheadBytes, a.hidden * (slice_bytes(a.x.dtype) / kSlice));
    if (slices > 2) {
      f.out_no_l1 = l2s > kHeldFetchTo;
      f.ahead_rows = f.out_no_l1 ? ahead : 0;
      return f;
    }
    const int nslices = slices_of(a);
    const bool idle =
        nslices > kHeldWideSlices && ceil_div(nslices, slices) <= kHeldBusyFetch * p.threads;
    f.out_no_l1 = l2s <= kHeldFetchTo || idle;
    if (l2s <= kHeldFetchTo) p.threads = p.block = whole_warps(nslices, slices);
    if (l2s > kHeldFetchFrom && (l2s <= kHeldFetchTo || idle)) {
      f.no_l1 = true;
      f.ahead_rows = ahead;
    }
  } else if (slices == 2 && Dtype(d.rt) == Dtype::F32 && a.residual.present() &&
             a.residual_out.present()) {
    const double l2s = l2_share(a, device, 6);
    f.no_l1 = f.out_no_l1 = l2s > kStreamFetchFrom && l2s <= kStreamFetchTo;
  }
  return f;
}

// The held forward's plan: one plain CTA of plain_held_slices a thread, else, for a segment
// past one stage, the fewest clustered CTAs that hold it; f: how it moves the rows
// (held_fwd_fetch). Returns the slices a thread holds, or 0 where the staged forward takes the
// call, or more than kMaxCluster CTAs would be needed, or the device runs no clusters.
int held_plan(const NormArgs& a, LeanDtypes d, int device, NormPlan& p, HeldFwdFetch& f) {
  if (a.z.present()) return 0;
  const int nslices = slices_of(a);
  const int plain = plain_held_slices(a, d, device);
  const int K = plain > 0 ? plain : held_slices(Dtype(d.dt));
  const int cluster = plain > 0 ? 1 : int(ceil_div(nslices, K * kNormMaxThreads));
  if (plain == 0 && (one_stage_fits(a, d) || cluster > kMaxCluster || !cluster_kernels_run(device)))
    return 0;
  p = shape_plan(a, K, cluster);
  // shape_plan stops at kNormMaxThreads; a plain CTA of 4 slices a thread takes up to
  // kHeldMaxThreads.
  if (plain > 0) p.threads = pow2_at_least(ceil_div(nslices, K));
  p.block = p.threads;
  p.vec = true;
  p.row_blocks = a.rows;
  f = held_fwd_fetch(a, d, K, device, p);
  return p.row_blocks * a.ngroups * cluster <= INT_MAX ? K : 0;
}

// The plain forward's plan (norm_plan.h): the slices a thread holds, or 0 where the call is not
// one it takes.
int plain_plan(const NormArgs& a, LeanDtypes d, int device, NormPlan& p) {
  const Dtype dt = Dtype(d.dt);
  const int nslices = slices_of(a);
  const bool weight_ok = a.weight.present() &&
                         (a.weight.dtype == Dtype::F32 || a.weight.dtype == dt) &&
                         (!a.bias.present() || a.bias.dtype == a.weight.dtype);
  if (dt == Dtype::F32 || d.rt != d.dt || a.residual.present() || a.residual_out.present() ||
      a.z.present() || a.ngroups != 1 || !weight_ok || nslices < kPlainMinSlices)
    return 0;
  const bool short_ctas = nslices > 2 * kPlainCtaSlices && (a.layer_norm || fast_dram(device));
  const int per_cta = short_ctas ? kPlainShortCtaSlices : kPlainCtaSlices;
  const int cluster = int(ceil_div(nslices, per_cta));
  if (cluster > 1 && (cluster > kMaxCluster || !cluster_kernels_run(device))) return 0;
  if (a.rows > INT_MAX / cluster) return 0;
  const int K = plain_slices(a.layer_norm, int(ceil_div(nslices, cluster)));
  p = shape_plan(a, K, cluster);
  p.threads = whole_warps(p.cta_slices, K);
  p.block = p.threads;
  p.vec = true;
  p.row_blocks = a.rows;
  return K;
}

// The ring forward's CTAs a cluster (norm_plan.h) for a lean call, or 0 where it does not take
// it.
int ring_fwd_plan(const NormArgs& a, LeanDtypes d, int device) {
  const int nslices = slices_of(a);
  const int cluster = ring_fwd_cluster(nslices, Dtype(d.rt));
  const bool residual = a.residual.present() || a.residual_out.present();
  const bool alone = !a.z.present() && !residual && d.rt == d.dt &&
                     nslices >= (a.layer_norm ? kRingLayerMinSlices : kRingRmsMinSlices) &&
                     fast_dram(device);
  const bool gated = a.z.present() && !a.layer_norm && d.rt == d.dt && !residual &&
                     nslices >= kRingGatedMinSlices;
  const bool f32_layer = a.layer_norm && Dtype(d.rt) == Dtype::F32;
  const bool stream = !a.z.present() && a.residual.present() &&
                      nslices >= (f32_layer ? kRingStreamLayerMinSlices : kRingFwdMinSlices);
  return (alone || gated || stream) && Dtype(d.dt) != Dtype::F32 && a.ngroups == 1 &&
                 cluster <= kMaxCluster && a.rows <= INT_MAX / cluster &&
                 cluster_kernels_run(device)
             ? cluster
             : 0;
}

// A ring forward's plan: persistent clusters of `cluster` CTAs, K slices a thread.
NormPlan ring_fwd_shape(const NormArgs& a, int cluster, int K) {
  NormPlan p = shape_plan(a, K, cluster);
  p.block = p.threads;
  p.vec = true;
  p.row_blocks = a.rows;
  return p;
}

// Gated segments the staged forward takes (those lean_fwd_slices leaves) up to 128
// slices (1024 16-bit columns) share blocks of 128 threads, and take two slices a thread where
// that leaves no lane idle (whole_pairs: 512 and 1024 columns) and the device's DRAM lets them
// (spread_gated_pairs). One H100, % of copy, direct
// timing, Mamba-2's gated RMSNorm (bf16 x and z, float32 weight, 32768 rows), four slices a
// thread in blocks of 256 / 128 / two slices in blocks of 128 (torch.compile): 75.9 / 78.4 /
// 65.6 at 320 columns (79.8), 81.3 / 80.7 / 76.3 at 384 (85.5), 82.9 / 83.8 / 86.3 at 512
// (89.4), 90.9 / 90.5 / 87.7 at 768 (94.0), 92.3 / 92.2 / 94.9 at 1024 (95.7). Blocks of 512
// threads lost at every width (72.5 at 320, 91.3 at 1024).
constexpr int kStagedNarrowGatedSlices = 128;

bool staged_plan(const NormArgs& a, LeanDtypes d, int device, NormPlan& p) {
  const int nslices = slices_of(a);
  const int64_t per_slice = staged_slice_bytes(a, Dtype(d.dt), Dtype(d.rt));
  auto fits = [&](int c, int64_t budget) {
    return ceil_div(nslices, c) <= kStagedSlices * kNormMaxThreads &&
           ceil_div(nslices, c) * per_slice <= budget;
  };
  int cluster = 1;
  if (!one_stage_fits(a, d)) {
    for (const int64_t budget : kClusterStageBudgets) {
      for (cluster = 2; cluster <= kMaxCluster && !fits(cluster, budget);) ++cluster;
      if (cluster <= kMaxCluster) break;
    }
  }
  if (cluster > kMaxCluster || (cluster > 1 && !cluster_kernels_run(device))) return false;
  // Without a cluster or a gate, two slices a thread and one segment a block: one H200, % of
  // copy against four slices a thread in blocks of at least 256 threads: 95 / 88 (RMSNorm, bf16
  // with a bf16 residual, 2048 columns), 91 / 85 and 93 / 90 (LayerNorm, bf16 with a float32
  // residual stream, 2048 and 8192 columns), the same at 4096 and 16384. With a gate that lost
  // (78 / 93 at 4096 columns), and so did more threads in the clusters (79 / 84 at 32768).
  const bool gated = a.z.present();
  const bool narrow_gated = gated && nslices <= kStagedNarrowGatedSlices;
  const bool spread =
      cluster == 1 && (!gated || (narrow_gated && whole_pairs(nslices) &&
                                  spread_gated_pairs(device)));
  p = shape_plan(a, spread ? 2 : kStagedSlices, cluster);
  // A cluster exchanges one sum a CTA (cluster_push_sum): one segment a block there too. Gated
  // segments share blocks of at least 256 threads, 128 up to kStagedNarrowGatedSlices.
  p.block = cluster > 1 || (spread && !gated)
                ? p.threads
                : std::max(p.threads, narrow_gated ? 128 : 256);
  p.vec = true;
  p.row_blocks = ceil_div(a.rows, p.block / p.threads);
  return p.row_blocks * a.ngroups * cluster <= INT_MAX;
}

ssm_status norm_fwd_cuda(const NormArgs& a, int device, void* stream) {
  CudaDeviceGuard guard(device);
  if (guard.status() != SSM_SUCCESS) return guard.status();
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (a.rows == 0) return SSM_SUCCESS;
  const int nslices = slices_of(a);
  const int dt = common_row_dtype(a);
  const LeanDtypes lean = fwd_lean_dtypes(a, can_vectorize(a));
  const int sms = std::max(1, multiprocessor_count(device));  // cached after the first call
  const int lean_slices = lean_fwd_slices(a, lean, device);
  NormPlan p = shape_plan(a, std::max(lean_slices, 1));
  if (lean_slices > 0) {
    const FastFwdInputs inputs = fast_fwd_inputs(a, lean, p.threads);
    const LeanFwdFetch fetch = lean_fwd_fetch(a, inputs, lean_slices, device);
    p.block = lean_fwd_block(a, p, inputs, Dtype(lean.dt), Dtype(lean.rt), lean_slices);
    const int rows =
        alone_kernel_takes(a, p, inputs, Dtype(lean.dt)) ? alone_fwd_rows(lean_slices, a.layer_norm)
        : stream_kernel_takes(a, p, inputs, Dtype(lean.dt), Dtype(lean.rt), lean_slices)
            ? stream_fwd_rows(lean_slices, a.layer_norm)
            : fast_fwd_rows(inputs, lean_slices, lean.dt);
    p.row_blocks = ceil_div(a.rows, int64_t(p.block / p.threads) * rows);
    if (p.row_blocks <= INT_MAX)
      return cuda_status(with_lean_dtypes(lean, [&](auto dt, auto rt) {
                           return launch_norm_fwd_fast<decltype(dt)::value, decltype(rt)::value>(
                               a, p, lean_slices, inputs, fetch, s);
                         }),
                         "norm_fwd launch");
  }
  const int ring = lean.ok ? ring_fwd_plan(a, lean, device) : 0;
  if (ring > 0) {
    NormPlan rp = ring_fwd_shape(a, ring, ring_slices(Dtype(lean.rt)));
    const cudaError_t err = with_lean_dtypes(lean, [&](auto dt, auto rt) {
      constexpr int D = decltype(dt)::value, R = decltype(rt)::value;
      if constexpr (D == int(Dtype::F32)) return cudaErrorInvalidValue;  // never planned
      else return launch_norm_fwd_ring<D, R>(a, rp, sms, s);
    });
    // Otherwise not one cluster fits on this device: the kernels below.
    if (err != cudaErrorInvalidClusterSize) return cuda_status(err, "norm_fwd launch");
  }
  const int plain = lean.ok ? plain_plan(a, lean, device, p) : 0;
  if (plain > 0) {
    // kPlainAheadBytes ahead from kPlainAheadSlices, and past the L2 (norm_plan.h).
    const int64_t ahead =
        nslices >= kPlainAheadSlices || outgrows_l2(a, device) ? kPlainAheadBytes : 0;
    const cudaError_t err =
        Dtype(lean.dt) == Dtype::F16
            ? launch_norm_fwd_plain<int(Dtype::F16)>(a, p, plain, sms, ahead, s)
            : launch_norm_fwd_plain<int(Dtype::BF16)>(a, p, plain, sms, ahead, s);
    // Otherwise not one cluster fits on this device: the kernels below.
    if (err != cudaErrorInvalidClusterSize) return cuda_status(err, "norm_fwd launch");
  }
  HeldFwdFetch fetch;
  const int held = lean.ok ? held_plan(a, lean, device, p, fetch) : 0;
  if (held > 0) {
    const cudaError_t err = with_lean_dtypes(lean, [&](auto dt, auto rt) {
      return launch_norm_fwd_held<decltype(dt)::value, decltype(rt)::value>(a, p, held, fetch,
                                                                            sms, s);
    });
    // Otherwise not one cluster fits on this device: the general kernels below.
    if (err != cudaErrorInvalidClusterSize) return cuda_status(err, "norm_fwd launch");
  } else if (lean.ok && staged_plan(a, lean, device, p)) {
    const cudaError_t err = with_lean_dtypes(lean, [&](auto dt, auto rt) {
      constexpr int D = decltype(dt)::value, R = decltype(rt)::value;
      return p.cluster > 1 ? launch_norm_fwd_staged<D, R, true>(a, p, sms, s)
                           : launch_norm_fwd_staged<D, R, false>(a, p, sms, s);
    });
    // Otherwise not one cluster fits on this device: the general kernels below.
    if (err != cudaErrorInvalidClusterSize) return cuda_status(err, "norm_fwd launch");
  }
  const int K = fwd_slices(nslices);
  p = shape_plan(a, K);
  p.vec = can_vectorize(a);
  p.row_blocks = std::min<int64_t>(ceil_div(a.rows, p.block / p.threads), INT_MAX / a.ngroups);
  const bool tail = p.nslices > K * p.threads;
  const cudaError_t err = K == 1   ? fwd_by_dtype<1, false>(dt, a, p, s)
                          : K == 2 ? fwd_by_dtype<2, false>(dt, a, p, s)
                          : tail   ? fwd_by_dtype<4, true>(dt, a, p, s)
                                   : fwd_by_dtype<4, false>(dt, a, p, s);
  return cuda_status(err, "norm_fwd launch");
}

// The CTAs of the ring backward's cluster (norm_plan.h) for rows of nslices slices of a stream
// (x) of dtype rt, when it can take them, or 0: it copies with the bulk-copy engine, sm_90 code
// like the clusters'. `full`: a LayerNorm or a dbias wanted (the kernel's kFull); `gate`: z staged
// too; `stream`: the stream's gradients wanted. kFull past one CTA's slices and a gate past
// kRingGateOneCtaSlices take CTAs of kRingFullCtaSlices, or twice that, ..., the fewest slices a
// CTA that kMaxCluster CTAs hold.
int ring_ctas(int nslices, Dtype rt, bool full, bool gate, bool stream, const NormArgs& a,
              int device) {
  int most = ring_max_slices(rt, gate, stream);
  const bool gate_split = gate && nslices > kRingGateOneCtaSlices;
  if (rt != Dtype::F32 && ((full && nslices > most) || gate_split)) {
    for (int m = kRingFullCtaSlices; m < most; m *= 2) {
      if (ceil_div(nslices, m) <= kMaxCluster) {
        most = m;
        break;
      }
    }
  }
  const int cluster = int(ceil_div(nslices, most));
  // Beside a float32 stream kFull takes it from kRingAloneMinSlices only past kFastDram, where it
  // was measured (norm_plan.h); there and elsewhere the RMSNorm keeps the lean CTA longer.
  const bool alone_least = rt != Dtype::F32 || (full && fast_dram(device));
  const int least = alone_least ? kRingAloneMinSlices : kRingMinSlices;
  return nslices >= least && a.ngroups == 1 && cluster <= kMaxCluster &&
                 a.rows <= INT_MAX / cluster && cluster_kernels_run(device)
             ? cluster
             : 0;
}

// The ring backward's cluster for a call, or 0 where it does not take it: 16-bit rows without a
// residual stream's gradients, or beside a float32 stream; past kFastDram, where they were
// measured (norm_plan.h), an RMSNorm without a dbias gated or beside a stream of x's dtype up to
// kRingStream16MaxSlices.
int ring_cluster(const NormArgs& a, LeanDtypes d, int device) {
  const Dtype rt = Dtype(d.rt);
  const int nslices = slices_of(a);
  const bool full = a.layer_norm || a.dbias.present();
  const bool f32_stream = rt == Dtype::F32 && d.dt != d.rt;
  const bool residual = a.stream_grads();
  const bool measured = !full && fast_dram(device);
  const bool stream16 = measured && !f32_stream && nslices <= kRingStream16MaxSlices;
  const bool gate = !a.z.present() || measured;
  const bool takes = d.ok && Dtype(d.dt) != Dtype::F32 && a.rows > 0 && gate &&
                     (!residual || f32_stream || (stream16 && !a.z.present()));
  return takes ? ring_ctas(nslices, rt, full, a.z.present(), residual, a, device) : 0;
}

// The ring backward's plan: clusters of `ctas` CTAs of whole warps, ring_slices(rt) a thread, and
// as many row blocks as its CTAs that run at once by their registers (at most 128 a thread, its
// launch bounds), up to kRingCtasPerSm an SM; the launcher lowers them to those that fit.
NormPlan ring_bwd_plan(const NormArgs& a, Dtype rt, bool stream, int ctas, int sms) {
  NormPlan p = shape_plan(a, ring_bwd_slices(rt, stream), ctas);
  p.threads = whole_warps(p.cta_slices, ring_bwd_slices(rt, stream));
  p.block = p.threads;
  const int per_sm = std::clamp(kNormMaxThreads / p.block, 1, kRingCtasPerSm);
  p.row_blocks = std::clamp<int64_t>(int64_t(sms) * per_sm / ctas, 1, std::max<int64_t>(a.rows, 1));
  return p;
}

cudaError_t launch_ring_bwd(LeanDtypes d, const NormArgs& a, NormPlan& p, int sms,
                            cudaStream_t s) {
  constexpr int F32 = int(Dtype::F32), F16 = int(Dtype::F16), BF16 = int(Dtype::BF16);
  if (d.rt == F32)
    return d.dt == F16 ? launch_norm_bwd_ring<F16, F32>(a, p, sms, s)
                       : launch_norm_bwd_ring<BF16, F32>(a, p, sms, s);
  return d.dt == F16 ? launch_norm_bwd_ring<F16, F16>(a, p, sms, s)
                     : launch_norm_bwd_ring<BF16, BF16>(a, p, sms, s);
}

size_t norm_bwd_cuda_workspace(const NormArgs& a, int device) {
  CudaDeviceGuard guard(device);
  // The size query sees only x and weight, so it cannot tell whether the call will take a lean
  // cluster kernel, the ring backward or the general kernels: enough for any of them.
  const int nslices = slices_of(a);
  const int cluster = lean_cluster(nslices, device);
  size_t bytes = BwdSetup(a, device, 0).workspace;
  if (cluster > 1) bytes = std::max(bytes, BwdSetup(a, device, cluster).workspace);
  // Nor whether x, the stream s, float32 here, comes beside 16-bit dy (the one-slice plan).
  if (bwd_one_slice(Dtype::BF16, a.x.dtype, nslices, cluster))
    bytes = std::max(bytes, BwdSetup(a, device, cluster, true).workspace);
  // Nor whether a dbias or the stream's gradients are wanted, or a gate, which shape the ring's
  // clusters. The ring takes a gate only on an RMSNorm alone without a dbias (ring_cluster).
  auto ring_partial = [&](bool full, bool gate, bool stream) -> size_t {
    const int ring = ring_ctas(nslices, a.x.dtype, full, gate, stream, a, device);
    if (ring == 0) return 0;
    const NormPlan p =
        ring_bwd_plan(a, a.x.dtype, stream, ring, std::max(1, multiprocessor_count(device)));
    return partial_bytes(p.row_blocks, a.hidden);
  };
  for (const bool full : {a.layer_norm, true}) {
    for (const bool stream : {false, true})
      bytes = std::max(bytes, ring_partial(full, false, stream));
  }
  if (!a.layer_norm) bytes = std::max(bytes, ring_partial(false, true, false));
  return bytes;
}

ssm_status norm_bwd_cuda(const NormArgs& a, int device, void* workspace, void* stream) {
  CudaDeviceGuard guard(device);
  if (guard.status() != SSM_SUCCESS) return guard.status();
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  const int dt = common_row_dtype(a);
  const bool vec = can_vectorize(a);
  const LeanDtypes lean = bwd_lean_dtypes(a, vec);
  const int ring_ctas = ring_cluster(a, lean, device);
  bool ring = ring_ctas > 0;
  const int sms = std::max(1, multiprocessor_count(device));
  int cluster = lean.ok && !ring ? lean_cluster(slices_of(a), device) : 0;
  const bool sums = a.dweight.present() || a.dbias.present();
  float* partial = static_cast<float*>(workspace);
  // The lean or general kernels' setup; the ring backward's plan replaces its plan below.
  const bool one_slice =
      cluster > 0 && bwd_one_slice(Dtype(lean.dt), Dtype(lean.rt), slices_of(a), cluster);
  BwdSetup setup(a, device, cluster, one_slice);
  NormPlan& p = setup.plan;
  auto prepare = [&] {
    p.vec = vec;
    if (setup.fused && sums) p.partial = partial;
  };
  if (ring) {
    p = ring_bwd_plan(a, Dtype(lean.rt), a.stream_grads(), ring_ctas, sms);
    setup.fused = true;
  }
  prepare();

  cudaError_t err = cudaSuccess;
  // The row kernel also runs with no rows when it is the one writing the (zero) partial sums.
  if (a.rows > 0 || p.partial != nullptr) {
    if (ring) {
      err = launch_ring_bwd(lean, a, p, sms, s);
      setup.partial_rows = p.row_blocks;  // as the launcher lowered it
      if (err == cudaErrorInvalidClusterSize) {
        // Not one cluster fits on this device: the general kernels.
        ring = false;
        setup = BwdSetup(a, device, 0);
        prepare();
      }
    } else if (cluster > 0) {
      err = with_lean_dtypes(lean, [&](auto dt, auto rt) {
        constexpr int D = decltype(dt)::value, R = decltype(rt)::value;
        return cluster > 1 ? launch_norm_bwd_fast<D, R, true>(a, p, sms, s)
                           : launch_norm_bwd_fast<D, R, false>(a, p, sms, s);
      });
      setup.partial_rows = p.row_blocks;  // as the launcher lowered it
      if (err == cudaErrorInvalidClusterSize) {
        // Not one cluster fits on this device: the general kernels (the workspace covers both).
        cluster = 0;
        setup = BwdSetup(a, device, 0);
        prepare();
      }
    }
    if (cluster == 0 && !ring) {
      err = setup.fused ? bwd_by_dtype<kBwdMaxSlices, false>(dt, a, p, s)
                        : bwd_by_dtype<kBwdMaxSlices, true>(dt, a, p, s);
    }
  }
  if (err == cudaSuccess && sums && !setup.fused) {
    const dim3 grid(unsigned(ceil_div(a.ngroups * p.nslices, kColumnThreads)),
                    unsigned(setup.partial_rows));
    norm_column_sums_kernel<<<grid, kColumnThreads, 0, s>>>(a, p, partial);
    err = cudaGetLastError();
  }
  if (err == cudaSuccess && sums) {
    const dim3 grid(unsigned(ceil_div(a.hidden, column_sum_block_columns(a.hidden, partial))), 2);
    norm_reduce_partials_kernel<<<grid, 32 * column_sum_warps(setup.partial_rows), 0, s>>>(
        partial, setup.partial_rows, a.hidden, a.dweight, a.dbias);
    err = cudaGetLastError();
  }
  return cuda_status(err, "norm_bwd launch");
}

}  // namespace ssm
