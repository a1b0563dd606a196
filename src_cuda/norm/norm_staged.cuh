// The staged forward: the lean forward's calls (norm_fast.cuh) for segments past 256 columns
// that the held forward (norm_held.cuh) leaves, those with a gate among them, with each CTA's
// share of its rows copied global -> shared memory by cp.async (sm_80 and later) instead of
// through registers. The general register kernels keep at most one row a thread in flight
// (the next, loaded while this one is reduced) and use 116-128 registers at these lengths: one
// or two CTAs an SM, and the clusters past 8192 columns ran at 61-75% of copy. Here a CTA issues
// every load of its share at once, holds none of it in registers (40-49 of them, three CTAs an
// SM), and the CTAs of an SM are at different steps, so the memory system always has loads to
// serve: 94-96% of copy from 4096 to 16384 columns (one H200, bf16, benchmarks/NOTES_norm.md). Each
// CTA takes one row block (not persistent: a new CTA starts loading the moment one ends); its
// threads read the staged slices back for the statistics, LayerNorm's second moment and the
// output, which shared memory serves at a small part of its bandwidth. Included only by the
// instantiation files.
#pragma once

#include "../common/cp_async.cuh"
#include "norm_fast.cuh"

namespace ssm {

namespace norm_detail {

template <Dtype D>
__device__ __forceinline__ void stage_slice(char* to, const TensorRef& t, int64_t r,
                                            int64_t col) {
  constexpr int kBytes = D == Dtype::F32 ? 4 : 2;
  const char* from = static_cast<const char*>(t.data) + (r * t.stride[0] + col) * kBytes;
  cp_async_16(to, from);
  if (D == Dtype::F32) cp_async_16(to + 16, from + 16);
}

}  // namespace norm_detail

// kDt, kRt, kGate as for norm_fwd_fast_kernel. The stage (dynamic shared memory) holds, for
// each of the block's slots, p.cta_slices slices of x, then of residual, then of z. With the
// gate first, g = s silu(z) is made once and kept in float32 where that slice's x and z were
// (x's 32 bytes for float32, x's then z's 16 for 16-bit dtypes): recomputing it for the output
// took two more exponentials and reciprocals an element, and ran at 53% of copy against 68%.
template <int kDt, int kRt, bool kGate, bool kCluster>
__global__ void __launch_bounds__(kNormMaxThreads) norm_fwd_staged_kernel(const NormArgs a,
                                                                          const NormPlan p) {
  using namespace norm_detail;
  constexpr Dtype D = Dtype(kDt), R = Dtype(kRt);
  constexpr int BD = slice_bytes(D), BR = slice_bytes(R);
  constexpr int K = kStagedSlices;
  extern __shared__ __align__(16) char stage[];
  __shared__ float red[2][kNormMaxThreads / 32];
  __shared__ ClusterInbox<1> inbox[kCluster ? 2 : 1];  // one a reduction
  if (kCluster) cluster_inbox_init(inbox);
  const Place at(a, p, kCluster);
  const int T = p.threads;
  const int64_t r = at.row_block * at.slots + at.slot;
  const bool row_ok = r < a.rows;
  const bool residual = a.residual.present();
  const bool gate_first = kGate && !a.norm_before_gate;
  const size_t own = size_t(at.slot) * p.cta_slices;    // the slot's first slice in a region
  const size_t span = size_t(at.slots) * p.cta_slices;  // slices of one operand in the stage
  char* const sx = stage + own * BD;
  char* const sr = stage + span * BD + own * BR;
  char* const sz = stage + span * (BD + (residual ? BR : 0)) + own * BD;

  // Slice k of this thread is v = lane + k * T of the block's share, at column col(k); it
  // exists when v < live (nothing past the last row). Recomputed where used: columns and
  // weights held across the loops cost spills, and those kept CTAs off the SM.
  const int live = row_ok ? at.limit : 0;
  auto col = [&](int k) { return at.col0 + int64_t(at.lane + k * T) * kSlice; };
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int v = at.lane + k * T;
    if (v >= live) continue;
    stage_slice<D>(sx + v * BD, a.x, r, col(k));
    if (residual) stage_slice<R>(sr + v * BR, a.residual, r, col(k));
    if (kGate) stage_slice<D>(sz + v * BD, a.z, r, col(k));
  }
  cp_async_commit();
  cp_async_wait<0>();
  if (kCluster) cluster_inbox_ready();
  auto row_sum = [&](float v, int i) {
    float t[1] = {v};
    segment_sum(t, T, red[i], true);
    if constexpr (kCluster)
      cluster_push_sum(t, inbox[i], p.cluster, int(blockIdx.x % p.cluster), 0);
    return t[0];
  };

  // s = x + residual of slice k, from the stage.
  auto load_s = [&](int v, Slice& g) {
    fetch_slice(sx + v * BD, D, 0, kSlice, true, g);
    widen_slice(D, true, g);
    if (residual) {
      Slice t;
      fetch_slice(sr + v * BR, R, 0, kSlice, true, t);
      widen_slice(R, true, t);
#pragma unroll
      for (int e = 0; e < kSlice; ++e) g[e] += t[e];
    }
  };
  auto load_gate = [&](int v, Slice& u) {
    fetch_slice(sz + v * BD, D, 0, kSlice, true, u);
    widen_slice(D, true, u);
#pragma unroll
    for (int e = 0; e < kSlice; ++e) u[e] = silu(u[e]);
  };
  // Where the gate-first g of slice v is kept: two float4 halves.
  auto kept = [&](int v, int half) {
    return reinterpret_cast<float4*>(half == 0 ? sx + v * BD
                                     : D == Dtype::F32 ? sx + v * BD + 16 : sz + v * BD);
  };
  // g: s, or the kept s silu(z) when the gate comes first.
  auto load_g = [&](int v, Slice& g) {
    if (gate_first) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float4 q = *kept(v, h);
        g[4 * h] = q.x, g[4 * h + 1] = q.y, g[4 * h + 2] = q.z, g[4 * h + 3] = q.w;
      }
    } else {
      load_s(v, g);
    }
  };

  float acc = 0.f;
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int v = at.lane + k * T;
    if (v >= live) continue;
    Slice g;
    load_s(v, g);
    if (a.residual_out.present())
      store_slice(a.residual_out.data, R, r * a.residual_out.stride[0] + col(k), kSlice, true,
                  g);
    if (gate_first) {
      Slice u;
      load_gate(v, u);
#pragma unroll
      for (int e = 0; e < kSlice; ++e) g[e] *= u[e];
#pragma unroll
      for (int h = 0; h < 2; ++h)
        *kept(v, h) = make_float4(g[4 * h], g[4 * h + 1], g[4 * h + 2], g[4 * h + 3]);
    }
#pragma unroll
    for (int e = 0; e < kSlice; ++e) acc += a.layer_norm ? g[e] : g[e] * g[e];
  }
  const float2 stats = segment_statistics(a, at, r, row_ok, acc, row_sum, [&](float mean) {
    float dev = 0.f;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int v = at.lane + k * T;
      if (v >= live) continue;
      Slice g;
      load_g(v, g);
#pragma unroll
      for (int e = 0; e < kSlice; ++e) dev += (g[e] - mean) * (g[e] - mean);
    }
    return dev;
  });
  const float mean = stats.x, rstd = stats.y;
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int v = at.lane + k * T;
    if (v >= live) continue;
    Slice w, g;
    slice_scale(a, true, col(k), w);
    load_g(v, g);
#pragma unroll
    for (int e = 0; e < kSlice; ++e) g[e] = (g[e] - mean) * rstd * w[e];
    if (a.bias.present()) {
      fetch_slice(a.bias.data, a.bias.dtype, col(k), kSlice, true, w);
      widen_slice(a.bias.dtype, true, w);
#pragma unroll
      for (int e = 0; e < kSlice; ++e) g[e] += w[e];
    }
    if (kGate && !gate_first) {
      load_gate(v, w);
#pragma unroll
      for (int e = 0; e < kSlice; ++e) g[e] *= w[e];
    }
    store_slice(a.y.data, D, r * a.y.stride[0] + col(k), kSlice, true, g);
  }
}

template <int kDt, int kRt, bool kCluster>
cudaError_t launch_norm_fwd_staged(const NormArgs& a, NormPlan& p, int sms, cudaStream_t stream) {
  auto kernel = norm_fwd_staged_kernel<kDt, kRt, false, kCluster>;
  if constexpr (kDt == kRt) {
    if (a.z.present()) kernel = norm_fwd_staged_kernel<kDt, kRt, true, kCluster>;
  }
  // One block (cluster) a row block: a new one starts copying the moment one ends.
  return launch_rows<kCluster>(kernel, a, p, sms, stream,
                               staged_fwd_bytes(a, p, Dtype(kDt), Dtype(kRt)), false);
}

}  // namespace ssm
