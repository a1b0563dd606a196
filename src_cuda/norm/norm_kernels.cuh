// The fused-norm row kernels and their launchers; included only by the instantiation files
// (instantiations/*.cu), one (K, kDt, kTail) per file. The segment layout is described in
// norm_plan.h.
#pragma once

#include "norm_device.cuh"
#include "norm_plan.h"

namespace ssm {

namespace norm_detail {

// The slices a thread keeps (k < K), or one slice v of the remainder, of row r.
template <int K>
__device__ __forceinline__ Slices<K> kept_slices(const NormArgs& a, const NormPlan& p,
                                                 const Place& at, int64_t r, bool row_ok) {
  Slices<K> s;
  s.row = r;
  s.vec = p.vec;
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int v = at.lane + k * p.threads;
    s.col[k] = at.col0 + int64_t(v) * kSlice;
    const int64_t left = a.group_size - int64_t(v) * kSlice;
    s.n[k] = row_ok && v < p.nslices ? int(left < kSlice ? left : kSlice) : 0;
  }
  return s;
}

__device__ __forceinline__ Slices<1> one_slice(const NormArgs& a, const Place& at, bool vec,
                                               int64_t r, int v) {
  Slices<1> s;
  s.row = r;
  s.vec = vec;
  s.col[0] = at.col0 + int64_t(v) * kSlice;
  const int64_t left = a.group_size - int64_t(v) * kSlice;
  s.n[0] = int(left < kSlice ? left : kSlice);
  return s;
}

template <int N>
__device__ __forceinline__ float sum_of(const Slice (&v)[N], bool squares) {
  float acc = 0.f;
#pragma unroll
  for (int k = 0; k < N; ++k)
#pragma unroll
    for (int e = 0; e < kSlice; ++e) acc += squares ? v[k][e] * v[k][e] : v[k][e];
  return acc;
}

// Sum of (g - mean)^2 over the valid elements (padding reads as 0, which is not the mean).
template <int N>
__device__ __forceinline__ float deviation_of(const Slice (&g)[N], const Slices<N>& s,
                                              float mean) {
  float acc = 0.f;
#pragma unroll
  for (int k = 0; k < N; ++k)
#pragma unroll
    for (int e = 0; e < kSlice; ++e) {
      const float d = g[k][e] - mean;
      acc += e < s.n[k] ? d * d : 0.f;
    }
  return acc;
}

}  // namespace norm_detail

// Up to 2 slices, registers are capped at 64 so two 512-thread blocks fit an SM (4096 bf16
// columns: 2.85 -> 3.22 TB/s); at 4 slices the same cap spills kilobytes and runs at a third.
template <int K, int kDt, bool kTail>
__global__ void __launch_bounds__(kNormMaxThreads, K <= 2 ? 2 : 1)
    norm_fwd_kernel(const NormArgs a, const NormPlan p) {
  using namespace norm_detail;
  __shared__ float red[kNormMaxThreads / 32];
  const Place at(a, p);
  const int T = p.threads;
  const float inv_len = 1.f / float(a.group_size);
  const bool rms = !a.layer_norm;
  // Every thread of the block runs the same number of iterations: segment_sum synchronises.
  for (int64_t base = at.row_block * at.slots; base < a.rows;
       base += p.row_blocks * at.slots) {
    const int64_t r = base + at.slot;
    const bool row_ok = r < a.rows;
    const Slices<K> s = kept_slices<K>(a, p, at, r, row_ok);
    Slice g[K], t[K];
    load_g<kDt>(a, s, true, g, t);
    float acc[1] = {sum_of(g, rms)};
    for (int v = at.lane + K * T; kTail && row_ok && v < p.nslices; v += T) {
      Slice g1[1], t1[1];
      load_g<kDt>(a, one_slice(a, at, p.vec, r, v), true, g1, t1);
      acc[0] += sum_of(g1, rms);
    }
    segment_sum(acc, T, red);

    float mean = 0.f, var = acc[0] * inv_len;
    if (!rms) {
      // Second pass about the mean: no cancellation, unlike E[g^2] - E[g]^2.
      mean = var;
      float dev[1] = {deviation_of(g, s, mean)};
      for (int v = at.lane + K * T; kTail && row_ok && v < p.nslices; v += T) {
        const Slices<1> s1 = one_slice(a, at, p.vec, r, v);
        Slice g1[1], t1[1];
        load_g<kDt>(a, s1, false, g1, t1);
        dev[0] += deviation_of(g1, s1, mean);
      }
      segment_sum(dev, T, red);
      var = dev[0] * inv_len;
    }
    const float rstd = rsqrtf(var + a.eps);
    if (row_ok && at.lane == 0) {
      if (a.mean.present()) store_stat(a.mean, r, at.group, mean);
      if (a.rstd.present()) store_stat(a.rstd, r, at.group, rstd);
    }
    store_y<kDt>(a, s, mean, rstd, g, t);
    for (int v = at.lane + K * T; kTail && row_ok && v < p.nslices; v += T) {
      const Slices<1> s1 = one_slice(a, at, p.vec, r, v);
      Slice g1[1], t1[1];
      load_g<kDt>(a, s1, false, g1, t1);
      store_y<kDt>(a, s1, mean, rstd, g1, t1);
    }
  }
}

// The backward. With p.partial set, each thread also sums dweight and dbias over the rows it
// visits for its kept slices (the plan only sets it when the segment fits in them); the block
// then adds its slots together in slot order and writes one partial row per row block, which
// norm_cuda.cu reduces over row blocks in a fixed order.
template <int K, int kDt, bool kTail>
__global__ void __launch_bounds__(kNormMaxThreads) norm_bwd_kernel(const NormArgs a,
                                                                   const NormPlan p) {
  using namespace norm_detail;
  __shared__ float red[kNormMaxThreads / 32 * 2];
  const Place at(a, p);
  const int T = p.threads;
  const float inv_len = 1.f / float(a.group_size);
  Slice dw[K] = {}, db[K] = {};
  for (int64_t base = at.row_block * at.slots; base < a.rows;
       base += p.row_blocks * at.slots) {
    const int64_t r = base + at.slot;
    const bool row_ok = r < a.rows;
    const float mean = row_ok && a.layer_norm ? load_stat(a.mean, r, at.group) : 0.f;
    const float rstd = row_ok ? load_stat(a.rstd, r, at.group) : 0.f;
    const Slices<K> s = kept_slices<K>(a, p, at, r, row_ok);
    Slice xhat[K], wdy[K], t[K];
    backward_terms<kDt>(a, s, mean, rstd, xhat, t, wdy);
    float acc[2] = {0.f, 0.f};
#pragma unroll
    for (int k = 0; k < K; ++k)
#pragma unroll
      for (int e = 0; e < kSlice; ++e) {
        acc[0] += wdy[k][e] * xhat[k][e];
        acc[1] += wdy[k][e];
        dw[k][e] += t[k][e] * xhat[k][e];
        db[k][e] += t[k][e];
      }
    for (int v = at.lane + K * T; kTail && row_ok && v < p.nslices; v += T) {
      Slice x1[1], d1[1], w1[1];
      backward_terms<kDt>(a, one_slice(a, at, p.vec, r, v), mean, rstd, x1, d1, w1);
#pragma unroll
      for (int e = 0; e < kSlice; ++e) {
        acc[0] += w1[0][e] * x1[0][e];
        acc[1] += w1[0][e];
      }
    }
    segment_sum(acc, T, red);
    const float c1 = acc[0] * inv_len;
    const float c2 = a.layer_norm ? acc[1] * inv_len : 0.f;
    store_grads<kDt>(a, s, rstd, c1, c2, xhat, wdy, t);
    for (int v = at.lane + K * T; kTail && row_ok && v < p.nslices; v += T) {
      const Slices<1> s1 = one_slice(a, at, p.vec, r, v);
      Slice x1[1], d1[1], w1[1];
      backward_terms<kDt>(a, s1, mean, rstd, x1, d1, w1);
      store_grads<kDt>(a, s1, rstd, c1, c2, x1, w1, d1);
    }
  }
  if (p.partial != nullptr) write_partial_sums(a, p, at, dw, db);
}

template <int K, int kDt, bool kTail>
cudaError_t launch_norm_fwd(const NormArgs& a, const NormPlan& p, cudaStream_t stream) {
  norm_fwd_kernel<K, kDt, kTail><<<unsigned(p.row_blocks * a.ngroups), p.block, 0, stream>>>(a, p);
  return cudaGetLastError();
}

template <int K, int kDt, bool kTail>
cudaError_t launch_norm_bwd(const NormArgs& a, const NormPlan& p, cudaStream_t stream) {
  norm_bwd_kernel<K, kDt, kTail><<<unsigned(p.row_blocks * a.ngroups), p.block, 0, stream>>>(a, p);
  return cudaGetLastError();
}

template <int K, int kDt, bool kTail>
int norm_bwd_blocks_per_sm(int block) {
  int n = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, norm_bwd_kernel<K, kDt, kTail>, block,
                                                    0) !=
      cudaSuccess) {
    cudaGetLastError();  // or the next launch would report this failure as its own
    return 1;
  }
  return n > 0 ? n : 1;
}

}  // namespace ssm
