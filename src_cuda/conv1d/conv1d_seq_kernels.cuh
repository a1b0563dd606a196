// The conv1d kernels for x contiguous along seqlen ("seq", see conv1d_plan.h) and their
// launchers; included only by the instantiation files, one (kDt, kTaps) per file.
//
// A lane owns slice s (positions 8s .. 8s+7) of one row per iteration, and no lane loads a slice
// another lane of its segment loads in the same pass: what a slice needs of its neighbours comes
// by shuffles. The forward walks its unit upwards and needs the kTaps-1 inputs before the slice:
// the lane before it holds them, and the segment's first lane gets them from the last lane's
// slice of the previous iteration (only a unit's first iteration loads them, or takes
// initial_states at the row's start). The backward walks its unit downwards, so the gradients
// after a slice (dz at the next kTaps-1 positions) were made by the lane after it, or, for the
// segment's last lane, by the first lane in the previous iteration; only the kTaps-1 after the
// unit are computed again from memory, once a unit. Its loads (x, dout and, for the first lane,
// the slice before its own) run kBwdStages-1 iterations ahead into shared memory by cp.async.
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

__device__ __forceinline__ int valid_in_slice(int64_t seqlen, int64_t s) {
  const int64_t left = seqlen - s * kSlice;
  return left <= 0 ? 0 : left < kSlice ? int(left) : kSlice;
}

// The valid elements of slice s, which is within the lane's unit when `in`; with kFast (seqlen
// a multiple of 8) that is all of them, without the 64-bit arithmetic.
template <bool kFast>
__device__ __forceinline__ int valid_if(bool in, int64_t seqlen, int64_t s) {
  if constexpr (kFast) {
    return in ? kSlice : 0;
  } else {
    return in ? valid_in_slice(seqlen, s) : 0;
  }
}

// Where slice s of a row starts; kFast rows have stride 1 along seqlen.
template <bool kFast>
__device__ __forceinline__ int64_t slice_start(const SeqRow& r, int64_t s) {
  return r.base + s * kSlice * (kFast ? 1 : r.stride);
}

// Slice s of a row: its `n` valid elements (the last slice of a row may be partial; with kFast,
// n is 0 or 8 and the row a vector row).
template <int kDt, bool kFast>
__device__ __forceinline__ void fetch(const SeqRow& r, int64_t s, int n, bool vec, Raw<kDt>& v) {
  if (n <= 0) {
    clear(v);
    return;
  }
  load_raw<kDt>(r.data, slice_start<kFast>(r, s), r.stride, n, kFast || (vec && n == kSlice), v);
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

// The words of a slice that hold its last kTaps-1 elements.
template <int kDt, int kTaps>
constexpr int kTailWord = (kSlice - (kTaps - 1)) / (kDt == int(Dtype::F32) ? 1 : 2);

// The tail of slice s-1 for the forward's upward walk: lanes after the segment's first take it
// from the previous lane's slice; the first lane takes `carry`, and keeps the last lane's slice
// (slice s-1 of its next iteration) in it instead. One shuffle a word serves both.
template <int kDt, int kTaps>
__device__ __forceinline__ void tail_before(const Raw<kDt>& cur, int lane, int seg,
                                            Raw<kDt>& carry, Raw<kDt>& before) {
#pragma unroll
  for (int i = 0; i < kWords<kDt>; ++i) {
    if (i < kTailWord<kDt, kTaps>) {
      before.w[i] = 0u;
      continue;
    }
    const uint32_t r = __shfl_sync(kFullMask, cur.w[i], lane + seg - 1, seg);
    before.w[i] = lane == 0 ? carry.w[i] : r;
    if (lane == 0) carry.w[i] = r;
  }
}

// x at positions 8s - (kTaps-1) .. 8s + 7 into xw: slice s (`cur`) and the tail of slice s-1
// (`before`), or initial_states at the row's start. Without kStates there are none, and
// `before` holds the zeros that stand for them.
template <int kDt, int kTaps, bool kStates>
__device__ __forceinline__ void x_window(const Conv1dArgs& a, const SeqPlace& at, int64_t s,
                                         bool ok, const Raw<kDt>& before, const Raw<kDt>& cur,
                                         float (&xw)[kTaps - 1 + kSlice]) {
  constexpr int kHalo = kTaps - 1;
#pragma unroll
  for (int h = 0; h < kHalo; ++h) xw[h] = element(before, kSlice - kHalo + h);
#pragma unroll
  for (int e = 0; e < kSlice; ++e) xw[kHalo + e] = element(cur, e);
  if (kStates && ok && s == 0) halo_from_initial_states<kTaps>(a, at.b, at.c, xw);
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

// The backward's pipeline: each lane copies its slices (x, dout and, for the segment's first
// lane, x of the slice before) kBwdStages-1 iterations ahead into its own shared-memory slots,
// where they wait without holding registers. A lane reads only what it copied, so no barrier.
template <int kDt>
constexpr int kBwdStages = kDt == int(Dtype::F32) ? 3 : 4;
template <int kDt>
constexpr int kQuads = kWords<kDt> / 4;  // 16-byte pieces of a raw slice
constexpr int kBwdKinds = 3;             // x, dout, x before

template <int kDt>
using BwdSlots = uint4[kBwdStages<kDt> * kBwdKinds * kQuads<kDt> * kConv1dBlock];

// The lane's slot of `kind` in stage `stage`; its pieces lie kConv1dBlock apart, so a warp's
// 16-byte accesses are contiguous.
template <int kDt>
__device__ __forceinline__ uint4* slot(BwdSlots<kDt>& sm, int stage, int kind) {
  return sm + (stage * kBwdKinds + kind) * kQuads<kDt> * kConv1dBlock + threadIdx.x;
}

// Slice s of a row (its n valid elements; 0: zeros) into a slot: a full slice of a vector row by
// cp.async, anything else loaded now and stored. With kFast (a vector row, n 0 or 8) always by
// cp.async, which zero-fills for n 0 from the row's first slice, a valid address.
template <int kDt, bool kFast>
__device__ __forceinline__ void stage_slice(uint4* dst, const SeqRow& r, int64_t s, int n,
                                            bool vec) {
  if constexpr (kFast) {
    const uint4* src = reinterpret_cast<const uint4*>(
        static_cast<const char*>(r.data) +
        (r.base + (n > 0 ? s : 0) * kSlice) * (kDt == int(Dtype::F32) ? 4 : 2));
#pragma unroll
    for (int q = 0; q < kQuads<kDt>; ++q)
      cp_async_16_or_zero(dst + q * kConv1dBlock, src + q, n > 0);
    return;
  }
  if (vec && n == kSlice) {
    const uint4* src = reinterpret_cast<const uint4*>(
        static_cast<const char*>(r.data) +
        (r.base + s * kSlice) * (kDt == int(Dtype::F32) ? 4 : 2));
#pragma unroll
    for (int q = 0; q < kQuads<kDt>; ++q) cp_async_16(dst + q * kConv1dBlock, src + q);
    return;
  }
  Raw<kDt> v;
  fetch<kDt, false>(r, s, n, vec, v);
#pragma unroll
  for (int q = 0; q < kQuads<kDt>; ++q)
    dst[q * kConv1dBlock] = make_uint4(v.w[4 * q], v.w[4 * q + 1], v.w[4 * q + 2], v.w[4 * q + 3]);
}

template <int kDt>
__device__ __forceinline__ void unstage(const uint4* src, Raw<kDt>& v) {
#pragma unroll
  for (int q = 0; q < kQuads<kDt>; ++q) {
    const uint4 u = src[q * kConv1dBlock];
    v.w[4 * q] = u.x, v.w[4 * q + 1] = u.y, v.w[4 * q + 2] = u.z, v.w[4 * q + 3] = u.w;
  }
}

// dz (the gradient of the convolution's output z, before the activation) at position pos < seqlen
// of row (b, c), from memory: x at the kTaps positions up to pos and dout at pos. For the kTaps-1
// positions after a unit, which another unit owns.
template <int kDt, int kTaps, bool kMasked>
__device__ __forceinline__ float dz_from_memory(const Conv1dArgs& a, int64_t b, int64_t c,
                                                int64_t pos, const float (&wt)[kTaps],
                                                float bias, uint32_t wmask) {
  float xw[kTaps];
  int sw[kTaps];
#pragma unroll
  for (int k = 0; k < kTaps; ++k) {
    const int64_t q = pos - (kTaps - 1) + k;
    xw[k] = x_or_initial<kDt>(a, b, c, q);
    sw[k] = kMasked ? load_seq_id(a.seq_idx, b, q > 0 ? q : 0) : 0;
  }
  const float z =
      conv_at<kTaps>(xw, wt, bias, kMasked ? same_sequence_taps<kTaps>(sw, wmask) : wmask);
  const float g = load_x<kDt>(a.dout.data, at3(a.dout, b, c, pos));
  return a.silu ? g * dsilu(z) : g;
}

// The forward kernel's body; kMasked: seq_idx is given. Without it every output has the same
// taps, whose predicates the compiler then computes once instead of at every tap. kFast: the
// common case (seq_fast below), with no predicates on the taps, SiLU, vector rows of whole
// slices and no states, so that nothing of the general case costs registers or instructions.
template <int kDt, int kTaps, bool kMasked, bool kFast>
__device__ __forceinline__ void fwd_seq(const Conv1dArgs& a, const SeqPlan& p) {
  constexpr int kHalo = kTaps - 1;
  const SeqPlace at(a, p);
  const int64_t L = a.seqlen;
  float wt[kTaps];
  load_taps(a.weight, at.c, a.width, wt);
  const float bias = load_bias(a.bias, at.c);
  const uint32_t wmask = body_taps<kTaps, kFast>(a.width);
  const SeqRow xr(a.x, at.b, at.c), outr(a.out, at.b, at.c);

  int64_t s = at.first_slice + at.lane;
  Raw<kDt> cur, carry;
  fetch<kDt, kFast>(xr, s, valid_if<kFast>(at.unit_ok && s < at.end_slice, L, s), p.vec, cur);
  Raw<kDt> nxt;
  fetch<kDt, kFast>(xr, s + p.seg, valid_if<kFast>(at.unit_ok && s + p.seg < at.end_slice, L,
                                                   s + p.seg),
                    p.vec, nxt);
  // The slice before the unit, for its first lane (none at the row's start).
  fetch<kDt, kFast>(xr, at.first_slice - 1,
                    at.lane == 0 && at.unit_ok && at.first_slice > 0 ? kSlice : 0, p.vec, carry);
  // Every lane runs every iteration: the shuffles need the whole warp.
  for (int it = 0; it < p.iters; ++it, s += p.seg) {
    const bool ok = at.unit_ok && s < at.end_slice;
    const int n = valid_if<kFast>(ok, L, s);
    // The slice two iterations on is fetched before this one's result is stored, so two loads
    // a lane are in flight while this slice is computed.
    Raw<kDt> after_next;
    const int64_t s_after = s + 2 * p.seg;
    fetch<kDt, kFast>(xr, s_after,
                      valid_if<kFast>(at.unit_ok && s_after < at.end_slice, L, s_after), p.vec,
                      after_next);

    SliceMasks tm = replicate<kTaps>(wmask);
    if constexpr (kMasked) {
      int sw[kHalo + kSlice];
      seq_ids_behind_and_own<kTaps>(a, at.b, s, n, at.lane == 0, p.seg, sw);
      tm = 0;
#pragma unroll
      for (int e = 0; e < kSlice; ++e)
        tm |= SliceMasks(same_sequence_taps<kTaps>(sw + e, wmask)) << (e * kTaps);
    }

    Raw<kDt> before;
    tail_before<kDt, kTaps>(cur, at.lane, p.seg, carry, before);
    float xw[kHalo + kSlice];  // x at positions 8s - (kTaps-1) .. 8s + 7
    x_window<kDt, kTaps, !kFast>(a, at, s, ok, before, cur, xw);

    if (ok) {
      float o[kSlice];
#pragma unroll
      for (int e = 0; e < kSlice; ++e) {
        const uint32_t m = kMasked ? mask_of<kTaps>(tm, e) : wmask;
        const float z = conv_at<kTaps>(xw + e, wt, bias, m);
        o[e] = kFast || a.silu ? silu(z) : z;
      }
      Raw<kDt> r;
      narrow(o, r);
      store_raw<kDt>(outr.data, slice_start<kFast>(outr, s), outr.stride, n,
                     kFast || (p.vec && n == kSlice), r);
    }
    cur = nxt;
    nxt = after_next;
  }
  if (!kFast && a.final_states.present() && holds_row_end(at, p))
    write_final_states<kDt>(a, at.b, at.c);
}

// The backward kernel's body; kMasked and kFast as for fwd_seq; sm: the block's pipeline slots.
// Iteration it takes slice first + (iters-1-it)*seg + lane: the unit from the top down.
template <int kDt, int kTaps, bool kMasked, bool kFast>
__device__ __forceinline__ void bwd_seq(const Conv1dArgs& a, const SeqPlan& p,
                                        BwdSlots<kDt>& sm) {
  constexpr int kHalo = kTaps - 1;
  const SeqPlace at(a, p);
  const int W = a.width;
  const int64_t L = a.seqlen;
  float wt[kTaps];
  load_taps(a.weight, at.c, W, wt);
  const float bias = load_bias(a.bias, at.c);
  const uint32_t wmask = body_taps<kTaps, kFast>(W);
  const bool first_lane = at.lane == 0, last_lane = at.lane == p.seg - 1;
  const SeqRow xr(a.x, at.b, at.c), gr(a.dout, at.b, at.c), dxr(a.dx, at.b, at.c);
  float dw[kTaps] = {}, db = 0.f;

  // dz at the kTaps-1 positions after the slice of the segment's last lane: in the first
  // iteration those after the unit (the last lane has the unit's last slice when the unit is
  // full; a shorter unit ends the row, after which dz is 0), later the first lane's.
  float dz_after[kHalo];
#pragma unroll
  for (int h = 0; h < kHalo; ++h) {
    const int64_t pos = at.end_slice * kSlice + h;
    dz_after[h] = last_lane && at.unit_ok && pos < L
                      ? dz_from_memory<kDt, kTaps, kMasked>(a, at.b, at.c, pos, wt, bias, wmask)
                      : 0.f;
  }

  // Iteration j's slices into stage j % kStages: x and dout of slice s and, for the segment's
  // first lane, x of slice s-1 (its tail starts the window; the other lanes get theirs by a
  // shuffle). Every iteration commits a group, empty or not, so the counts below hold.
  constexpr int kStages = kBwdStages<kDt>;
  const int64_t top = at.first_slice + int64_t(p.iters - 1) * p.seg + at.lane;
  const auto stage_in = [&](int j) {
    if (j < p.iters) {
      const int64_t sj = top - int64_t(j) * p.seg;
      const bool ok = at.unit_ok && sj < at.end_slice;
      const int n = valid_if<kFast>(ok, L, sj);
      const int st = j % kStages;
      stage_slice<kDt, kFast>(slot<kDt>(sm, st, 0), xr, sj, n, p.vec);
      stage_slice<kDt, kFast>(slot<kDt>(sm, st, 1), gr, sj, n, p.vec);
      if (first_lane)
        stage_slice<kDt, kFast>(slot<kDt>(sm, st, 2), xr, sj - 1, ok && sj > 0 ? kSlice : 0,
                                p.vec);
    }
    cp_async_commit();
  };
#pragma unroll
  for (int j = 0; j + 1 < kStages; ++j) stage_in(j);
  int64_t s = top;
  for (int it = 0; it < p.iters; ++it, s -= p.seg) {
    const bool ok = at.unit_ok && s < at.end_slice;
    const int n = valid_if<kFast>(ok, L, s);
    cp_async_wait<kStages - 2>();
    Raw<kDt> xcur, gcur, xbefore;
    const int st = it % kStages;
    unstage(slot<kDt>(sm, st, 0), xcur);
    unstage(slot<kDt>(sm, st, 1), gcur);
    if (first_lane) {
      unstage(slot<kDt>(sm, st, 2), xbefore);
    } else {
      clear(xbefore);
    }
    // Into the stage the previous iteration read (its values are used by now): kStages-1
    // iterations in flight while this one is computed.
    stage_in(it + kStages - 1);

    // Tap masks of the own outputs (tm), output masks of the own inputs (gm); bit e of fm: own
    // position e is of position seqlen-1's sequence, bit 8: so is position 0; bit t of im: own
    // position t is of position 0's sequence (the initial states' gradients use the last two).
    SliceMasks tm = replicate<kTaps>(wmask), gm = tm;
    uint32_t fm = ~0u, im = ~0u;
    if constexpr (kMasked) {
      int sw[kHalo + kSlice + kHalo];  // ids of positions 8s - (kTaps-1) .. 8s + 8 + kTaps - 2
      seq_ids_behind_and_own<kTaps>(a, at.b, s, n, first_lane, p.seg, sw);
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
      tm = gm = 0;
      fm = uint32_t(sw[kHalo] == last_id) << kSlice;
      im = 0u;
#pragma unroll
      for (int e = 0; e < kSlice; ++e) {
        tm |= SliceMasks(same_sequence_taps<kTaps>(sw + e, wmask)) << (e * kTaps);
        gm |= SliceMasks(same_sequence_outputs<kTaps>(sw + kHalo + e, wmask)) << (e * kTaps);
        fm |= uint32_t(sw[kHalo + e] == last_id) << e;
        im |= uint32_t(sw[kHalo + e] == sw[kHalo]) << e;
      }
    }

    Raw<kDt> before;
#pragma unroll
    for (int i = 0; i < kWords<kDt>; ++i) {
      const uint32_t up =
          i < kTailWord<kDt, kTaps> ? 0u : __shfl_up_sync(kFullMask, xcur.w[i], 1, p.seg);
      before.w[i] = first_lane ? xbefore.w[i] : up;
    }
    float xw[kHalo + kSlice];  // x at positions 8s - (kTaps-1) .. 8s + 7
    x_window<kDt, kTaps, !kFast>(a, at, s, ok, before, xcur, xw);

    // dz at positions 8s .. 8s + 8 + kTaps - 2: the slice's own (0 past seqlen), then the next
    // lane's first; the last lane has them from the first lane's previous iteration, and keeps
    // the first lane's of this one for its next.
    float dz[kSlice + kHalo];
#pragma unroll
    for (int e = 0; e < kSlice; ++e) {
      const float g = element(gcur, e);
      const uint32_t m = kMasked ? mask_of<kTaps>(tm, e) : wmask;
      dz[e] = kFast || a.silu ? g * dsilu(conv_at<kTaps>(xw + e, wt, bias, m)) : g;
    }
    // One test a slice rather than one an element: a full slice has no position past seqlen.
    // kFast has only full slices and zero-filled ones, whose dz (0 times a finite dsilu) is 0.
    if (!kFast && n < kSlice) {
#pragma unroll
      for (int e = 0; e < kSlice; ++e) dz[e] = e < n ? dz[e] : 0.f;
    }
#pragma unroll
    for (int h = 0; h < kHalo; ++h) {
      const float r = __shfl_sync(kFullMask, dz[h], at.lane + 1, p.seg);
      dz[kSlice + h] = last_lane ? dz_after[h] : r;
      if (last_lane) dz_after[h] = r;
    }

    if (ok) {
      if (a.dx.present()) {
        float g[kSlice];
#pragma unroll
        for (int e = 0; e < kSlice; ++e)
          g[e] = input_grad_at<kTaps>(dz + e, wt, kMasked ? mask_of<kTaps>(gm, e) : wmask);
        // dfinal_states reaches the last W-1 positions only: one test a slice.
        if (!kFast && a.dfinal_states.present() && (s + 1) * kSlice > L - (W - 1)) {
#pragma unroll
          for (int e = 0; e < kSlice; ++e)
            g[e] += final_state_grad(a, at.b, at.c, s * kSlice + e, (fm >> e) & 1u);
        }
        Raw<kDt> r;
        narrow(g, r);
        store_raw<kDt>(dxr.data, slice_start<kFast>(dxr, s), dxr.stride, n,
                       kFast || (p.vec && n == kSlice), r);
      }
      // Positions past seqlen have dz 0, so they add nothing.
#pragma unroll
      for (int e = 0; e < kSlice; ++e) {
        db += dz[e];
        const uint32_t m = kMasked ? mask_of<kTaps>(tm, e) : wmask;
#pragma unroll
        for (int k = 0; k < kTaps; ++k)
          dw[k] = (m >> k) & 1u ? fmaf(dz[e], xw[e + k], dw[k]) : dw[k];
      }
      const TensorRef& di = a.dinitial_states;
      if (!kFast && di.present() && s == 0) {
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

// Three kernels: with packed sequences (kMasked), and without in a general form and a fast one
// (kFast), each with the registers its own body needs; the launcher picks.
template <int kDt, int kTaps, bool kMasked, bool kFast>
__global__ void __launch_bounds__(kConv1dBlock)
    conv1d_fwd_seq_kernel(const Conv1dArgs a, const SeqPlan p) {
  conv1d_detail::fwd_seq<kDt, kTaps, kMasked, kFast>(a, p);
}

template <int kDt, int kTaps, bool kMasked, bool kFast>
__global__ void __launch_bounds__(kConv1dBlock, kConv1dBwdSeqMinBlocks<kDt, kTaps, kMasked, kFast>)
    conv1d_bwd_seq_kernel(const Conv1dArgs a, const SeqPlan p) {
  __shared__ conv1d_detail::BwdSlots<kDt> sm;
  conv1d_detail::bwd_seq<kDt, kTaps, kMasked, kFast>(a, p, sm);
}

// The fast kernels' case, Mamba's: the width is kTaps, SiLU, every row-shaped operand is a
// vector row of whole slices, and there are no states (seq_idx is checked by the launch).
template <int kTaps>
bool seq_fast(const Conv1dArgs& a, const SeqPlan& p) {
  return a.width == kTaps && a.silu && p.vec && a.seqlen % conv1d_detail::kSlice == 0 &&
         !a.initial_states.present() && !a.final_states.present() &&
         !a.dfinal_states.present() && !a.dinitial_states.present();
}

template <int kDt, int kTaps>
cudaError_t launch_conv1d_fwd_seq(const Conv1dArgs& a, const SeqPlan& p, cudaStream_t stream) {
  const auto plain = seq_fast<kTaps>(a, p) ? conv1d_fwd_seq_kernel<kDt, kTaps, false, true>
                                           : conv1d_fwd_seq_kernel<kDt, kTaps, false, false>;
  return launch_by_seq_idx(conv1d_fwd_seq_kernel<kDt, kTaps, true, false>, plain, p.units * p.seg,
                           a, p, stream);
}

template <int kDt, int kTaps>
cudaError_t launch_conv1d_bwd_seq(const Conv1dArgs& a, const SeqPlan& p, cudaStream_t stream) {
  const auto plain = seq_fast<kTaps>(a, p) ? conv1d_bwd_seq_kernel<kDt, kTaps, false, true>
                                           : conv1d_bwd_seq_kernel<kDt, kTaps, false, false>;
  return launch_by_seq_idx(conv1d_bwd_seq_kernel<kDt, kTaps, true, false>, plain, p.units * p.seg,
                           a, p, stream);
}

}  // namespace ssm
