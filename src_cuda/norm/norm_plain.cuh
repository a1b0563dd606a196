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
// and the prefetch of rows ahead, are in norm_plan.h). Prefetching the weight and bias into L1
// with x's loads (prefetch.global.L1) cost a third of that speed and more; loading the first
// two slices' before the statistics, rather than after, moved LayerNorm by -4 to +2 points. One
// block (or one cluster, past kPlainCtaSlices) a row, not persistent (a new block starts loading
// the moment one ends). Included only by the instantiation files.
#pragma once

#include <algorithm>

#include "norm_fast.cuh"

namespace ssm {

// One row of norm_fwd_plain_kernel with the weight (and bias) in dtype W: the block's share of
// it, slices [first, first + n) (all of it without kCluster).
template <Dtype D, Dtype W, bool kLayer, int K, int kMaxThreads, bool kStream, bool kCluster>
__device__ __forceinline__ void plain_row(const NormArgs& a, const NormPlan& p, int ahead,
                                          float* red,
                                          norm_detail::ClusterInbox<kLayer ? 3 : 1>& inbox) {
  using namespace norm_detail;
  const int T = p.threads, lane = threadIdx.x;
  const int rank = kCluster ? int(blockIdx.x % p.cluster) : 0;
  const int first = rank * p.cta_slices;
  const int n = kCluster ? min(p.cta_slices, p.nslices - first) : p.nslices;
  const int64_t r = kCluster ? blockIdx.x / p.cluster : blockIdx.x;
  const uint16_t* x_row = static_cast<const uint16_t*>(a.x.data) + r * a.x.stride[0];
  const uint4* x = reinterpret_cast<const uint4*>(x_row) + first;
  const bool bias = a.bias.present();
  const void* wp = a.weight.data;
  const void* bp = a.bias.data;
  auto col = [&](int v) { return int64_t(first + v) * kSlice; };

  uint4 xs[K];
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int v = lane + k * T;
    xs[k] = v < n ? (kStream ? __ldcs(x + v) : x[v]) : make_uint4(0, 0, 0, 0);
  }
  if (ahead > 0 && lane == 0 && r + ahead < a.rows)
    prefetch_l2_bulk(x_row + ahead * a.x.stride[0] + col(0), unsigned(n) * 16);
  if (kCluster) cluster_inbox_ready();
  Slice ws[2], bs[2];
  auto fetch_pair = [&](int k0) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int v = lane + (k0 + j) * T;
      if (v >= n) continue;
      fetch_slice(wp, W, col(v), kSlice, true, ws[j]);
      if (bias) fetch_slice(bp, W, col(v), kSlice, true, bs[j]);
    }
  };
  const float2 stats =
      row_moments<D, kLayer, K, kMaxThreads, kCluster>(a, p, xs, n, rank, red, inbox, 0);
  const float mean = stats.x, rstd = stats.y;
  if (lane == 0 && rank == 0) {
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
      unpack_slice(D, xs[k0 + j], f);
#pragma unroll
      for (int e = 0; e < kSlice; ++e) {
        const float s = a.zero_centered_weight ? ws[j][e] + 1.f : ws[j][e];
        f[e] = (f[e] - mean) * rstd * s;
        if (bias) f[e] += bs[j][e];
      }
      store_slice(y, D, col(v), kSlice, true, f,
                  kStream ? StoreHint::kStreaming : StoreHint::kCached);
    }
  }
}

// kDt: x and y (16-bit); kLayer: LayerNorm, else RMSNorm; K slices a thread in blocks of up to
// kMaxThreads, kMinBlocks of them an SM. kStream: x loaded and y stored as streaming, first out
// of the caches (ld/st.global.cs), so the weight and bias every row reads again stay. kCluster:
// the p.cluster CTAs of a thread-block cluster share each row, p.cta_slices slices each, and
// merge their statistics through distributed shared memory (cluster_reduce); sm_90 and later.
template <int kDt, bool kLayer, int K, int kMaxThreads, int kMinBlocks, bool kStream,
          bool kCluster>
__global__ void __launch_bounds__(kMaxThreads, kMinBlocks)
    norm_fwd_plain_kernel(const NormArgs a, const NormPlan p, int ahead) {
  using namespace norm_detail;
  constexpr Dtype D = Dtype(kDt);
  static_assert(D != Dtype::F32, "x is held packed, two elements a register");
  __shared__ float red[3 * kMaxThreads / 32];
  __shared__ ClusterInbox<kLayer ? 3 : 1> inbox[1];
  if (kCluster) cluster_inbox_init(inbox);
  if (a.weight.dtype == Dtype::F32)
    plain_row<D, Dtype::F32, kLayer, K, kMaxThreads, kStream, kCluster>(a, p, ahead, red,
                                                                         inbox[0]);
  else
    plain_row<D, D, kLayer, K, kMaxThreads, kStream, kCluster>(a, p, ahead, red, inbox[0]);
}

// A plain kernel and what its launcher needs to know of it: the blocks an SM it is bounded to
// and whether it streams x and y.
struct PlainKernel {
  void (*kernel)(NormArgs, NormPlan, int);
  int per_sm;
  bool streams;
};
template <int kDt, bool kLayer, int K, int kMaxThreads, int kMinBlocks, bool kStream,
          bool kCluster>
constexpr PlainKernel plain_shape() {
  return {norm_fwd_plain_kernel<kDt, kLayer, K, kMaxThreads, kMinBlocks, kStream, kCluster>,
          kMinBlocks, kStream};
}

// The kernel of each shape (norm_plan.h): 8 slices a thread in up to 128 threads six blocks an
// SM or 256 three, 4 in up to kPlainNarrowThreads four blocks an SM or kNormMaxThreads two. The
// LayerNorm in 256 threads streams x and y: one H200, % of copy, direct timing, 79-87 -> 89.5 at
// 16384 columns (91 with a bf16 weight), level at 12288; at 8192 (and for RMSNorm) it lost,
// 91.6 -> 89.
constexpr int kPlainNarrow8 = 6, kPlainWide8 = 3, kPlainNarrow4 = 4, kPlainWide4 = 2;
template <int kDt, bool kCluster>
PlainKernel plain_kernel(bool layer, int slices, bool wide) {
  constexpr int N = kPlainNarrowThreads;
  if (slices == 8) {
    if (layer)
      return wide ? plain_shape<kDt, true, 8, N, kPlainWide8, true, kCluster>()
                  : plain_shape<kDt, true, 8, N / 2, kPlainNarrow8, false, kCluster>();
    return wide ? plain_shape<kDt, false, 8, N, kPlainWide8, false, kCluster>()
                : plain_shape<kDt, false, 8, N / 2, kPlainNarrow8, false, kCluster>();
  }
  if (layer) return plain_shape<kDt, true, 4, N, kPlainNarrow4, false, kCluster>();
  return wide ? plain_shape<kDt, false, 4, kNormMaxThreads, kPlainWide4, false, kCluster>()
              : plain_shape<kDt, false, 4, N, kPlainNarrow4, false, kCluster>();
}

template <int kDt>
cudaError_t launch_norm_fwd_plain(const NormArgs& a, NormPlan& p, int slices, int sms,
                                  int64_t ahead_bytes, cudaStream_t stream) {
  constexpr int N = kPlainNarrowThreads;
  const bool wide = slices == 8 ? p.threads > N / 2 : p.threads > N;
  const bool cluster = p.cluster > 1;
  const PlainKernel k = cluster ? plain_kernel<kDt, true>(a.layer_norm, slices, wide)
                                : plain_kernel<kDt, false>(a.layer_norm, slices, wide);
  // A block fetches into L2 its share of the row one wave of blocks ahead where the kernel
  // streams x and y past the caches, else the row ahead_bytes of x ahead, at most a wave.
  const int wave = sms * k.per_sm / p.cluster;
  const int64_t row_bytes = int64_t(p.nslices) * 16;  // of x, 16-bit
  int ahead = 0;
  if (ahead_bytes > 0)
    ahead = k.streams ? wave : int(std::clamp<int64_t>(ahead_bytes / row_bytes, 1, wave));
  return cluster ? launch_rows<true>(k.kernel, a, p, sms, stream, 0, false, ahead)
                 : launch_rows<false>(k.kernel, a, p, sms, stream, 0, false, ahead);
}

}  // namespace ssm
