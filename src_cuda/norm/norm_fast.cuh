// The lean kernels for the calls most models make: every row-shaped operand 16-byte aligned, of one
// dtype, or of two where the residual stream is kept in float32 beside 16-bit x (Mamba's
// residual_in_fp32). The general kernels (norm_kernels.cuh) spend about 49 instructions an element
// on their run-time options, re-checked slice by slice, and issue for 60% of the cycles (ncu, 4096
// bf16 columns), so they cannot reach the bandwidth. These decide the options at compile time or
// once a row. The forward here takes short segments (up to 256 columns, and up to 768 16-bit gated
// ones and 512 or 1024 without a gate, lean_fwd_slices in norm_cuda.cu), one to
// four slices a lane and up to four rows a lane at once, the weight loaded once for them; longer
// ones go to the held, plain, ring or staged forwards. The lean backward is in norm_fast_bwd.cuh;
// the segment sums, cluster inboxes and launch_rows here serve it and the other kernels that
// include this file. Included only by the instantiation files.
#pragma once

#include <algorithm>

#include "../common/bulk_copy.cuh"
#include "norm_device.cuh"
#include "norm_plan.h"

namespace ssm {

// The gate of a lean or ring backward kernel, a template argument: none, y = norm(s silu(z))
// (Mamba-2's RMSNormGated), or y = norm(s) silu(z).
enum LeanGate { kNoGate = 0, kGateFirst = 1, kGateAfter = 2 };

namespace norm_detail {

// A thread's K slices (lane + k * threads of its block's share): whether each lies in the row
// and its first column.
template <int K>
__device__ __forceinline__ void thread_columns(const NormPlan& p, const Place& at,
                                               bool (&valid)[K], int64_t (&col)[K]) {
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int v = at.lane + k * p.threads;
    valid[k] = v < at.limit;
    col[k] = at.col0 + int64_t(v) * kSlice;
  }
}

// The scale w of one slice: weight (of dtype d, or nullptr), + 1 when zero-centred, or 1.
__device__ __forceinline__ void slice_scale(const void* weight, Dtype d, bool zero_centered,
                                            bool valid, int64_t col, Slice& w) {
  if (valid && weight != nullptr) {
    fetch_slice(weight, d, col, kSlice, true, w);
    widen_slice(d, true, w);
  } else {
#pragma unroll
    for (int e = 0; e < kSlice; ++e) w[e] = 1.f;
  }
  if (zero_centered) {
#pragma unroll
    for (int e = 0; e < kSlice; ++e) w[e] += 1.f;
  }
}

__device__ __forceinline__ void slice_scale(const NormArgs& a, bool valid, int64_t col,
                                            Slice& w) {
  slice_scale(a.weight.data, a.weight.dtype, a.zero_centered_weight, valid, col, w);
}

template <int K>
__device__ __forceinline__ void column_scale(const NormArgs& a, const bool (&valid)[K],
                                             const int64_t (&col)[K], Slice (&w)[K]) {
#pragma unroll
  for (int k = 0; k < K; ++k) slice_scale(a, valid[k], col[k], w[k]);
}

// The cluster's sums of M floats a CTA, pushed instead of pulled: every CTA stores its totals
// into row `rank` of every CTA's inbox (st.async, which counts its bytes on the receiver's
// mbarrier) and waits on its own mbarrier until all have landed, then adds the inbox in rank
// order, so every thread of every CTA gets the same bits. No CTA waits for the slowest to reach
// a barrier, and none needs the others resident after its last wait (they store only into CTAs
// still waiting for them), so a kernel ends without a cluster barrier. A kernel that sums more
// than once a launch uses two inboxes in turn: sum n goes to inbox n % 2 at mbarrier phase
// parity (n / 2) % 2. A CTA cannot store sum n + 2 into a peer still reading sum n: it first
// needs the peer's sum n + 1, which the peer pushes only after segment_sum's block barrier, and
// every read of sum n precedes that barrier (the segments of clustered kernels span warps).
// The staged forward ran at 79% of copy at 65536 columns pulling its sum from its peers, with a
// cluster barrier around the reads, and at 83% pushing it.
template <int M>
struct ClusterInbox {
  float value[kMaxCluster][M];
  alignas(8) unsigned long long landed;
};

// Thread 0 readies `boxes` before any peer may store into them: call first thing, then
// cluster_inbox_ready before the first cluster_push_sum (loads can be issued in between).
template <int M, int N>
__device__ __forceinline__ void cluster_inbox_init(ClusterInbox<M> (&boxes)[N]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (threadIdx.x == 0) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const unsigned bar = static_cast<unsigned>(__cvta_generic_to_shared(&boxes[i].landed));
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar) : "memory");
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __cluster_barrier_arrive_relaxed();
#endif
}

__device__ __forceinline__ void cluster_inbox_ready() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  __cluster_barrier_wait();
#endif
}

// Stores v (the same in every thread of the block) into row `rank` of every CTA's `box` and
// waits until every CTA's has landed in this one's. Called by every thread of the block.
template <int M>
__device__ __forceinline__ void cluster_push(const float (&v)[M], ClusterInbox<M>& box, int ranks,
                                             int rank, int parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const unsigned bar = static_cast<unsigned>(__cvta_generic_to_shared(&box.landed));
  if (threadIdx.x == 0) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar),
                 "r"(unsigned(ranks * M * sizeof(float)))
                 : "memory");
  }
  if (int(threadIdx.x) < ranks) {
    unsigned remote_bar;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote_bar) : "r"(bar),
                 "r"(threadIdx.x));
#pragma unroll
    for (int i = 0; i < M; ++i) {
      const unsigned slot =
          static_cast<unsigned>(__cvta_generic_to_shared(&box.value[rank][i]));
      unsigned remote_slot;
      asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote_slot) : "r"(slot),
                   "r"(threadIdx.x));
      asm volatile(
          "st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];" ::"r"(
              remote_slot),
          "r"(__float_as_uint(v[i])), "r"(remote_bar)
          : "memory");
    }
  }
  unsigned done = 0;
  while (!done) {
    asm volatile(
        "{\n\t.reg .pred p;\n\t"
        "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n\t"
        "selp.u32 %0, 1, 0, p;\n\t}"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  }
#endif
}

// Replaces v (the same in every thread of the block) with the cluster's values combined by
// `combine` (as for segment_reduce; zeros stand for the ranks past `ranks`, so they must be taken
// for nothing), in rank order, so every thread of every CTA gets the same bits. Called by every
// thread of the block.
template <int M, class Combine>
__device__ __forceinline__ void cluster_reduce(float (&v)[M], ClusterInbox<M>& box, int ranks,
                                               int rank, int parity, Combine combine) {
  static_assert(kMaxCluster <= 8, "a group of 8 lanes holds the ranks");
  // A cluster of one has nothing to add, and a CTA may not store to its own shared memory
  // through the cluster's window when the cluster is one CTA (memcheck: an invalid write).
  if (ranks == 1) return;
  cluster_push(v, box, ranks, rank, parity);
  const int lane = threadIdx.x & 31;
  float t[M];
#pragma unroll
  for (int i = 0; i < M; ++i) t[i] = lane < ranks ? box.value[lane & 7][i] : 0.f;
  combine(t, 8, Lanes<8>());
#pragma unroll
  for (int i = 0; i < M; ++i) v[i] = __shfl_sync(0xffffffffu, t[i], 0);
}

// The cluster's sums of v (cluster_reduce).
template <int M>
__device__ __forceinline__ void cluster_push_sum(float (&v)[M], ClusterInbox<M>& box, int ranks,
                                                 int rank, int parity) {
  cluster_reduce(v, box, ranks, rank, parity, GroupSum());
}

// One 16-byte slice of 16-bit dtype d, as loaded (two elements a register), widened.
__device__ __forceinline__ void unpack_slice(Dtype d, const uint4& raw, Slice& f) {
  f[0] = __uint_as_float(raw.x), f[1] = __uint_as_float(raw.y);
  f[2] = __uint_as_float(raw.z), f[3] = __uint_as_float(raw.w);
  widen_slice(d, true, f);
}

// Slice k of a lane in halves (norm_fwd_stream_kernel): 4 columns from element i into v[0..3]
// and 4 from i + 128 into v[4..7], each where its flag says (zeros otherwise). 16-bit values stay
// packed in v[0..3], as fetch_slice leaves them for widen_slice. kReadOnly: through the
// read-only path (ld.global.nc), for a tensor the kernel does not write, so the compiler may
// move the loads past the kernel's stores instead of holding their registers across them.
template <bool kReadOnly = false>
__device__ __forceinline__ void fetch_halves(const void* p, Dtype d, int64_t i, bool lo, bool hi,
                                             Slice& v) {
  auto load = [](const auto* q) { return kReadOnly ? __ldg(q) : *q; };
  if (d == Dtype::F32) {
    const float4* q = reinterpret_cast<const float4*>(static_cast<const float*>(p) + i);
    const float4 none = make_float4(0.f, 0.f, 0.f, 0.f);
    const float4 a = lo ? load(q) : none, b = hi ? load(q + 32) : none;
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w;
    v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
  } else {
    const uint2* q = reinterpret_cast<const uint2*>(static_cast<const uint16_t*>(p) + i);
    const uint2 a = lo ? load(q) : make_uint2(0, 0), b = hi ? load(q + 32) : make_uint2(0, 0);
    v[0] = __uint_as_float(a.x), v[1] = __uint_as_float(a.y);
    v[2] = __uint_as_float(b.x), v[3] = __uint_as_float(b.y);
  }
}

// v stored as fetch_halves reads it, rounded to dtype d.
__device__ __forceinline__ void store_halves(void* p, Dtype d, int64_t i, bool lo, bool hi,
                                             const Slice& v) {
  if (d == Dtype::F32) {
    float4* q = reinterpret_cast<float4*>(static_cast<float*>(p) + i);
    if (lo) q[0] = make_float4(v[0], v[1], v[2], v[3]);
    if (hi) q[32] = make_float4(v[4], v[5], v[6], v[7]);
  } else {
    uint2* q = reinterpret_cast<uint2*>(static_cast<uint16_t*>(p) + i);
    if (lo) q[0] = make_uint2(pack_pair(d, v[0], v[1]), pack_pair(d, v[2], v[3]));
    if (hi) q[32] = make_uint2(pack_pair(d, v[4], v[5]), pack_pair(d, v[6], v[7]));
  }
}

// Mean (0 for RMSNorm) and rstd of a whole row of 16-bit dtype D whose CTA share of n slices
// the block's T threads (any whole warps) hold packed in xs (slices lane + k * T, zeros past n),
// merged across the p.cluster CTAs of a cluster with kCluster (through `box` at mbarrier
// `parity`; `rank`: this CTA's). red: the block's reduction buffer, 3 * kMaxThreads / 32 floats.
template <Dtype D, bool kLayer, int K, int kMaxThreads, bool kCluster>
__device__ __forceinline__ float2 row_moments(const NormArgs& a, const NormPlan& p,
                                              const uint4 (&xs)[K], int n, int rank, float* red,
                                              ClusterInbox<kLayer ? 3 : 1>& box, int parity) {
  const int T = p.threads, lane = threadIdx.x;
  // The slices past n hold zeros, so every sum may run over all K.
  float sum = 0.f;
#pragma unroll
  for (int k = 0; k < K; ++k) {
    Slice f;
    unpack_slice(D, xs[k], f);
#pragma unroll
    for (int e = 0; e < kSlice; ++e) sum += kLayer ? f[e] : f[e] * f[e];
  }
  const float inv_len = 1.f / float(a.group_size);
  float mean = 0.f, var;
  if constexpr (kLayer) {
    // The row's moments in one round: each thread's from its own slices, then merged.
    const int held = lane < n ? (n - 1 - lane) / T + 1 : 0;
    const float count = float(held * kSlice);
    Moments m = {count > 0.f ? __fdividef(sum, count) : 0.f, 0.f, count};
#pragma unroll
    for (int k = 0; k < K; ++k) {
      if (lane + k * T >= n) continue;
      Slice f;
      unpack_slice(D, xs[k], f);
#pragma unroll
      for (int e = 0; e < kSlice; ++e) m[1] += (f[e] - m[0]) * (f[e] - m[0]);
    }
    segment_moments<kMaxThreads, true>(m, T, red);
    if constexpr (kCluster) cluster_reduce(m, box, p.cluster, rank, parity, ShiftedMoments());
    mean = m[0];
    var = m[1] * inv_len;
  } else {
    float q[1] = {sum};
    segment_sum<1, kMaxThreads, true>(q, T, red, true);
    if constexpr (kCluster) cluster_push_sum(q, box, p.cluster, rank, parity);
    var = q[0] * inv_len;
  }
  return make_float2(mean, rsqrtf(var + a.eps));
}

// The statistics of a segment once each thread has its share of the first sum in `acc`: g
// (LayerNorm) or g squared (RMSNorm), summed over its elements. dev(mean): a thread's sum of
// (g - mean)^2 over the same elements (called for LayerNorm only); row_sum(v, i): the segment's
// total of v through reduction buffer i. Stores mean and rstd of row r where `store` (one thread
// of the segment's first CTA does) and returns them.
template <class RowSum, class Dev>
__device__ __forceinline__ float2 segment_statistics(const NormArgs& a, const Place& at, int64_t r,
                                                     bool store, float acc, RowSum row_sum,
                                                     Dev dev) {
  const float inv_len = 1.f / float(a.group_size);
  float mean = 0.f, var = row_sum(acc, 0) * inv_len;
  if (a.layer_norm) {
    mean = var;
    var = row_sum(dev(mean), 1) * inv_len;
  }
  const float rstd = rsqrtf(var + a.eps);
  if (store && at.lane == 0 && at.first == 0) {
    if (a.mean.present()) store_stat(a.mean, r, at.group, mean);
    if (a.rstd.present()) store_stat(a.rstd, r, at.group, rstd);
  }
  return make_float2(mean, rstd);
}

}  // namespace norm_detail

// Rows between two visits of the same (row block, group) unit: every block (cluster) of the grid
// takes one unit, and the grid is row_blocks * ngroups of them.
__device__ __forceinline__ int64_t row_step(const NormArgs& a, const NormPlan& p,
                                            const norm_detail::Place& at, bool cluster) {
  return int64_t(gridDim.x / ((cluster ? p.cluster : 1) * a.ngroups)) * at.slots;
}

// What the lean forward reads, packed into a few constant-bank lines instead of spread over the
// ~850 bytes of a NormArgs. One H100, % of copy, direct timing, bf16 rows of 256 columns, the
// kernel below taking a NormArgs / this: the norm alone RMSNorm 89.4 / 95.8, LayerNorm 78.5 /
// 80.3.
struct FastFwdArgs {
  const void *x, *residual, *z, *weight, *bias;
  void *y, *residual_out;
  float *mean, *rstd;
  int64_t x_stride, residual_stride, z_stride, y_stride, residual_out_stride;
  int64_t mean_stride[2], rstd_stride[2];
  int64_t rows, group_size;
  int nslices, threads;
  int64_t ahead_rows;  // the L2 prefetch distance, 0 for none (set by the launcher)
  bool no_l1 = false;  // x, z and the residual loaded without allocating them in L1 (launcher)
  float eps, inv_len;  // inv_len: 1 / group_size, so no thread converts and divides
  Dtype weight_dtype, bias_dtype;
  bool zero_centered_weight, norm_before_gate;

  FastFwdArgs(const NormArgs& a, const NormPlan& p)
      : x(a.x.data), residual(a.residual.data), z(a.z.data), weight(a.weight.data),
        bias(a.bias.data), y(a.y.data), residual_out(a.residual_out.data),
        mean(static_cast<float*>(a.mean.data)), rstd(static_cast<float*>(a.rstd.data)),
        x_stride(a.x.stride[0]), residual_stride(a.residual.stride[0]), z_stride(a.z.stride[0]),
        y_stride(a.y.stride[0]), residual_out_stride(a.residual_out.stride[0]),
        mean_stride{a.mean.stride[0], a.mean.stride[1]},
        rstd_stride{a.rstd.stride[0], a.rstd.stride[1]}, rows(a.rows),
        group_size(a.group_size), nslices(p.nslices), threads(p.threads), ahead_rows(0), eps(a.eps),
        inv_len(1.f / float(a.group_size)),
        weight_dtype(a.weight.dtype), bias_dtype(a.bias.dtype),
        zero_centered_weight(a.zero_centered_weight), norm_before_gate(a.norm_before_gate) {}
};

// Why each FastFwdInputs (norm_plan.h) has its own kernel: the norm alone (as torch.nn.RMSNorm and
// LayerNorm call it) then has none of the residual's code, registers or branches, and the prenorm
// RMSNorm none of the options a transformer or Mamba block's call leaves out. One H100, % of copy,
// direct timing, bf16 rows of 256 columns, the norm alone in the residual's kernel / in its own:
// LayerNorm 78.4 / 87.2, RMSNorm 92.4 / 95.0 (48 registers against 55; 4.49 M warp instructions
// against 5.80 M at 32768 rows). Four rows a lane in its own lost: 92.6 and 84.0 at 72
// registers, 83.0 and 69.5 held to 64. RMSNorm + residual (bf16, float32 weight) in the
// residual's kernel / the prenorm one: 82.3-82.4 / 84.7 at 256 columns, 86.3 / 87.6-87.7 at 384,
// 90.3-90.6 / 91.4 at 512 (torch.compile 86.9, 88.7, 91.6), with a bf16 weight 81.1-81.8 /
// 83.0-83.4 at 256; one H200: 76.7-77.4 / 77.8-78.0, 80.7-80.8 / 82.2-82.3, 84.2-84.3 /
// 85.8-86.2 (compile 81.7, 85.5, 88.2). Its whole-warp segments alone, its weight's options
// alone and both: 82.9-83.3, 83.8-84.3 and 84.6-84.7 at 256 columns (four rows a lane in each),
// 90.9-91.1, 90.7 and 91.0-91.1 at 512.
//
// The lean forward, for segments of up to K * kFastFwdSlices slices (norm_plan.h): p.threads lanes
// a segment (a power of two up to a warp), K slices a lane (lane + k * p.threads), each lane taking
// fast_fwd_rows rows at once, so their loads are in flight together, their reductions interleave
// and the scale is loaded once for them. Blocks of p.block threads (lean_fwd_block, norm_plan.h),
// one a (row group, group) pair: grid (row groups, ngroups). kDt: x, y and z; kRt: residual and
// residual_out (kDt too, or float32 beside 16-bit x). kIn: the inputs beside x, a FastFwdInputs;
// kLayer: a LayerNorm; kWt: the weight's dtype in the prenorm kernel and the plain gated ones
// (gated_fwd_kernel; -1 elsewhere: read at run time).
template <int kDt, int kRt, int kIn, bool kLayer, int K, int kWt = -1>
__global__ void __launch_bounds__(kFastFwdBlock) norm_fwd_fast_kernel(const FastFwdArgs a) {
  using namespace norm_detail;
  constexpr bool kPrenorm = kIn == kFwdPrenorm;
  static_assert(!kPrenorm || (!kLayer && kWt >= 0), "the prenorm kernel is RMSNorm's");
  constexpr int R = fast_fwd_rows(FastFwdInputs(kIn), K, kDt);
  constexpr Dtype D = Dtype(kDt), S = Dtype(kRt);
  constexpr bool kGate = kIn == kFwdGateFirst || kIn == kFwdGateAfter;
  constexpr bool kGateFirst = kIn == kFwdGateFirst;
  // The prenorm kernel and the plain gated ones (kWt >= 0) have no bias, no zero-centred weight
  // and a weight, of dtype kWt; the plain gated ones no residual.
  constexpr bool kPlainGated = kGate && kWt >= 0;
  constexpr bool kFixed = kPrenorm || kPlainGated;
  const int T = kPrenorm ? 32 : a.threads;
  const int shift = kPrenorm ? 5 : __ffs(T) - 1;
  const int lane = threadIdx.x & (T - 1);
  const int64_t r0 = (int64_t(blockIdx.x) * (blockDim.x >> shift) + (threadIdx.x >> shift)) * R;
  // The lane's slices lane + k T of the segment: whether each lies in it, and its first column.
  bool valid[K];
  int64_t col[K];
#pragma unroll
  for (int k = 0; k < K; ++k) {
    valid[k] = lane + k * T < a.nslices;
    col[k] = int64_t(blockIdx.y) * a.group_size + int64_t(lane + k * T) * kSlice;
  }
  const bool residual = kPrenorm || (kIn != kFwdAlone && !kPlainGated && a.residual != nullptr);
  const bool residual_out =
      kPrenorm || (kIn != kFwdAlone && !kPlainGated && a.residual_out != nullptr);
  // Where slice k of row r0 + i starts in a tensor of row stride `stride`.
  auto offset = [&](int64_t stride, int i, int k) { return r0 * stride + col[k] + i * stride; };
  bool row_ok[R];
#pragma unroll
  for (int i = 0; i < R; ++i) row_ok[i] = r0 + i < a.rows;
  auto ok = [&](int i, int k) { return row_ok[i] && valid[k]; };

  // With a gate at one slice a lane, in the plain gated kernels from two and in the prenorm
  // kernel, the weight (and bias) are fetched first, raw, so their latency overlaps that of
  // x instead of following the reductions (the other gated kernels at two or three slices a lane
  // held 83-132 registers with them, against 72-80). % of copy, direct timing: gated rows of 256
  // columns 80.7 -> 82.5-82.9 (one H100). RMSNorm + residual (bf16, float32 weight) at four slices
  // a lane, 1024 columns: 91.0-91.1 -> 92.5-92.6 on 32768 rows (one H200), 87.0 -> 96.1 on 2640
  // rows, whose bytes stay in L2 (one H100; level on 32768 there); at two, 512 columns: 84.3-84.4
  // -> 85.6-86.1 (H200), level on the H100; level at 256 on both. In the residual kernel it moved
  // nothing (-0.9 to +0.7), and the norm alone lost 5-9 points. Fetched after x and z, the weight
  // waited behind the first use of z (ptxas scheduled the gate's sigmoid, which stalls on z's
  // arrival, ahead of the weight's loads). One H200, bf16 x and z, float32 weight, 32768 rows,
  // warm, the weight fetched after / before x and z (torch.compile): the gate first 84.3 / 85.8 at
  // 256 columns (82.6), 87.4 / 88.4 at 640 (88.8), 90.2 / 92.0 at 768 (94.7-95.1), 93.1 / 94.4 at
  // 1024 (95.5), but 91.6 / 89.8 at 896 (93.5); the gate after 91.0 / 93.3 at 768, 87.3 / 93.1 at
  // 896, 92.2 / 94.9 at 1024; RMSNorm + residual level (95.0 / 95.3 at 1024). At two slices a lane
  // (512 columns) the plain gated call lost with the weight fetched early after x and z (87.3 ->
  // 86.0); fetched first it is level with the gate first and gains with the gate after.
  constexpr bool kEarly = kPrenorm || (kGate && K == 1) || (kPlainGated && K >= 2);
  // With the gate first at two and four slices a lane, the plain gated kernels fetch the weight's
  // last slice after x and z are issued: fetched first it held back their loads (at four that
  // slice idles in the lanes past the segment's end below 1024 columns). Same H200 and rows, all
  // late / all first / the last after (compile): the gate first 88.2 / 88.1 / 88.5 at 512 columns
  // (88.9), the gate after 85.7 / 87.5 / 87.2 (80.3); at four, all first / the last after, the
  // gate first 82.3 / 85.7 at 776 columns (88.7), 85.9 / 89.5 at 832 (90.0), 89.8 / 92.4 at 896
  // (93.4), 92.0 / 93.1 at 960 (94.6), 94.4 / 94.8 at 1024 (95.7), the gate after 93.6 / 86.7 at
  // 896. At three the last after lost 1.1-1.4 at 768 with either order. The prenorm kernel at two
  // slices a lane does the same: RMSNorm + residual, all first / the last after (compile),
  // 87.8-88.0 / 88.4-88.7 at 512 columns (90.3), 89.5-89.7 / 89.6-90.1 at 384 (88.0), level at 448.
  constexpr bool kLastAfter =
      (kPrenorm && K == 2) || (kPlainGated && kGateFirst && (K == 2 || K == 4));
  // wt is read below, after the fetches, as before this fetch moved first: read here, it changed
  // the machine code of the kernels that fetch no weight early.
  auto weight_dtype = [&] { return kWt >= 0 ? Dtype(kWt) : a.weight_dtype; };
  Slice we[K], be[K];
  auto fetch_weight = [&](int k0, int k1) {
#pragma unroll
    for (int k = k0; k < k1; ++k) {
      if (!valid[k]) continue;
      if (kFixed || a.weight != nullptr)
        fetch_slice(a.weight, weight_dtype(), col[k], kSlice, true, we[k]);
      if (!kFixed && a.bias != nullptr)
        fetch_slice(a.bias, a.bias_dtype, col[k], kSlice, true, be[k]);
    }
  };
  if constexpr (kEarly) fetch_weight(0, kLastAfter ? K - 1 : K);
  // x, residual and z as loaded (16-bit ones packed): every load is issued before any is used.
  const LoadHint load_hint = D != Dtype::F32 && a.no_l1 ? LoadHint::kNoL1 : LoadHint::kCached;
  Slice xs[R][K], rs[R][K], zs[R][K];
#pragma unroll
  for (int i = 0; i < R; ++i) {
#pragma unroll
    for (int k = 0; k < K; ++k) {
#pragma unroll
      for (int e = 0; e < kSlice; ++e) xs[i][k][e] = 0.f, rs[i][k][e] = 0.f, zs[i][k][e] = 0.f;
      if (!ok(i, k)) continue;
      fetch_slice(a.x, D, offset(a.x_stride, i, k), kSlice, true, xs[i][k], load_hint);
      if (residual)
        fetch_slice(a.residual, S, offset(a.residual_stride, i, k), kSlice, true, rs[i][k],
                    load_hint);
      if (kGate) fetch_slice(a.z, D, offset(a.z_stride, i, k), kSlice, true, zs[i][k], load_hint);
    }
  }
  // The prenorm kernel's lanes 0 to R - 1 fetch into L2 the group's share of x in rows
  // a.ahead_rows past their own, lanes R to 2 R - 1 the residual's (kPrenormAheadBytes says why);
  // the plain gated kernels' likewise x's and z's, and the norm alone's lanes 0 to R - 1 x's,
  // where their launcher asks (kGatedAheadBytes, kAloneAheadBytes).
  if (kPrenorm || ((kIn == kFwdAlone || kPlainGated) && a.ahead_rows > 0)) {
    const int64_t r = r0 + lane % R + a.ahead_rows;
    if (lane < (kPrenorm || kPlainGated ? 2 : 1) * R && r < a.rows) {
      const bool second = lane >= R;  // the residual's or z's share
      const Dtype dt = second && kPrenorm ? S : D;
      const int64_t stride = !second ? a.x_stride : kPrenorm ? a.residual_stride : a.z_stride;
      const void* base = !second ? a.x : kPrenorm ? a.residual : a.z;
      const int bytes = slice_bytes(dt) / kSlice;
      const int64_t at = r * stride + int64_t(blockIdx.y) * a.group_size;
      prefetch_l2_bulk(static_cast<const char*>(base) + at * bytes,
                       unsigned(a.group_size * bytes));
    }
  }
  if constexpr (kLastAfter) fetch_weight(K - 1, K);
  const Dtype wt = weight_dtype();
  // s = x + residual in float32. The norm alone keeps x packed and widens it again in each pass
  // (half the registers), and so does a float32 stream beside 16-bit x; the others form s once
  // into vs, in as many registers as the packed x and residual it replaces, so each later pass
  // saves two widenings and an add. One H100, % of copy, widened in each pass / once: RMSNorm +
  // residual 81.5 / 82.1 at 256 columns and 106.0 / 108.5 at 128, gated 78.0 / 78.4 and 87.0 /
  // 92.8 (78 registers down to 64), LayerNorm beside a float32 stream 86.8 / 84.6 at 256.
  auto stream_value = [&](int i, int k, Slice& f) {
#pragma unroll
    for (int e = 0; e < kSlice; ++e) f[e] = xs[i][k][e];
    widen_slice(D, true, f);
    if (residual) {
      Slice t;
#pragma unroll
      for (int e = 0; e < kSlice; ++e) t[e] = rs[i][k][e];
      widen_slice(S, true, t);
#pragma unroll
      for (int e = 0; e < kSlice; ++e) f[e] += t[e];
    }
  };
  constexpr bool kKeep = kIn != kFwdAlone && kDt == kRt;
  // z of slice k of row i, widened to float32.
  auto gate_value = [&](int i, int k, Slice& g) {
#pragma unroll
    for (int e = 0; e < kSlice; ++e) g[e] = zs[i][k][e];
    widen_slice(D, true, g);
  };
  // With the gate first vs holds s silu(z), the value normalised; with it after, z stays packed
  // until the output takes its silu (one sigmoid an element either way).
  Slice vs[R][K];
  if constexpr (kIn != kFwdAlone) {
#pragma unroll
    for (int i = 0; i < R; ++i) {
#pragma unroll
      for (int k = 0; k < K; ++k) {
        Slice f;
        stream_value(i, k, f);
        if (residual_out && ok(i, k))
          store_slice(a.residual_out, S, offset(a.residual_out_stride, i, k), kSlice, true, f,
                      StoreHint::kNoL1);
        if constexpr (kKeep) {
#pragma unroll
          for (int e = 0; e < kSlice; ++e) vs[i][k][e] = f[e];
        }
        if constexpr (kGateFirst) {
          Slice g;
          gate_value(i, k, g);
#pragma unroll
          for (int e = 0; e < kSlice; ++e) vs[i][k][e] *= silu(g[e]);
        }
      }
    }
  }
  auto value = [&](int i, int k, Slice& f) {
    if constexpr (!kKeep) {
      stream_value(i, k, f);
    } else {
#pragma unroll
      for (int e = 0; e < kSlice; ++e) f[e] = vs[i][k][e];
    }
  };
  // Each row's total over its segment of term(sum, v, row, k) folded over the lane's values v.
  float sums[R];
  auto row_sums = [&](auto term) {
    lane_row_sums<R, K>(sums, value, term, [](int) { return true; });
    segment_sum<R, 32>(sums, T, nullptr, true);
  };
  row_sums([](float sum, float v, int, int) { return kLayer ? sum + v : fmaf(v, v, sum); });
  float mean[R], var[R];
#pragma unroll
  for (int i = 0; i < R; ++i) {
    mean[i] = kLayer ? sums[i] * a.inv_len : 0.f;
    var[i] = sums[i] * a.inv_len;
  }
  if (kLayer) {
    row_sums([&](float sum, float v, int i, int k) {
      return valid[k] ? fmaf(v - mean[i], v - mean[i], sum) : sum;
    });
#pragma unroll
    for (int i = 0; i < R; ++i) var[i] = sums[i] * a.inv_len;
  }
  float rstd[R];
#pragma unroll
  for (int i = 0; i < R; ++i) rstd[i] = rsqrtf(var[i] + a.eps);
  // The statistics in one store each for a segment's R rows (every lane has their sums): lane i
  // writes row r0 + i, or lane 0 all where a segment has fewer lanes. Against one lane writing
  // each row (its address arithmetic issued for the whole warp): LayerNorm alone 89.1 -> 90.2%
  // of copy (one H100, 256 columns). The statistics still cost it more than their bytes (93.9
  // without them, 32768 rows, direct timing; no difference under ncu): not yet explained.
  auto store_stats = [&](int64_t r, float m, float s) {
    if (r >= a.rows) return;
    if (kLayer && a.mean != nullptr)
      a.mean[r * a.mean_stride[0] + blockIdx.y * a.mean_stride[1]] = m;
    if (a.rstd != nullptr) a.rstd[r * a.rstd_stride[0] + blockIdx.y * a.rstd_stride[1]] = s;
  };
  if (T >= R) {
    if (lane < R) {
      float m = mean[0], s = rstd[0];
#pragma unroll
      for (int i = 1; i < R; ++i)
        if (lane == i) m = mean[i], s = rstd[i];
      store_stats(r0 + lane, m, s);
    }
  } else if (lane == 0) {
#pragma unroll
    for (int i = 0; i < R; ++i) store_stats(r0 + i, mean[i], rstd[i]);
  }
  if (!valid[0]) return;  // no slice of the segment (valid[0] false leaves every k false)

#pragma unroll
  for (int k = 0; k < K; ++k) {
    if (!valid[k]) continue;
    Slice w, b;
    if constexpr (kEarly) {
      if (kFixed || a.weight != nullptr) {
#pragma unroll
        for (int e = 0; e < kSlice; ++e) w[e] = we[k][e];
        widen_slice(wt, true, w);
      } else {
#pragma unroll
        for (int e = 0; e < kSlice; ++e) w[e] = 1.f;
      }
      if (!kFixed && a.zero_centered_weight) {
#pragma unroll
        for (int e = 0; e < kSlice; ++e) w[e] += 1.f;
      }
    } else {
      slice_scale(a.weight, wt, !kPrenorm && a.zero_centered_weight, true, col[k], w);
    }
    if (!kFixed && a.bias != nullptr) {
      if constexpr (kEarly) {
#pragma unroll
        for (int e = 0; e < kSlice; ++e) b[e] = be[k][e];
      } else {
        fetch_slice(a.bias, a.bias_dtype, col[k], kSlice, true, b);
      }
      widen_slice(a.bias_dtype, true, b);
    } else {
#pragma unroll
      for (int e = 0; e < kSlice; ++e) b[e] = 0.f;
    }
#pragma unroll
    for (int i = 0; i < R; ++i) {
      if (!row_ok[i]) continue;
      Slice f, g;
      value(i, k, f);
      if constexpr (kGate && !kGateFirst) gate_value(i, k, g);
#pragma unroll
      for (int e = 0; e < kSlice; ++e) {
        f[e] = (kLayer ? f[e] - mean[i] : f[e]) * rstd[i] * w[e] + b[e];
        if constexpr (kGate && !kGateFirst) f[e] *= silu(g[e]);
      }
      // y (and a 16-bit residual_out above) not allocated in L1. One H100, % of copy, direct
      // timing (bf16, float32 weight, 32768 rows), allocated / not: RMSNorm alone 98.5-100.2 /
      // 105.3-105.6 at 256 columns, 80.9-81.7 / 107.5-108.3 at 320, 79.9-80.1 / 91.2-91.5 at
      // 384; LayerNorm alone 90.5-92.1 / 96.2-96.5, 72.6-73.4 / 88.2-88.7, 76.1-76.4 / 85.0-85.4;
      // gated at 256 82.1-82.4 / 89.7-89.9: where the call's bytes fit the L2, more of them stay
      // there from one call to the next. Level (within 0.7) from 448 columns and beside a
      // residual. Float32 stores not allocated in L1 lost 7-13 points (LayerNorm beside a float32
      // stream, 256-8192 columns), so store_slice keeps those cached.
      store_slice(a.y, D, offset(a.y_stride, i, k), kSlice, true, f, StoreHint::kNoL1);
    }
  }
}

// Each of R sums totalled over the warp, every lane getting the same bits (the whole-warp
// kernels below).
template <int R>
__device__ __forceinline__ void warp_sums(float (&sums)[R]) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
#pragma unroll
    for (int i = 0; i < R; ++i) sums[i] += __shfl_xor_sync(0xffffffffu, sums[i], o);
  }
}

// The norm alone of 16-bit rows in whole-warp segments at K slices a lane (up to 32 K slices, 256
// K columns, a group; lean_fwd_slices in norm_cuda.cu picks K), its weight (and bias, if any) of
// dtype kWt: the lean forward's plan for it (alone_fwd_rows rows a lane, blocks of lean_fwd_block,
// the fetch plan past the L2, the statistics, y not in L1) with nothing decided at run time but
// the bias, the zero-centred weight, the statistics and the fetch plan. At one slice a lane and two
// rows norm_fwd_fast_kernel holds 48 registers (10 CTAs an SM), this one 40 (12; a LayerNorm
// takes four rows a lane there since, in 64 registers: alone_fwd_rows). One H200, % of
// copy, bf16 rows, float32 weight, warm (back to back) on 32768 rows, from a C harness calling
// the library, norm_fwd_fast_kernel / here: RMSNorm alone at 256 columns 95.8-97.5 /
// 108.9-110.2 (114.3 in the same plan written standalone at 40 registers), LayerNorm alone
// 80.8-81.8 / 91.7-92.6; at 392, 1016 (two, four slices; at four one row a lane then, two since:
// alone_fwd_rows) RMSNorm 86.4-87.4 / 91.1-92.2, 83.8 / 85.6-85.8, LayerNorm 68.1-68.5 / 82.5-83.0,
// 78.5 / 82.0-82.2. norm_fwd_fast_kernel held to 40 by launch bounds spilled 20-28 bytes and fell
// to 82.7-84.2. Forming the output four columns at a time (the weight loaded for each row) held
// LayerNorm to 40 registers at one slice but lost 15 points there.
template <int kDt, bool kLayer, int kWt, int K>
__global__ void __launch_bounds__(kFastFwdBlock) norm_fwd_alone_kernel(const FastFwdArgs a) {
  using namespace norm_detail;
  constexpr Dtype D = Dtype(kDt), W = Dtype(kWt);
  constexpr int R = alone_fwd_rows(K, kLayer);
  const int lane = threadIdx.x & 31;
  const int64_t r0 = (int64_t(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5)) * R;
  const int64_t col0 = int64_t(blockIdx.y) * a.group_size + lane * kSlice;
  // Slice k of the lane: lane + 32 k, columns col0 + 256 k onward.
  auto valid = [&](int k) { return lane + 32 * k < a.nslices; };
  auto column = [&](int k) { return col0 + 32 * k * kSlice; };
  // From three slices a lane the weight (and bias) are fetched first, raw, as norm_fwd_fast_kernel
  // fetches them with a gate: fetched after the reductions, each slice's waited behind the stores
  // of the slice before (they may alias). One H200, bf16 x, float32 weight, 32768 rows, warm, %
  // of copy, after / first (compile): LayerNorm alone 85.6-86.0 / 88.1-88.4 at 1024 columns
  // (87.7-87.8), 85.6-86.4 / 87.2-87.5 at 768; RMSNorm alone 88.5-88.7 / 89.5-90.0 at 1024
  // (90.6-90.7), level at 768. At one slice a lane it lost 4-7 points (RMSNorm 104.5-107.6 /
  // 99.9-100.6 at 256, LayerNorm 88.1-89.7 / 82.5-83.3); fetching every slice's weight together
  // after the reductions, before the stores, lost 0.3-1.5 at 256-1024.
  constexpr bool kEarly = K >= 3;
  Slice ws[K], bs[K];
  if constexpr (kEarly) {
#pragma unroll
    for (int k = 0; k < K; ++k) {
      if (!valid(k)) continue;
      fetch_slice(a.weight, W, column(k), kSlice, true, ws[k]);
      if (kLayer && a.bias != nullptr) fetch_slice(a.bias, W, column(k), kSlice, true, bs[k]);
    }
  }
  const LoadHint hint = a.no_l1 ? LoadHint::kNoL1 : LoadHint::kCached;
  Slice xs[R][K];
#pragma unroll
  for (int i = 0; i < R; ++i) {
#pragma unroll
    for (int k = 0; k < K; ++k) {
#pragma unroll
      for (int e = 0; e < kSlice; ++e) xs[i][k][e] = 0.f;
      if (valid(k) && r0 + i < a.rows)
        fetch_slice(a.x, D, (r0 + i) * a.x_stride + column(k), kSlice, true, xs[i][k], hint);
    }
  }
  // As norm_fwd_fast_kernel: lanes 0 to R - 1 fetch x's rows a.ahead_rows past their own.
  if (a.ahead_rows > 0 && lane < R && r0 + lane + a.ahead_rows < a.rows) {
    const int64_t at = (r0 + lane + a.ahead_rows) * a.x_stride + int64_t(blockIdx.y) * a.group_size;
    prefetch_l2_bulk(static_cast<const uint16_t*>(a.x) + at, unsigned(a.group_size * 2));
  }
  // The lane's values of slice k of row i, widened from the packed registers in each pass (as
  // norm_fwd_fast_kernel keeps the norm alone's x).
  auto value = [&](int i, int k, Slice& f) {
#pragma unroll
    for (int e = 0; e < kSlice; ++e) f[e] = xs[i][k][e];
    widen_slice(D, true, f);
  };
  float sums[R], mean[R], rstd[R];
  // Each row's total over the warp of term(sum, v, i) folded over the lane's values v. An idle
  // slice's zeros add nothing to the plain sums; `centred` sums leave them out.
  auto row_sums = [&](bool centred, auto term) {
    lane_row_sums<R, K>(sums, value, term, [&](int k) { return !centred || valid(k); });
    warp_sums(sums);
  };
  row_sums(false, [](float t, float v, int, int) { return kLayer ? t + v : fmaf(v, v, t); });
#pragma unroll
  for (int i = 0; i < R; ++i) mean[i] = kLayer ? sums[i] * a.inv_len : 0.f;
  if (kLayer)
    row_sums(true, [&](float t, float v, int i, int) { return fmaf(v - mean[i], v - mean[i], t); });
#pragma unroll
  for (int i = 0; i < R; ++i) rstd[i] = rsqrtf(sums[i] * a.inv_len + a.eps);
  // The statistics as norm_fwd_fast_kernel stores them: lane i writes row r0 + i.
  if (lane < R && r0 + lane < a.rows) {
    float m = mean[0], s = rstd[0];
#pragma unroll
    for (int i = 1; i < R; ++i)
      if (lane == i) m = mean[i], s = rstd[i];
    const int64_t r = r0 + lane;
    if (kLayer && a.mean != nullptr)
      a.mean[r * a.mean_stride[0] + blockIdx.y * a.mean_stride[1]] = m;
    if (a.rstd != nullptr) a.rstd[r * a.rstd_stride[0] + blockIdx.y * a.rstd_stride[1]] = s;
  }
#pragma unroll
  for (int k = 0; k < K; ++k) {
    if (!valid(k)) return;
    Slice w, b;
    if constexpr (kEarly) {
#pragma unroll
      for (int e = 0; e < kSlice; ++e) w[e] = ws[k][e];
    } else {
      fetch_slice(a.weight, W, column(k), kSlice, true, w);
    }
    widen_slice(W, true, w);
    if (a.zero_centered_weight) {
#pragma unroll
      for (int e = 0; e < kSlice; ++e) w[e] += 1.f;
    }
#pragma unroll
    for (int e = 0; e < kSlice; ++e) b[e] = 0.f;
    if (kLayer && a.bias != nullptr) {
      if constexpr (kEarly) {
#pragma unroll
        for (int e = 0; e < kSlice; ++e) b[e] = bs[k][e];
      } else {
        fetch_slice(a.bias, W, column(k), kSlice, true, b);
      }
      widen_slice(W, true, b);
    }
#pragma unroll
    for (int i = 0; i < R; ++i) {
      if (r0 + i >= a.rows) continue;
      Slice f;
      value(i, k, f);
#pragma unroll
      for (int e = 0; e < kSlice; ++e) f[e] = (f[e] - mean[i]) * rstd[i] * w[e] + b[e];
      // y not allocated in L1, as norm_fwd_fast_kernel stores it.
      store_slice(a.y, D, (r0 + i) * a.y_stride + column(k), kSlice, true, f, StoreHint::kNoL1);
    }
  }
}

// 16-bit x beside a float32 residual stream (Mamba's residual_in_fp32, a transformer's float32
// residual) in whole-warp segments at K slices a lane (up to 32 K slices, 256 K columns, a
// group; lean_fwd_slices picks K), the weight (and bias, if any) of dtype kWt: the residual and
// residual_out decided at run time, as the zero-centred weight, the bias and the statistics
// (stream_kernel_takes, norm_plan.h). A lane's slice k is two halves, the 4 columns at 4 lane +
// 256 k and the 4 at 128 past them, so each warp access covers contiguous bytes (256 of x or y,
// 512 of the stream); in whole 8-column slices each access covers half of each of 32 sectors of
// the stream. residual_out is stored after the reductions, just before y, and y is stored
// cached. stream_fwd_rows rows a lane, blocks of lean_fwd_block. One H200, % of copy, direct
// timing (bf16 x, float32 weight and bias, 32768 rows, warm), a standalone LayerNorm of this
// plan in whole slices / in halves / with this store order and y cached (torch.compile writing
// no statistics): 82.5 / 85.9 / 86.7 at 256 columns (86.7), 90.2 / 91.4 / 92.5 at 512 (93.0),
// 93.3 / 93.9 / 94.9 at 768 (95.1), 93.2 / 94.2 / 96.0 at 1024 (96.1); residual_out stored
// right after s was formed lost 3-12 points. norm_fwd_fast_kernel / this kernel in the library
// (four rows a lane at 256 columns then): LayerNorm 82.3 / 83.5 at 256, 86.3 / 86.6 at 384,
// 89.3 / 90.8 at 512, 91.3 / 94.3 at 768, 93.4 / 95.0 at 1024, 83.4 / 86.7 at 392; RMSNorm
// 90.6 / 90.8 at 512, 93.4 / 93.4 at 768, 94.7 / 95.8 at 1024.
template <int kDt, bool kLayer, int kWt, int K, bool kNarrow>
__global__ void __launch_bounds__(kFastFwdBlock) norm_fwd_stream_kernel(const FastFwdArgs a) {
  using namespace norm_detail;
  constexpr Dtype D = Dtype(kDt), W = Dtype(kWt), S = Dtype::F32;
  constexpr int R = stream_fwd_rows(K, kLayer);
  const int lane = threadIdx.x & 31;
  const int64_t r0 = (int64_t(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5)) * R;
  const int64_t col0 = int64_t(blockIdx.y) * a.group_size + 4 * lane;
  // Whether half h of slice k (the quad of 4 columns lane + 32 (2 k + h)) lies in the segment.
  auto in_row = [&](int k, int h) { return lane + 32 * (2 * k + h) < 2 * a.nslices; };
  auto column = [&](int k) { return col0 + 256 * k; };
  // Where slice k of row r0 + i starts in a tensor of row stride `stride`: in 32-bit arithmetic
  // where every offset of the call fits it (kNarrow, offsets_fit_32; unsigned, so the rows past
  // the end, never loaded, wrap instead of overflowing).
  auto at = [&](int64_t stride, int i, int k) -> int64_t {
    if constexpr (kNarrow) return unsigned(r0 + i) * unsigned(stride) + unsigned(column(k));
    else return (r0 + i) * stride + column(k);
  };
  bool row_ok[R];
#pragma unroll
  for (int i = 0; i < R; ++i) row_ok[i] = r0 + i < a.rows;
  // s = x + residual, every load issued before any is used.
  Slice xs[R][K], rs[R][K];
#pragma unroll
  for (int i = 0; i < R; ++i) {
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const bool lo = row_ok[i] && in_row(k, 0), hi = row_ok[i] && in_row(k, 1);
      fetch_halves(a.x, D, at(a.x_stride, i, k), lo, hi, xs[i][k]);
      fetch_halves(a.residual, S, at(a.residual_stride, i, k),
                   lo && a.residual != nullptr, hi && a.residual != nullptr, rs[i][k]);
    }
  }
#pragma unroll
  for (int i = 0; i < R; ++i) {
#pragma unroll
    for (int k = 0; k < K; ++k) {
      widen_slice(D, true, xs[i][k]);
#pragma unroll
      for (int e = 0; e < kSlice; ++e) xs[i][k][e] += rs[i][k][e];
    }
  }
  // Each row's total over the warp of term(sum, v, i) folded over the lane's values v of s, or
  // with `centred` of s with the segment's idle halves at the row's mean (adding nothing).
  float sums[R], mean[R], rstd[R];
  auto row_sums = [&](bool centred, auto term) {
    auto value = [&](int i, int k, Slice& f) {
#pragma unroll
      for (int e = 0; e < kSlice; ++e)
        f[e] = centred && !in_row(k, e / 4) ? mean[i] : xs[i][k][e];
    };
    lane_row_sums<R, K>(sums, value, term, [](int) { return true; });
    warp_sums(sums);
  };
  row_sums(false, [](float t, float v, int, int) { return kLayer ? t + v : fmaf(v, v, t); });
#pragma unroll
  for (int i = 0; i < R; ++i) mean[i] = kLayer ? sums[i] * a.inv_len : 0.f;
  if (kLayer)
    row_sums(true, [&](float t, float v, int i, int) { return fmaf(v - mean[i], v - mean[i], t); });
#pragma unroll
  for (int i = 0; i < R; ++i) rstd[i] = rsqrtf(sums[i] * a.inv_len + a.eps);
  // The statistics as norm_fwd_fast_kernel stores them: lane i writes row r0 + i.
  if (lane < R && r0 + lane < a.rows) {
    float m = mean[0], s = rstd[0];
#pragma unroll
    for (int i = 1; i < R; ++i)
      if (lane == i) m = mean[i], s = rstd[i];
    const int64_t r = r0 + lane;
    if (kLayer && a.mean != nullptr)
      a.mean[r * a.mean_stride[0] + blockIdx.y * a.mean_stride[1]] = m;
    if (a.rstd != nullptr) a.rstd[r * a.rstd_stride[0] + blockIdx.y * a.rstd_stride[1]] = s;
  }
  Slice w[K], b[K];
#pragma unroll
  for (int k = 0; k < K; ++k) {
    fetch_halves<true>(a.weight, W, column(k), in_row(k, 0), in_row(k, 1), w[k]);
    widen_slice(W, true, w[k]);
#pragma unroll
    for (int e = 0; e < kSlice; ++e) w[k][e] += a.zero_centered_weight ? 1.f : 0.f;
    const bool bias = kLayer && a.bias != nullptr;
    fetch_halves<true>(a.bias, W, column(k), bias && in_row(k, 0), bias && in_row(k, 1), b[k]);
    widen_slice(W, true, b[k]);
  }
  if (a.residual_out != nullptr) {
#pragma unroll
    for (int i = 0; i < R; ++i) {
#pragma unroll
      for (int k = 0; k < K; ++k)
        store_halves(a.residual_out, S, at(a.residual_out_stride, i, k),
                     row_ok[i] && in_row(k, 0), row_ok[i] && in_row(k, 1), xs[i][k]);
    }
  }
#pragma unroll
  for (int i = 0; i < R; ++i) {
#pragma unroll
    for (int k = 0; k < K; ++k) {
      Slice f;
#pragma unroll
      for (int e = 0; e < kSlice; ++e)
        f[e] = (xs[i][k][e] - mean[i]) * rstd[i] * w[k][e] + b[k][e];
      store_halves(a.y, D, at(a.y_stride, i, k), row_ok[i] && in_row(k, 0),
                   row_ok[i] && in_row(k, 1), f);
    }
  }
}

// Launches `kernel` on p.row_blocks * ngroups blocks, or clusters of p.cluster blocks with
// kCluster, each with `smem` bytes of dynamic shared memory, passing `extra` after a and p. With
// `persistent` (kernels that walk down the rows) p.row_blocks is first lowered so that all of
// them run at once. With kCluster it returns cudaErrorInvalidClusterSize, launching nothing,
// when not one cluster fits on the device.
template <bool kCluster, class... Extra>
cudaError_t launch_rows(void (*kernel)(NormArgs, NormPlan, Extra...), const NormArgs& a,
                        NormPlan& p, int sms, cudaStream_t stream, size_t smem = 0,
                        bool persistent = true, Extra... extra) {
  cudaError_t err = cudaSuccess;
  // The opt-in for dynamic shared memory, before the occupancy queries that count it. Needed
  // only where static and dynamic together pass 48 KB, but asking for the static size would
  // cost a call too.
  if (smem > 0) {
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
    if (err != cudaSuccess) return err;
  }
  cudaLaunchConfig_t config = {};
  config.blockDim = dim3(unsigned(p.block));
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute cluster;
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = unsigned(p.cluster);
  cluster.val.clusterDim.y = cluster.val.clusterDim.z = 1;
  int fit = 0;
  if constexpr (kCluster) {
    config.attrs = &cluster;
    config.numAttrs = 1;
    config.gridDim = dim3(unsigned(p.cluster * std::min<int64_t>(p.row_blocks * a.ngroups, sms)));
    err = cudaOccupancyMaxActiveClusters(&fit, kernel, &config);
    if (err != cudaSuccess || fit == 0) {
      cudaGetLastError();
      return cudaErrorInvalidClusterSize;
    }
  } else if (persistent) {
    err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&fit, kernel, p.block, smem);
    if (err != cudaSuccess) return err;
    fit *= sms;
  }
  if (persistent)
    p.row_blocks = std::min<int64_t>(p.row_blocks, std::max<int64_t>(fit / a.ngroups, 1));
  config.gridDim = dim3(unsigned(p.row_blocks * a.ngroups * p.cluster));
  return cudaLaunchKernelEx(&config, kernel, a, p, extra...);
}

// The lean forward kernel of `slices` slices a lane, for a kernel kind that takes up to kMost
// (lean_fwd_slices: more than one only for 16-bit rows).
template <int kDt, int kRt, int kIn, bool kLayer, int kMost, int kWt = -1>
auto fast_fwd_kernel(int slices) {
  if constexpr (kMost > 1 && Dtype(kDt) != Dtype::F32) {
    if (slices == 2) return norm_fwd_fast_kernel<kDt, kRt, kIn, kLayer, 2, kWt>;
    if constexpr (kMost > 2) {
      if (slices == 3) return norm_fwd_fast_kernel<kDt, kRt, kIn, kLayer, 3, kWt>;
    }
    if constexpr (kMost > 3) {
      if (slices == 4) return norm_fwd_fast_kernel<kDt, kRt, kIn, kLayer, 4, kWt>;
    }
  }
  return norm_fwd_fast_kernel<kDt, kRt, kIn, kLayer, 1, kWt>;
}

// The gated lean forward kernel, kIn the gate's order: for the plain gated call
// (plain_gated_call, norm_plan.h) the one with its options compiled out, its weight's dtype kWt,
// up to four slices a lane (lean_fwd_slices); for the others the one that reads them at run
// time, up to three. One H100, RMSNorm of bf16 x and z, float32
// weight, the gate first: 64 / 48 registers at one slice a lane, 77 / 70 at two, 69 / 56 at
// three; the gate after: 64 / 56, 96 / 80, 70 / 64. % of copy, direct timing, 32768 rows, x
// and z through L1 (lean_fwd_fetch), run time / compiled out: the gate first 94.0-94.1 /
// 94.3-94.4 at 256 columns, 84.8-85.0 / 86.7-86.9 at 384, 85.7-85.8 / 87.5-87.6 at 448,
// 88.7-88.8 / 89.4-89.6 at 576, 90.2-90.3 / 91.0-91.2 at 640, 91.9-92.0 / 92.7-92.8 at 768; the
// gate after 89.6-89.7 / 96.8-96.9, 83.8-83.9 / 87.2, 84.6-84.7 / 86.0-86.1, 88.1-88.4 / 88.4,
// 89.6-89.7 / 90.9-91.0, 91.7-91.9 / 92.5. Its weight fetched with x (as the prenorm kernel's)
// at three slices a lane holds 64 / 80 registers against 56 / 64, gate first / after, and gains;
// one H100, % of copy, direct timing, fetched late / early: the gate first 102.4 / 108.4 at 384
// columns, 89.5 / 89.9 at 576, 91.3 / 91.9 at 640, 92.8 / 93.8 at 768; the gate after 104.4 /
// 111.7, 88.6 / 92.3, 90.4 / 93.5, 92.8 / 94.9 (torch.compile 94.5 and 95.9 at 576 and 768 with
// the gate first, 87.0 and 95.6 after). At two slices (448 columns) it held 72 / 90 against 70 /
// 80: 93.5 / 93.8 with the gate first, 92.3 / 90.3 after, so there it stays fetched late. At
// four (one H200) it is fetched early too, before x and z (norm_fwd_fast_kernel has the figures).
// Early at four slices a lane, float32 weight: 82 registers with the gate first, 96 after.
template <int kDt, int kRt, int kIn>
auto gated_fwd_kernel(const NormArgs& a, int slices) {
  constexpr int F = int(Dtype::F32);
  const bool L = a.layer_norm;
  if (!plain_gated_call(a))
    return L ? fast_fwd_kernel<kDt, kRt, kIn, true, 3>(slices)
             : fast_fwd_kernel<kDt, kRt, kIn, false, 3>(slices);
  if (a.weight.dtype == Dtype::F32)
    return L ? fast_fwd_kernel<kDt, kRt, kIn, true, 4, F>(slices)
             : fast_fwd_kernel<kDt, kRt, kIn, false, 4, F>(slices);
  return L ? fast_fwd_kernel<kDt, kRt, kIn, true, 4, kDt>(slices)
           : fast_fwd_kernel<kDt, kRt, kIn, false, 4, kDt>(slices);
}

// norm_fwd_alone_kernel at `slices` slices a lane (1 to 4), its weight of dtype kWt.
template <int kDt, int kWt>
auto alone_kernel(const NormArgs& a, int slices) {
  const bool L = a.layer_norm;
  if (slices == 2)
    return L ? norm_fwd_alone_kernel<kDt, true, kWt, 2> : norm_fwd_alone_kernel<kDt, false, kWt, 2>;
  if (slices == 3)
    return L ? norm_fwd_alone_kernel<kDt, true, kWt, 3> : norm_fwd_alone_kernel<kDt, false, kWt, 3>;
  if (slices == 4)
    return L ? norm_fwd_alone_kernel<kDt, true, kWt, 4> : norm_fwd_alone_kernel<kDt, false, kWt, 4>;
  return L ? norm_fwd_alone_kernel<kDt, true, kWt, 1> : norm_fwd_alone_kernel<kDt, false, kWt, 1>;
}

// norm_fwd_stream_kernel at `slices` slices a lane (1 to 4), its weight of dtype kWt.
template <int kDt, int kWt, bool kNarrow>
auto stream_kernel(const NormArgs& a, int slices) {
  const bool L = a.layer_norm;
  if (slices == 2)
    return L ? norm_fwd_stream_kernel<kDt, true, kWt, 2, kNarrow>
             : norm_fwd_stream_kernel<kDt, false, kWt, 2, kNarrow>;
  if (slices == 3)
    return L ? norm_fwd_stream_kernel<kDt, true, kWt, 3, kNarrow>
             : norm_fwd_stream_kernel<kDt, false, kWt, 3, kNarrow>;
  if (slices == 4)
    return L ? norm_fwd_stream_kernel<kDt, true, kWt, 4, kNarrow>
             : norm_fwd_stream_kernel<kDt, false, kWt, 4, kNarrow>;
  return L ? norm_fwd_stream_kernel<kDt, true, kWt, 1, kNarrow>
           : norm_fwd_stream_kernel<kDt, false, kWt, 1, kNarrow>;
}

template <int kDt, int kWt>
auto stream_kernel(const NormArgs& a, int slices) {
  return offsets_fit_32(a) ? stream_kernel<kDt, kWt, true>(a, slices)
                           : stream_kernel<kDt, kWt, false>(a, slices);
}

template <int kDt, int kRt>
cudaError_t launch_norm_fwd_fast(const NormArgs& a, NormPlan& p, int slices, FastFwdInputs inputs,
                                 LeanFwdFetch fetch, cudaStream_t stream) {
  const dim3 grid(unsigned(p.row_blocks), unsigned(a.ngroups));
  const bool L = a.layer_norm;
  // Four slices a lane beside a residual only beside a float32 stream or in the prenorm kernel.
  constexpr int kResidualMost = kDt == kRt ? 2 : 4;
  auto kernel = L ? fast_fwd_kernel<kDt, kRt, kFwdResidual, true, kResidualMost>(slices)
                  : fast_fwd_kernel<kDt, kRt, kFwdResidual, false, kResidualMost>(slices);
  if constexpr (kDt == kRt) {  // fast_fwd_inputs gives kFwdResidual beside a float32 stream
    constexpr int F = int(Dtype::F32);
    if (inputs == kFwdAlone)
      kernel = L ? fast_fwd_kernel<kDt, kRt, kFwdAlone, true, 4>(slices)
                 : fast_fwd_kernel<kDt, kRt, kFwdAlone, false, 4>(slices);
    if constexpr (Dtype(kDt) != Dtype::F32) {
      if (alone_kernel_takes(a, p, inputs, Dtype(kDt)))
        kernel = a.weight.dtype == Dtype::F32 ? alone_kernel<kDt, int(Dtype::F32)>(a, slices)
                                              : alone_kernel<kDt, kDt>(a, slices);
    }
    if (inputs == kFwdPrenorm)  // the weight in x's dtype or float32 (fast_fwd_inputs)
      kernel = a.weight.dtype != Dtype::F32
                   ? fast_fwd_kernel<kDt, kRt, kFwdPrenorm, false, 4, kDt>(slices)
                   : fast_fwd_kernel<kDt, kRt, kFwdPrenorm, false, 4, F>(slices);
    if (inputs == kFwdGateFirst) kernel = gated_fwd_kernel<kDt, kRt, kFwdGateFirst>(a, slices);
    if (inputs == kFwdGateAfter) kernel = gated_fwd_kernel<kDt, kRt, kFwdGateAfter>(a, slices);
  } else if constexpr (Dtype(kRt) == Dtype::F32) {
    if (stream_kernel_takes(a, p, inputs, Dtype(kDt), Dtype(kRt), slices))
      kernel = a.weight.dtype == Dtype::F32 ? stream_kernel<kDt, int(Dtype::F32)>(a, slices)
                                            : stream_kernel<kDt, kDt>(a, slices);
  }
  FastFwdArgs args(a, p);
  if (fetch.ahead_bytes > 0) {
    const int64_t row_bytes = a.hidden * (slice_bytes(Dtype(kDt)) / kSlice);
    args.ahead_rows = std::max<int64_t>(fetch.ahead_bytes / row_bytes, 1);
  }
  // Loads not allocated in L1 (lean_fwd_fetch, norm_cuda.cu): the norm alone's x past the L2 (on
  // the H200 from a little below it to 2.5 L2s), the plain gated call's x and z and, on the H200,
  // the prenorm call's x and residual in windows about the L2's size (lean_fwd_fetch has those
  // measurements). The norm alone, one H100, % of copy, direct timing, one process each (bf16,
  // float32 weight, 32768 rows), allocated / not: RMSNorm alone 80.0-80.2 / 98.1-98.7 at 448
  // columns, 81.6 / 91.5-92.8 at 512, 86.7-86.8 / 88.9-90.2 at 768, LayerNorm alone 78.1-78.8 /
  // 87.7 at 512. Where the call fits the L2 it lost: LayerNorm alone 90.8-90.9 / 80.7-81.3 at 256
  // columns, RMSNorm alone 90.4 / 88.9-90.0 at 384. Rows beside a residual lost 0.2-2.5 points at
  // 256-768 (RMSNorm + residual, in one process, x alone not allocated, on an H100).
  args.no_l1 = fetch.no_l1;
  // A cap on the CTAs an SM holds (lean_fwd_fetch has the measurements) is dynamic shared memory
  // the kernel never touches: as much a CTA as leaves room for no more than the cap. The opt-in
  // as launch_rows asks it. Where the registers already hold the CTAs to the cap (a kernel built
  // for another architecture may take more of them) there is nothing to cap, and asking for room
  // for more CTAs than fit would fail the call.
  size_t smem = 0;
  if (fetch.ctas_per_sm > 0) {
    int fit = 0;
    cudaError_t err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&fit, kernel, int(p.block), 0);
    if (err == cudaSuccess && fit > fetch.ctas_per_sm) {
      err = cudaOccupancyAvailableDynamicSMemPerBlock(&smem, kernel, fetch.ctas_per_sm,
                                                      int(p.block));
      if (err == cudaSuccess)
        err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
    }
    if (err != cudaSuccess) return err;
  }
  kernel<<<grid, p.block, smem, stream>>>(args);
  return cudaGetLastError();
}

}  // namespace ssm
