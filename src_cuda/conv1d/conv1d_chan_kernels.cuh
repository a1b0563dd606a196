// The conv1d kernels for any layout other than contiguous-along-seqlen ("chan", see
// conv1d_plan.h) and their launchers; included only by the instantiation files, one
// (kDt, kTaps) per file.
//
// A thread walks positions t0 .. t1-1 of one (batch, channel) keeping the inputs (and in the
// backward the dz) of the last kTaps positions in registers. Neighbouring threads take
// neighbouring channels, so with channel-last x each step of a warp reads 32 contiguous
// elements. Loads are issued kBatch positions at a time so that many are in flight per thread.
#pragma once

#include "conv1d_device.cuh"
#include "conv1d_plan.h"

namespace ssm {
namespace conv1d_detail {

constexpr int kBatch = 8;

struct ChanPlace {
  bool ok;
  int64_t b, c, chunk, t0, t1;
  __device__ ChanPlace(const Conv1dArgs& a, const ChanPlan& p) {
    const int64_t g = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    ok = g < p.threads;
    const int64_t gg = ok ? g : 0;
    c = gg % a.dim;
    const int64_t unit = gg / a.dim;
    b = unit / p.nchunks;
    chunk = unit % p.nchunks;
    t0 = chunk * p.chunk_len;
    t1 = t0 + p.chunk_len < a.seqlen ? t0 + p.chunk_len : a.seqlen;
  }
};

// Shifts a window of kTaps values down by one position and puts v at the top.
template <int kTaps, class T>
__device__ __forceinline__ void push(T (&w)[kTaps], T v) {
#pragma unroll
  for (int k = 0; k + 1 < kTaps; ++k) w[k] = w[k + 1];
  w[kTaps - 1] = v;
}

// Pushes the inputs and sequence ids of the kTaps-1 positions before the chunk (initial states
// or 0 before position 0, whose id they take) into the windows, one position at a time: all at
// once, each with a run-time dtype, they would hold registers the main loop then lacks.
template <int kDt, int kTaps, bool kMasked>
__device__ __forceinline__ void push_halo(const Conv1dArgs& a, const ChanPlace& at,
                                          float (&xw)[kTaps], int (&sw)[kTaps]) {
#pragma unroll 1
  for (int h = 0; h < kTaps - 1; ++h) {
    const int64_t pos = at.t0 - (kTaps - 1) + h;
    push(xw, x_or_initial<kDt>(a, at.b, at.c, pos));
    push(sw, kMasked ? load_seq_id(a.seq_idx, at.b, pos > 0 ? pos : 0) : 0);
  }
}

// The forward kernel's body; kMasked: seq_idx is given (without it the taps' predicates are
// computed once, not at every step).
template <int kDt, int kTaps, bool kMasked>
__device__ __forceinline__ void fwd_chan(const Conv1dArgs& a, const ChanPlan& p) {
  const ChanPlace at(a, p);
  if (!at.ok) return;
  const int W = a.width;
  float wt[kTaps];
  load_taps(a.weight, at.c, W, wt);
  const float bias = load_bias(a.bias, at.c);
  const uint32_t wmask = width_taps<kTaps>(W);
  const int64_t b = at.b, c = at.c;

  // Inputs and sequence ids of positions t-(kTaps-1) .. t; first the ones before the chunk.
  float xw[kTaps] = {};
  int sw[kTaps] = {};
  push_halo<kDt, kTaps, kMasked>(a, at, xw, sw);
  auto step = [&](int64_t t, float xv, int id) {
    push(xw, xv);
    push(sw, id);
    const float z =
        conv_at<kTaps>(xw, wt, bias, kMasked ? same_sequence_taps<kTaps>(sw, wmask) : wmask);
    store_from_float(a.out.data, at3(a.out, b, c, t), Dtype(kDt), a.silu ? silu(z) : z);
  };
  int64_t t = at.t0;
  for (; t + kBatch <= at.t1; t += kBatch) {
    float xv[kBatch];
    int iv[kBatch] = {};
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      xv[u] = load_x<kDt>(a.x.data, at3(a.x, b, c, t + u));
      if constexpr (kMasked) iv[u] = load_seq_id(a.seq_idx, b, t + u);
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) step(t + u, xv[u], iv[u]);
  }
  for (; t < at.t1; ++t)
    step(t, load_x<kDt>(a.x.data, at3(a.x, b, c, t)), kMasked ? load_seq_id(a.seq_idx, b, t) : 0);

  if (a.final_states.present() && at.t1 == a.seqlen) write_final_states<kDt>(a, b, c);
}

// The backward kernel's body; kMasked and kFull as for fwd_chan.
template <int kDt, int kTaps, bool kMasked, bool kFull>
__device__ __forceinline__ void bwd_chan(const Conv1dArgs& a, const ChanPlan& p) {
  constexpr int kHalo = kTaps - 1;
  const ChanPlace at(a, p);
  if (!at.ok) return;
  const int W = a.width;
  const int64_t L = a.seqlen, b = at.b, c = at.c;
  float wt[kTaps];
  load_taps(a.weight, c, W, wt);
  const float bias = load_bias(a.bias, c);
  const uint32_t wmask = body_taps<kTaps, kFull>(W);
  const int last_id = kMasked ? load_seq_id(a.seq_idx, b, L - 1) : 0;
  // The input gradients made here: positions t0 .. t1-1, and from -(W-1) on in the first chunk
  // (the initial states) when they are asked for.
  const bool want_dx = a.dx.present();
  const int64_t p_low = at.t0 == 0 && a.dinitial_states.present() ? -(W - 1) : at.t0;

  // Windows over positions tau-(kTaps-1) .. tau: x, the sequence ids and dz (0 before t0, where
  // only the initial states' gradients read them and dz is 0 below position 0).
  float xw[kTaps] = {}, dzw[kTaps] = {};
  int sw[kTaps] = {};
  push_halo<kDt, kTaps, kMasked>(a, at, xw, sw);
  float dw[kTaps] = {}, db = 0.f;

  // Step tau makes dz at tau and then the gradient of the input kTaps-1 positions back, whose
  // outputs (tau-kHalo .. tau) are all known by then.
  auto step = [&](int64_t tau, float xv, float gv, int id) {
    push(xw, xv);
    push(sw, tau < L ? id : sw[kHalo]);
    float dz = 0.f;
    if (tau < L) {
      const uint32_t m = kMasked ? same_sequence_taps<kTaps>(sw, wmask) : wmask;
      dz = a.silu ? gv * dsilu(conv_at<kTaps>(xw, wt, bias, m)) : gv;
      if (tau < at.t1) {
        db += dz;
#pragma unroll
        for (int k = 0; k < kTaps; ++k) dw[k] = (m >> k) & 1u ? fmaf(dz, xw[k], dw[k]) : dw[k];
      }
    }
    push(dzw, dz);
    const int64_t pos = tau - kHalo;
    if (pos < p_low || pos >= at.t1) return;
    float g = input_grad_at<kTaps>(dzw, wt,
                                   kMasked ? same_sequence_outputs<kTaps>(sw, wmask) : wmask);
    const TensorRef& d = a.dfinal_states;
    const int64_t j = pos - (L - (W - 1));
    if (d.present() && j >= 0 && !(kMasked && sw[0] != last_id))
      g += load_as_float(d.data, at3(d, b, c, j), d.dtype);
    if (pos >= 0) {
      if (want_dx) store_from_float(a.dx.data, at3(a.dx, b, c, pos), Dtype(kDt), g);
    } else {
      const TensorRef& di = a.dinitial_states;
      store_from_float(di.data, at3(di, b, c, pos + W - 1), di.dtype, g);
    }
  };
  const int64_t tau_end = at.t1 + kHalo;
  int64_t tau = at.t0;
  for (; tau + kBatch <= tau_end && tau + kBatch <= L; tau += kBatch) {
    float xv[kBatch], gv[kBatch];
    int iv[kBatch] = {};
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      xv[u] = load_x<kDt>(a.x.data, at3(a.x, b, c, tau + u));
      gv[u] = load_x<kDt>(a.dout.data, at3(a.dout, b, c, tau + u));
      if constexpr (kMasked) iv[u] = load_seq_id(a.seq_idx, b, tau + u);
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) step(tau + u, xv[u], gv[u], iv[u]);
  }
  for (; tau < tau_end; ++tau) {
    const bool in = tau < L;
    step(tau, in ? load_x<kDt>(a.x.data, at3(a.x, b, c, tau)) : 0.f,
         in ? load_x<kDt>(a.dout.data, at3(a.dout, b, c, tau)) : 0.f,
         in && kMasked ? load_seq_id(a.seq_idx, b, tau) : 0);
  }

  if (p.partial == nullptr) return;
  write_tap_partials(p.partial + ((b * p.nchunks + at.chunk) * a.dim + c) * (W + 1), dw, db, W);
}

}  // namespace conv1d_detail

// One kernel with packed sequences (kMasked) and one without, so the common case keeps
// registers for nothing it does not use; the launcher picks by seq_idx. As in the seq kernels,
// the backward without gives the width that fills the taps a body of its own (issue-bound, it
// gained 14%); the forward did not gain from one (its loads, not its taps, bound it).
template <int kDt, int kTaps, bool kMasked>
__global__ void __launch_bounds__(kConv1dBlock)
    conv1d_fwd_chan_kernel(const Conv1dArgs a, const ChanPlan p) {
  conv1d_detail::fwd_chan<kDt, kTaps, kMasked>(a, p);
}

template <int kDt, int kTaps, bool kMasked>
__global__ void __launch_bounds__(kConv1dBlock, kConv1dBwdMinBlocks<kTaps, kMasked>)
    conv1d_bwd_chan_kernel(const Conv1dArgs a, const ChanPlan p) {
  if constexpr (!kMasked) {
    if (a.width == kTaps) return conv1d_detail::bwd_chan<kDt, kTaps, false, true>(a, p);
  }
  conv1d_detail::bwd_chan<kDt, kTaps, kMasked, false>(a, p);
}

template <int kDt, int kTaps>
cudaError_t launch_conv1d_fwd_chan(const Conv1dArgs& a, const ChanPlan& p, cudaStream_t stream) {
  return launch_by_seq_idx(conv1d_fwd_chan_kernel<kDt, kTaps, true>,
                           conv1d_fwd_chan_kernel<kDt, kTaps, false>, p.threads, a, p, stream);
}

template <int kDt, int kTaps>
cudaError_t launch_conv1d_bwd_chan(const Conv1dArgs& a, const ChanPlan& p, cudaStream_t stream) {
  return launch_by_seq_idx(conv1d_bwd_chan_kernel<kDt, kTaps, true>,
                           conv1d_bwd_chan_kernel<kDt, kTaps, false>, p.threads, a, p, stream);
}

}  // namespace ssm
