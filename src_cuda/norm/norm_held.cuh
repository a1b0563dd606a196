// The held forward: the lean forward's calls without a gate whose segments pass one CTA's stage
// (norm_staged.cuh), one CTA a segment or a thread-block cluster sharing it, each thread holding
// its held_slices slices in registers from the load to the store. Against the staged clusters
// there (one H200, bf16, % of copy): 92 against 86 at 32768 columns, 90 against 86-88 at 65536,
// 84 against 70 for LayerNorm with a float32 residual stream at 32768. The stage's round trip
// through shared memory (about 1 us a 128 KB row at 128 bytes a clock) and clusters three times
// the size (6 CTAs at 32768 columns against 2) cost more than the CTAs an SM that registers
// allow (two of 512 threads against six of 256) lose. A cluster launch costs too, even of one
// CTA: the same 1024-thread CTA a row ran at 89-90% of copy launched as a cluster and at 95
// launched plain (RMSNorm, bf16 with a bf16 residual, 32768 columns), so held_plan
// (norm_cuda.cu) plans one plain CTA for the 16-bit RMSNorm rows one holds. Included only by the
// instantiation files.
#pragma once

#include "norm_fast.cuh"

namespace ssm {

// kDt, kRt as for norm_fwd_fast_kernel; kCluster: launched as clusters of p.cluster CTAs of up
// to kNormMaxThreads threads (two an SM), else as plain CTAs of up to kHeldMaxThreads. Not
// persistent: one block (cluster) a segment, so every row a block sees exists, and a new one
// starts loading the moment one ends.
template <int kDt, int kRt, bool kCluster>
__global__ void __launch_bounds__(kCluster ? kNormMaxThreads : kHeldMaxThreads, kCluster ? 2 : 1)
    norm_fwd_held_kernel(const NormArgs a, const NormPlan p) {
  using namespace norm_detail;
  constexpr Dtype D = Dtype(kDt), R = Dtype(kRt);
  constexpr int K = held_slices(D);
  __shared__ float red[2][(kCluster ? kNormMaxThreads : kHeldMaxThreads) / 32];
  __shared__ ClusterInbox<1> inbox[kCluster ? 2 : 1];  // one a reduction
  if (kCluster) cluster_inbox_init(inbox);
  const Place at(a, p, kCluster);
  const int T = p.threads;
  const int64_t r = at.row_block;
  const bool residual = a.residual.present();
  auto col = [&](int k) { return at.col0 + int64_t(at.lane + k * T) * kSlice; };
  auto live = [&](int k) { return at.lane + k * T < at.limit; };

  // Every load first, so a thread has all of its share in flight at once.
  Slice g[K], t[K];
#pragma unroll
  for (int k = 0; k < K; ++k) {
    if (!live(k)) continue;
    fetch_slice(a.x.data, D, r * a.x.stride[0] + col(k), kSlice, true, g[k]);
    if (residual)
      fetch_slice(a.residual.data, R, r * a.residual.stride[0] + col(k), kSlice, true, t[k]);
  }
  if (kCluster) cluster_inbox_ready();
  auto row_sum = [&](float v, int i) {
    float q[1] = {v};
    segment_sum<1, kCluster ? kNormMaxThreads : kHeldMaxThreads>(q, T, red[i], true);
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
                  g[k]);
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
    store_slice(a.y.data, D, r * a.y.stride[0] + col(k), kSlice, true, g[k]);
  }
}

template <int kDt, int kRt>
cudaError_t launch_norm_fwd_held(const NormArgs& a, NormPlan& p, int sms, cudaStream_t stream) {
  // held_plan plans plain CTAs for 16-bit rows beside a stream of their dtype only.
  if constexpr (kDt == kRt && Dtype(kDt) != Dtype::F32) {
    if (p.cluster == 1)
      return launch_rows<false>(norm_fwd_held_kernel<kDt, kRt, false>, a, p, sms, stream, 0,
                                false);
  }
  return launch_rows<true>(norm_fwd_held_kernel<kDt, kRt, true>, a, p, sms, stream, 0, false);
}

}  // namespace ssm
