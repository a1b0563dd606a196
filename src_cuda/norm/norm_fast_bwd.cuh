// The lean backward (the lean kernels' other half, norm_fast.cuh): it keeps the weight in
// registers for the whole walk down the rows (a thread's columns never change) and loads the next
// row while it reduces and stores this one, 2 slices a thread in a CTA of up to 512 threads (8192
// 16-bit columns); longer segments, up to 65536 columns, are shared by the CTAs of a thread-block
// cluster (kCluster, sm_90 and later; norm_plan.h) that add their partial sums through distributed
// shared memory, so every row is still read from DRAM once (the norm alone on 16-bit rows past
// 8192 columns takes the ring backward instead, norm_ring.cuh). It takes the gate where every
// row-shaped operand has one dtype. Included only by the instantiation files.
#pragma once

#include "norm_fast.cuh"

namespace ssm {

// The backward's lean kernel: the terms of norm_bwd_kernel, with dweight (and dbias) summed in
// registers over the rows a thread visits (the plan is the fused one of norm_cuda.cu). kRt: x
// (the forward's residual stream s), dresidual_out and dresidual; kDt: dy, dx, z and dz. kFull
// (LayerNorm, or a call that wants dbias) keeps the mean, the sum of w dy and the dbias sums;
// RMSNorm without a bias, the common case, compiles without them: 16 registers and ~3
// instructions an element fewer. kGate: a LeanGate (kDt == kRt only). K: slices a thread
// (kFastBwdSlices, or one where bwd_one_slice says, norm_plan.h). Rows past the end and
// slices past the segment read as zeros (their registers are zeroed instead of loaded), so the
// element loops need no per-element selects.
template <int kDt, int kRt, bool kFull, int kGate, bool kCluster, int K = kFastBwdSlices>
__global__ void __launch_bounds__(kNormMaxThreads) norm_bwd_fast_kernel(const NormArgs a,
                                                                        const NormPlan p) {
  using namespace norm_detail;
  constexpr int M = kFull ? 2 : 1;  // sums a row needs: w dy xhat (and w dy)
  constexpr Dtype D = Dtype(kDt), R = Dtype(kRt);
  // With kFull or a gate the scale is read again for each slice at every row instead of staying
  // in registers for the whole walk (their extra terms would otherwise spill): beside a stream
  // of x's dtype from the copy each thread keeps of its own in shared memory, beside a float32
  // stream from global memory (bwd_stashes_scale, norm_plan.h).
  constexpr bool kReloadWeight = kFull || kGate != kNoGate;
  constexpr bool kStashScale = kReloadWeight && kDt == kRt;
  __shared__ float red[2][kNormMaxThreads / 32 * M];
  __shared__ ClusterInbox<M> inbox[kCluster ? 2 : 1];
  // Dynamic: the scale of the thread's slices with kStashScale, then with kGateFirst silu(z)
  // and s silu'(z) of each of its elements, made before the row's reduction for the terms after
  // it. Recomputing those there read s and z again and took a second sigmoid: 989 instructions
  // a thread and row (16 elements); keeping them in registers spilled. A thread reads only what
  // it wrote: no barrier.
  extern __shared__ float4 stash_base[];
  constexpr int kScaleQuads = kStashScale ? K * 2 : 0;
  auto scale_quad = [&](int k, int half) -> float4& {
    return stash_base[(k * 2 + half) * blockDim.x + threadIdx.x];
  };
  auto stash = [&](int k, int term, int half) -> float4& {
    return stash_base[(kScaleQuads + (k * 2 + term) * 2 + half) * blockDim.x + threadIdx.x];
  };
  if (kCluster) cluster_inbox_init(inbox);
  const Place at(a, p, kCluster);
  const int T = p.threads;
  const int64_t step = row_step(a, p, at, kCluster);
  const float inv_len = 1.f / float(a.group_size);
  const bool dres_in = a.dresidual_out.present();
  // x, dy and z loaded and dx and dz stored without allocating them in L1, beside dresidual_out
  // only up to kBwdNoL1StreamSlices (norm_plan.h).
  const bool no_l1 = !dres_in || p.nslices <= kBwdNoL1StreamSlices;
  const LoadHint in_hint = no_l1 ? LoadHint::kNoL1 : LoadHint::kCached;
  const StoreHint out_hint = no_l1 ? StoreHint::kNoL1 : StoreHint::kCached;

  bool valid[K];
  int64_t col[K];
  Slice w[K], dw[K] = {}, db[K] = {};
  thread_columns(p, at, valid, col);
  if (!kReloadWeight) column_scale(a, valid, col, w);
  if (kStashScale) {
#pragma unroll
    for (int k = 0; k < K; ++k) {
      slice_scale(a, valid[k], col[k], w[0]);
      scale_quad(k, 0) = make_float4(w[0][0], w[0][1], w[0][2], w[0][3]);
      scale_quad(k, 1) = make_float4(w[0][4], w[0][5], w[0][6], w[0][7]);
    }
  }

  // Row r's x, dy, z (packed) and statistics, loaded a row ahead; zeros past the last row.
  // dresidual_out is loaded at the start of its own row instead, in flight through the row's
  // arithmetic and reduction: a row-ahead copy held 8-16 more registers across the loop, which
  // LayerNorm and the float32 residual stream spilled.
  Slice xs[K] = {}, dys[K] = {}, zs[K] = {};
  float mean_next = 0.f, rstd_next = 0.f;
  auto fetch = [&](int64_t r) {
    if (r >= a.rows) {
      mean_next = rstd_next = 0.f;
#pragma unroll
      for (int k = 0; k < K; ++k)
#pragma unroll
        for (int e = 0; e < kSlice; ++e) xs[k][e] = dys[k][e] = zs[k][e] = 0.f;
      return;
    }
    if (kFull && a.layer_norm) mean_next = load_stat(a.mean, r, at.group);
    rstd_next = load_stat(a.rstd, r, at.group);
#pragma unroll
    for (int k = 0; k < K; ++k) {
      if (!valid[k]) continue;
      fetch_slice(a.x.data, R, r * a.x.stride[0] + col[k], kSlice, true, xs[k], in_hint);
      fetch_slice(a.dy.data, D, r * a.dy.stride[0] + col[k], kSlice, true, dys[k], in_hint);
      if (kGate != kNoGate)
        fetch_slice(a.z.data, D, r * a.z.stride[0] + col[k], kSlice, true, zs[k], in_hint);
    }
  };

  int64_t r = at.row_block * at.slots + at.slot;
  fetch(r);
  if (kCluster) cluster_inbox_ready();
  int phase = 0, sums = 0;
  // Every thread of the block (of the cluster) runs the same number of iterations: segment_sum
  // and cluster_push_sum synchronise.
  for (int64_t base = at.row_block * at.slots; base < a.rows; base += step, r += step) {
    Slice xhat[K], dye[K], wdy[K], gate[K];
#pragma unroll
    for (int k = 0; k < K; ++k)
#pragma unroll
      for (int e = 0; e < kSlice; ++e) xhat[k][e] = xs[k][e], dye[k][e] = dys[k][e],
                                       gate[k][e] = zs[k][e];
    const float mean = mean_next, rstd = rstd_next;
    const bool row_ok = r < a.rows;
    fetch(r + step);
    // Rows without a residual stream are light (6 bytes an element in bf16): the one row a CTA
    // keeps in flight in registers does not cover the memory's latency, so the row after next
    // is also fetched into L2 (one bulk prefetch of x and of dy a segment). Gated rows lost with
    // it, and so did the clusters. LayerNorm at one slice a thread (beside a float32 stream)
    // loads dresidual_out late, after its element loop, and does the same, also fetching the
    // next row's dresidual_out, where a quarter of the segment's threads or more are idle or
    // one CTA fills an SM (512 threads): nothing else keeps the memory busy through its row's
    // reduction. One H100, % of copy, none / ahead: 77 / 86 at 640 columns, 80 / 93 at 1280,
    // 74 / 88 at 2304, 81 / 94 at 3072, 86 / 95 at 3840, 88 / 94 at 4096 (91 / 89 on another
    // machine), 85 / 90 at 1536 and 84 / 83 at 768 (a quarter idle); 89 / 83 at 896 and 92 /
    // 87 at 2048, where more threads of two or five CTAs an SM work. RMSNorm lost 2-6 points.
    const bool stream_ahead = K == 1 && kFull && dres_in &&
                              (T == kNormMaxThreads || 4 * p.nslices <= 3 * T);
    if (kGate == kNoGate && !kCluster && (!dres_in || stream_ahead) && T >= 32 &&
        at.lane == 0) {
      const unsigned n = unsigned(at.limit);
      auto prefetch_row = [&](const TensorRef& t, Dtype dt, int64_t row) {
        if (row < a.rows)
          prefetch_l2_bulk(static_cast<const char*>(t.data) +
                               (row * t.stride[0] + at.col0) * (slice_bytes(dt) / kSlice),
                           n * slice_bytes(dt));
      };
      if (stream_ahead) prefetch_row(a.dresidual_out, R, r + step);
      prefetch_row(a.x, R, r + 2 * step);
      prefetch_row(a.dy, D, r + 2 * step);
    }
    auto fetch_dres = [&] {
#pragma unroll
      for (int k = 0; k < K; ++k) {
        if (dres_in && valid[k] && row_ok)
          fetch_slice(a.dresidual_out.data, R, r * a.dresidual_out.stride[0] + col[k], kSlice,
                      true, wdy[k]);
      }
    };
    // kFull issues it after the element loop below, whose registers it would otherwise share.
    if (!kFull) fetch_dres();
    float acc[M] = {};
#pragma unroll
    for (int k = 0; k < K; ++k) {
      Slice& ws = w[kReloadWeight ? 0 : k];
      if (kStashScale) {
        const float4 lo = scale_quad(k, 0), hi = scale_quad(k, 1);
        ws[0] = lo.x, ws[1] = lo.y, ws[2] = lo.z, ws[3] = lo.w;
        ws[4] = hi.x, ws[5] = hi.y, ws[6] = hi.z, ws[7] = hi.w;
      } else if (kReloadWeight) {
        slice_scale(a, valid[k], col[k], ws);
      }
      widen_slice(R, true, xhat[k]);
      widen_slice(D, true, dye[k]);
      if (kGate != kNoGate) widen_slice(D, true, gate[k]);
      Slice bias;  // with kGateAfter: dz = dy o silu'(z), o = xhat w + b
      if (kGate == kGateAfter) {
        if (a.bias.present() && valid[k]) {
          fetch_slice(a.bias.data, a.bias.dtype, col[k], kSlice, true, bias);
          widen_slice(a.bias.dtype, true, bias);
        } else {
#pragma unroll
          for (int e = 0; e < kSlice; ++e) bias[e] = 0.f;
        }
      }
      if (kGate == kGateFirst) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float silu_z[4], ds_dg[4];  // ds = dg silu(z), dz = dg s silu'(z)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float z = gate[k][4 * h + e], sg = sigmoid(z), s_ = xhat[k][4 * h + e];
            silu_z[e] = z * sg;
            // silu'(z) = sg (1 + z (1 - sg)) = sg + silu(z) - silu(z) sg
            ds_dg[e] = s_ * fmaf(-silu_z[e], sg, sg + silu_z[e]);
            xhat[k][4 * h + e] = s_ * silu_z[e];
          }
          stash(k, 0, h) = make_float4(silu_z[0], silu_z[1], silu_z[2], silu_z[3]);
          stash(k, 1, h) = make_float4(ds_dg[0], ds_dg[1], ds_dg[2], ds_dg[3]);
        }
      }
#pragma unroll
      for (int e = 0; e < kSlice; ++e) {
        const float z = gate[k][e], sg = kGate == kGateAfter ? sigmoid(z) : 0.f;
        // (x - mean) rstd, not x rstd - mean rstd: a constant row must give xhat 0 exactly.
        xhat[k][e] = kFull ? (xhat[k][e] - mean) * rstd : xhat[k][e] * rstd;
        if (kGate == kGateAfter) {
          // dz = dy o silu'(z) needs nothing from the reduction: made now (into gate, stored
          // below), silu'(z) = sg (1 + z (1 - sg)).
          const float dy = dye[k][e];
          dye[k][e] = dy * z * sg;
          gate[k][e] = dy * fmaf(xhat[k][e], ws[e], bias[e]) * sg * (1.f + z * (1.f - sg));
        }
        dw[k][e] = fmaf(dye[k][e], xhat[k][e], dw[k][e]);
        if (kFull) db[k][e] += dye[k][e];
        dye[k][e] *= ws[e];  // from here on, w dy
        acc[0] = fmaf(dye[k][e], xhat[k][e], acc[0]);
        if (kFull) acc[M - 1] += dye[k][e];
      }
      if (kGate == kGateAfter && valid[k] && row_ok && a.dz.present())
        store_slice(a.dz.data, D, r * a.dz.stride[0] + col[k], kSlice, true, gate[k], out_hint);
    }
    if (kFull) fetch_dres();
    segment_sum(acc, T, red[phase], true);
    if constexpr (kCluster)
      cluster_push_sum(acc, inbox[sums & 1], p.cluster, int(blockIdx.x % p.cluster),
                       (sums >> 1) & 1);
    ++sums;
    phase ^= 1;
    if (!row_ok) continue;
    const float c1 = acc[0] * inv_len;
    const float c2 = kFull && a.layer_norm ? acc[M - 1] * inv_len : 0.f;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      if (!valid[k]) continue;
      if (dres_in) widen_slice(R, true, wdy[k]);
      Slice z;  // kGateFirst: dz
#pragma unroll
      for (int e = 0; e < kSlice; ++e) {
        float ds = rstd * (dye[k][e] - fmaf(xhat[k][e], c1, c2));  // dg
        if (kGate == kGateFirst) {
          const float4 q = stash(k, 0, e / 4), t = stash(k, 1, e / 4);
          const float dg = ds;
          ds *= (&q.x)[e % 4];
          z[e] = dg * (&t.x)[e % 4];
        }
        wdy[k][e] = dres_in ? ds + wdy[k][e] : ds;
      }
      if (kGate == kGateFirst && a.dz.present())
        store_slice(a.dz.data, D, r * a.dz.stride[0] + col[k], kSlice, true, z, out_hint);
      if (a.dx.present())
        store_slice(a.dx.data, D, r * a.dx.stride[0] + col[k], kSlice, true, wdy[k], out_hint);
      if (a.dresidual.present())
        store_slice(a.dresidual.data, R, r * a.dresidual.stride[0] + col[k], kSlice, true,
                    wdy[k]);
    }
  }
  if (p.partial != nullptr) write_partial_sums(a, p, at, dw, db, kFull);
}

template <int kDt, int kRt, bool kCluster>
cudaError_t launch_norm_bwd_fast(const NormArgs& a, NormPlan& p, int sms, cudaStream_t stream) {
  const bool full = a.layer_norm || a.dbias.present();
  auto kernel = full ? norm_bwd_fast_kernel<kDt, kRt, true, kNoGate, kCluster>
                     : norm_bwd_fast_kernel<kDt, kRt, false, kNoGate, kCluster>;
  if constexpr (kDt == kRt) {
    if (a.z.present() && a.norm_before_gate)
      kernel = full ? norm_bwd_fast_kernel<kDt, kRt, true, kGateAfter, kCluster>
                    : norm_bwd_fast_kernel<kDt, kRt, false, kGateAfter, kCluster>;
    else if (a.z.present())
      kernel = full ? norm_bwd_fast_kernel<kDt, kRt, true, kGateFirst, kCluster>
                    : norm_bwd_fast_kernel<kDt, kRt, false, kGateFirst, kCluster>;
  }
  const size_t smem = bwd_stash_bytes(a, p, kDt == kRt);
  // The one-slice kernel's grid is lowered to the CTAs that fit (bwd_one_slice); otherwise,
  // without a cluster, the fused plan (norm_cuda.cu) has already sized the persistent grid.
  if constexpr (!kCluster) {
    if (bwd_one_slice(Dtype(kDt), Dtype(kRt), p.nslices, p.cluster)) {
      kernel = full ? norm_bwd_fast_kernel<kDt, kRt, true, kNoGate, false, 1>
                    : norm_bwd_fast_kernel<kDt, kRt, false, kNoGate, false, 1>;
      return launch_rows<false>(kernel, a, p, sms, stream, smem, true);
    }
  }
  return launch_rows<kCluster>(kernel, a, p, sms, stream, smem, kCluster);
}

}  // namespace ssm
