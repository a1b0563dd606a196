// The plain forward: y = norm(x) * weight (+ bias) over whole rows of 16-bit x, without a
// residual or a gate, as torch.nn.LayerNorm / RMSNorm call it. The held forward (norm_held.cuh)
// serves these too, but decides its options (residual, dtypes of weight and bias, LayerNorm or
// RMSNorm) at run time, slice by slice, and addresses every slice in 64 bits: 936 instructions
// a warp and row at 8192 columns, its warps issuing on 76% of the cycles (ncu, one H200,
// LayerNorm, 4 slices a thread in 256 threads), so a CTA kept the SM's issue slots while the
// others waited on memory. Here those are template arguments or one branch a row, x stays packed
// in registers (4 a slice) and a row's addresses are 32-bit offsets from its first element. One
// H200, % of copy, direct timing, held against plain with 4 slices a thread: LayerNorm, bf16,
// float32 weight and bias, 76 / 88 at 2048 columns, 77 / 84 at 8192, 70 / 81 at 16384; with
// bf16 weight and bias 74 / 90 at 8192; RMSNorm 89 / 94 at 8192 (the shapes the plan now takes,
// and the prefetch of rows ahead, are in norm_plan.h). Prefetching the weight and bias into L1 with x's loads
// (prefetch.global.L1) cost a third of that speed and more; loading the first two slices' before
// the statistics, rather than after, moved LayerNorm by -4 to +2 points. One block a row, not
// persistent (a new block starts loading the moment one ends). Included only by the
// instantiation files.
#pragma once

#include "norm_fast.cuh"

namespace ssm {

// One row of norm_fwd_plain_kernel with the weight (and bias) in dtype W.
template <Dtype D, Dtype W, bool kLayer, int K, int kMaxThreads, bool kStream>
__device__ __forceinline__ void plain_row(const NormArgs& a, const NormPlan& p, int ahead,
                                          float (&red)[2][kMaxThreads / 32]) {
  using namespace norm_detail;
  const int T = p.threads, lane = threadIdx.x, n = p.nslices;
  const int64_t r = blockIdx.x;
  const uint4* x = reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(a.x.data) +
                                                  r * a.x.stride[0]);
  const bool bias = a.bias.present();
  const void* wp = a.weight.data;
  const void* bp = a.bias.data;

  uint4 xs[K];
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int v = lane + k * T;
    xs[k] = v < n ? (kStream ? __ldcs(x + v) : x[v]) : make_uint4(0, 0, 0, 0);
  }
  if (ahead > 0 && lane == 0 && r + ahead < a.rows)
    prefetch_l2_bulk(static_cast<const uint16_t*>(a.x.data) + (r + ahead) * a.x.stride[0],
                     unsigned(n) * 16);
  Slice ws[2], bs[2];
  auto fetch_pair = [&](int k0) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int v = lane + (k0 + j) * T;
      if (v >= n) continue;
      fetch_slice(wp, W, int64_t(v) * kSlice, kSlice, true, ws[j]);
      if (bias) fetch_slice(bp, W, int64_t(v) * kSlice, kSlice, true, bs[j]);
    }
  };
  auto widen = [&](int k, Slice& f) {
    f[0] = __uint_as_float(xs[k].x), f[1] = __uint_as_float(xs[k].y);
    f[2] = __uint_as_float(xs[k].z), f[3] = __uint_as_float(xs[k].w);
    widen_slice(D, true, f);
  };

  const float inv_len = 1.f / float(a.group_size);
  float sum[1] = {0.f};
#pragma unroll
  for (int k = 0; k < K; ++k) {
    Slice f;
    widen(k, f);
#pragma unroll
    for (int e = 0; e < kSlice; ++e) sum[0] += kLayer ? f[e] : f[e] * f[e];
  }
  float mean = 0.f, var = 0.f;
  if (kLayer && n == K * T) {
    // Every lane holds K whole slices: the row's moments in one round.
    mean = sum[0] * (1.f / float(K * kSlice));
    float m2 = 0.f;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      Slice f;
      widen(k, f);
#pragma unroll
      for (int e = 0; e < kSlice; ++e) m2 += (f[e] - mean) * (f[e] - mean);
    }
    segment_moments<kMaxThreads>(mean, m2, float(K * kSlice), T, red[0], red[1]);
    var = m2 * inv_len;
  } else if (kLayer) {
    segment_sum<1, kMaxThreads>(sum, T, red[0], true);
    mean = sum[0] * inv_len;
    float dev[1] = {0.f};
#pragma unroll
    for (int k = 0; k < K; ++k) {
      if (lane + k * T >= n) continue;
      Slice f;
      widen(k, f);
#pragma unroll
      for (int e = 0; e < kSlice; ++e) dev[0] += (f[e] - mean) * (f[e] - mean);
    }
    segment_sum<1, kMaxThreads>(dev, T, red[1], true);
    var = dev[0] * inv_len;
  } else {
    segment_sum<1, kMaxThreads>(sum, T, red[0], true);
    var = sum[0] * inv_len;
  }
  const float rstd = rsqrtf(var + a.eps);
  if (lane == 0) {
    if (a.mean.present()) store_stat(a.mean, r, 0, mean);
    if (a.rstd.present()) store_stat(a.rstd, r, 0, rstd);
  }

  uint16_t* y = static_cast<uint16_t*>(a.y.data) + r * a.y.stride[0];
  // A pair's weight and bias loads before either slice uses them: one round trip a pair.
#pragma unroll
  for (int k0 = 0; k0 < K; k0 += 2) {
    fetch_pair(k0);
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int v = lane + (k0 + j) * T;
      if (v >= n) continue;
      widen_slice(W, true, ws[j]);
      if (bias) widen_slice(W, true, bs[j]);
      Slice f;
      widen(k0 + j, f);
#pragma unroll
      for (int e = 0; e < kSlice; ++e) {
        const float s = a.zero_centered_weight ? ws[j][e] + 1.f : ws[j][e];
        f[e] = (f[e] - mean) * rstd * s;
        if (bias) f[e] += bs[j][e];
      }
      store_slice(y, D, int64_t(v) * kSlice, kSlice, true, f, kStream);
    }
  }
}

// kDt: x and y (16-bit); kLayer: LayerNorm, else RMSNorm; K slices a thread in blocks of up to
// kMaxThreads, kMinBlocks of them an SM. kStream: x loaded and y stored as streaming, first out
// of the caches (ld/st.global.cs), so the weight and bias every row reads again stay.
template <int kDt, bool kLayer, int K, int kMaxThreads, int kMinBlocks, bool kStream = false>
__global__ void __launch_bounds__(kMaxThreads, kMinBlocks)
    norm_fwd_plain_kernel(const NormArgs a, const NormPlan p, int ahead) {
  constexpr Dtype D = Dtype(kDt);
  static_assert(D != Dtype::F32, "x is held packed, two elements a register");
  __shared__ float red[2][kMaxThreads / 32];
  if (a.weight.dtype == Dtype::F32)
    plain_row<D, Dtype::F32, kLayer, K, kMaxThreads, kStream>(a, p, ahead, red);
  else
    plain_row<D, D, kLayer, K, kMaxThreads, kStream>(a, p, ahead, red);
}

template <int kDt>
cudaError_t launch_norm_fwd_plain(const NormArgs& a, const NormPlan& p, int slices, int sms,
                                  cudaStream_t stream) {
  // Blocks an SM of each shape (norm_plan.h): 8 slices a thread in up to 128 or 256 threads,
  // 4 in up to kPlainNarrowThreads or kNormMaxThreads. The LayerNorm past 1024 slices streams x
  // and y: one H200, % of copy, direct timing, 79-87 -> 89.5 at 16384 columns (91 with a bf16
  // weight), level at 12288; at 8192 (and for RMSNorm) it lost, 91.6 -> 89.
  constexpr int N = kPlainNarrowThreads, kNarrow8 = 6, kWide8 = 3, kNarrow4 = 4, kWide4 = 2;
  const bool wide = slices == 8 ? p.threads > N / 2 : p.threads > N;
  auto kernel = slices == 8 ? (wide ? norm_fwd_plain_kernel<kDt, true, 8, N, kWide8, true>
                                    : norm_fwd_plain_kernel<kDt, true, 8, N / 2, kNarrow8>)
                : a.layer_norm ? norm_fwd_plain_kernel<kDt, true, 4, N, kNarrow4>
                : wide         ? norm_fwd_plain_kernel<kDt, false, 4, kNormMaxThreads, kWide4>
                               : norm_fwd_plain_kernel<kDt, false, 4, N, kNarrow4>;
  // Past 1024 slices a block fetches the row one wave of blocks ahead into L2 (norm_plan.h).
  const int per_sm = slices == 8 ? (wide ? kWide8 : kNarrow8) : (wide ? kWide4 : kNarrow4);
  const int ahead = p.nslices > 1024 ? sms * per_sm : 0;
  kernel<<<unsigned(a.rows), unsigned(p.threads), 0, stream>>>(a, p, ahead);
  return cudaGetLastError();
}

}  // namespace ssm
