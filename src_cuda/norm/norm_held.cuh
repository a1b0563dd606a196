// The held forward: the lean forward's calls without a gate past the register kernel's 32
// slices, each thread holding its slices of x and the residual in registers from the load to
// the store, one block a segment: a plain CTA where one holds it, else a thread-block cluster
// sharing it. No shared memory round trip (the staged forward writes each row to its stage by
// cp.async and reads it back two or three times, norm_staged.cuh) and fewer instructions: 155 M
// against 213 M for LayerNorm with a float32 stream at 8192 columns. Where one CTA's stage
// holds the row, the staged forward's three CTAs an SM beat the held one on a few rows only
// (plain_held_slices, norm_cuda.cu, lists them). Past one stage: against the staged
// clusters (one H200, bf16, % of copy) 92 against 86 at 32768 columns, 90 against 86-88 at
// 65536, 84 against 70 for LayerNorm with a float32 residual stream at 32768: the stage's round
// trip (about 1 us a 128 KB row at 128 bytes a clock) and clusters three times the size (6 CTAs
// at 32768 columns against 2) cost more than the CTAs an SM that registers allow lose. A
// cluster launch costs too, even of one CTA: the same 1024-thread CTA a row ran at 89-90% of
// copy launched as a cluster and at 95 launched plain (RMSNorm, bf16 with a bf16 residual,
// 32768 columns). Included only by the instantiation files.
#pragma once

#include "norm_fast.cuh"

namespace ssm {

// kDt, kRt as for norm_fwd_fast_kernel; K slices a thread; blocks of up to kMaxThreads,
// kMinBlocks of them an SM (what caps the registers); kCluster: launched as clusters of
// p.cluster CTAs, else as plain CTAs; kFetch: the kernel for a fetch plan f (held_fwd_fetch, where
// f.out_no_l1), 16-bit y and residual_out stored without L1 allocation, x and the residual loaded
// as f.no_l1 says, the rows f.ahead_rows ahead fetched into L2, in blocks of one segment of any
// whole number of warps (held_fwd_fetch gives some whole warps rather than a power of two). The
// others compile all of it out: a run-time store hint spilled 24 bytes at 40 registers, and the
// load hint's branches changed the registers of kernels that never take them (44 against 48 for
// 16-bit rows beside a float32 stream). Not persistent: one block (cluster) a segment, so every
// row a block sees exists, and a new one starts loading the moment one ends.
template <int kDt, int kRt, int K, int kMaxThreads, int kMinBlocks, bool kCluster,
          bool kFetch = false>
__global__ void __launch_bounds__(kMaxThreads, kMinBlocks)
    norm_fwd_held_kernel(const NormArgs a, const NormPlan p, const HeldFwdFetch f) {
  using namespace norm_detail;
  constexpr Dtype D = Dtype(kDt), R = Dtype(kRt);
  __shared__ float red[2][kMaxThreads / 32];
  __shared__ ClusterInbox<1> inbox[kCluster ? 2 : 1];  // one a reduction
  if (kCluster) cluster_inbox_init(inbox);
  Place at(a, p, kCluster);
  if (kFetch) at.lane = threadIdx.x;  // Place masks by a power of two
  const int T = p.threads;
  const int64_t r = at.row_block;
  const bool residual = a.residual.present();
  const LoadHint in = kFetch && f.no_l1 ? LoadHint::kNoL1 : LoadHint::kCached;
  constexpr StoreHint kOut = kFetch ? StoreHint::kNoL1 : StoreHint::kCached;
  auto col = [&](int k) { return at.col0 + int64_t(at.lane + k * T) * kSlice; };
  auto live = [&](int k) { return at.lane + k * T < at.limit; };

  // Threads 0 and 1 fetch into L2 x's and the residual's share of the row f.ahead_rows past this
  // one, before the loads so that the addresses are not live beside the slices.
  if (kFetch && f.ahead_rows > 0 && threadIdx.x < (residual ? 2 : 1) &&
      r + f.ahead_rows < a.rows) {
    const TensorRef& t = threadIdx.x == 0 ? a.x : a.residual;
    const int bytes = slice_bytes(t.dtype) / kSlice;
    prefetch_l2_bulk(static_cast<const char*>(t.data) +
                         ((r + f.ahead_rows) * t.stride[0] + at.col0) * bytes,
                     unsigned(a.group_size * bytes));
  }
  // Every load first, so a thread has all of its share in flight at once.
  Slice g[K], t[K];
#pragma unroll
  for (int k = 0; k < K; ++k) {
    if (!live(k)) continue;
    fetch_slice(a.x.data, D, r * a.x.stride[0] + col(k), kSlice, true, g[k], in);
    if (residual)
      fetch_slice(a.residual.data, R, r * a.residual.stride[0] + col(k), kSlice, true, t[k],
                  in);
  }
  if (kCluster) cluster_inbox_ready();
  auto row_sum = [&](float v, int i) {
    float q[1] = {v};
    segment_sum<1, kMaxThreads, kFetch>(q, T, red[i], true);
    if constexpr (kCluster)
      cluster_push_sum(q, inbox[i], p.cluster, int(blockIdx.x % p.cluster), 0);
    return q[0];
  };

  float acc = 0.f;
#pragma unroll
  for (int k = 0; k < K; ++k) {
    if (!live(k)) {
#pragma unroll
      for (int e = 0; e < kSlice; ++e) g[k][e] = 0.f;
      continue;
    }
    widen_slice(D, true, g[k]);
    if (residual) {
      widen_slice(R, true, t[k]);
#pragma unroll
      for (int e = 0; e < kSlice; ++e) g[k][e] += t[k][e];
    }
    if (a.residual_out.present())
      store_slice(a.residual_out.data, R, r * a.residual_out.stride[0] + col(k), kSlice, true,
                  g[k], kOut);
#pragma unroll
    for (int e = 0; e < kSlice; ++e) acc += a.layer_norm ? g[k][e] : g[k][e] * g[k][e];
  }
  const float2 stats = segment_statistics(a, at, r, true, acc, row_sum, [&](float mean) {
    float dev = 0.f;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      if (!live(k)) continue;
#pragma unroll
      for (int e = 0; e < kSlice; ++e) dev += (g[k][e] - mean) * (g[k][e] - mean);
    }
    return dev;
  });
  const float mean = stats.x, rstd = stats.y;
#pragma unroll
  for (int k = 0; k < K; ++k) {
    if (!live(k)) continue;
    Slice w;
    slice_scale(a, true, col(k), w);
#pragma unroll
    for (int e = 0; e < kSlice; ++e) g[k][e] = (g[k][e] - mean) * rstd * w[e];
    if (a.bias.present()) {
      fetch_slice(a.bias.data, a.bias.dtype, col(k), kSlice, true, w);
      widen_slice(a.bias.dtype, true, w);
#pragma unroll
      for (int e = 0; e < kSlice; ++e) g[k][e] += w[e];
    }
    store_slice(a.y.data, D, r * a.y.stride[0] + col(k), kSlice, true, g[k], kOut);
  }
}

template <int kDt, int kRt>
cudaError_t launch_norm_fwd_held(const NormArgs& a, NormPlan& p, int slices, HeldFwdFetch f,
                                 int sms, cudaStream_t stream) {
  constexpr bool kSame16 = kDt == kRt && Dtype(kDt) != Dtype::F32;
  if (p.cluster > 1)
    return launch_rows<true>(
        norm_fwd_held_kernel<kDt, kRt, held_slices(Dtype(kDt)), kNormMaxThreads, 2, true>, a, p,
        sms, stream, 0, false, f);
  if (slices == 2) {
    constexpr int kBlocks = held_narrow_blocks(kSame16);
    if constexpr (Dtype(kDt) != Dtype::F32) {
      if (f.out_no_l1)
        return launch_rows<false>(
            norm_fwd_held_kernel<kDt, kRt, 2, kNormMaxThreads, kBlocks, false, true>, a, p, sms,
            stream, 0, false, f);
    }
    return launch_rows<false>(norm_fwd_held_kernel<kDt, kRt, 2, kNormMaxThreads, kBlocks, false>,
                              a, p, sms, stream, 0, false, f);
  }
  if constexpr (kSame16) {
    if (slices == 4 && f.out_no_l1)
      return launch_rows<false>(norm_fwd_held_kernel<kDt, kRt, 4, kHeldMaxThreads, 1, false, true>,
                                a, p, sms, stream, 0, false, f);
    if (slices == 3)
      return f.out_no_l1
                 ? launch_rows<false>(
                       norm_fwd_held_kernel<kDt, kRt, 3, kHeldMaxThreads, 1, false, true>, a, p,
                       sms, stream, 0, false, f)
                 : launch_rows<false>(norm_fwd_held_kernel<kDt, kRt, 3, kHeldMaxThreads, 1, false>,
                                      a, p, sms, stream, 0, false, f);
  }
  if constexpr (kDt == kRt) {
    if (slices == 4)
      return launch_rows<false>(
          norm_fwd_held_kernel<kDt, kRt, 4, held_wide_threads(Dtype(kDt)), 1, false>, a, p, sms,
          stream, 0, false, f);
  }
  return cudaErrorInvalidConfiguration;  // held_plan plans none of these
}

}  // namespace ssm
