// Device code shared by the forward and backward selective-scan kernels: where a block sits
// (batch, channels, B/C groups), per-thread constants, and staging one chunk of B, C, u and dt
// into float32 shared memory (zero-padded past seqlen, past dstate and past the block's valid
// channels, so padded steps leave the state unchanged: dt = 0 gives exp(0) = 1 and no input).
#pragma once

#include <cuda_runtime.h>

#include "../common/device_dtype.cuh"
#include "../common/device_math.cuh"
#include "scan_traits.cuh"

namespace ssm {

constexpr float kLog2e = 1.4426950408889634f;

__device__ __forceinline__ float softplus(float x) {
  return x <= 20.f ? log1pf(expf(x)) : x;
}

template <typename Tr>
struct BlockPlace {
  int64_t b;          // batch
  int64_t chan0;      // first channel of the block
  int nvalid;         // channels of the block inside its cell (the rest are padding)
  int64_t gB, gC;     // group of B and C (0 for fixed forms)
  int c, p;           // this thread's channel in the block and lane within the channel
  int64_t d;          // this thread's channel
  bool cvalid;

  __device__ BlockPlace(const ScanArgs& a, const ScanGrid& g, int64_t batch) {
    b = batch;
    const int64_t cell = blockIdx.x / g.tiles_per_cell, tile = blockIdx.x % g.tiles_per_cell;
    chan0 = cell * g.cell + tile * Tr::kK;
    const int64_t left = g.cell - tile * Tr::kK;
    nvalid = left < Tr::kK ? int(left) : Tr::kK;
    gB = a.B_fixed ? 0 : chan0 / (a.dim / a.B_groups);
    gC = a.C_fixed ? 0 : chan0 / (a.dim / a.C_groups);
    c = threadIdx.x / Tr::kP;
    p = threadIdx.x % Tr::kP;
    d = chan0 + c;
    cvalid = c < nvalid;
  }

  __device__ int64_t seq_index(const TensorRef& t, int64_t chan, int64_t step) const {
    return b * t.stride[0] + chan * t.stride[1] + step * t.stride[2];
  }
  // B or C (batch, groups, dstate, seqlen) element of group `grp`.
  __device__ int64_t bc_index(const TensorRef& t, int64_t grp, int n, int64_t step) const {
    return b * t.stride[0] + grp * t.stride[1] + n * t.stride[2] + step * t.stride[3];
  }
  __device__ int64_t state_index(const TensorRef& t, int n) const {
    return b * t.stride[0] + d * t.stride[1] + n * t.stride[2];
  }
};

// Thread-constant values of this thread's states: A pre-scaled by log2(e) for exp2, the fixed
// forms of B and C. Padded states get A = 0 and B = C = 0, so they stay at zero and add nothing.
template <typename Tr>
struct StateConsts {
  float A[Tr::kNS], A2[Tr::kNS], Bfix[Tr::kNS], Cfix[Tr::kNS];

  __device__ StateConsts(const ScanArgs& a, const BlockPlace<Tr>& pl) {
#pragma unroll
    for (int j = 0; j < Tr::kNS; ++j) {
      const int n = pl.p * Tr::kNS + j;
      const bool ok = pl.cvalid && n < a.dstate;
      A[j] = ok ? static_cast<const float*>(a.A.data)[pl.d * a.A.stride[0] + n * a.A.stride[1]] : 0.f;
      A2[j] = A[j] * kLog2e;
      Bfix[j] = ok && a.B_fixed
                    ? load_as_float(a.B.data, pl.d * a.B.stride[0] + n * a.B.stride[1], a.B.dtype)
                    : 0.f;
      Cfix[j] = ok && a.C_fixed
                    ? load_as_float(a.C.data, pl.d * a.C.stride[0] + n * a.C.stride[1], a.C.dtype)
                    : 0.f;
    }
  }
};

// Loads K elements of one tensor, element k at base + k * step, as raw bits (a float32's bits, or
// a 16-bit value in the low half). Converting right after the load would make the thread wait for
// it there; raw bits let every load of a chunk stay in flight until the chunk is written to
// shared memory.
template <int K>
__device__ __forceinline__ void gather_raw(const void* p, Dtype dtype, int64_t base, int64_t step,
                                           const bool (&ok)[K], uint32_t (&out)[K]) {
  if (dtype == Dtype::F32) {
    const uint32_t* q = static_cast<const uint32_t*>(p) + base;
#pragma unroll
    for (int k = 0; k < K; ++k) out[k] = ok[k] ? q[k * step] : 0u;
  } else {
    const uint16_t* q = static_cast<const uint16_t*>(p) + base;
#pragma unroll
    for (int k = 0; k < K; ++k) out[k] = ok[k] ? uint32_t(q[k * step]) : 0u;
  }
}

// Converts raw bits of one dtype to float, with the dtype branch taken once for all K values
// (per element it compiled to a jump table around every conversion).
template <int K>
__device__ __forceinline__ void raw_to_floats(const uint32_t (&raw)[K], Dtype dtype,
                                              float (&out)[K]) {
  if (dtype == Dtype::F32) {
#pragma unroll
    for (int k = 0; k < K; ++k) out[k] = __uint_as_float(raw[k]);
  } else if (dtype == Dtype::F16) {
#pragma unroll
    for (int k = 0; k < K; ++k)
      out[k] = __half2float(__ushort_as_half(static_cast<unsigned short>(raw[k])));
  } else {
#pragma unroll
    for (int k = 0; k < K; ++k) out[k] = __uint_as_float(raw[k] << 16);
  }
}

__device__ __forceinline__ float raw_to_float(uint32_t raw, Dtype dtype) {
  if (dtype == Dtype::F32) return __uint_as_float(raw);
  if (dtype == Dtype::F16) return __half2float(__ushort_as_half(static_cast<unsigned short>(raw)));
  return __uint_as_float(raw << 16);
}

// One chunk's inputs held in registers. Each chunk is loaded while the previous one computes,
// so global-memory latency hides behind arithmetic instead of stalling every chunk. kThreads is
// a multiple of kT, so a thread keeps one step s = threadIdx.x % kT and row r = threadIdx.x / kT:
//   B/C element k: state r + k * kRows, step s (steps fastest: global reads follow the sequence
//     stride);
//   slot m:        channel r + m * kRows, step s; the epilogue uses the same slots, so a thread
//     keeps its slots' values in registers.
// Every element of a thread is then one per-chunk offset plus k times a block-uniform stride,
// instead of a full 64-bit index product each (the v7 forward spent ~3 instructions a state
// update on those, and spilled them).
template <typename Tr>
struct ChunkInputs {
  static_assert(Tr::kThreads % Tr::kT == 0, "a thread keeps one step of every chunk");
  static constexpr int kRows = Tr::kThreads / Tr::kT;
  static constexpr int kBCPer = (Tr::kT * Tr::kNpad + Tr::kThreads - 1) / Tr::kThreads;
  static constexpr int kSlots = (Tr::kK * Tr::kT + Tr::kThreads - 1) / Tr::kThreads;
  uint32_t b[kBCPer], c[kBCPer];
  uint32_t u[kSlots], delta[kSlots], z[kSlots], dout[kSlots];

  __device__ float u_at(const ScanArgs& a, int m) const { return raw_to_float(u[m], a.u.dtype); }
  __device__ float z_at(const ScanArgs& a, int m) const { return raw_to_float(z[m], a.z.dtype); }
  __device__ float dout_at(const ScanArgs& a, int m) const {
    return raw_to_float(dout[m], a.dout.dtype);
  }
  __device__ float delta_at(const ScanArgs& a, int m) const {
    return raw_to_float(delta[m], a.delta.dtype);
  }

  __device__ static int step_of_thread() { return threadIdx.x % Tr::kT; }
  __device__ static int row_of_thread() { return threadIdx.x / Tr::kT; }
  __device__ static bool bc_exists(int k) {
    return threadIdx.x + k * Tr::kThreads < Tr::kT * Tr::kNpad;
  }
  __device__ static bool slot_exists(int m) {
    return threadIdx.x + m * Tr::kThreads < Tr::kK * Tr::kT;
  }

  // delta_bias and D of each slot's channel (0 where absent or padded).
  __device__ static void slot_consts(const ScanArgs& a, const BlockPlace<Tr>& pl,
                                     float (&bias)[kSlots], float (&D)[kSlots]) {
#pragma unroll
    for (int m = 0; m < kSlots; ++m) {
      const int c = slot_channel(m);
      const int64_t d = pl.chan0 + c;
      const bool ok = slot_exists(m) && c < pl.nvalid;
      bias[m] = ok && a.delta_bias.data
                    ? static_cast<const float*>(a.delta_bias.data)[d * a.delta_bias.stride[0]] : 0.f;
      D[m] = ok && a.D.data ? static_cast<const float*>(a.D.data)[d * a.D.stride[0]] : 0.f;
    }
  }

  __device__ static bool slot_valid(const ScanArgs& a, const BlockPlace<Tr>& pl, int m, int64_t t0) {
    return slot_exists(m) && slot_channel(m) < pl.nvalid && t0 + step_of_thread() < a.seqlen;
  }
  __device__ static int slot_channel(int m) { return row_of_thread() + m * kRows; }
  __device__ static int slot_step(int) { return step_of_thread(); }

  // `with_c`: stage C (the checkpoint replay does not need it); `with_dout`: backward inputs.
  __device__ void load(const ScanArgs& a, const BlockPlace<Tr>& pl, int64_t t0, bool with_c,
                       bool with_dout) {
    const int64_t t = t0 + step_of_thread();
    const bool step_ok = t < a.seqlen;
    const int r = row_of_thread();
    if (!a.B_fixed || (with_c && !a.C_fixed)) {
      bool ok[kBCPer];
#pragma unroll
      for (int k = 0; k < kBCPer; ++k) ok[k] = bc_exists(k) && r + k * kRows < a.dstate && step_ok;
      if (!a.B_fixed)
        gather_raw(a.B.data, a.B.dtype, pl.bc_index(a.B, pl.gB, r, t), kRows * a.B.stride[2], ok,
                   b);
      if (with_c && !a.C_fixed)
        gather_raw(a.C.data, a.C.dtype, pl.bc_index(a.C, pl.gC, r, t), kRows * a.C.stride[2], ok,
                   c);
    }
    bool sok[kSlots];
#pragma unroll
    for (int m = 0; m < kSlots; ++m)
      sok[m] = slot_exists(m) && r + m * kRows < pl.nvalid && step_ok;
    const int64_t chan = pl.chan0 + r;
    gather_raw(a.u.data, a.u.dtype, pl.seq_index(a.u, chan, t), kRows * a.u.stride[1], sok, u);
    gather_raw(a.delta.data, a.delta.dtype, pl.seq_index(a.delta, chan, t),
               kRows * a.delta.stride[1], sok, delta);
#pragma unroll
    for (int m = 0; m < kSlots; ++m) z[m] = dout[m] = 0u;
    if (a.z.data && (with_c || with_dout))
      gather_raw(a.z.data, a.z.dtype, pl.seq_index(a.z, chan, t), kRows * a.z.stride[1], sok, z);
    if (with_dout)
      gather_raw(a.dout.data, a.dout.dtype, pl.seq_index(a.dout, chan, t),
                 kRows * a.dout.stride[1], sok, dout);
  }

  // Writes the chunk to shared memory: B/C rows [step][state], and per channel at
  // [c * kChanPitch + step] u and dt = (softplus)(delta + bias) (each where its pointer is set),
  // (dt, dt * u) as one float2 with `sdtu` (what the forward's steps read), and with `sdy`
  // dy = dout * silu(z). `bias` holds delta_bias of each slot's channel.
  __device__ void store(const ScanArgs& a, const BlockPlace<Tr>& pl, int64_t t0,
                        const float (&bias)[kSlots], float* sB, float* sC, float* su, float* sdt,
                        float* sdy, float2* sdtu = nullptr) const {
    const int s = step_of_thread(), r = row_of_thread();
    if (!a.B_fixed) {
      float v[kBCPer];
      raw_to_floats(b, a.B.dtype, v);
#pragma unroll
      for (int k = 0; k < kBCPer; ++k)
        if (bc_exists(k)) sB[s * Tr::kBCPitch + r + k * kRows] = v[k];
    }
    if (sC && !a.C_fixed) {
      float v[kBCPer];
      raw_to_floats(c, a.C.dtype, v);
#pragma unroll
      for (int k = 0; k < kBCPer; ++k)
        if (bc_exists(k)) sC[s * Tr::kBCPitch + r + k * kRows] = v[k];
    }
    float uf[kSlots], df[kSlots];
    raw_to_floats(u, a.u.dtype, uf);
    raw_to_floats(delta, a.delta.dtype, df);
#pragma unroll
    for (int m = 0; m < kSlots; ++m) {
      if (!slot_exists(m)) break;
      const int at = slot_channel(m) * Tr::kChanPitch + s;
      float dt = df[m] + bias[m];
      if (a.delta_softplus) dt = softplus(dt);
      // dt = 0 on padded slots keeps the state unchanged there (softplus(0) would not).
      dt = slot_valid(a, pl, m, t0) ? dt : 0.f;
      if (su) su[at] = uf[m];
      if (sdt) sdt[at] = dt;
      if (sdtu) sdtu[at] = make_float2(dt, dt * uf[m]);
      if (sdy) {
        const float go = raw_to_float(dout[m], a.dout.dtype);
        const float zz = raw_to_float(z[m], a.z.dtype);
        sdy[at] = a.z.data ? go * zz * sigmoid(zz) : go;
      }
    }
  }
};

template <int kN>
__device__ __forceinline__ void load_states(float (&v)[kN], const float* src) {
  if constexpr (kN % 4 == 0) {
#pragma unroll
    for (int j = 0; j < kN; j += 4) {
      const float4 q = *reinterpret_cast<const float4*>(src + j);
      v[j] = q.x; v[j + 1] = q.y; v[j + 2] = q.z; v[j + 3] = q.w;
    }
  } else if constexpr (kN == 2) {
    const float2 q = *reinterpret_cast<const float2*>(src);
    v[0] = q.x; v[1] = q.y;
  } else {
#pragma unroll
    for (int j = 0; j < kN; ++j) v[j] = src[j];
  }
}

template <int kN>
__device__ __forceinline__ void store_states(float* dst, const float (&v)[kN]) {
  if constexpr (kN % 4 == 0) {
#pragma unroll
    for (int j = 0; j < kN; j += 4)
      *reinterpret_cast<float4*>(dst + j) = make_float4(v[j], v[j + 1], v[j + 2], v[j + 3]);
  } else {
#pragma unroll
    for (int j = 0; j < kN; ++j) dst[j] = v[j];
  }
}

}  // namespace ssm
