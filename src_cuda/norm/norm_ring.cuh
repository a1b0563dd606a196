// The ring kernels: whole rows of 16-bit x brought into a ring of shared-memory stages by the
// bulk-copy engine, each row's copies issued rows ahead by one thread a CTA, so no register holds
// them in flight; persistent CTAs (clusters) walk down the rows. The backward (dx, dweight, dbias)
// of the norm alone past 512 slices or beside a float32 stream past 1024; the forward (below, after
// the backward) of a LayerNorm alone where the DRAM is fast, of a gated RMSNorm, or of an RMSNorm
// or LayerNorm beside a residual (norm_plan.h says from which widths). The lean backward
// (norm_fast_bwd.cuh) keeps the next row in registers; with the dweight and dbias sums there too,
// its 128 registers a thread allow 512 threads an SM, 32 KB of x and dy in flight an SM at 16384
// columns, shared by the four CTAs of a cluster meeting every row: 71% of copy (one H200,
// LayerNorm, bf16, direct timing). The ring backward issues each row's copies two rows ahead (128
// KB an SM at 16384 columns); a CTA holds whole rows up to 16384 columns, so no cluster there: 84%
// (norm_plan.h). Past that the CTAs of a cluster share a row, each with a ring of its share. Each
// thread reads its slices from the stage twice (the sums, then the outputs after the row's
// reduction), so no register keeps them across it.
//
// Persistent: one CTA (cluster) a row block, rows b, b + row blocks, ...; the backward's dweight
// and dbias sums are row b of p.partial (p.row_blocks row blocks). Included only by the
// instantiation files.
#pragma once

#include <type_traits>

#include "../common/bulk_copy.cuh"
#include "norm_fast.cuh"

namespace ssm {

namespace norm_detail {

// Row r of t (of dtype d) from column col.
__device__ __forceinline__ const char* row_share(const TensorRef& t, Dtype d, int64_t r,
                                                 int64_t col) {
  return static_cast<const char*>(t.data) + (r * t.stride[0] + col) * (slice_bytes(d) / kSlice);
}

// Slice v of a stage share of dtype d, widened.
__device__ __forceinline__ void stage_slice(Dtype d, const uint4* share, int v, Slice& f) {
  fetch_slice(share, d, int64_t(v) * kSlice, kSlice, true, f);
  widen_slice(d, true, f);
}

// Where the two regions of each stage start in `ring` (16-byte units): the first region
// (first_bytes long) holding rows like first_src, the second rows like second_src, each kLead
// bytes further past a 128-byte line than its source (ring_stage_bytes says why). Rows whose byte
// stride is not a multiple of 128 line up as the given ones do, or not.
template <unsigned kLead>
__device__ __forceinline__ int ring_region_after(const uint4* ring, unsigned end,
                                                 const void* src) {
  const unsigned from = shared_address(ring) + end;
  return int((end + ((unsigned(reinterpret_cast<uintptr_t>(src)) + kLead - from) & 127u)) / 16);
}
template <unsigned kLead>
__device__ __forceinline__ int2 ring_regions(const uint4* ring, const void* first_src,
                                             unsigned first_bytes, const void* second_src) {
  const int first = ring_region_after<kLead>(ring, 0, first_src);
  return make_int2(first, ring_region_after<kLead>(ring, first * 16 + first_bytes, second_src));
}

}  // namespace norm_detail

// kDt: dy and dx (16-bit); kRt: x (the forward's residual stream s), dresidual_out and
// dresidual, float32 or kDt; kStream: the stream's gradients wanted (always beside a float32
// one). kFull: LayerNorm, or a dbias wanted
// (the mean and the sum of w dy, the dbias sums), as in the lean backward. K slices a thread (lane
// + k * threads). kCluster: the p.cluster CTAs of a thread-block cluster share each row,
// p.cta_slices slices each, and add their sums through distributed shared memory
// (cluster_push_sum); sm_90 and later. Persistent clusters then: cluster c takes rows c, c +
// clusters, ..., its dweight and dbias sums row c of p.partial, each CTA its own columns.
// dresidual_out is read once, by the second pass, so it is not staged: its share of a row is
// fetched into L2 when the row's copies are issued. kGate (LeanGate), the norm alone only
// (kDt == kRt) of an RMSNorm without a dbias (ring_cluster, norm_cuda.cu), as beside a stream
// of x's dtype: z is staged after dy. kGateAfter, y = norm(x) silu(z): dz stored by the first
// pass (it needs no sums), and the gated dy silu(z) written in float32 over the slice's dy and z
// for the second. kGateFirst, y = norm(x silu(z)): both passes take silu(z) from the stage's z,
// the second dx = dg silu(z) and dz = dg x silu'(z). S: the ring's stages (ring_stages).
template <int kDt, int kRt, bool kFull, int K, bool kCluster, int kGate = kNoGate,
          bool kStream = kRt != kDt, int S = kRingStages>
__global__ void __launch_bounds__(kNormMaxThreads, 1) norm_bwd_ring_kernel(const NormArgs a,
                                                                           const NormPlan p) {
  using namespace norm_detail;
  constexpr Dtype D = Dtype(kDt), R = Dtype(kRt);
  constexpr int M = kFull ? 2 : 1;
  // kStream: beside a stream (float32, or x's dtype), with its gradients; else the norm alone.
  static_assert(D != Dtype::F32 && (R == D || R == Dtype::F32) && (kStream || R == D),
                "16-bit dy and dx, x of their dtype or float32");
  static_assert(kGate == kNoGate || !kStream, "a gate only on the norm alone");
  static_assert(!kFull || (kGate == kNoGate && (!kStream || R == Dtype::F32)),
                "gated or beside a stream of x's dtype: an RMSNorm without a dbias");
  constexpr bool kZ = kGate != kNoGate;
  __shared__ uint64_t landed[S];
  __shared__ float red[2][kNormMaxThreads / 32 * M];
  // Two inboxes in turn, as cluster_push_sum asks of a kernel that sums every row.
  __shared__ ClusterInbox<M> inbox[2];
  if (kCluster) cluster_inbox_init(inbox);
  // Stage s: the CTA's share of the row's x (p.cta_slices slices), then of its dy, each lined up
  // with its rows (ring_regions).
  extern __shared__ uint4 ring[];
  const int T = p.threads, lane = threadIdx.x;
  const int rank = kCluster ? int(blockIdx.x % p.cluster) : 0;
  const int first = rank * p.cta_slices;
  const int n = kCluster ? min(p.cta_slices, p.nslices - first) : p.nslices;
  const int stride = kCluster ? p.cta_slices : p.nslices;
  const int64_t row0 = kCluster ? blockIdx.x / p.cluster : blockIdx.x;
  const int64_t step = kCluster ? gridDim.x / p.cluster : gridDim.x;
  const bool dres_in = kStream && a.dresidual_out.present();
  auto col = [&](int v) { return int64_t(first + v) * kSlice; };
  const unsigned x_share = unsigned(stride) * slice_bytes(R);
  // The lead each kernel ran fastest at, of 0, 16, ..., 112 (one H200, bf16, % of copy, direct
  // timing, at 5120, 8192 and 16384 columns, then at 20480, 32768, 49152 and 65536 in clusters):
  // - kFull in one CTA, 32: LayerNorm 92 / 91 / 91 (at 0: 93 / 91 / 90), RMSNorm with a bias
  //   89 / 88 / 92 (86 / 86 / 91);
  // - kFull in clusters, 0: LayerNorm 74 / 82 / 77 / 76 (at 32: 71 / 80 / 74 / 75);
  // - the rest, 64: RMSNorm in one CTA 90 / 90 / 90 (at 0: 88 / 88 / 89), in clusters
  //   92 / 89 / 87 / 88 (87 / 86 / 85 / 86).
  // Every kernel lost most at 48 and 80 (76-79).
  constexpr unsigned kLead = kFull ? (kCluster ? 0u : 32u) : 64u;
  const int2 regions = ring_regions<kLead>(ring, row_share(a.x, R, row0, col(0)), x_share,
                                           row_share(a.dy, D, row0, col(0)));
  const int dy_at = regions.y - regions.x;
  const unsigned dy_share = unsigned(stride) * 16u;
  const int z_at = kZ ? ring_region_after<kLead>(ring, unsigned(regions.y) * 16u + dy_share,
                                                    row_share(a.z, D, row0, col(0))) -
                               regions.x
                         : 0;
  const int stage_units =
      int(ring_stage_bytes(x_share, kZ ? ring_gated_second(dy_share) : dy_share) / 16u);
  auto stage_of = [&](int j) { return ring + regions.x + size_t(j % S) * stage_units; };

  // Thread 0: the copies of the block's j-th row into stage j % S, if that row exists.
  auto issue = [&](int j) {
    const int64_t r = row0 + int64_t(j) * step;
    if (r >= a.rows) return;
    uint4* stage = stage_of(j);
    uint64_t* bar = &landed[j % S];
    const unsigned x_bytes = unsigned(n) * slice_bytes(R), dy_bytes = unsigned(n) * 16u;
    mbarrier_expect_bytes(bar, x_bytes + dy_bytes * (kZ ? 2 : 1));
    bulk_copy_to_shared(stage, row_share(a.x, R, r, col(0)), x_bytes, bar);
    bulk_copy_to_shared(stage + dy_at, row_share(a.dy, D, r, col(0)), dy_bytes, bar);
    if (kZ) bulk_copy_to_shared(stage + z_at, row_share(a.z, D, r, col(0)), dy_bytes, bar);
    if (dres_in) prefetch_l2_bulk(row_share(a.dresidual_out, R, r, col(0)), x_bytes);
  };
  if (threadIdx.x == 0) {
#pragma unroll
    for (int s = 0; s < S; ++s) mbarrier_init_for_copies(&landed[s]);
#pragma unroll
    for (int j = 0; j < S; ++j) issue(j);
  }
  Slice w[K], dw[K] = {}, db[K] = {};
#pragma unroll
  for (int k = 0; k < K; ++k) slice_scale(a, lane + k * T < n, col(lane + k * T), w[k]);
  __syncthreads();  // the mbarriers are ready
  if (kCluster) cluster_inbox_ready();

  const float inv_len = 1.f / float(a.group_size);
  const bool writes = a.dx.present() || (kStream && a.dresidual.present()) ||
                      (kGate == kGateFirst && a.dz.present());
  // A row's mean and rstd are loaded a row ahead, so its first pass does not wait for them.
  float mean_next = 0.f, rstd_next = 0.f;
  auto load_stats = [&](int64_t r) {
    if (r >= a.rows) return;
    if (kFull && a.layer_norm) mean_next = load_stat(a.mean, r, 0);
    rstd_next = load_stat(a.rstd, r, 0);
  };
  load_stats(row0);
  int j = 0;
  for (int64_t r = row0; r < a.rows; r += step, ++j) {
    const float mean = mean_next, rstd = rstd_next;
    load_stats(r + step);
    uint4* xs = stage_of(j);
    uint4* dys = xs + dy_at;
    mbarrier_wait(&landed[j % S], unsigned(j / S) & 1u);
    // With kGateAfter, the two 16-byte halves of slice v's gated dy (float32) after the first
    // pass.
    auto gated = [&](int v, int half) { return half == 0 ? dys + v : xs + z_at + v; };
    // Each slice of the stage, widened: x - mean (x for an RMSNorm; x silu(z) with kGateFirst)
    // and dy (dy silu(z) with kGateAfter, after the first pass).
    auto each_slice = [&](auto&& f) {
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const int v = lane + k * T;
        if (v >= n) continue;
        Slice xd, g;
        stage_slice(R, xs, v, xd);
        if constexpr (kGate == kGateFirst) {
          Slice u;
          unpack_slice(D, xs[z_at + v], u);
#pragma unroll
          for (int e = 0; e < kSlice; ++e) xd[e] *= silu(u[e]);
        }
        if constexpr (kGate == kGateAfter) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const uint4 q = *gated(v, h);
            g[4 * h] = __uint_as_float(q.x), g[4 * h + 1] = __uint_as_float(q.y);
            g[4 * h + 2] = __uint_as_float(q.z), g[4 * h + 3] = __uint_as_float(q.w);
          }
        } else {
          unpack_slice(D, dys[v], g);
        }
        if (kFull) {
          // x - mean, not x rstd - mean rstd: a constant row must give xhat 0 exactly.
#pragma unroll
          for (int e = 0; e < kSlice; ++e) xd[e] -= mean;
        }
        f(k, v, xd, g);
      }
    };
    // The dweight and dbias sums of slice k.
    auto weight_sums = [&](int k, const Slice& xd, const Slice& g) {
#pragma unroll
      for (int e = 0; e < kSlice; ++e) {
        dw[k][e] = fmaf(g[e] * rstd, xd[e], dw[k][e]);
        if (kFull) db[k][e] += g[e];
      }
    };
    // The row's sums of w dy (x - mean) and w dy, rstd applied once to the first; the dweight
    // and dbias sums wait for the second pass, which has x - mean and dy at hand. One H200,
    // LayerNorm alone at 16384 columns: 101M warp instructions before (xhat, the weight sums in
    // the first pass, dx as rstd (w dy - (xhat c1 + c2))), 94M now.
    float acc[M] = {};
    if constexpr (kGate == kGateAfter) {
      // dz = dy o silu'(z), o = xhat w + b, and g = dy silu(z), which replaces dy and z in the
      // stage; the sums as below, over g.
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const int v = lane + k * T;
        if (v >= n) continue;
        Slice xd, g, u, b;
        stage_slice(R, xs, v, xd);
        unpack_slice(D, dys[v], g);
        unpack_slice(D, xs[z_at + v], u);
        if (a.bias.present()) {
          fetch_slice(a.bias.data, a.bias.dtype, col(v), kSlice, true, b);
          widen_slice(a.bias.dtype, true, b);
        } else {
#pragma unroll
          for (int e = 0; e < kSlice; ++e) b[e] = 0.f;
        }
#pragma unroll
        for (int e = 0; e < kSlice; ++e) {
          const float z = u[e], sg = sigmoid(z), dy = g[e];
          u[e] = dy * fmaf(xd[e] * rstd, w[k][e], b[e]) * sg * (1.f + z * (1.f - sg));
          g[e] = dy * z * sg;
          acc[0] = fmaf(g[e] * w[k][e], xd[e], acc[0]);
        }
        if (a.dz.present())
          store_slice(a.dz.data, D, r * a.dz.stride[0] + col(v), kSlice, true, u);
#pragma unroll
        for (int h = 0; h < 2; ++h)
          *gated(v, h) = make_uint4(__float_as_uint(g[4 * h]), __float_as_uint(g[4 * h + 1]),
                                    __float_as_uint(g[4 * h + 2]), __float_as_uint(g[4 * h + 3]));
      }
      // Those stores reach the stage through the generic proxy; the bulk copy that refills it
      // later writes through the async one.
      fence_shared_for_copies();
    } else {
      each_slice([&](int k, int, const Slice& xd, const Slice& g) {
#pragma unroll
        for (int e = 0; e < kSlice; ++e) {
          const float gw = g[e] * w[k][e];
          acc[0] = fmaf(gw, xd[e], acc[0]);
          if (kFull) acc[M - 1] += gw;
        }
      });
    }
    acc[0] *= rstd;
    // The CTAs are whole warps (ring_bwd_plan).
    segment_sum<M, kNormMaxThreads, true>(acc, T, red[j & 1], true);
    // Past that barrier every thread is done with the previous row's stage: refill it.
    if (threadIdx.x == 0 && j > 0) issue(j - 1 + S);
    if constexpr (kCluster) cluster_push_sum(acc, inbox[j & 1], p.cluster, rank, (j >> 1) & 1);
    if (!writes) {
      each_slice([&](int k, int, const Slice& xd, const Slice& g) { weight_sums(k, xd, g); });
      continue;
    }
    const float c1 = acc[0] * inv_len * rstd * rstd;
    const float c2 = kFull && a.layer_norm ? acc[M - 1] * inv_len * rstd : 0.f;
    // dresidual_out of every slice first, so its loads are in flight together.
    Slice dres[kStream ? K : 1];
    if constexpr (kStream) {
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const int v = lane + k * T;
        if (dres_in && v < n) {
          fetch_slice(a.dresidual_out.data, R, r * a.dresidual_out.stride[0] + col(v), kSlice,
                      true, dres[k]);
          widen_slice(R, true, dres[k]);
        } else {
#pragma unroll
          for (int e = 0; e < kSlice; ++e) dres[k][e] = 0.f;
        }
      }
    }
    uint16_t* dx = static_cast<uint16_t*>(a.dx.data) + r * a.dx.stride[0];
    if constexpr (kGate == kGateFirst) {
      // dg as dx below, of g = x silu(z); then dx = dg silu(z), dz = dg x silu'(z).
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const int v = lane + k * T;
        if (v >= n) continue;
        Slice xr, u, g;
        stage_slice(R, xs, v, xr);
        unpack_slice(D, xs[z_at + v], u);
        unpack_slice(D, dys[v], g);
#pragma unroll
        for (int e = 0; e < kSlice; ++e) {
          const float z = u[e], sg = sigmoid(z), sz = z * sg;
          const float gd = xr[e] * sz;
          dw[k][e] = fmaf(g[e] * rstd, gd, dw[k][e]);
          const float dg = fmaf(g[e] * rstd, w[k][e], -gd * c1);
          g[e] = dg * sz;
          u[e] = dg * xr[e] * sg * (1.f + z * (1.f - sg));
        }
        if (a.dx.present()) store_slice(dx, D, col(v), kSlice, true, g);
        if (a.dz.present())
          store_slice(a.dz.data, D, r * a.dz.stride[0] + col(v), kSlice, true, u);
      }
      continue;
    }
    // dx = rstd (w dy - xhat c1 - c2) = rstd dy w - (x - mean) rstd^2 c1 - rstd c2.
    each_slice([&](int k, int v, const Slice& xd, Slice& g) {
      weight_sums(k, xd, g);
#pragma unroll
      for (int e = 0; e < kSlice; ++e) {
        g[e] = fmaf(g[e] * rstd, w[k][e], -fmaf(xd[e], c1, c2));
        if constexpr (kStream) g[e] += dres[k][e];
      }
      if (a.dx.present()) store_slice(dx, D, col(v), kSlice, true, g);
      if (kStream && a.dresidual.present())
        store_slice(a.dresidual.data, R, r * a.dresidual.stride[0] + col(v), kSlice, true, g);
    });
  }
  if (p.partial == nullptr) return;
  float* const out_w = p.partial + row0 * a.hidden;
  float* const out_b = out_w + step * a.hidden;
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int v = lane + k * T;
    if (v >= n) continue;
    store_slice(out_w, Dtype::F32, col(v), kSlice, true, dw[k]);
    if (kFull) store_slice(out_b, Dtype::F32, col(v), kSlice, true, db[k]);
  }
}

// The ring forward: y, mean and rstd of whole rows of 16-bit x, alone or with a second operand,
// shared by the p.cluster CTAs of a thread-block cluster (p.cta_slices each; sm_90 and later)
// that add their sums through distributed shared memory, x and the second operand brought into a
// ring of kRingFwdStages stages (one group; norm_plan.h). kOp (RingOp):
// - kRingAlone: the norm of x alone (a LayerNorm when kLayer);
// - kRingGateFirst: an RMSNorm of g = x silu(z), y = norm(g) w (+ b) (Mamba-2's RMSNormGated);
// - kRingGateAfter: an RMSNorm of g = x, y = (norm(g) w (+ b)) silu(z);
// - kRingResidual: g = x + residual, the stream s in kRt (kDt or float32), stored as
//   residual_out when asked for; RMSNorm or LayerNorm (kLayer).
// Each thread reads its slices from the stage again after the row's reduction, so no register keeps
// them across. A LayerNorm's statistics take one pass over the stage and one round across the CTA:
// each thread sums g - c and (g - c)^2 around c, its own first g, into its moments (stable: c is
// one of the thread's own elements, so n (mean - c)^2 <= n m2 with n <= 32), segment_moments
// combines the CTA's threads' and the CTAs combine theirs in one cluster round. One H200, bf16, %
// of copy, against the CTA's mean and then its deviations (a second read of the stage, a second
// round): the LayerNorm alone 83 / 87 at 24576 columns, 86 / 89 at 32768, 81-82 / 85-86 at 40960
// and 49152, 83 / 87 at 65536; beside a float32 stream level at 40960 and 65536 (88-91), but 89 /
// 84 at 49152 (six CTAs of 1024 slices in 512 threads; not understood). The same sums around the
// first g of the CTA's share ran as fast but lost ~1e-3 of the variance where that g stands far
// from the rest (test_ring_layer_norm_moments). The first pass writes g back over its slice in
// float32 where it is neither x nor derived from x alone (recomputing x silu(z) for y would cost
// two more exponentials and reciprocals an element), over the second operand's 32 bytes when it is
// float32, else over both operands' 16. The stage is refilled once the next row's reduction barrier
// has passed. The scale and bias are held in registers for the whole walk (persistent clusters:
// cluster c takes rows c, c + clusters, ...). K slices a thread.
enum RingOp { kRingAlone = 0, kRingGateFirst = 1, kRingGateAfter = 2, kRingResidual = 3 };
template <int kDt, int kRt, int kOp, bool kLayer, int K>
__global__ void __launch_bounds__(kNormMaxThreads, 1) norm_fwd_ring_kernel(
    const NormArgs a, const NormPlan p) {
  using namespace norm_detail;
  constexpr Dtype D = Dtype(kDt), R = Dtype(kOp == kRingResidual ? kRt : kDt);
  constexpr int S = kRingFwdStages;
  // 16-byte units of a slice of the second operand; g is kept in float32 unless it is x.
  constexpr int BQ = kOp == kRingAlone ? 0 : slice_bytes(R) / 16;
  constexpr bool kKeep = kOp != kRingGateAfter && kOp != kRingAlone;
  static_assert(D != Dtype::F32, "a slice of x is one 16-byte copy");
  __shared__ uint64_t landed[S];
  __shared__ float red[2][kNormMaxThreads / 32 * (kLayer ? 3 : 1)];
  // A LayerNorm's CTAs merge their moments (mean, m2, count) across the cluster.
  __shared__ ClusterInbox<kLayer ? 3 : 1> inbox[2];
  cluster_inbox_init(inbox);
  // Stage s: the CTA's share of a row's x, then of its second operand (z or the residual), each
  // lined up with its rows (ring_regions).
  extern __shared__ uint4 ring[];
  const int T = p.threads, lane = threadIdx.x;
  const int rank = int(blockIdx.x % p.cluster);
  const int first = rank * p.cta_slices;
  const int n = min(p.cta_slices, p.nslices - first);
  const int64_t row0 = blockIdx.x / p.cluster, step = gridDim.x / p.cluster;
  const TensorRef& second = kOp == kRingResidual ? a.residual : a.z;
  auto col = [&](int v) { return int64_t(first + v) * kSlice; };
  const unsigned x_share = unsigned(p.cta_slices) * 16u;
  // The lead each kernel ran fastest at, as in the backward: 64 for a gate (RMSNorm gated at
  // 8192, 16384, 32768, 65536 columns 92 / 92 / 92 / 92, at 0: 87 / 87 / 89 / 91), 0 beside a
  // residual (a LayerNorm beside a float32 stream at 16384, 32768, 65536 90 / 89 / 92, at 64: 88 /
  // 88 / 89).
  constexpr unsigned kLead = kOp == kRingGateFirst || kOp == kRingGateAfter ? 64u : 0u;
  const int2 regions = ring_regions<kLead>(ring, row_share(a.x, D, row0, col(0)), x_share,
                                           BQ > 0 ? row_share(second, R, row0, col(0)) : nullptr);
  const int b_at = regions.y - regions.x;
  const int stage_units = int(ring_stage_bytes(x_share, x_share * BQ) / 16u);
  auto stage_of = [&](int j) { return ring + regions.x + size_t(j % S) * stage_units; };
  // The two 16-byte halves of slice v's kept g in the stage whose x share is xs.
  auto kept = [&](uint4* xs, int v, int half) {
    uint4* bs = xs + b_at;
    return BQ == 2 ? bs + 2 * v + half : half == 0 ? xs + v : bs + v;
  };

  auto issue = [&](int j) {
    const int64_t r = row0 + int64_t(j) * step;
    if (r >= a.rows) return;
    uint4* stage = stage_of(j);
    uint64_t* bar = &landed[j % S];
    const unsigned x_bytes = unsigned(n) * 16u, b_bytes = unsigned(n) * 16u * BQ;
    mbarrier_expect_bytes(bar, x_bytes + b_bytes);
    bulk_copy_to_shared(stage, row_share(a.x, D, r, col(0)), x_bytes, bar);
    if (BQ > 0)
      bulk_copy_to_shared(stage + b_at, row_share(second, R, r, col(0)), b_bytes, bar);
  };
  if (threadIdx.x == 0) {
#pragma unroll
    for (int s = 0; s < S; ++s) mbarrier_init_for_copies(&landed[s]);
#pragma unroll
    for (int j = 0; j < S; ++j) issue(j);
  }
  const bool bias = a.bias.present();
  Slice w[K], b[K];
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int v = lane + k * T;
    slice_scale(a, v < n, col(v), w[k]);
#pragma unroll
    for (int e = 0; e < kSlice; ++e) b[k][e] = 0.f;
    if (bias && v < n) {
      fetch_slice(a.bias.data, a.bias.dtype, col(v), kSlice, true, b[k]);
      widen_slice(a.bias.dtype, true, b[k]);
    }
  }
  __syncthreads();  // the mbarriers are ready
  cluster_inbox_ready();

  // g of slice v from the stage: kept in float32, or x.
  auto load_g = [&](uint4* xs, int v, Slice& g) {
    if constexpr (kKeep) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint4 q = *kept(xs, v, h);
        g[4 * h] = __uint_as_float(q.x), g[4 * h + 1] = __uint_as_float(q.y);
        g[4 * h + 2] = __uint_as_float(q.z), g[4 * h + 3] = __uint_as_float(q.w);
      }
    } else {
      unpack_slice(D, xs[v], g);
    }
  };
  // f(k, v, g) for each of this thread's slices v = lane + k * T of the CTA's share, g read
  // from the stage whose x share is xs (after the first pass).
  auto each_g = [&](uint4* xs, auto f) {
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int v = lane + k * T;
      if (v >= n) continue;
      Slice g;
      load_g(xs, v, g);
      f(k, v, g);
    }
  };
  const float inv_len = 1.f / float(a.group_size);
  // The elements this thread sums in every row of a LayerNorm.
  const float held = lane < n ? float(((n - 1 - lane) / T + 1) * kSlice) : 0.f;
  const float inv_held = held > 0.f ? 1.f / held : 0.f;
  int j = 0;
  for (int64_t r = row0; r < a.rows; r += step, ++j) {
    uint4* xs = stage_of(j);
    const uint4* bs = xs + b_at;
    mbarrier_wait(&landed[j % S], unsigned(j / S) & 1u);
    // An RMSNorm's sum of g^2; a LayerNorm's sums of g - shift and its square, shift the
    // thread's first g.
    float acc = 0.f, acc2 = 0.f, shift = 0.f;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int v = lane + k * T;
      if (v >= n) continue;
      Slice g, u;
      unpack_slice(D, xs[v], g);
      if constexpr (kOp == kRingGateFirst) {
        unpack_slice(D, bs[v], u);
#pragma unroll
        for (int e = 0; e < kSlice; ++e) g[e] *= silu(u[e]);
      } else if constexpr (kOp == kRingResidual) {
        stage_slice(R, bs, v, u);
#pragma unroll
        for (int e = 0; e < kSlice; ++e) g[e] += u[e];
        if (a.residual_out.present())
          store_slice(a.residual_out.data, R, r * a.residual_out.stride[0] + col(v), kSlice, true,
                      g);
      }
      if constexpr (kKeep) {
#pragma unroll
        for (int h = 0; h < 2; ++h)
          *kept(xs, v, h) =
              make_uint4(__float_as_uint(g[4 * h]), __float_as_uint(g[4 * h + 1]),
                         __float_as_uint(g[4 * h + 2]), __float_as_uint(g[4 * h + 3]));
      }
      if constexpr (kLayer) {
        if (k == 0) shift = g[0];
#pragma unroll
        for (int e = 0; e < kSlice; ++e) {
          const float d = g[e] - shift;
          acc += d;
          acc2 = fmaf(d, d, acc2);
        }
      } else {
#pragma unroll
        for (int e = 0; e < kSlice; ++e) acc = fmaf(g[e], g[e], acc);
      }
    }
    // The stores above reach the stage through the generic proxy; the bulk copy that refills
    // it later writes through the async one.
    if constexpr (kKeep) fence_shared_for_copies();
    // The rows take the two reduction buffers in turn (segment_reduce's red_free).
    float* const rb = red[j & 1];
    // The CTA's statistics: a LayerNorm's moments, an RMSNorm's sum of g^2.
    Moments m = {shift + acc * inv_held, fmaxf(acc2 - acc * (acc * inv_held), 0.f), held};
    float t[1] = {acc};
    // The moments combine around the first lane's mean (ShiftedMoments) for the norm alone, from
    // the mean (CenteredMoments) beside a stream. One H200, bf16, % of copy, direct timing,
    // Shifted / Centered: beside a float32 stream 87 / 92 at 49152 columns (six CTAs of 1024
    // slices in 512 threads), 86 / 89 at 28672, but 91 / 89 at 18432 and 20480; alone 90 / 88 at
    // 18432, 91 / 86 at 21504, 90 / 86 at 36864 (threads holding unequal counts), 91 / 91 from
    // 40960, but 88-90 / 89-91 at 20480 to 32768 (benchmarks/NOTES_norm.md).
    using RowMoments = std::conditional_t<kOp == kRingAlone, ShiftedMoments, CenteredMoments>;
    if constexpr (kLayer)
      segment_moments<kNormMaxThreads, false, RowMoments>(m, T, rb);
    else
      segment_sum<1>(t, T, rb, true);
    // Past that barrier every thread is done with the previous row's stage: refill it.
    if (threadIdx.x == 0 && j > 0) issue(j - 1 + S);
    // The row's, merged across the cluster.
    if constexpr (kLayer)
      cluster_reduce(m, inbox[j & 1], p.cluster, rank, (j >> 1) & 1, RowMoments());
    else
      cluster_push_sum(t, inbox[j & 1], p.cluster, rank, (j >> 1) & 1);
    const float mean = kLayer ? m[0] : 0.f;
    const float var = (kLayer ? m[1] : t[0]) * inv_len;
    const float rstd = rsqrtf(var + a.eps);
    if (lane == 0 && rank == 0) {
      if (kLayer && a.mean.present()) store_stat(a.mean, r, 0, mean);
      if (a.rstd.present()) store_stat(a.rstd, r, 0, rstd);
    }
    uint16_t* y = static_cast<uint16_t*>(a.y.data) + r * a.y.stride[0];
    // The norm alone: g rstd - mean rstd in one FFMA, not (g - mean) rstd in two. Its ring
    // forward is bound by instruction issue (benchmarks/NOTES_norm.md), and this ran it 1-2
    // points faster (one H200, bf16, 87-90% of copy at 24576-65536 columns); beside a float32
    // stream it lost 0.3-0.7. The rounding of mean rstd moves xhat by |mean| / std * 2^-24, below
    // the 16-bit output's resolution wherever 16-bit input can resolve the row's deviations.
    const float shift_out = -mean * rstd;
    each_g(xs, [&](int k, int v, Slice& g) {
#pragma unroll
      for (int e = 0; e < kSlice; ++e) {
        const float xhat = kOp == kRingAlone ? fmaf(g[e], rstd, shift_out) : (g[e] - mean) * rstd;
        g[e] = fmaf(xhat, w[k][e], b[k][e]);
      }
      if constexpr (kOp == kRingGateAfter) {
        Slice u;
        unpack_slice(D, bs[v], u);
#pragma unroll
        for (int e = 0; e < kSlice; ++e) g[e] *= silu(u[e]);
      }
      store_slice(y, D, col(v), kSlice, true, g);
    });
  }
}

template <int kDt, int kRt>
cudaError_t launch_norm_fwd_ring(const NormArgs& a, NormPlan& p, int sms, cudaStream_t stream) {
  constexpr int K = ring_slices(Dtype(kRt));
  auto kernel = a.layer_norm ? norm_fwd_ring_kernel<kDt, kRt, kRingResidual, true, K>
                             : norm_fwd_ring_kernel<kDt, kRt, kRingResidual, false, K>;
  if constexpr (kDt == kRt) {
    if (!a.z.present() && !a.residual.present())
      kernel = a.layer_norm ? norm_fwd_ring_kernel<kDt, kRt, kRingAlone, true, K>
                            : norm_fwd_ring_kernel<kDt, kRt, kRingAlone, false, K>;
    if (a.z.present())
      kernel = a.norm_before_gate ? norm_fwd_ring_kernel<kDt, kRt, kRingGateAfter, false, K>
                                  : norm_fwd_ring_kernel<kDt, kRt, kRingGateFirst, false, K>;
  }
  return launch_rows<true>(kernel, a, p, sms, stream, ring_fwd_bytes(a, p, Dtype(kRt)));
}

template <int kDt, int kRt>
cudaError_t launch_norm_bwd_ring(const NormArgs& a, NormPlan& p, int sms, cudaStream_t stream) {
  constexpr int K = ring_slices(Dtype(kRt));
  const bool full = a.layer_norm || a.dbias.present();
  const size_t smem = ring_bytes(p, Dtype(kRt), a.z.present());
  // pick(std::bool_constant<kCluster>) gives the kernel.
  auto run = [&](auto pick) {
    if (p.cluster == 1)
      return launch_rows<false>(pick(std::false_type()), a, p, sms, stream, smem);
    return launch_rows<true>(pick(std::true_type()), a, p, sms, stream, smem);
  };
  if constexpr (kDt == kRt) {
    // An RMSNorm without a dbias beside a stream of x's dtype (2 slices a thread,
    // ring_bwd_slices; one CTA a row, norm_plan.h) or gated (ring_cluster, norm_cuda.cu).
    if (a.stream_grads())
      return launch_rows<false>(norm_bwd_ring_kernel<kDt, kRt, false, 2, false, kNoGate, true>, a,
                                p, sms, stream, smem);
    // A gated CTA of more slices than kRingGateOneCtaSlices is one of a cluster's (ring_ctas,
    // norm_cuda.cu), with kRingGateWideStages stages.
    if (a.z.present() && ring_stages(p.cta_slices, true) == kRingGateWideStages) {
      constexpr int W = kRingGateWideStages;
      return launch_rows<true>(
          a.norm_before_gate
              ? norm_bwd_ring_kernel<kDt, kRt, false, K, true, kGateAfter, false, W>
              : norm_bwd_ring_kernel<kDt, kRt, false, K, true, kGateFirst, false, W>,
          a, p, sms, stream, smem);
    }
    if (a.z.present() && a.norm_before_gate) {
      return run([](auto c) {
        return norm_bwd_ring_kernel<kDt, kRt, false, K, decltype(c)::value, kGateAfter>;
      });
    }
    if (a.z.present()) {
      return run([](auto c) {
        return norm_bwd_ring_kernel<kDt, kRt, false, K, decltype(c)::value, kGateFirst>;
      });
    }
  }
  return run([full](auto c) {
    constexpr bool C = decltype(c)::value;
    return full ? norm_bwd_ring_kernel<kDt, kRt, true, K, C>
                : norm_bwd_ring_kernel<kDt, kRt, false, K, C>;
  });
}

}  // namespace ssm
