// CUDA side of the causal conv1d: the choice between the seq and chan kernels and their plans
// (conv1d_plan.h), the dispatch on dtype and width, the backward's workspace and the fixed-order
// reduction of its partial sums into dweight and dbias, the states of a call with seqlen 0, and
// the decode step's kernel.
#include <algorithm>

#include "../common/column_sums.cuh"
#include "../common/cuda_status.h"
#include "conv1d_device.cuh"
#include "conv1d_plan.h"

namespace ssm {
namespace {

constexpr size_t kAlign = 256;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

int pow2_at_least(int64_t n) {
  int p = 1;
  while (p < n) p <<= 1;
  return p;
}

// Threads (lanes) worth starting: two waves of full occupancy (2048 threads an SM). Below that
// the loads in flight fall short of what the memory system needs; above it, longer units
// spread the fixed costs (weights, halos, partial sums) over more positions.
int64_t lanes_target(int device) {
  return int64_t(std::max(1, multiprocessor_count(device))) * 2048 * 2;
}

// The seq kernels when x is contiguous along seqlen; with seqlen 1 there is nothing to walk
// along and channel-last x (stride 1 along dim) coalesces better in the chan kernels.
bool use_seq_kernels(const Conv1dArgs& a) { return a.seqlen > 1 && a.x.stride[2] == 1; }

bool row_aligned(const TensorRef& t, int64_t batch, int64_t dim, int64_t elem) {
  if (!t.present()) return true;
  const auto ok = [&](int64_t extent, int64_t stride) {
    return extent <= 1 || stride * elem % 16 == 0;
  };
  return reinterpret_cast<uintptr_t>(t.data) % 16 == 0 && t.stride[2] == 1 &&
         ok(batch, t.stride[0]) && ok(dim, t.stride[1]);
}

// The backward's units are kept at least 4 iterations long where the rows allow it: every unit
// writes width+1 partial sums a channel, which at one iteration (256 bf16 positions) would add
// 7% to the backward's memory traffic.
SeqPlan seq_plan(const Conv1dArgs& a, int device, bool backward) {
  SeqPlan p;
  p.nslices = ceil_div(a.seqlen, 8);
  p.seg = std::min(32, pow2_at_least(p.nslices));
  const int64_t rows = a.batch * a.dim;
  const int64_t per_row = ceil_div(p.nslices, p.seg);
  const int64_t wanted = ceil_div(rows * per_row * p.seg, lanes_target(device));
  p.iters = int(std::clamp<int64_t>(wanted, std::min<int64_t>(per_row, backward ? 4 : 1),
                                    per_row));
  p.chunk_slices = int64_t(p.seg) * p.iters;
  p.nchunks = ceil_div(p.nslices, p.chunk_slices);
  p.units = rows * p.nchunks;
  const int64_t elem = a.x.dtype == Dtype::F32 ? 4 : 2;
  p.vec = row_aligned(a.x, a.batch, a.dim, elem) &&
          (backward ? row_aligned(a.dout, a.batch, a.dim, elem) &&
                          row_aligned(a.dx, a.batch, a.dim, elem)
                    : row_aligned(a.out, a.batch, a.dim, elem));
  return p;
}

// Whether t's channel groups of `group` elements (element size elem) are aligned vectors:
// contiguous along dim, 16-byte or group-sized alignment of every group's start.
bool groups_aligned(const TensorRef& t, int64_t batch, int64_t seqlen, int64_t group,
                    int64_t elem) {
  if (!t.present()) return true;
  const int64_t bytes = group * elem;
  const auto ok = [&](int64_t extent, int64_t stride) {
    return extent <= 1 || stride * elem % bytes == 0;
  };
  return reinterpret_cast<uintptr_t>(t.data) % bytes == 0 && t.stride[1] == 1 &&
         ok(batch, t.stride[0]) && ok(seqlen, t.stride[2]);
}

// Chunks of at least 64 positions: the kTaps-1 positions a thread reads before its chunk are
// read twice, 11% more at 64 and width 8. The backward's threads fill two waves of its fast
// kernel's 512 threads an SM rather than of 2048 (lanes_target), so its chunks are 4x longer:
// every chunk writes width+1 partial sums for each of its channels, which at 64 positions were
// 42 MB of writes at (8, 4096, 4096), 16% of dx's, and as much again for the reduction to read.
// Multiples of 8 positions keep the interior in whole batches.
ChanPlan chan_plan(const Conv1dArgs& a, int device, bool backward) {
  ChanPlan p;
  const int64_t group = conv1d_chan_group(a.width <= 4 ? 4 : 8);
  p.groups = ceil_div(a.dim, group);
  const int64_t target = backward ? lanes_target(device) / 4 : lanes_target(device);
  const int64_t wanted = ceil_div(ceil_div(a.batch * p.groups * a.seqlen, target), 8) * 8;
  p.chunk_len = std::clamp<int64_t>(wanted, std::min<int64_t>(a.seqlen, 64), a.seqlen);
  p.nchunks = ceil_div(a.seqlen, p.chunk_len);
  p.threads = a.batch * p.nchunks * p.groups;
  const int64_t elem = a.x.dtype == Dtype::F32 ? 4 : 2;
  const auto aligned = [&](const TensorRef& t) {
    return groups_aligned(t, a.batch, a.seqlen, group, elem);
  };
  p.vec = a.dim % group == 0 && aligned(a.x) &&
          (backward ? aligned(a.dout) && aligned(a.dx) : aligned(a.out));
  return p;
}

// Partial-sum rows of the backward (batch * nchunks); 0 when there is no unit to make one.
int64_t partial_rows(const Conv1dArgs& a, int device) {
  if (a.batch * a.dim == 0 || a.seqlen == 0) return 0;
  return a.batch * (use_seq_kernels(a) ? seq_plan(a, device, true).nchunks
                                       : chan_plan(a, device, true).nchunks);
}

size_t workspace_bytes(const Conv1dArgs& a, int device) {
  const size_t floats = size_t(partial_rows(a, device)) * size_t(a.dim) * size_t(a.width + 1);
  return (floats * sizeof(float) + kAlign - 1) / kAlign * kAlign;
}

template <class Plan>
using Launcher = cudaError_t (*)(const Conv1dArgs&, const Plan&, cudaStream_t);

// The instantiated launchers of each kind, by x's dtype (rows, in ssm::Dtype order) and taps
// (4 for widths 2..4, Mamba's 4 above all; 8 for widths 5..8).
const Launcher<SeqPlan> kFwdSeq[3][2] = {
    {launch_conv1d_fwd_seq<0, 4>, launch_conv1d_fwd_seq<0, 8>},
    {launch_conv1d_fwd_seq<1, 4>, launch_conv1d_fwd_seq<1, 8>},
    {launch_conv1d_fwd_seq<2, 4>, launch_conv1d_fwd_seq<2, 8>}};
const Launcher<SeqPlan> kBwdSeq[3][2] = {
    {launch_conv1d_bwd_seq<0, 4>, launch_conv1d_bwd_seq<0, 8>},
    {launch_conv1d_bwd_seq<1, 4>, launch_conv1d_bwd_seq<1, 8>},
    {launch_conv1d_bwd_seq<2, 4>, launch_conv1d_bwd_seq<2, 8>}};
const Launcher<ChanPlan> kFwdChan[3][2] = {
    {launch_conv1d_fwd_chan<0, 4>, launch_conv1d_fwd_chan<0, 8>},
    {launch_conv1d_fwd_chan<1, 4>, launch_conv1d_fwd_chan<1, 8>},
    {launch_conv1d_fwd_chan<2, 4>, launch_conv1d_fwd_chan<2, 8>}};
const Launcher<ChanPlan> kBwdChan[3][2] = {
    {launch_conv1d_bwd_chan<0, 4>, launch_conv1d_bwd_chan<0, 8>},
    {launch_conv1d_bwd_chan<1, 4>, launch_conv1d_bwd_chan<1, 8>},
    {launch_conv1d_bwd_chan<2, 4>, launch_conv1d_bwd_chan<2, 8>}};

template <class Plan>
cudaError_t dispatch(const Launcher<Plan> (&table)[3][2], const Conv1dArgs& a, const Plan& p,
                     cudaStream_t s) {
  return table[int(a.x.dtype)][a.width <= 4 ? 0 : 1](a, p, s);
}

// dst[b,c,j] = src[b,c,j] (0 when src is absent) for (batch, dim, width-1) states: the final
// states of a forward with seqlen 0 (its initial states), and the initial states' gradient of
// such a backward (dfinal_states).
__global__ void conv1d_copy_states_kernel(const TensorRef src, const TensorRef dst, int64_t batch,
                                          int64_t dim, int len) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= batch * dim * len) return;
  const int64_t j = i % len, c = (i / len) % dim, b = i / len / dim;
  const float v = src.present() ? load_as_float(src.data, b * src.stride[0] + c * src.stride[1] +
                                                              j * src.stride[2], src.dtype)
                                : 0.f;
  store_from_float(dst.data, b * dst.stride[0] + c * dst.stride[1] + j * dst.stride[2], dst.dtype,
                   v);
}

cudaError_t copy_states(const TensorRef& src, const TensorRef& dst, const Conv1dArgs& a,
                        cudaStream_t s) {
  const int64_t n = a.batch * a.dim * (a.width - 1);
  if (n == 0 || !dst.present()) return cudaSuccess;
  conv1d_copy_states_kernel<<<unsigned(ceil_div(n, kConv1dBlock)), kConv1dBlock, 0, s>>>(
      src, dst, a.batch, a.dim, a.width - 1);
  return cudaGetLastError();
}

// dweight[c,k] (column c*(W+1)+k) and dbias[c] (column c*(W+1)+W): the partial rows added in
// a fixed order (column_totals). No partial rows (batch 0 or seqlen 0) give zeros.
__global__ void __launch_bounds__(32 * kMaxColumnSumWarps)
    conv1d_reduce_partials_kernel(const float* partial, int64_t prows, int64_t dim, int width,
                                  TensorRef dweight, TensorRef dbias) {
  column_totals(partial, prows, dim * (width + 1), [&](int64_t j, float total) {
    const int64_t c = j / (width + 1);
    const int k = int(j % (width + 1));
    if (k < width && dweight.present())
      store_from_float(dweight.data, c * dweight.stride[0] + k * dweight.stride[1],
                       dweight.dtype, total);
    if (k == width && dbias.present())
      store_from_float(dbias.data, c * dbias.stride[0], dbias.dtype, total);
  });
}

__device__ __forceinline__ int64_t load_index(const TensorRef& t, int64_t i) {
  return t.dtype == Dtype::I64 ? static_cast<const int64_t*>(t.data)[i * t.stride[0]]
                               : static_cast<const int32_t*>(t.data)[i * t.stride[0]];
}

// The decode step, one thread a (batch row, channel): a latency-bound kernel with a few
// positions a thread, so the width and the dtypes stay run-time values. Taps are laid out as
// in the whole-sequence kernels: W's at the top of 8.
__global__ void __launch_bounds__(kConv1dBlock) conv1d_update_kernel(const Conv1dUpdateArgs a) {
  using namespace conv1d_detail;
  constexpr int kTaps = kConv1dMaxWidth;
  const int64_t g = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (g >= a.batch * a.dim) return;
  const int64_t b = g / a.dim, c = g % a.dim;
  const int64_t n = a.seqlen, S = a.state_len;
  const TensorRef &x = a.x, &out = a.out, &st = a.conv_state;
  const auto out_at = [&](int64_t t) {
    return b * out.stride[0] + c * out.stride[1] + t * out.stride[2];
  };
  const int64_t s = a.conv_state_indices.present() ? load_index(a.conv_state_indices, b) : b;
  if (s < 0 || s >= a.batch_state) {
    // A padding row gives zeros; an index past the state (which the host cannot see) NaN.
    const float v = s < 0 ? 0.f : __int_as_float(0x7fc00000);
    for (int64_t t = 0; t < n; ++t) store_from_float(out.data, out_at(t), out.dtype, v);
    return;
  }
  const int W = a.width;
  float wt[kTaps];
  load_taps(a.weight, c, W, wt);
  const float bias = load_bias(a.bias, c);
  const bool circular = a.cache_seqlens.present();
  const int64_t q = circular ? load_index(a.cache_seqlens, b) : 0;
  const auto wrap = [S](int64_t i) { return ((i % S) + S) % S; };
  const int64_t srow = s * st.stride[0] + c * st.stride[1];
  const int64_t xrow = b * x.stride[0] + c * x.stride[1];

  // Each token is shifted in at win[kTaps-1], so the W-1 state entries the first token sees
  // start at the top, one place above where that token's taps read them.
  float win[kTaps] = {};
#pragma unroll
  for (int i = 1; i < kTaps; ++i) {
    const int j = i - (kTaps + 1 - W);  // state entry j of the W-1 the first token sees
    if (j < 0) continue;
    const int64_t e = circular ? wrap(q - (W - 1) + j) : S - (W - 1) + j;
    win[i] = load_as_float(st.data, srow + e * st.stride[2], st.dtype);
  }
  for (int64_t t = 0; t < n; ++t) {
#pragma unroll
    for (int i = 0; i + 1 < kTaps; ++i) win[i] = win[i + 1];
    win[kTaps - 1] = load_as_float(x.data, xrow + t * x.stride[2], x.dtype);
    float z = bias;
#pragma unroll
    for (int k = 0; k < kTaps; ++k) z = k >= kTaps - W ? fmaf(wt[k], win[k], z) : z;
    store_from_float(out.data, out_at(t), out.dtype, a.silu ? silu(z) : z);
  }
  if (circular) {
    for (int64_t t = n > S ? n - S : 0; t < n; ++t)
      store_from_float(st.data, srow + wrap(q + t) * st.stride[2], st.dtype,
                       load_as_float(x.data, xrow + t * x.stride[2], x.dtype));
    return;
  }
  // The last S entries of state ++ tokens, in increasing order: entry i reads entry i + n,
  // which no earlier step has overwritten.
  for (int64_t i = 0; i < S; ++i) {
    const int64_t from = i + n;
    const float v = from < S ? load_as_float(st.data, srow + from * st.stride[2], st.dtype)
                             : load_as_float(x.data, xrow + (from - S) * x.stride[2], x.dtype);
    store_from_float(st.data, srow + i * st.stride[2], st.dtype, v);
  }
}

}  // namespace

size_t conv1d_bwd_cuda_workspace(const Conv1dArgs& a, int device) {
  CudaDeviceGuard guard(device);
  return workspace_bytes(a, device);
}

ssm_status conv1d_fwd_cuda(const Conv1dArgs& a, int device, void* stream) {
  CudaDeviceGuard guard(device);
  if (guard.status() != SSM_SUCCESS) return guard.status();
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (a.batch * a.dim == 0) return SSM_SUCCESS;
  cudaError_t err;
  if (a.seqlen == 0) {
    err = copy_states(a.initial_states, a.final_states, a, s);
  } else if (use_seq_kernels(a)) {
    err = dispatch(kFwdSeq, a, seq_plan(a, device, false), s);
  } else {
    err = dispatch(kFwdChan, a, chan_plan(a, device, false), s);
  }
  return cuda_status(err, "causal_conv1d_fwd launch");
}

ssm_status conv1d_bwd_cuda(const Conv1dArgs& a, int device, void* workspace, void* stream) {
  CudaDeviceGuard guard(device);
  if (guard.status() != SSM_SUCCESS) return guard.status();
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  const bool sums = a.dweight.present() || a.dbias.present();
  const int64_t prows = partial_rows(a, device);
  float* partial = sums && prows > 0 ? static_cast<float*>(workspace) : nullptr;
  cudaError_t err = cudaSuccess;
  if (a.seqlen == 0) {
    err = copy_states(a.dfinal_states, a.dinitial_states, a, s);
  } else if (prows > 0 && (partial != nullptr || a.dx.present() || a.dinitial_states.present())) {
    if (use_seq_kernels(a)) {
      SeqPlan p = seq_plan(a, device, true);
      p.partial = partial;
      err = dispatch(kBwdSeq, a, p, s);
    } else {
      ChanPlan p = chan_plan(a, device, true);
      p.partial = partial;
      err = dispatch(kBwdChan, a, p, s);
    }
  }
  // dweight and dbias are written even with no partial rows: sums over nothing are zeros.
  if (err == cudaSuccess && sums && a.dim > 0) {
    const int64_t columns = a.dim * (a.width + 1);
    const int64_t rows = partial == nullptr ? 0 : prows;
    conv1d_reduce_partials_kernel<<<unsigned(ceil_div(
                                        columns, column_sum_block_columns(columns, partial))),
                                    32 * column_sum_warps(rows), 0, s>>>(
        partial, rows, a.dim, a.width, a.dweight, a.dbias);
    err = cudaGetLastError();
  }
  return cuda_status(err, "causal_conv1d_bwd launch");
}

ssm_status conv1d_update_cuda(const Conv1dUpdateArgs& a, int device, void* stream) {
  CudaDeviceGuard guard(device);
  if (guard.status() != SSM_SUCCESS) return guard.status();
  const int64_t n = a.batch * a.dim;
  if (n == 0) return SSM_SUCCESS;
  conv1d_update_kernel<<<unsigned(ceil_div(n, kConv1dBlock)), kConv1dBlock, 0,
                         static_cast<cudaStream_t>(stream)>>>(a);
  return cuda_status(cudaGetLastError(), "causal_conv1d_update launch");
}

}  // namespace ssm
