// CUDA side of the selective scan: grid sizing, the backward workspace layout, dispatch of dstate
// to the kNpad instantiations (instantiations/*.cu), and the pass that turns the backward's
// float32 accumulators into the caller's gradient tensors.
#include <numeric>

#include "../common/cuda_status.h"
#include "../common/device_dtype.cuh"
#include "scan_traits.cuh"

namespace ssm {

ScanGrid make_scan_grid(const ScanArgs& a, int channels_per_block, int chunk_steps) {
  const int64_t group_b = a.B_fixed ? a.dim : a.dim / a.B_groups;
  const int64_t group_c = a.C_fixed ? a.dim : a.dim / a.C_groups;
  ScanGrid g;
  g.cell = std::gcd(group_b, group_c);
  g.tiles_per_cell = (g.cell + channels_per_block - 1) / channels_per_block;
  g.nchunks = (a.seqlen + chunk_steps - 1) / chunk_steps;
  return g;
}

namespace {

constexpr size_t kAlign = 256;

size_t align_up(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

// Backward workspace: checkpoints (batch, dim, nchunks, npad) then the zeroed accumulators.
struct BwdLayout {
  int npad = 4;
  int64_t seqlen_padded = 0;
  size_t checkpoints = 0, accumulators = 0, dA = 0, dD = 0, ddelta_bias = 0, dB = 0, dC = 0;
  size_t total = 0;

  explicit BwdLayout(const ScanArgs& a) {
    npad = scan_npad(a.dstate);
    const int steps = scan_chunk_steps(npad);
    const int64_t nchunks = (a.seqlen + steps - 1) / steps;
    seqlen_padded = nchunks * steps;
    size_t at = 0;
    auto take = [&at](size_t floats) {
      const size_t off = at;
      at += align_up(floats * sizeof(float));
      return off;
    };
    checkpoints = take(size_t(a.batch) * a.dim * nchunks * npad);
    accumulators = at;
    dA = take(size_t(a.dim) * a.dstate);
    dD = take(size_t(a.dim));
    ddelta_bias = take(size_t(a.dim));
    dB = take(a.B_fixed ? size_t(a.dim) * a.dstate
                        : size_t(a.batch) * a.B_groups * a.dstate * seqlen_padded);
    dC = take(a.C_fixed ? size_t(a.dim) * a.dstate
                        : size_t(a.batch) * a.C_groups * a.dstate * seqlen_padded);
    total = at;
  }
};

template <template <int> class Launch, typename... Args>
cudaError_t dispatch_npad(int npad, Args&&... args) {
  switch (npad) {
    case 4: return Launch<4>::run(args...);
    case 8: return Launch<8>::run(args...);
    case 16: return Launch<16>::run(args...);
    case 32: return Launch<32>::run(args...);
    case 64: return Launch<64>::run(args...);
    case 128: return Launch<128>::run(args...);
    default: return Launch<256>::run(args...);
  }
}

template <int kNpad>
struct FwdLaunch {
  static cudaError_t run(const ScanArgs& a, float* checkpoints, bool narrow, cudaStream_t s) {
    if constexpr (narrow_states(kNpad) < wide_states(kNpad)) {
      if (narrow) return launch_selective_scan_fwd<kNpad, narrow_states(kNpad)>(a, checkpoints, s);
    }
    return launch_selective_scan_fwd<kNpad, wide_states(kNpad)>(a, checkpoints, s);
  }
};

// The narrow kernels give a channel 4x the threads at ~1.5x the instructions per state update;
// they win while the wide grid has fewer than two blocks per SM (batch 1, dim 2048, dstate 32:
// forward 0.122 ms wide, 0.072 narrow; the game-AI rows, 512 and 1024 wide blocks, stay wide).
bool use_narrow(const ScanArgs& a, int device) {
  const int npad = scan_npad(a.dstate);
  const int channels_per_block = 128 * wide_states(npad) / npad;
  const ScanGrid g = make_scan_grid(a, channels_per_block, scan_chunk_steps(npad));
  const int64_t blocks = a.batch * (a.dim / g.cell) * g.tiles_per_cell;
  return blocks < 2 * int64_t(multiprocessor_count(device));
}

template <int kNpad>
struct BwdLaunch {
  static cudaError_t run(const ScanArgs& a, const float* checkpoints, const BwdAccumulators& acc,
                         bool narrow, cudaStream_t s) {
    if constexpr (narrow_states(kNpad) < wide_states(kNpad)) {
      if (narrow)
        return launch_selective_scan_bwd<kNpad, narrow_states(kNpad)>(a, checkpoints, acc, s);
    }
    return launch_selective_scan_bwd<kNpad, wide_states(kNpad)>(a, checkpoints, acc, s);
  }
};

// Copies a float32 accumulator laid out with `src_stride` into a gradient tensor of any float
// dtype and strides; the four axes are those of the gradient (leading ones of size 1 if fewer).
struct AccumulatorCopy {
  const float* src;
  int64_t size[4];
  int64_t src_stride[4];
  TensorRef dst;
};

__global__ void copy_accumulator_kernel(const AccumulatorCopy c) {
  const int64_t total = c.size[0] * c.size[1] * c.size[2] * c.size[3];
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    int64_t rest = i, src = 0, dst = 0;
    for (int ax = 3; ax >= 0; --ax) {
      const int64_t idx = rest % c.size[ax];
      rest /= c.size[ax];
      src += idx * c.src_stride[ax];
      dst += idx * c.dst.stride[ax];
    }
    store_from_float(c.dst.data, dst, c.dst.dtype, c.src[src]);
  }
}

cudaError_t copy_accumulator(const float* src, const int64_t (&size)[4],
                             const int64_t (&src_stride)[4], const TensorRef& dst,
                             const int64_t (&dst_stride)[4], cudaStream_t stream) {
  AccumulatorCopy c{src, {}, {}, dst};
  int64_t total = 1;
  for (int ax = 0; ax < 4; ++ax) {
    c.size[ax] = size[ax];
    c.src_stride[ax] = src_stride[ax];
    c.dst.stride[ax] = dst_stride[ax];
    total *= size[ax];
  }
  if (total == 0) return cudaSuccess;
  const int64_t blocks = std::min<int64_t>((total + 255) / 256, 4096);
  copy_accumulator_kernel<<<unsigned(blocks), 256, 0, stream>>>(c);
  return cudaGetLastError();
}

// The (dim, dstate) accumulators: dA and the fixed forms of dB / dC.
cudaError_t copy_dim_state(const ScanArgs& a, const float* src, const TensorRef& dst,
                           cudaStream_t s) {
  return copy_accumulator(src, {1, 1, a.dim, a.dstate}, {0, 0, a.dstate, 1}, dst,
                          {0, 0, dst.stride[0], dst.stride[1]}, s);
}

cudaError_t copy_bc(const ScanArgs& a, bool fixed, int64_t groups, int64_t seqlen_padded,
                    const float* src, const TensorRef& dst, cudaStream_t s) {
  if (fixed) return copy_dim_state(a, src, dst, s);
  return copy_accumulator(src, {a.batch, groups, a.dstate, a.seqlen},
                          {groups * a.dstate * seqlen_padded, a.dstate * seqlen_padded,
                           seqlen_padded, 1},
                          dst, {dst.stride[0], dst.stride[1], dst.stride[2], dst.stride[3]}, s);
}

}  // namespace

size_t selective_scan_fwd_cuda_workspace(const ScanArgs&) { return 0; }

size_t selective_scan_bwd_cuda_workspace(const ScanArgs& a) { return BwdLayout(a).total; }

ssm_status selective_scan_fwd_cuda(const ScanArgs& a, int device, void*, void* stream) {
  CudaDeviceGuard guard(device);
  if (guard.status() != SSM_SUCCESS) return guard.status();
  return cuda_status(dispatch_npad<FwdLaunch>(scan_npad(a.dstate), a, nullptr,
                                              use_narrow(a, device),
                                              static_cast<cudaStream_t>(stream)),
                     "selective_scan_fwd launch");
}

ssm_status selective_scan_bwd_cuda(const ScanArgs& a, int device, void* workspace, void* stream) {
  CudaDeviceGuard guard(device);
  if (guard.status() != SSM_SUCCESS) return guard.status();
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  const BwdLayout L(a);
  char* ws = static_cast<char*>(workspace);
  float* checkpoints = reinterpret_cast<float*>(ws + L.checkpoints);
  BwdAccumulators acc;
  // Only requested gradients are summed: a null accumulator skips its reductions and atomics.
  acc.dA = a.dA.data ? reinterpret_cast<float*>(ws + L.dA) : nullptr;
  acc.dD = a.dD.data ? reinterpret_cast<float*>(ws + L.dD) : nullptr;
  acc.ddelta_bias = a.ddelta_bias.data ? reinterpret_cast<float*>(ws + L.ddelta_bias) : nullptr;
  acc.dB = a.dB.data ? reinterpret_cast<float*>(ws + L.dB) : nullptr;
  acc.dC = a.dC.data ? reinterpret_cast<float*>(ws + L.dC) : nullptr;
  acc.seqlen_padded = L.seqlen_padded;

  ssm_status st = cuda_status(
      cudaMemsetAsync(ws + L.accumulators, 0, L.total - L.accumulators, s), "cudaMemsetAsync");
  if (st != SSM_SUCCESS) return st;

  // With batch 0 the sums over batches are zero: only the zeroed accumulators are copied out.
  if (a.batch > 0) {
    // Pass 1: the forward again, keeping only h at every chunk start.
    ScanArgs replay = a;
    replay.out.data = nullptr;
    replay.last_state.data = nullptr;
    // The replay is always the wide forward: its chunks are the backward's 16 steps. (Storing
    // mid-chunk from the narrow one put a branch inside its unrolled steps: +20% forward time.)
    st = cuda_status(dispatch_npad<FwdLaunch>(L.npad, replay, checkpoints, false, s),
                     "selective_scan_bwd checkpoint pass");
    if (st != SSM_SUCCESS) return st;
    const bool narrow = use_narrow(a, device);
    st = cuda_status(dispatch_npad<BwdLaunch>(L.npad, a, checkpoints, acc, narrow, s),
                     "selective_scan_bwd launch");
    if (st != SSM_SUCCESS) return st;
  }

  cudaError_t err = cudaSuccess;
  if (a.dA.data) err = copy_dim_state(a, acc.dA, a.dA, s);
  if (err == cudaSuccess && a.dD.data)
    err = copy_accumulator(acc.dD, {1, 1, 1, a.dim}, {0, 0, 0, 1}, a.dD, {0, 0, 0, a.dD.stride[0]}, s);
  if (err == cudaSuccess && a.ddelta_bias.data)
    err = copy_accumulator(acc.ddelta_bias, {1, 1, 1, a.dim}, {0, 0, 0, 1}, a.ddelta_bias,
                           {0, 0, 0, a.ddelta_bias.stride[0]}, s);
  if (err == cudaSuccess && a.dB.data)
    err = copy_bc(a, a.B_fixed, a.B_groups, L.seqlen_padded, acc.dB, a.dB, s);
  if (err == cudaSuccess && a.dC.data)
    err = copy_bc(a, a.C_fixed, a.C_groups, L.seqlen_padded, acc.dC, a.dC, s);
  return cuda_status(err, "selective_scan_bwd gradient copy");
}

}  // namespace ssm
