// The conv1d kernels for x contiguous along seqlen ("seq", see conv1d_plan.h) and their
// launchers; included only by the instantiation files, one (kDt, kTaps) per file.
//
// A lane owns slice s (positions 8s .. 8s+7) of one row per iteration. The forward needs the
// kTaps-1 inputs before the slice: the lane before it holds them (a shuffle), the segment's
// first lane loads them (or takes initial_states at the row's start). The backward also needs
// the input gradients' sources after the slice, dz at the next kTaps-1 positions: the lane after
// it computed them (a shuffle), the segment's last lane recomputes them from the next slice.
#pragma once

#include "conv1d_device.cuh"
#include "conv1d_plan.h"

namespace ssm {
namespace conv1d_detail {

constexpr unsigned kFullMask = 0xffffffffu;

// Where a lane's work lies.
struct SeqPlace {
  int lane;                        // lane within the segment
  bool unit_ok;                    // false for the lanes past the last unit
  int64_t b, c;                    // the row
  int64_t first_slice, end_slice;  // the unit's slices [first, end)

  __device__ SeqPlace(const Conv1dArgs& a, const SeqPlan& p) {
    lane = int(threadIdx.x) & (p.seg - 1);
    const int64_t unit = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / p.seg;
    unit_ok = unit < p.units;
    const int64_t u = unit_ok ? unit : 0;
    const int64_t row = u / p.nchunks, chunk = u % p.nchunks;
    b = row / a.dim;
    c = row % a.dim;
    first_slice = chunk * p.chunk_slices;
    end_slice = first_slice + p.chunk_slices < p.nslices ? first_slice + p.chunk_slices
                                                         : p.nslices;
  }
};

// The row of a (batch, dim, seqlen) tensor, and its stride along seqlen.
struct SeqRow {
  void* data;
  int64_t base, stride;
  __device__ SeqRow(const TensorRef& t, int64_t b, int64_t c)
      : data(t.data), base(b * t.stride[0] + c * t.stride[1]), stride(t.stride[2]) {}
};

// Slice s of a row: its `n` valid elements (the last slice of a row may be partial).
template <int kDt>
__device__ __forceinline__ void fetch(const SeqRow& r, int64_t s, int n, bool vec, Raw<kDt>& v) {
  if (n <= 0) {
    clear(v);
    return;
  }
  load_raw<kDt>(r.data, r.base + s * kSlice * r.stride, r.stride, n, vec && n == kSlice, v);
}

__device__ __forceinline__ int valid_in_slice(int64_t seqlen, int64_t s) {
  const int64_t left = seqlen - s * kSlice;
  return left <= 0 ? 0 : left < kSlice ? int(left) : kSlice;
}

// The words of the previous lane's slice that hold its last kTaps-1 elements.
template <int kDt, int kTaps>
__device__ __forceinline__ void shuffle_tail_up(const Raw<kDt>& src, int seg, Raw<kDt>& dst) {
  constexpr int kPerWord = kDt == int(Dtype::F32) ? 1 : 2;
  constexpr int kFirst = (kSlice - (kTaps - 1)) / kPerWord;
#pragma unroll
  for (int i = 0; i < kWords<kDt>; ++i)
    dst.w[i] = i >= kFirst ? __shfl_up_sync(kFullMask, src.w[i], 1, seg) : 0u;
}

// xw[0 .. kTaps-2] (positions -(kTaps-1) .. -1) for the slice at a row's start:
// initial_states where the header defines them, 0 before. One value at a time, shifted in: this
// runs for one slice a row, and loading them all at once (each with a run-time dtype) would hold
// registers that the main loop then lacks.
template <int kTaps>
__device__ __forceinline__ void halo_from_initial_states(const Conv1dArgs& a, int64_t b, int64_t c,
                                                         float* xw) {
  const TensorRef& st = a.initial_states;
#pragma unroll 1
  for (int h = 0; h < kTaps - 1; ++h) {
    const int j = h - (kTaps - 1) + a.width - 1;
    const float v = st.present() && j >= 0 ? load_as_float(st.data, at3(st, b, c, j), st.dtype)
                                           : 0.f;
#pragma unroll
    for (int i = 0; i + 2 < kTaps; ++i) xw[i] = xw[i + 1];
    xw[kTaps - 2] = v;
  }
}

// x at positions 8s - (kTaps-1) .. 8s + 7 into xw: slice s (`cur`) and, before it, the last
// kTaps-1 elements of slice s-1, from the previous lane; the segment's first lane loads them, or
// takes initial_states at the row's start.
template <int kDt, int kTaps>
__device__ __forceinline__ void x_window(const Conv1dArgs& a, const SeqPlace& at, const SeqPlan& p,
                                         const SeqRow& xr, int64_t s, bool ok,
                                         const Raw<kDt>& cur, float (&xw)[kTaps - 1 + kSlice]) {
  constexpr int kHalo = kTaps - 1;
  Raw<kDt> prev;
  shuffle_tail_up<kDt, kTaps>(cur, p.seg, prev);
  if (at.lane == 0 && ok && s > 0) fetch(xr, s - 1, kSlice, p.vec, prev);
#pragma unroll
  for (int h = 0; h < kHalo; ++h) xw[h] = element(prev, kSlice - kHalo + h);
#pragma unroll
  for (int e = 0; e < kSlice; ++e) xw[kHalo + e] = element(cur, e);
  if (ok && s == 0) halo_from_initial_states<kTaps>(a, at.b, at.c, xw);
}

// Sequence ids of positions 8s - (kTaps-1) .. 8s + 7 into sw[0 .. kTaps+6]: the slice's own
// loaded, those before from the previous lane or (first lane) loaded; positions below 0 take
// position 0's id, positions past seqlen read as 0 (nothing of theirs is kept).
template <int kTaps>
__device__ __forceinline__ void seq_ids_behind_and_own(const Conv1dArgs& a, int64_t b, int64_t s,
                                                       int n, bool first_lane, int seg, int* sw) {
  constexpr int kHalo = kTaps - 1;
#pragma unroll
  for (int e = 0; e < kSlice; ++e)
    sw[kHalo + e] = e < n ? load_seq_id(a.seq_idx, b, s * kSlice + e) : 0;
#pragma unroll
  for (int h = 0; h < kHalo; ++h) sw[h] = __shfl_up_sync(kFullMask, sw[kSlice + h], 1, seg);
  if (first_lane && n > 0) {
#pragma unroll
    for (int h = 0; h < kHalo; ++h) {
      const int64_t pos = s * kSlice - kHalo + h;
      sw[h] = load_seq_id(a.seq_idx, b, pos > 0 ? pos : 0);
    }
  }
}

// dfinal_states' contribution to the gradient of the input at position pos (any of
// -(W-1) .. seqlen-1); `same` says whether pos is of position seqlen-1's sequence.
__device__ __forceinline__ float final_state_grad(const Conv1dArgs& a, int64_t b, int64_t c,
                                                  int64_t pos, bool same) {
  const TensorRef& d = a.dfinal_states;
  const int64_t j = pos - (a.seqlen - (a.width - 1));
  if (!d.present() || j < 0 || pos >= a.seqlen || !same) return 0.f;
  return load_as_float(d.data, at3(d, b, c, j), d.dtype);
}

// Whether this lane did slice nslices-1, which ends its row (so it writes the final states).
__device__ __forceinline__ bool holds_row_end(const SeqPlace& at, const SeqPlan& p) {
  return at.unit_ok && at.end_slice == p.nslices &&
         at.lane == int((p.nslices - 1 - at.first_slice) % p.seg);
}

// The forward kernel's body; kMasked: seq_idx is given. Without it every output has the same
// taps, whose predicates the compiler then computes once instead of at every tap.
template <int kDt, int kTaps, bool kMasked>
__device__ __forceinline__ void fwd_seq(const Conv1dArgs& a, const SeqPlan& p) {
  constexpr int kHalo = kTaps - 1;
  const SeqPlace at(a, p);
  const int64_t L = a.seqlen;
  float wt[kTaps];
  load_taps(a.weight, at.c, a.width, wt);
  const float bias = load_bias(a.bias, at.c);
  const uint32_t wmask = width_taps<kTaps>(a.width);
  const SeqRow xr(a.x, at.b, at.c), outr(a.out, at.b, at.c);

  int64_t s = at.first_slice + at.lane;
  Raw<kDt> cur;
  fetch(xr, s, at.unit_ok && s < at.end_slice ? valid_in_slice(L, s) : 0, p.vec, cur);
  // Every lane runs every iteration: the shuffles need the whole warp.
  for (int it = 0; it < p.iters; ++it, s += p.seg) {
    const bool ok = at.unit_ok && s < at.end_slice;
    const int n = ok ? valid_in_slice(L, s) : 0;
    // The next iteration's slice is fetched before this one's result is stored, so its load is
    // in flight while this slice is computed.
    Raw<kDt> nxt;
    const int64_t s_next = s + p.seg;
    fetch(xr, s_next, at.unit_ok && s_next < at.end_slice ? valid_in_slice(L, s_next) : 0, p.vec,
          nxt);

    SliceMasks tm = replicate<kTaps>(wmask);
    if constexpr (kMasked) {
      int sw[kHalo + kSlice];
      seq_ids_behind_and_own<kTaps>(a, at.b, s, n, at.lane == 0, p.seg, sw);
      tm = 0;
#pragma unroll
      for (int e = 0; e < kSlice; ++e)
        tm |= SliceMasks(same_sequence_taps<kTaps>(sw + e, wmask)) << (e * kTaps);
    }

    float xw[kHalo + kSlice];  // x at positions 8s - (kTaps-1) .. 8s + 7
    x_window<kDt, kTaps>(a, at, p, xr, s, ok, cur, xw);

    if (ok) {
      float o[kSlice];
#pragma unroll
      for (int e = 0; e < kSlice; ++e) {
        const uint32_t m = kMasked ? mask_of<kTaps>(tm, e) : wmask;
        const float z = conv_at<kTaps>(xw + e, wt, bias, m);
        o[e] = a.silu ? silu(z) : z;
      }
      Raw<kDt> r;
      narrow(o, r);
      store_raw<kDt>(outr.data, outr.base + s * kSlice * outr.stride, outr.stride, n,
                     p.vec && n == kSlice, r);
    }
    cur = nxt;
  }
  if (a.final_states.present() && holds_row_end(at, p)) write_final_states<kDt>(a, at.b, at.c);
}

// The backward kernel's body; kMasked as for fwd_seq.
template <int kDt, int kTaps, bool kMasked>
__device__ __forceinline__ void bwd_seq(const Conv1dArgs& a, const SeqPlan& p) {
  constexpr int kHalo = kTaps - 1;
  const SeqPlace at(a, p);
  const int W = a.width;
  const int64_t L = a.seqlen;
  float wt[kTaps];
  load_taps(a.weight, at.c, W, wt);
  const float bias = load_bias(a.bias, at.c);
  const uint32_t wmask = width_taps<kTaps>(W);
  const bool last_lane = at.lane == p.seg - 1;
  const SeqRow xr(a.x, at.b, at.c), gr(a.dout, at.b, at.c), dxr(a.dx, at.b, at.c);
  float dw[kTaps] = {}, db = 0.f;

  int64_t s = at.first_slice + at.lane;
  for (int it = 0; it < p.iters; ++it, s += p.seg) {
    const bool ok = at.unit_ok && s < at.end_slice;
    const int n = ok ? valid_in_slice(L, s) : 0;
    Raw<kDt> xcur, gcur;
    fetch(xr, s, n, p.vec, xcur);
    fetch(gr, s, n, p.vec, gcur);

    // Tap masks of the own outputs (tm) and of the next slice's first kTaps-1 (am, for the last
    // lane), output masks of the own inputs (gm); bit e of fm: own position e is of position
    // seqlen-1's sequence, bit 8: so is position 0; bit t of im: own position t is of position
    // 0's sequence (the initial states' gradients use the last two).
    SliceMasks tm = replicate<kTaps>(wmask), gm = tm, am = tm;
    uint32_t fm = ~0u, im = ~0u;
    if constexpr (kMasked) {
      int sw[kHalo + kSlice + kHalo];  // ids of positions 8s - (kTaps-1) .. 8s + 8 + kTaps - 2
      seq_ids_behind_and_own<kTaps>(a, at.b, s, n, at.lane == 0, p.seg, sw);
#pragma unroll
      for (int h = 0; h < kHalo; ++h)
        sw[kHalo + kSlice + h] = __shfl_down_sync(kFullMask, sw[kHalo + h], 1, p.seg);
      if (last_lane && ok) {
#pragma unroll
        for (int h = 0; h < kHalo; ++h) {
          const int64_t pos = (s + 1) * kSlice + h;
          sw[kHalo + kSlice + h] = pos < L ? load_seq_id(a.seq_idx, at.b, pos) : 0;
        }
      }
      const int last_id = load_seq_id(a.seq_idx, at.b, L - 1);
      tm = gm = am = 0;
      fm = uint32_t(sw[kHalo] == last_id) << kSlice;
      im = 0u;
#pragma unroll
      for (int e = 0; e < kSlice; ++e) {
        tm |= SliceMasks(same_sequence_taps<kTaps>(sw + e, wmask)) << (e * kTaps);
        gm |= SliceMasks(same_sequence_outputs<kTaps>(sw + kHalo + e, wmask)) << (e * kTaps);
        fm |= uint32_t(sw[kHalo + e] == last_id) << e;
        im |= uint32_t(sw[kHalo + e] == sw[kHalo]) << e;
      }
#pragma unroll
      for (int h = 0; h < kHalo; ++h)
        am |= SliceMasks(same_sequence_taps<kTaps>(sw + kSlice + h, wmask)) << (h * kTaps);
    }

    float xw[kHalo + kSlice];  // x at positions 8s - (kTaps-1) .. 8s + 7
    x_window<kDt, kTaps>(a, at, p, xr, s, ok, xcur, xw);

    // dz at positions 8s .. 8s + 8 + kTaps - 2: the slice's own, then the next lane's first
    // (positions past seqlen have dout 0, so dz 0).
    float dz[kSlice + kHalo];
#pragma unroll
    for (int e = 0; e < kSlice; ++e) {
      const float g = element(gcur, e);
      const uint32_t m = kMasked ? mask_of<kTaps>(tm, e) : wmask;
      dz[e] = a.silu ? g * dsilu(conv_at<kTaps>(xw + e, wt, bias, m)) : g;
    }
#pragma unroll
    for (int h = 0; h < kHalo; ++h) dz[kSlice + h] = __shfl_down_sync(kFullMask, dz[h], 1, p.seg);
    if (last_lane) {
      const int n_next = ok ? valid_in_slice(L, s + 1) : 0;
      Raw<kDt> xn, gn;
      fetch(xr, s + 1, n_next, p.vec, xn);
      fetch(gr, s + 1, n_next, p.vec, gn);
      float xa[kHalo + kHalo];  // x at positions 8(s+1) - (kTaps-1) .. 8(s+1) + kTaps - 2
#pragma unroll
      for (int h = 0; h < kHalo; ++h) {
        xa[h] = xw[kSlice + h];
        xa[kHalo + h] = element(xn, h);
      }
#pragma unroll
      for (int h = 0; h < kHalo; ++h) {
        const float g = element(gn, h);
        const uint32_t m = kMasked ? mask_of<kTaps>(am, h) : wmask;
        dz[kSlice + h] = a.silu ? g * dsilu(conv_at<kTaps>(xa + h, wt, bias, m)) : g;
      }
    }

    if (ok) {
      if (a.dx.present()) {
        float g[kSlice];
#pragma unroll
        for (int e = 0; e < kSlice; ++e)
          g[e] = input_grad_at<kTaps>(dz + e, wt, kMasked ? mask_of<kTaps>(gm, e) : wmask) +
                 final_state_grad(a, at.b, at.c, s * kSlice + e, (fm >> e) & 1u);
        Raw<kDt> r;
        narrow(g, r);
        store_raw<kDt>(dxr.data, dxr.base + s * kSlice * dxr.stride, dxr.stride, n,
                       p.vec && n == kSlice, r);
      }
      // Positions past seqlen have dz 0 and x 0, so they add nothing.
#pragma unroll
      for (int e = 0; e < kSlice; ++e) {
        db += dz[e];
        const uint32_t m = kMasked ? mask_of<kTaps>(tm, e) : wmask;
#pragma unroll
        for (int k = 0; k < kTaps; ++k)
          dw[k] = (m >> k) & 1u ? fmaf(dz[e], xw[e + k], dw[k]) : dw[k];
      }
      const TensorRef& di = a.dinitial_states;
      if (di.present() && s == 0) {
#pragma unroll
        for (int h = 0; h < kHalo; ++h) {
          const int j = h - kHalo + W - 1;  // position h - kHalo is initial state j
          if (j < 0) continue;
          float dzn[kTaps];  // dz at positions h - kHalo .. h (none below position 0)
          uint32_t m = 0u;
#pragma unroll
          for (int i = 0; i < kTaps; ++i) {
            const int t = h - kHalo + i;
            dzn[i] = t >= 0 ? dz[t] : 0.f;
            m |= uint32_t(t < 0 || ((im >> t) & 1u)) << (kTaps - 1 - i);
          }
          const float g = input_grad_at<kTaps>(dzn, wt, m & wmask) +
                          final_state_grad(a, at.b, at.c, h - kHalo, (fm >> kSlice) & 1u);
          store_from_float(di.data, at3(di, at.b, at.c, j), di.dtype, g);
        }
      }
    }
  }

  if (p.partial == nullptr) return;
  // The segment's sums, by butterfly shuffles: every lane ends with the same bits.
  for (int o = 1; o < p.seg; o <<= 1) {
#pragma unroll
    for (int k = 0; k < kTaps; ++k) dw[k] += __shfl_xor_sync(kFullMask, dw[k], o, p.seg);
    db += __shfl_xor_sync(kFullMask, db, o, p.seg);
  }
  if (at.lane != 0 || !at.unit_ok) return;
  const int64_t chunk = at.first_slice / p.chunk_slices;
  write_tap_partials(p.partial + ((at.b * p.nchunks + chunk) * a.dim + at.c) * (W + 1), dw, db, W);
}

}  // namespace conv1d_detail

// One kernel with packed sequences (kMasked) and one without, so the common case keeps
// registers for nothing it does not use; the launcher picks by seq_idx.
template <int kDt, int kTaps, bool kMasked>
__global__ void __launch_bounds__(kConv1dBlock)
    conv1d_fwd_seq_kernel(const Conv1dArgs a, const SeqPlan p) {
  conv1d_detail::fwd_seq<kDt, kTaps, kMasked>(a, p);
}

template <int kDt, int kTaps, bool kMasked>
__global__ void __launch_bounds__(kConv1dBlock, kConv1dBwdMinBlocks<kTaps, kMasked>)
    conv1d_bwd_seq_kernel(const Conv1dArgs a, const SeqPlan p) {
  conv1d_detail::bwd_seq<kDt, kTaps, kMasked>(a, p);
}

template <int kDt, int kTaps>
cudaError_t launch_conv1d_fwd_seq(const Conv1dArgs& a, const SeqPlan& p, cudaStream_t stream) {
  return launch_by_seq_idx(conv1d_fwd_seq_kernel<kDt, kTaps, true>,
                           conv1d_fwd_seq_kernel<kDt, kTaps, false>, p.units * p.seg, a, p,
                           stream);
}

template <int kDt, int kTaps>
cudaError_t launch_conv1d_bwd_seq(const Conv1dArgs& a, const SeqPlan& p, cudaStream_t stream) {
  return launch_by_seq_idx(conv1d_bwd_seq_kernel<kDt, kTaps, true>,
                           conv1d_bwd_seq_kernel<kDt, kTaps, false>, p.units * p.seg, a, p,
                           stream);
}

}  // namespace ssm
