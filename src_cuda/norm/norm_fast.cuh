// The lean forward and backward for the calls most models make: one group, no gate, every
// row-shaped operand of one dtype and 16-byte aligned. The general kernels (norm_kernels.cuh)
// spend about 49 instructions an element on their run-time options, re-checked slice by slice,
// and issue for 60% of the cycles (ncu, 4096 bf16 columns), so they cannot reach the bandwidth.
// These decide the options once a row, keep the weight in registers for the whole walk down the
// rows (a thread's columns never change), and load the next row while they reduce and store this
// one. A CTA of up to 512 threads keeps 2 slices a thread (8192 16-bit columns); longer
// segments, up to 65536 columns, are shared by the CTAs of a thread-block cluster (kCluster,
// sm_90 and later; norm_plan.h) that add their partial sums through distributed shared memory,
// so every row is still read from DRAM once. Included only by the instantiation files.
#pragma once

#include <cooperative_groups.h>

#include <algorithm>

#include "norm_device.cuh"
#include "norm_plan.h"

namespace ssm {

namespace norm_detail {

// A thread's K slices (lane + k * threads of its block's share): whether each lies in the row,
// its first column, and its scale w (weight, + 1 when zero-centred, or 1), kept for the whole
// walk down the rows.
template <int K>
__device__ __forceinline__ void thread_columns(const NormArgs& a, const NormPlan& p,
                                               const Place& at, bool (&valid)[K],
                                               int64_t (&col)[K], Slice (&w)[K]) {
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int v = at.lane + k * p.threads;
    valid[k] = v < at.limit;
    col[k] = int64_t(at.first + v) * kSlice;  // one group: at.col0 without its group term
    if (valid[k] && a.weight.present()) {
      fetch_slice(a.weight.data, a.weight.dtype, col[k], kSlice, true, w[k]);
      widen_slice(a.weight.dtype, true, w[k]);
    } else {
#pragma unroll
      for (int e = 0; e < kSlice; ++e) w[k][e] = 1.f;
    }
    if (a.zero_centered_weight) {
#pragma unroll
      for (int e = 0; e < kSlice; ++e) w[k][e] += 1.f;
    }
  }
}

// With kCluster, adds the M block totals of the cluster's CTAs (each CTA's thread 0 leaves its
// own in `mine`), in rank order through a butterfly over 8 lanes: every thread of every CTA gets
// the same bits. The cluster barrier between the write and the reads also means that when a CTA
// writes `mine` again two calls later, every CTA has read this call's: callers alternate two.
template <bool kCluster, int M>
__device__ __forceinline__ void cluster_sum(float (&v)[M], float (&mine)[M], int ranks) {
  if constexpr (kCluster) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    static_assert(kMaxCluster <= 8, "the butterfly below spans 8 lanes");
    if (threadIdx.x == 0) {
#pragma unroll
      for (int i = 0; i < M; ++i) mine[i] = v[i];
    }
    __cluster_barrier_arrive();
    __cluster_barrier_wait();
    const int lane = threadIdx.x & 31;
    const float* theirs = cooperative_groups::this_cluster().map_shared_rank(&mine[0], lane & 7);
#pragma unroll
    for (int i = 0; i < M; ++i) {
      float t = lane < ranks ? theirs[i] : 0.f;
#pragma unroll
      for (int o = 1; o < 8; o <<= 1) t += __shfl_xor_sync(0xffffffffu, t, o);
      v[i] = __shfl_sync(0xffffffffu, t, 0);
    }
#endif
  }
}

// With kCluster, keeps the block's shared memory alive until every CTA of the cluster is done
// reading it.
template <bool kCluster>
__device__ __forceinline__ void cluster_done() {
  if constexpr (kCluster) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    __cluster_barrier_arrive();
    __cluster_barrier_wait();
#endif
  }
}

}  // namespace norm_detail

template <int K, int kDt, bool kCluster>
__global__ void __launch_bounds__(kNormMaxThreads) norm_fwd_fast_kernel(const NormArgs a,
                                                                        const NormPlan p) {
  using namespace norm_detail;
  constexpr Dtype D = Dtype(kDt);
  // Two buffers used in turn: one barrier a reduction (segment_sum with red_free, cluster_sum).
  __shared__ float red[2][kNormMaxThreads / 32];
  __shared__ float totals[2][1];
  const Place at(a, p, kCluster);
  const int T = p.threads;
  const int slots = at.slots;
  const int64_t step = int64_t(kCluster ? gridDim.x / p.cluster : gridDim.x) * slots;
  const float inv_len = 1.f / float(a.hidden);
  const bool residual = a.residual.present();

  bool valid[K];
  int64_t col[K];
  Slice w[K];
  thread_columns(a, p, at, valid, col, w);

  // x and residual of row r, still packed: loads only, so the next row's are in flight while
  // this row is reduced and stored.
  Slice xs[K], rs[K];
  auto fetch = [&](int64_t r) {
#pragma unroll
    for (int k = 0; k < K; ++k) {
      if (!valid[k] || r >= a.rows) continue;
      fetch_slice(a.x.data, D, r * a.x.stride[0] + col[k], kSlice, true, xs[k]);
      if (residual)
        fetch_slice(a.residual.data, D, r * a.residual.stride[0] + col[k], kSlice, true, rs[k]);
    }
  };

  int64_t r = at.row_block * slots + at.slot;
  fetch(r);
  int phase = 0;
  // Every thread of the block (of the cluster) runs the same number of iterations: segment_sum
  // and cluster_sum synchronise.
  for (int64_t base = at.row_block * slots; base < a.rows; base += step, r += step) {
    Slice g[K], t[K];
#pragma unroll
    for (int k = 0; k < K; ++k)
#pragma unroll
      for (int e = 0; e < kSlice; ++e) g[k][e] = xs[k][e], t[k][e] = rs[k][e];
    fetch(r + step);
    const bool row_ok = r < a.rows;
    float acc[1] = {0.f};
#pragma unroll
    for (int k = 0; k < K; ++k) {
      widen_slice(D, true, g[k]);
      if (residual) {
        widen_slice(D, true, t[k]);
#pragma unroll
        for (int e = 0; e < kSlice; ++e) g[k][e] += t[k][e];
      }
      if (row_ok && valid[k] && a.residual_out.present())
        store_slice(a.residual_out.data, D, r * a.residual_out.stride[0] + col[k], kSlice, true,
                    g[k]);
      if (!valid[k] || !row_ok) {
#pragma unroll
        for (int e = 0; e < kSlice; ++e) g[k][e] = 0.f;
      }
#pragma unroll
      for (int e = 0; e < kSlice; ++e) acc[0] += a.layer_norm ? g[k][e] : g[k][e] * g[k][e];
    }
    segment_sum(acc, T, red[phase], true);
    cluster_sum<kCluster>(acc, totals[phase], p.cluster);
    phase ^= 1;
    float mean = 0.f, var = acc[0] * inv_len;
    if (a.layer_norm) {
      mean = var;
      float dev[1] = {0.f};
#pragma unroll
      for (int k = 0; k < K; ++k)
#pragma unroll
        for (int e = 0; e < kSlice; ++e) {
          const float d = g[k][e] - mean;
          dev[0] += valid[k] ? d * d : 0.f;
        }
      segment_sum(dev, T, red[phase], true);
      cluster_sum<kCluster>(dev, totals[phase], p.cluster);
      phase ^= 1;
      var = dev[0] * inv_len;
    }
    const float rstd = rsqrtf(var + a.eps);
    if (!row_ok) continue;
    if (at.lane == 0 && at.first == 0) {
      if (a.mean.present()) store_stat(a.mean, r, 0, mean);
      if (a.rstd.present()) store_stat(a.rstd, r, 0, rstd);
    }
#pragma unroll
    for (int k = 0; k < K; ++k) {
      if (!valid[k]) continue;
#pragma unroll
      for (int e = 0; e < kSlice; ++e) g[k][e] = (g[k][e] - mean) * rstd * w[k][e];
      if (a.bias.present()) {
        fetch_slice(a.bias.data, a.bias.dtype, col[k], kSlice, true, t[k]);
        widen_slice(a.bias.dtype, true, t[k]);
#pragma unroll
        for (int e = 0; e < kSlice; ++e) g[k][e] += t[k][e];
      }
      store_slice(a.y.data, D, r * a.y.stride[0] + col[k], kSlice, true, g[k]);
    }
  }
  cluster_done<kCluster>();
}

// The backward's lean kernel: the terms of norm_bwd_kernel without a gate, with dweight and dbias
// summed in registers over the rows a thread visits (the plan is the fused one of norm_cuda.cu).
template <int kDt, bool kCluster>
__global__ void __launch_bounds__(kNormMaxThreads) norm_bwd_fast_kernel(const NormArgs a,
                                                                        const NormPlan p) {
  using namespace norm_detail;
  constexpr int K = kFastBwdSlices;
  constexpr Dtype D = Dtype(kDt);
  __shared__ float red[2][kNormMaxThreads / 32 * 2];
  __shared__ float totals[2][2];
  const Place at(a, p, kCluster);
  const int T = p.threads;
  const int64_t step = int64_t(kCluster ? gridDim.x / p.cluster : gridDim.x) * at.slots;
  const float inv_len = 1.f / float(a.hidden);
  const bool dres_in = a.dresidual_out.present();

  bool valid[K];
  int64_t col[K];
  Slice w[K], dw[K] = {}, db[K] = {};
  thread_columns(a, p, at, valid, col, w);

  // Row r's x, dy, dresidual_out (packed) and statistics, loaded a row ahead.
  Slice xs[K], dys[K], dos[K];
  float mean_next = 0.f, rstd_next = 0.f;
  auto fetch = [&](int64_t r) {
    if (r >= a.rows) return;
    mean_next = a.layer_norm ? load_stat(a.mean, r, 0) : 0.f;
    rstd_next = load_stat(a.rstd, r, 0);
#pragma unroll
    for (int k = 0; k < K; ++k) {
      if (!valid[k]) continue;
      fetch_slice(a.x.data, D, r * a.x.stride[0] + col[k], kSlice, true, xs[k]);
      fetch_slice(a.dy.data, D, r * a.dy.stride[0] + col[k], kSlice, true, dys[k]);
      if (dres_in)
        fetch_slice(a.dresidual_out.data, D, r * a.dresidual_out.stride[0] + col[k], kSlice,
                    true, dos[k]);
    }
  };

  int64_t r = at.row_block * at.slots + at.slot;
  fetch(r);
  int phase = 0;
  // Every thread of the block (of the cluster) runs the same number of iterations: segment_sum
  // and cluster_sum synchronise.
  for (int64_t base = at.row_block * at.slots; base < a.rows; base += step, r += step) {
    Slice xhat[K], dye[K], wdy[K];
#pragma unroll
    for (int k = 0; k < K; ++k)
#pragma unroll
      for (int e = 0; e < kSlice; ++e) xhat[k][e] = xs[k][e], dye[k][e] = dys[k][e],
                                       wdy[k][e] = dos[k][e];
    const float mean = mean_next, rstd = rstd_next;
    fetch(r + step);
    const bool row_ok = r < a.rows;
    float acc[2] = {0.f, 0.f};
#pragma unroll
    for (int k = 0; k < K; ++k) {
      widen_slice(D, true, xhat[k]);
      widen_slice(D, true, dye[k]);
      const bool live = valid[k] && row_ok;
#pragma unroll
      for (int e = 0; e < kSlice; ++e) {
        xhat[k][e] = live ? (xhat[k][e] - mean) * rstd : 0.f;
        dye[k][e] = live ? dye[k][e] : 0.f;
        dw[k][e] += dye[k][e] * xhat[k][e];
        db[k][e] += dye[k][e];
        const float t = w[k][e] * dye[k][e];
        acc[0] += t * xhat[k][e];
        acc[1] += t;
      }
    }
    segment_sum(acc, T, red[phase], true);
    cluster_sum<kCluster>(acc, totals[phase], p.cluster);
    phase ^= 1;
    const float c1 = acc[0] * inv_len;
    const float c2 = a.layer_norm ? acc[1] * inv_len : 0.f;
    if (!row_ok) continue;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      if (!valid[k]) continue;
      if (dres_in) widen_slice(D, true, wdy[k]);
#pragma unroll
      for (int e = 0; e < kSlice; ++e) {
        const float ds = rstd * (w[k][e] * dye[k][e] - xhat[k][e] * c1 - c2);
        wdy[k][e] = dres_in ? ds + wdy[k][e] : ds;
      }
      if (a.dx.present())
        store_slice(a.dx.data, D, r * a.dx.stride[0] + col[k], kSlice, true, wdy[k]);
      if (a.dresidual.present())
        store_slice(a.dresidual.data, D, r * a.dresidual.stride[0] + col[k], kSlice, true,
                    wdy[k]);
    }
  }
  if (p.partial != nullptr) write_partial_sums(a, p, at, dw, db);
  cluster_done<kCluster>();
}

// Launches `kernel` on p.row_blocks blocks, or clusters of p.cluster blocks, lowered first to
// as many as run at once (the kernels walk down the rows persistently).
template <bool kCluster>
cudaError_t launch_persistent(void (*kernel)(NormArgs, NormPlan), const NormArgs& a, NormPlan& p,
                              int sms, cudaStream_t stream) {
  cudaLaunchConfig_t config = {};
  config.blockDim = dim3(unsigned(p.block));
  config.stream = stream;
  cudaLaunchAttribute cluster;
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = unsigned(p.cluster);
  cluster.val.clusterDim.y = cluster.val.clusterDim.z = 1;
  int fit = 0;
  cudaError_t err = cudaSuccess;
  if constexpr (kCluster) {
    config.attrs = &cluster;
    config.numAttrs = 1;
    config.gridDim = dim3(unsigned(p.cluster * std::min<int64_t>(p.row_blocks, sms)));
    err = cudaOccupancyMaxActiveClusters(&fit, kernel, &config);
    if (err != cudaSuccess || fit == 0) {
      cudaGetLastError();
      return cudaErrorInvalidClusterSize;
    }
  } else {
    err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&fit, kernel, p.block, 0);
    if (err != cudaSuccess) return err;
    fit *= sms;
  }
  p.row_blocks = std::min<int64_t>(p.row_blocks, std::max(fit, 1));
  config.gridDim = dim3(unsigned(p.row_blocks * p.cluster));
  return cudaLaunchKernelEx(&config, kernel, a, p);
}

template <int K, int kDt, bool kCluster>
cudaError_t launch_norm_fwd_fast(const NormArgs& a, NormPlan& p, int sms, cudaStream_t stream) {
  return launch_persistent<kCluster>(norm_fwd_fast_kernel<K, kDt, kCluster>, a, p, sms, stream);
}

template <int kDt, bool kCluster>
cudaError_t launch_norm_bwd_fast(const NormArgs& a, NormPlan& p, int sms, cudaStream_t stream) {
  if constexpr (kCluster) {
    return launch_persistent<true>(norm_bwd_fast_kernel<kDt, true>, a, p, sms, stream);
  } else {
    norm_bwd_fast_kernel<kDt, false><<<unsigned(p.row_blocks), p.block, 0, stream>>>(a, p);
    return cudaGetLastError();
  }
}

}  // namespace ssm
