// The conv1d kernels for any layout other than contiguous-along-seqlen ("chan", see
// conv1d_plan.h) and their launchers; included only by the instantiation files, one
// (kDt, kTaps) per file.
//
// A thread walks positions t0 .. t1-1 of a group of kGroup neighbouring channels of one batch
// row, keeping the inputs (and in the backward the dz) of the last kTaps positions of each in
// registers. Neighbouring threads take neighbouring groups, so with channel-last x each step of
// a warp reads 32 * kGroup contiguous elements, a vector a thread; everything a position costs
// beside its channels' arithmetic (addresses, sequence ids and their masks, the tests of where
// the position lies) is paid once for the group. Loads are issued a batch of positions at a time
// so that many are in flight per thread; the fast kernels copy their batches ahead into shared
// memory instead.
#pragma once

#include "conv1d_device.cuh"
#include "conv1d_plan.h"

namespace ssm {
namespace conv1d_detail {

constexpr int kBatch = 8;
// The backward loads two tensors, and keeps four arrays of taps a channel: at 8 positions a
// batch its four-channel groups needed 184-212 registers, at 4 they fit 128.
constexpr int kBwdBatch = 4;

template <int kTaps>
constexpr int kGroup = conv1d_chan_group(kTaps);

struct ChanPlace {
  bool ok;
  int n;  // channels c0 .. c0+n-1 of the group lie in dim
  int64_t b, c0, chunk, t0, t1;
  __device__ ChanPlace(const Conv1dArgs& a, const ChanPlan& p, int group) {
    const int64_t g = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    ok = g < p.threads;
    const int64_t gg = ok ? g : 0;
    c0 = gg % p.groups * group;
    n = a.dim - c0 < group ? int(a.dim - c0) : group;
    const int64_t unit = gg / p.groups;
    b = unit / p.nchunks;
    chunk = unit % p.nchunks;
    t0 = chunk * p.chunk_len;
    t1 = t0 + p.chunk_len < a.seqlen ? t0 + p.chunk_len : a.seqlen;
  }

  // Channel v of the group, or the group's first for those past dim: their values are computed
  // from real data and never stored, which keeps the per-channel loads free of tests.
  __device__ int64_t channel(int v) const { return c0 + (v < n ? v : 0); }
};

// Shifts a window of kTaps values down by one position and puts v at the top.
template <int kTaps, class T>
__device__ __forceinline__ void push(T (&w)[kTaps], T v) {
#pragma unroll
  for (int k = 0; k + 1 < kTaps; ++k) w[k] = w[k + 1];
  w[kTaps - 1] = v;
}

// The group's kN channels of a (batch, dim, seqlen) tensor at position t.
template <int kDt, int kN>
__device__ __forceinline__ void load_group(const TensorRef& t, const ChanPlace& at, int64_t pos,
                                           bool vec, Raw<kDt, kN>& r) {
  load_raw<kDt>(t.data, at3(t, at.b, at.c0, pos), t.stride[1], at.n, vec, r);
}

template <int kDt, int kN>
__device__ __forceinline__ void store_group(const TensorRef& t, const ChanPlace& at, int64_t pos,
                                            bool vec, const float (&v)[kN]) {
  Raw<kDt, kN> r;
  narrow(v, r);
  store_raw<kDt>(t.data, at3(t, at.b, at.c0, pos), t.stride[1], at.n, vec, r);
}

// The fast kernels' pipeline: a thread copies its groups of a batch of positions (x, and dout
// in the backward) by cp.async into its own shared-memory slots, kChanStages-1 batches ahead of
// the batch it computes, so that many bytes are in flight without holding registers. A thread
// reads only what it copied, so no barrier.
constexpr int kChanStages = 3;

template <int kBytes>
struct BitsOf;
template <>
struct BitsOf<4> { using T = uint32_t; };
template <>
struct BitsOf<8> { using T = uint2; };
template <>
struct BitsOf<16> { using T = uint4; };

// A group as one 4-, 8- or 16-byte value, the unit of the pipeline's copies and slots.
template <int kDt, int kN>
using GroupBits = typename BitsOf<4 * kRawWords<kDt, kN>>::T;

template <int kDt, int kN>
__device__ __forceinline__ const void* group_address(const TensorRef& t, const ChanPlace& at,
                                                     int64_t pos) {
  return static_cast<const char*>(t.data) +
         at3(t, at.b, at.c0, pos) * (kDt == int(Dtype::F32) ? 4 : 2);
}

template <int kDt, int kN>
__device__ __forceinline__ void unstage_group(const GroupBits<kDt, kN>& slot, Raw<kDt, kN>& r) {
  const GroupBits<kDt, kN> v = slot;
  memcpy(&r, &v, sizeof v);
}

// Pushes the inputs and sequence ids of the kTaps-1 positions before the chunk (initial states
// or 0 before position 0, whose id they take) into the windows, one position at a time: all at
// once, each with a run-time dtype, they would hold registers the main loop then lacks.
template <int kDt, int kTaps, bool kMasked>
__device__ __forceinline__ void push_halo(const Conv1dArgs& a, const ChanPlace& at,
                                          float (&xw)[kGroup<kTaps>][kTaps], int (&sw)[kTaps]) {
#pragma unroll 1
  for (int h = 0; h < kTaps - 1; ++h) {
    const int64_t pos = at.t0 - (kTaps - 1) + h;
#pragma unroll
    for (int v = 0; v < kGroup<kTaps>; ++v)
      push(xw[v], x_or_initial<kDt>(a, at.b, at.channel(v), pos));
    push(sw, kMasked ? load_seq_id(a.seq_idx, at.b, pos > 0 ? pos : 0) : 0);
  }
}

// The group's taps and biases.
template <int kTaps>
__device__ __forceinline__ void load_group_taps(const Conv1dArgs& a, const ChanPlace& at,
                                                float (&wt)[kGroup<kTaps>][kTaps],
                                                float (&bias)[kGroup<kTaps>]) {
#pragma unroll
  for (int v = 0; v < kGroup<kTaps>; ++v) {
    load_taps(a.weight, at.channel(v), a.width, wt[v]);
    bias[v] = load_bias(a.bias, at.channel(v));
  }
}

// The forward kernel's body; kMasked: seq_idx is given (without it the taps' predicates are
// computed once, not at every step); kFast: the common case (chan_fast below): the width is
// kTaps, SiLU, the groups move as vectors and there are no states, so neither the taps nor the
// loads and stores have run-time tests.
template <int kDt, int kTaps, bool kMasked, bool kFast>
__device__ __forceinline__ void fwd_chan(const Conv1dArgs& a, const ChanPlan& p) {
  constexpr int kG = kGroup<kTaps>;
  const ChanPlace at(a, p, kG);
  if (!at.ok) return;
  float wt[kG][kTaps], bias[kG];
  load_group_taps<kTaps>(a, at, wt, bias);
  const uint32_t wmask = body_taps<kTaps, kFast>(a.width);
  const bool vec = kFast || (p.vec && at.n == kG);

  // Inputs and sequence ids of positions t-(kTaps-1) .. t; first the ones before the chunk.
  float xw[kG][kTaps] = {};
  int sw[kTaps] = {};
  push_halo<kDt, kTaps, kMasked>(a, at, xw, sw);
  auto step = [&](int64_t t, const Raw<kDt, kG>& xv, int id) {
    push(sw, id);
    const uint32_t m = kMasked ? same_sequence_taps<kTaps>(sw, wmask) : wmask;
    float o[kG];
#pragma unroll
    for (int v = 0; v < kG; ++v) {
      push(xw[v], element(xv, v));
      const float z = conv_at<kTaps>(xw[v], wt[v], bias[v], m);
      o[v] = kFast || a.silu ? silu(z) : z;
    }
    store_group<kDt>(a.out, at, t, vec, o);
  };
  // Whole batches, then the positions left one at a time.
  const int nb = int((at.t1 - at.t0) / kBatch);
  if constexpr (kFast) {
    __shared__ GroupBits<kDt, kG> slots[kChanStages][kBatch][kConv1dBlock];
    // Batch j into stage j % kChanStages; every call commits a group, empty or not, so the
    // waits' counts hold.
    const auto stage_in = [&](int j) {
      if (j < nb) {
#pragma unroll
        for (int u = 0; u < kBatch; ++u)
          cp_async_ca<sizeof(GroupBits<kDt, kG>)>(
              &slots[j % kChanStages][u][threadIdx.x],
              group_address<kDt, kG>(a.x, at, at.t0 + int64_t(j) * kBatch + u));
      }
      cp_async_commit();
    };
#pragma unroll
    for (int j = 0; j + 1 < kChanStages; ++j) stage_in(j);
    for (int j = 0; j < nb; ++j) {
      cp_async_wait<kChanStages - 2>();
      Raw<kDt, kG> xv[kBatch];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) unstage_group(slots[j % kChanStages][u][threadIdx.x], xv[u]);
      // Into the stage the previous batch was read from.
      stage_in(j + kChanStages - 1);
#pragma unroll
      for (int u = 0; u < kBatch; ++u) step(at.t0 + int64_t(j) * kBatch + u, xv[u], 0);
    }
  } else {
    for (int j = 0; j < nb; ++j) {
      const int64_t t = at.t0 + int64_t(j) * kBatch;
      Raw<kDt, kG> xv[kBatch];
      int iv[kBatch] = {};
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        load_group(a.x, at, t + u, vec, xv[u]);
        if constexpr (kMasked) iv[u] = load_seq_id(a.seq_idx, at.b, t + u);
      }
#pragma unroll
      for (int u = 0; u < kBatch; ++u) step(t + u, xv[u], iv[u]);
    }
  }
  for (int64_t t = at.t0 + int64_t(nb) * kBatch; t < at.t1; ++t) {
    Raw<kDt, kG> xv;
    load_group(a.x, at, t, vec, xv);
    step(t, xv, kMasked ? load_seq_id(a.seq_idx, at.b, t) : 0);
  }

  if (!kFast && a.final_states.present() && at.t1 == a.seqlen) {
#pragma unroll 1
    for (int v = 0; v < at.n; ++v) write_final_states<kDt>(a, at.b, at.c0 + v);
  }
}

// The backward kernel's body; kMasked and kFast as for fwd_chan.
template <int kDt, int kTaps, bool kMasked, bool kFast>
__device__ __forceinline__ void bwd_chan(const Conv1dArgs& a, const ChanPlan& p) {
  constexpr int kHalo = kTaps - 1, kG = kGroup<kTaps>;
  const ChanPlace at(a, p, kG);
  if (!at.ok) return;
  const int W = a.width;
  const int64_t L = a.seqlen, b = at.b;
  float wt[kG][kTaps], bias[kG];
  load_group_taps<kTaps>(a, at, wt, bias);
  const uint32_t wmask = body_taps<kTaps, kFast>(W);
  const int last_id = kMasked ? load_seq_id(a.seq_idx, b, L - 1) : 0;
  const bool vec = kFast || (p.vec && at.n == kG);
  // The input gradients made here: positions t0 .. t1-1, and from -(W-1) on in the first chunk
  // (the initial states) when they are asked for.
  const bool want_dx = a.dx.present();
  const int64_t p_low = at.t0 == 0 && a.dinitial_states.present() ? -(W - 1) : at.t0;

  // Windows over positions tau-(kTaps-1) .. tau: x, the sequence ids and dz (0 before t0, where
  // only the initial states' gradients read them and dz is 0 below position 0).
  float xw[kG][kTaps] = {}, dzw[kG][kTaps] = {};
  int sw[kTaps] = {};
  push_halo<kDt, kTaps, kMasked>(a, at, xw, sw);
  float dw[kG][kTaps] = {}, db[kG] = {};

  // Step tau makes dz at tau and then the gradient of the input kTaps-1 positions back, whose
  // outputs (tau-kHalo .. tau) are all known by then. `edge`, a constant at each call, says
  // whether tau may lie outside t0+kHalo .. t1-1, the interior, where tau < seqlen, its dz
  // counts for the sums, and its input gradient, of a position in the chunk, is dx's alone
  // (dfinal_states reaches only the last W-1 <= kHalo positions of a row).
  auto step = [&](bool edge, int64_t tau, const Raw<kDt, kG>& xv, const Raw<kDt, kG>& gv,
                  int id) {
    push(sw, !edge || tau < L ? id : sw[kHalo]);
    const uint32_t m = kMasked ? same_sequence_taps<kTaps>(sw, wmask) : wmask;
    float dz[kG] = {};
#pragma unroll
    for (int v = 0; v < kG; ++v) push(xw[v], element(xv, v));
    if (!edge || tau < L) {
#pragma unroll
      for (int v = 0; v < kG; ++v) {
        const float g = element(gv, v);
        dz[v] = kFast || a.silu ? g * dsilu(conv_at<kTaps>(xw[v], wt[v], bias[v], m)) : g;
      }
      if (!edge || tau < at.t1) {
#pragma unroll
        for (int v = 0; v < kG; ++v) {
          db[v] += dz[v];
#pragma unroll
          for (int k = 0; k < kTaps; ++k)
            dw[v][k] = (m >> k) & 1u ? fmaf(dz[v], xw[v][k], dw[v][k]) : dw[v][k];
        }
      }
    }
#pragma unroll
    for (int v = 0; v < kG; ++v) push(dzw[v], dz[v]);
    const int64_t pos = tau - kHalo;
    if (edge && (pos < p_low || pos >= at.t1)) return;
    const uint32_t gm = kMasked ? same_sequence_outputs<kTaps>(sw, wmask) : wmask;
    float g[kG];
#pragma unroll
    for (int v = 0; v < kG; ++v) g[v] = input_grad_at<kTaps>(dzw[v], wt[v], gm);
    if (!edge) {
      if (want_dx) store_group<kDt>(a.dx, at, pos, vec, g);
      return;
    }
    const TensorRef& d = a.dfinal_states;
    const int64_t j = pos - (L - (W - 1));
    if (!kFast && d.present() && j >= 0 && !(kMasked && sw[0] != last_id)) {
#pragma unroll
      for (int v = 0; v < kG; ++v)
        g[v] += load_as_float(d.data, at3(d, b, at.channel(v), j), d.dtype);
    }
    if (kFast || pos >= 0) {
      if (want_dx) store_group<kDt>(a.dx, at, pos, vec, g);
    } else {
      const TensorRef& di = a.dinitial_states;
#pragma unroll
      for (int v = 0; v < kG; ++v)
        if (v < at.n) store_from_float(di.data, at3(di, b, at.c0 + v, pos + W - 1), di.dtype, g[v]);
    }
  };
  // One position at a time where the tests are needed, the interior in batches without them.
  const auto edge_step = [&](int64_t tau) {
    Raw<kDt, kG> xv, gv;
    clear(xv);
    clear(gv);
    if (tau < L) {
      load_group(a.x, at, tau, vec, xv);
      load_group(a.dout, at, tau, vec, gv);
    }
    step(true, tau, xv, gv, tau < L && kMasked ? load_seq_id(a.seq_idx, b, tau) : 0);
  };
  const int64_t tau_end = at.t1 + kHalo, head_end = at.t0 + kHalo;
  // The interior's whole batches, from head_end on.
  const int nb = at.t1 - head_end >= kBwdBatch ? int((at.t1 - head_end) / kBwdBatch) : 0;
  const auto batch_start = [&](int j) { return head_end + int64_t(j) * kBwdBatch; };
  if constexpr (kFast) {
    // As in fwd_chan; the first batches are on their way during the head's steps.
    __shared__ GroupBits<kDt, kG> slots[kChanStages][kBwdBatch][2][kConv1dBlock];
    const auto stage_in = [&](int j) {
      if (j < nb) {
#pragma unroll
        for (int u = 0; u < kBwdBatch; ++u) {
          auto& slot = slots[j % kChanStages][u];
          cp_async_ca<sizeof(GroupBits<kDt, kG>)>(
              &slot[0][threadIdx.x], group_address<kDt, kG>(a.x, at, batch_start(j) + u));
          cp_async_ca<sizeof(GroupBits<kDt, kG>)>(
              &slot[1][threadIdx.x], group_address<kDt, kG>(a.dout, at, batch_start(j) + u));
        }
      }
      cp_async_commit();
    };
#pragma unroll
    for (int j = 0; j + 1 < kChanStages; ++j) stage_in(j);
#pragma unroll 1
    for (int64_t tau = at.t0; tau < head_end; ++tau) edge_step(tau);
    for (int j = 0; j < nb; ++j) {
      cp_async_wait<kChanStages - 2>();
      Raw<kDt, kG> xv[kBwdBatch], gv[kBwdBatch];
#pragma unroll
      for (int u = 0; u < kBwdBatch; ++u) {
        unstage_group(slots[j % kChanStages][u][0][threadIdx.x], xv[u]);
        unstage_group(slots[j % kChanStages][u][1][threadIdx.x], gv[u]);
      }
      stage_in(j + kChanStages - 1);
#pragma unroll
      for (int u = 0; u < kBwdBatch; ++u) step(false, batch_start(j) + u, xv[u], gv[u], 0);
    }
  } else {
#pragma unroll 1
    for (int64_t tau = at.t0; tau < head_end; ++tau) edge_step(tau);
    for (int j = 0; j < nb; ++j) {
      Raw<kDt, kG> xv[kBwdBatch], gv[kBwdBatch];
      int iv[kBwdBatch] = {};
#pragma unroll
      for (int u = 0; u < kBwdBatch; ++u) {
        const int64_t tau = batch_start(j) + u;
        load_group(a.x, at, tau, vec, xv[u]);
        load_group(a.dout, at, tau, vec, gv[u]);
        if constexpr (kMasked) iv[u] = load_seq_id(a.seq_idx, b, tau);
      }
#pragma unroll
      for (int u = 0; u < kBwdBatch; ++u) step(false, batch_start(j) + u, xv[u], gv[u], iv[u]);
    }
  }
#pragma unroll 1
  for (int64_t tau = batch_start(nb); tau < tau_end; ++tau) edge_step(tau);

  if (p.partial == nullptr) return;
  float* row = p.partial + ((b * p.nchunks + at.chunk) * a.dim + at.c0) * (W + 1);
#pragma unroll
  for (int v = 0; v < kG; ++v)
    if (v < at.n) write_tap_partials(row + v * (W + 1), dw[v], db[v], W);
}

}  // namespace conv1d_detail

// Three kernels: with packed sequences (kMasked), and without in a general form and a fast one
// (kFast: the common case of Mamba's width, channel-last, no seq_idx), so that neither the
// general loads and stores nor the packed sequences' masks take registers or issue slots from
// the fast one. The launcher picks.
template <int kDt, int kTaps, bool kMasked, bool kFast>
__global__ void __launch_bounds__(kConv1dBlock, kConv1dFwdChanMinBlocks<kDt, kFast>)
    conv1d_fwd_chan_kernel(const Conv1dArgs a, const ChanPlan p) {
  conv1d_detail::fwd_chan<kDt, kTaps, kMasked, kFast>(a, p);
}

template <int kDt, int kTaps, bool kMasked, bool kFast>
__global__ void __launch_bounds__(kConv1dBlock, kConv1dBwdChanMinBlocks<kFast>)
    conv1d_bwd_chan_kernel(const Conv1dArgs a, const ChanPlan p) {
  conv1d_detail::bwd_chan<kDt, kTaps, kMasked, kFast>(a, p);
}

// The fast kernels' case, Mamba-2's: the width is kTaps, SiLU, every row-shaped operand is
// channel-last with aligned groups, and there are no states (seq_idx is checked by the launch).
template <int kTaps>
bool chan_fast(const Conv1dArgs& a, const ChanPlan& p) {
  return a.width == kTaps && a.silu && p.vec && !a.initial_states.present() &&
         !a.final_states.present() && !a.dfinal_states.present() &&
         !a.dinitial_states.present();
}

template <int kDt, int kTaps>
cudaError_t launch_conv1d_fwd_chan(const Conv1dArgs& a, const ChanPlan& p, cudaStream_t stream) {
  const auto plain = chan_fast<kTaps>(a, p) ? conv1d_fwd_chan_kernel<kDt, kTaps, false, true>
                                            : conv1d_fwd_chan_kernel<kDt, kTaps, false, false>;
  return launch_by_seq_idx(conv1d_fwd_chan_kernel<kDt, kTaps, true, false>, plain, p.threads, a,
                           p, stream);
}

template <int kDt, int kTaps>
cudaError_t launch_conv1d_bwd_chan(const Conv1dArgs& a, const ChanPlan& p, cudaStream_t stream) {
  const auto plain = chan_fast<kTaps>(a, p) ? conv1d_bwd_chan_kernel<kDt, kTaps, false, true>
                                            : conv1d_bwd_chan_kernel<kDt, kTaps, false, false>;
  return launch_by_seq_idx(conv1d_bwd_chan_kernel<kDt, kTaps, true, false>, plain, p.threads, a,
                           p, stream);
}

}  // namespace ssm
