// Device helpers the fused-norm kernels share (norm_kernels.cuh and the column sums in
// norm_cuda.cu): where a thread's segment lies, segment-wide sums, and the pieces of the forward
// and backward formulas of libssm/norm.h, each applied to N slices at once.
//
// Every helper issues the loads of all N slices before it uses or stores any of them: a store
// between two loads would stop the compiler from hoisting the second (it cannot rule out that
// they alias), leaving one slice's worth of loads in flight per thread instead of N.
#pragma once

#include <cstdint>

#include "../common/device_math.cuh"
#include "norm_plan.h"
#include "norm_vec.cuh"

namespace ssm {
namespace norm_detail {

// A group of at most kMax lanes (a power of two, at most 32): the bound of a combine's unrolled
// loop, whose uniform guards stop at the group's width.
template <int kMax>
struct Lanes {};

// Combines M values over the `threads` threads of each segment with `combine(v, width,
// Lanes<kMax>())` (which combines v over each aligned group of min(width, kMax) lanes, width a
// power of two, giving every lane of a group the same bits), so every thread gets the same result:
// within each warp, then the segment's warp partials (`threads` <= kMaxThreads <= 1024: at most
// 32) across the lanes of every warp again, each lane group reading them in the same positions.
// `threads` is a power of two, or, with kWholeWarps and one segment spanning the block, any
// multiple of 32: the warp partials are then padded with zeros to a power of two, so `combine`
// must take zeros for nothing (sums; moments, whose zeros are an empty set). `red` is
// shared memory of (blockDim / 32) * M floats. Called by every thread of the block. `red_free`
// says no thread may still be reading `red` from an earlier call (the caller alternates two
// buffers, so the barrier of the call in between has seen to it); otherwise a barrier waits for
// them. The loops are unrolled with uniform guards: a run-time loop over the warps cost the lean
// backward ~10% of its instructions.
template <int M, int kMaxThreads, bool kWholeWarps = false, class Combine>
__device__ __forceinline__ void segment_reduce(float (&v)[M], int threads, float* red,
                                               bool red_free, Combine combine) {
  static_assert(kMaxThreads <= 32 * 32, "the warp partials fit one warp");
  combine(v, threads, Lanes<32>());
  if (threads <= 32) return;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (!red_free) __syncthreads();
  if (lane == 0) {
#pragma unroll
    for (int i = 0; i < M; ++i) red[warp * M + i] = v[i];
  }
  __syncthreads();
  const int warps = threads >> 5;
  // The warps rounded up to a power of two.
  const int span = kWholeWarps ? 1 << (32 - __clz(warps - 1)) : warps;
  const int from = (warp & ~(span - 1)) + (lane & (span - 1));
  const bool held = !kWholeWarps || (lane & (span - 1)) < warps;
#pragma unroll
  for (int i = 0; i < M; ++i) v[i] = held ? red[from * M + i] : 0.f;
  combine(v, span, Lanes<kMaxThreads / 32>());
}

// Sums over each group of lanes: butterflies, in which both lanes of a pair add the same two
// values.
struct GroupSum {
  template <int M, int kMax>
  __device__ __forceinline__ void operator()(float (&v)[M], int width, Lanes<kMax>) const {
#pragma unroll
    for (int o = 1; o < kMax; o <<= 1) {
      if (o >= width) break;
      float other[M];
#pragma unroll
      for (int i = 0; i < M; ++i) other[i] = __shfl_xor_sync(0xffffffffu, v[i], o);
#pragma unroll
      for (int i = 0; i < M; ++i) v[i] += other[i];
    }
  }
};

// Sums M values over the `threads` threads of each segment (segment_reduce).
template <int M, int kMaxThreads = kNormMaxThreads, bool kWholeWarps = false>
__device__ __forceinline__ void segment_sum(float (&v)[M], int threads, float* red,
                                            bool red_free = false) {
  segment_reduce<M, kMaxThreads, kWholeWarps>(v, threads, red, red_free, GroupSum());
}

// Moments of a set of elements: {mean, m2 (the sum of squared deviations from the mean),
// count}.
using Moments = float[3];

// Two ways to combine the moments of each group of lanes from each lane's own (an empty set as
// zeros), both one division a group where Chan, Golub and LeVeque's pairwise merge at every
// butterfly level took a division a level (~25 instructions a level; ~11 where every lane held
// as many elements, a halving instead), against ~6 here. Both give every lane of a group the
// same bits (GroupSum). One H200, bf16, % of copy, direct timing (benchmarks/NOTES_norm.md,
// twenty-second session): LayerNorm alone, the pairwise merges / ShiftedMoments, 76 / 90 at
// 18432 columns, 73 / 91 at 21504, 73 / 90 at 36864 (threads holding unequal counts), 87 / 91 at
// 40960 and 49152, 88 / 91 at 5120.
//
// ShiftedMoments: sums around c, the mean of the group's first lane (one holding the most): every
// lane's count, count (mean - c) and m2 + count (mean - c)^2 in one butterfly of three sums, then
// the group's mean c + s1 / n and m2 s2 - s1^2 / n. Stable: a set A of n_A elements within a set
// of n has n_A (mean_A - mean)^2 <= m2, so s2 <= (1 + n / n_A) m2 and the subtraction loses at
// most log2(1 + width) bits.
struct ShiftedMoments {
  template <int kMax>
  __device__ __forceinline__ void operator()(Moments& m, int width, Lanes<kMax> lanes) const {
    const float c = __shfl_sync(0xffffffffu, m[0], 0, width < kMax ? width : kMax);
    const float d = m[0] - c;
    float t[3] = {m[2], m[2] * d, fmaf(m[2] * d, d, m[1])};
    GroupSum()(t, width, lanes);
    const float shift = t[0] > 0.f ? t[1] * rcp_ftz(t[0]) : 0.f;
    m[0] = c + shift;
    m[1] = fmaxf(t[2] - t[1] * shift, 0.f);
    m[2] = t[0];
  }
};

// CenteredMoments: the group's count and sum in one butterfly, its mean, then every lane's m2 +
// count (mean_lane - mean)^2 summed in a second: no subtraction of large sums, and a longer chain
// of shuffles than ShiftedMoments.
struct CenteredMoments {
  template <int kMax>
  __device__ __forceinline__ void operator()(Moments& m, int width, Lanes<kMax> lanes) const {
    float t[2] = {m[2], m[2] * m[0]};
    GroupSum()(t, width, lanes);
    const float mean = t[0] > 0.f ? t[1] * rcp_ftz(t[0]) : 0.f;
    const float d = m[0] - mean;
    float q[1] = {fmaf(m[2] * d, d, m[1])};
    GroupSum()(q, width, lanes);
    m[0] = mean;
    m[1] = q[0];
    m[2] = t[0];
  }
};

// A segment's moments from each thread's own (threads holding none pass count 0), combined by
// Combine (ShiftedMoments or CenteredMoments): one round through shared memory, where the mean
// and then the deviations from it take two. `red`: 3 floats a warp, which no thread may still be
// reading from an earlier call.
template <int kMaxThreads, bool kWholeWarps = false, class Combine = ShiftedMoments>
__device__ __forceinline__ void segment_moments(Moments& m, int threads, float* red) {
  segment_reduce<3, kMaxThreads, kWholeWarps>(m, threads, red, true, Combine());
}

// Where a thread's work lies: its segment lane and slot, the group of its block and, when the
// CTAs of a cluster share each segment (`shared`, a compile-time constant in every caller, so
// the others keep none of this arithmetic), the block's share of it: consecutive slices from
// `first`, `limit` of them in the segment.
struct Place {
  int lane, slot, slots, first, limit;
  int64_t group, row_block, col0;  // col0: first column of the block's share
  __device__ __forceinline__ Place(const NormArgs& a, const NormPlan& p, bool shared = false) {
    lane = threadIdx.x & (p.threads - 1);
    slot = threadIdx.x / p.threads;
    slots = blockDim.x / p.threads;
    // A 1-D cluster's CTAs are consecutive blocks, rank = blockIdx.x % cluster.
    const int64_t unit = shared ? blockIdx.x / p.cluster : blockIdx.x;
    first = shared ? int(blockIdx.x % p.cluster) * p.cta_slices : 0;
    limit = shared ? min(p.cta_slices, p.nslices - first) : p.nslices;
    group = unit % a.ngroups;
    row_block = unit / a.ngroups;
    col0 = group * a.group_size + int64_t(first) * kSlice;
  }
};

// N slices of one row: first column and valid length of each; n == 0 marks a slice to skip
// (past the segment, or a row past the end), whose values read as 0.
template <int N>
struct Slices {
  int64_t row;
  int64_t col[N];
  int n[N];
  bool vec;
};

using Slice = float[kSlice];

// Each of R rows' sum within a lane, before its segment's reduction: term(sum, v, i, k) folded over
// the values v of each of the lane's K slices k of row i (value(i, k, f) gives them), kept where
// keep(k).
template <int R, int K, class Value, class Term, class Keep>
__device__ __forceinline__ void lane_row_sums(float (&sums)[R], Value value, Term term, Keep keep) {
#pragma unroll
  for (int i = 0; i < R; ++i) {
    sums[i] = 0.f;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      Slice f;
      value(i, k, f);
      float t = sums[i];
#pragma unroll
      for (int e = 0; e < kSlice; ++e) t = term(t, f[e], i, k);
      if (keep(k)) sums[i] = t;
    }
  }
}

// The backward's dweight and dbias sums of a block (each thread's, for slices lane + k * threads
// of its segment) written as partial row `at.row_block` of p.partial: the block's slots are added
// in slot order through shared memory (deterministic), one slice at a time. Called by every
// thread of the block.
// `bias`: whether dbias partials are written too (a compile-time constant in every caller).
template <int K>
__device__ __forceinline__ void write_partial_sums(const NormArgs& a, const NormPlan& p,
                                                  const Place& at, const Slice (&dw)[K],
                                                  const Slice (&db)[K], bool bias = true) {
  __shared__ float slot_sums[kNormMaxThreads * kSlice];
  auto emit = [&](const float(&mine)[kSlice], float* out, int v) {
    if (at.slots > 1) {
      __syncthreads();  // the previous slice's readers are done
#pragma unroll
      for (int e = 0; e < kSlice; ++e) slot_sums[threadIdx.x * kSlice + e] = mine[e];
      __syncthreads();
    }
    if (at.slot == 0 && v < at.limit) {
      const int64_t left = a.group_size - int64_t(at.first + v) * kSlice;
      const int n = int(left < kSlice ? left : kSlice);
#pragma unroll
      for (int e = 0; e < kSlice; ++e) {
        if (e >= n) break;
        float s = mine[e];
        for (int q = 1; q < at.slots; ++q) s += slot_sums[(q * p.threads + at.lane) * kSlice + e];
        out[v * kSlice + e] = s;
      }
    }
  };
  float* const out_w = p.partial + at.row_block * a.hidden + at.col0;
  float* const out_b = out_w + p.row_blocks * a.hidden;
#pragma unroll
  for (int k = 0; k < K; ++k) {
    emit(dw[k], out_w, at.lane + k * p.threads);
    if (bias) emit(db[k], out_b, at.lane + k * p.threads);
  }
}

// The dtype of a row-shaped operand: fixed at compile time in the kernels specialised for calls
// whose row-shaped operands all share one dtype (kDt >= 0), so loads and conversions compile to
// straight-line code; read from the tensor in the generic kernels (kDt < 0).
template <int kDt>
__device__ __forceinline__ Dtype row_dtype(const TensorRef& t) {
  return kDt < 0 ? t.dtype : Dtype(kDt);
}

template <int kDt, int N>
__device__ __forceinline__ void fetch_rows(const TensorRef& t, const Slices<N>& s,
                                           Slice (&v)[N]) {
#pragma unroll
  for (int k = 0; k < N; ++k) {
    if (s.n[k] > 0) {
      fetch_slice(t.data, row_dtype<kDt>(t), s.row * t.stride[0] + s.col[k], s.n[k], s.vec,
                  v[k]);
    } else {
#pragma unroll
      for (int e = 0; e < kSlice; ++e) v[k][e] = 0.f;
    }
  }
}

template <int kDt, int N>
__device__ __forceinline__ void widen_rows(const TensorRef& t, const Slices<N>& s,
                                           Slice (&v)[N]) {
#pragma unroll
  for (int k = 0; k < N; ++k) widen_slice(row_dtype<kDt>(t), s.vec, v[k]);
}

template <int kDt, int N>
__device__ __forceinline__ void load_rows(const TensorRef& t, const Slices<N>& s, Slice (&v)[N]) {
  fetch_rows<kDt>(t, s, v);
  widen_rows<kDt>(t, s, v);
}

template <int kDt, int N>
__device__ __forceinline__ void store_rows(const TensorRef& t, const Slices<N>& s,
                                           const Slice (&v)[N]) {
#pragma unroll
  for (int k = 0; k < N; ++k)
    if (s.n[k] > 0)
      store_slice(t.data, row_dtype<kDt>(t), s.row * t.stride[0] + s.col[k], s.n[k], s.vec, v[k]);
}

// A (hidden,) operand at the slices' columns (weight or bias).
template <int N>
__device__ __forceinline__ void load_cols(const TensorRef& t, const Slices<N>& s, Slice (&v)[N]) {
#pragma unroll
  for (int k = 0; k < N; ++k) {
    if (s.n[k] > 0) {
      fetch_slice(t.data, t.dtype, s.col[k], s.n[k], s.vec, v[k]);
    } else {
#pragma unroll
      for (int e = 0; e < kSlice; ++e) v[k][e] = 0.f;
    }
  }
#pragma unroll
  for (int k = 0; k < N; ++k) widen_slice(t.dtype, s.vec, v[k]);
}

// w[j]: weight (+1 when zero-centred), or 1 without a weight.
template <int N>
__device__ __forceinline__ void load_scale(const NormArgs& a, const Slices<N>& s,
                                           Slice (&w)[N]) {
  if (!a.weight.present()) {
#pragma unroll
    for (int k = 0; k < N; ++k)
#pragma unroll
      for (int e = 0; e < kSlice; ++e) w[k][e] = 1.f;
    return;
  }
  load_cols(a.weight, s, w);
  if (a.zero_centered_weight) {
#pragma unroll
    for (int k = 0; k < N; ++k)
#pragma unroll
      for (int e = 0; e < kSlice; ++e) w[k][e] += 1.f;
  }
}

// The normalised input g (formula in libssm/norm.h) into g; t is scratch. The forward's first
// visit passes write_residual so residual_out gets s exactly once.
template <int kDt, int N>
__device__ __forceinline__ void load_g(const NormArgs& a, const Slices<N>& s,
                                       bool write_residual, Slice (&g)[N], Slice (&t)[N]) {
  const bool gate = a.z.present() && !a.norm_before_gate;
  fetch_rows<kDt>(a.x, s, g);
  if (a.residual.present()) fetch_rows<kDt>(a.residual, s, t);
  else if (gate) fetch_rows<kDt>(a.z, s, t);
  widen_rows<kDt>(a.x, s, g);
  if (a.residual.present()) {
    widen_rows<kDt>(a.residual, s, t);
#pragma unroll
    for (int k = 0; k < N; ++k)
#pragma unroll
      for (int e = 0; e < kSlice; ++e) g[k][e] += t[k][e];
    if (write_residual && a.residual_out.present()) store_rows<kDt>(a.residual_out, s, g);
    if (gate) fetch_rows<kDt>(a.z, s, t);
  } else if (write_residual && a.residual_out.present()) {
    store_rows<kDt>(a.residual_out, s, g);
  }
  if (gate) {
    widen_rows<kDt>(a.z, s, t);
#pragma unroll
    for (int k = 0; k < N; ++k)
#pragma unroll
      for (int e = 0; e < kSlice; ++e) g[k][e] *= silu(t[k][e]);
  }
}

// y from g, given the segment's mean and rstd; g and t are overwritten.
template <int kDt, int N>
__device__ __forceinline__ void store_y(const NormArgs& a, const Slices<N>& s, float mean,
                                        float rstd, Slice (&g)[N], Slice (&t)[N]) {
  load_scale(a, s, t);
#pragma unroll
  for (int k = 0; k < N; ++k)
#pragma unroll
    for (int e = 0; e < kSlice; ++e) g[k][e] = (g[k][e] - mean) * rstd * t[k][e];
  if (a.bias.present()) {
    load_cols(a.bias, s, t);
#pragma unroll
    for (int k = 0; k < N; ++k)
#pragma unroll
      for (int e = 0; e < kSlice; ++e) g[k][e] += t[k][e];
  }
  if (a.z.present() && a.norm_before_gate) {
    load_rows<kDt>(a.z, s, t);
#pragma unroll
    for (int k = 0; k < N; ++k)
#pragma unroll
      for (int e = 0; e < kSlice; ++e) g[k][e] *= silu(t[k][e]);
  }
  store_rows<kDt>(a.y, s, g);
}

__device__ __forceinline__ void store_stat(const TensorRef& t, int64_t r, int64_t group,
                                           float v) {
  static_cast<float*>(t.data)[r * t.stride[0] + group * t.stride[1]] = v;
}

__device__ __forceinline__ float load_stat(const TensorRef& t, int64_t r, int64_t group) {
  return static_cast<const float*>(t.data)[r * t.stride[0] + group * t.stride[1]];
}

// The backward's per-element terms from the forward's inputs and statistics:
// xhat = (g - mean) * rstd, dye = the gradient reaching the affine output o, wdy = dye * w.
template <int kDt, int N>
__device__ __forceinline__ void backward_terms(const NormArgs& a, const Slices<N>& s, float mean,
                                               float rstd, Slice (&xhat)[N], Slice (&dye)[N],
                                               Slice (&wdy)[N]) {
  fetch_rows<kDt>(a.x, s, xhat);
  fetch_rows<kDt>(a.dy, s, dye);
  if (a.z.present()) fetch_rows<kDt>(a.z, s, wdy);
  widen_rows<kDt>(a.x, s, xhat);
  widen_rows<kDt>(a.dy, s, dye);
  if (a.z.present()) {
    widen_rows<kDt>(a.z, s, wdy);
#pragma unroll
    for (int k = 0; k < N; ++k)
#pragma unroll
      for (int e = 0; e < kSlice; ++e) {
        const float gate = silu(wdy[k][e]);
        if (a.norm_before_gate) dye[k][e] *= gate;
        else xhat[k][e] *= gate;
      }
  }
  load_scale(a, s, wdy);
#pragma unroll
  for (int k = 0; k < N; ++k)
#pragma unroll
    for (int e = 0; e < kSlice; ++e) {
      xhat[k][e] = (xhat[k][e] - mean) * rstd;
      wdy[k][e] *= dye[k][e];
    }
}

// The row-shaped gradients: dg from the terms and the segment constants c1 = mean(wdy * xhat),
// c2 = mean(wdy) (0 for RMSNorm), then through the gate and the residual stream. xhat and wdy
// are overwritten; t and u are scratch.
template <int kDt, int N>
__device__ __forceinline__ void store_grads(const NormArgs& a, const Slices<N>& s, float rstd,
                                            float c1, float c2, Slice (&xhat)[N],
                                            Slice (&wdy)[N], Slice (&t)[N]) {
  // Without a gate t is free from the start: fetch dresidual_out before the arithmetic.
  const bool early = a.dresidual_out.present() && !a.z.present();
  if (early) fetch_rows<kDt>(a.dresidual_out, s, t);
  // ds (in wdy) = rstd * (wdy - xhat * c1 - c2)
#pragma unroll
  for (int k = 0; k < N; ++k)
#pragma unroll
    for (int e = 0; e < kSlice; ++e) wdy[k][e] = rstd * (wdy[k][e] - xhat[k][e] * c1 - c2);
  if (a.z.present()) {
    if (a.norm_before_gate) {
      // y = o * silu(z): dz = dy * o * silu'(z), with o = xhat * w + b rebuilt in xhat.
      load_scale(a, s, t);
#pragma unroll
      for (int k = 0; k < N; ++k)
#pragma unroll
        for (int e = 0; e < kSlice; ++e) xhat[k][e] *= t[k][e];
      if (a.bias.present()) {
        load_cols(a.bias, s, t);
#pragma unroll
        for (int k = 0; k < N; ++k)
#pragma unroll
          for (int e = 0; e < kSlice; ++e) xhat[k][e] += t[k][e];
      }
      load_rows<kDt>(a.dy, s, t);
#pragma unroll
      for (int k = 0; k < N; ++k)
#pragma unroll
        for (int e = 0; e < kSlice; ++e) xhat[k][e] *= t[k][e];
      load_rows<kDt>(a.z, s, t);
#pragma unroll
      for (int k = 0; k < N; ++k)
#pragma unroll
        for (int e = 0; e < kSlice; ++e) xhat[k][e] *= dsilu(t[k][e]);
    } else {
      // g = s * silu(z): ds = dg * silu(z), dz = dg * s * silu'(z).
      load_rows<kDt>(a.x, s, xhat);
      load_rows<kDt>(a.z, s, t);
#pragma unroll
      for (int k = 0; k < N; ++k)
#pragma unroll
        for (int e = 0; e < kSlice; ++e) {
          xhat[k][e] *= wdy[k][e] * dsilu(t[k][e]);
          wdy[k][e] *= silu(t[k][e]);
        }
    }
  }
  if (a.dresidual_out.present()) {
    if (early) widen_rows<kDt>(a.dresidual_out, s, t);
    else load_rows<kDt>(a.dresidual_out, s, t);
#pragma unroll
    for (int k = 0; k < N; ++k)
#pragma unroll
      for (int e = 0; e < kSlice; ++e) wdy[k][e] += t[k][e];
  }
  if (a.z.present() && a.dz.present()) store_rows<kDt>(a.dz, s, xhat);
  if (a.dx.present()) store_rows<kDt>(a.dx, s, wdy);
  if (a.dresidual.present()) store_rows<kDt>(a.dresidual, s, wdy);
}

}  // namespace norm_detail
}  // namespace ssm
