// The lean forward and backward for the calls most models make: one group, no gate, every
// row-shaped operand of one dtype and 16-byte aligned, at most 2 slices a thread of a 512-thread
// segment (8192 16-bit columns). The general kernels (norm_kernels.cuh) spend about 49
// instructions an element on their run-time options, re-checked slice by slice, and issue for
// 60% of the cycles (ncu, 4096 bf16 columns), so they cannot reach the bandwidth. These decide
// the options once a row, keep the weight in registers for the whole walk down the rows (a
// thread's columns never change), and load the next row while they reduce and store this one.
// Included only by the instantiation files, one (K, kDt) per file.
#pragma once

#include "norm_device.cuh"
#include "norm_plan.h"

namespace ssm {

namespace norm_detail {

// A thread's K slices (lane + k * threads): whether each lies in the row, its first column, and
// its scale w (weight, + 1 when zero-centred, or 1), kept for the whole walk down the rows.
template <int K>
__device__ __forceinline__ void thread_columns(const NormArgs& a, const NormPlan& p, int lane,
                                               bool (&valid)[K], int64_t (&col)[K],
                                               Slice (&w)[K]) {
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int v = lane + k * p.threads;
    valid[k] = v < p.nslices;
    col[k] = int64_t(v) * kSlice;
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

}  // namespace norm_detail

template <int K, int kDt>
__global__ void __launch_bounds__(kNormMaxThreads) norm_fwd_fast_kernel(const NormArgs a,
                                                                        const NormPlan p) {
  using namespace norm_detail;
  constexpr Dtype D = Dtype(kDt);
  // Two buffers used in turn: one barrier a reduction (segment_sum with red_free).
  __shared__ float red[2][kNormMaxThreads / 32];
  const int T = p.threads;
  const int lane = threadIdx.x & (T - 1);
  const int slots = blockDim.x / T;
  const int64_t step = int64_t(gridDim.x) * slots;
  const float inv_len = 1.f / float(a.hidden);
  const bool residual = a.residual.present();

  bool valid[K];
  int64_t col[K];
  Slice w[K];
  thread_columns(a, p, lane, valid, col, w);

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

  int64_t r = int64_t(blockIdx.x) * slots + threadIdx.x / T;
  fetch(r);
  int phase = 0;
  // Every thread of the block runs the same number of iterations: segment_sum synchronises.
  for (int64_t base = int64_t(blockIdx.x) * slots; base < a.rows; base += step, r += step) {
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
      phase ^= 1;
      var = dev[0] * inv_len;
    }
    const float rstd = rsqrtf(var + a.eps);
    if (!row_ok) continue;
    if (lane == 0) {
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
}

// The backward's lean kernel: the terms of norm_bwd_kernel without a gate, with dweight and dbias
// summed in registers over the rows a thread visits (the plan is the fused one of norm_cuda.cu).
template <int kDt>
__global__ void __launch_bounds__(kNormMaxThreads) norm_bwd_fast_kernel(const NormArgs a,
                                                                        const NormPlan p) {
  using namespace norm_detail;
  constexpr int K = kFastBwdSlices;
  constexpr Dtype D = Dtype(kDt);
  __shared__ float red[2][kNormMaxThreads / 32 * 2];
  const Place at(a, p);
  const int T = p.threads;
  const int64_t step = int64_t(gridDim.x) * at.slots;
  const float inv_len = 1.f / float(a.hidden);
  const bool dres_in = a.dresidual_out.present();

  bool valid[K];
  int64_t col[K];
  Slice w[K], dw[K] = {}, db[K] = {};
  thread_columns(a, p, at.lane, valid, col, w);

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

  int64_t r = int64_t(blockIdx.x) * at.slots + at.slot;
  fetch(r);
  int phase = 0;
  // Every thread of the block runs the same number of iterations: segment_sum synchronises.
  for (int64_t base = int64_t(blockIdx.x) * at.slots; base < a.rows; base += step, r += step) {
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
}

template <int K, int kDt>
cudaError_t launch_norm_fwd_fast(const NormArgs& a, NormPlan& p, int sms, cudaStream_t stream) {
  int per_sm = 0;
  const cudaError_t err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      &per_sm, norm_fwd_fast_kernel<K, kDt>, p.block, 0);
  if (err != cudaSuccess) return err;
  // Persistent: as many blocks as run at once, at most one per `slots` rows.
  p.row_blocks = std::min<int64_t>(p.row_blocks, int64_t(std::max(per_sm, 1)) * sms);
  norm_fwd_fast_kernel<K, kDt><<<unsigned(p.row_blocks), p.block, 0, stream>>>(a, p);
  return cudaGetLastError();
}

template <int kDt>
cudaError_t launch_norm_bwd_fast(const NormArgs& a, const NormPlan& p, cudaStream_t stream) {
  norm_bwd_fast_kernel<kDt><<<unsigned(p.row_blocks), p.block, 0, stream>>>(a, p);
  return cudaGetLastError();
}

}  // namespace ssm
