// CPU reference of the selective scan (libssm/selective_scan.h), forward and backward: float32
// recurrent state, float64 accumulation of every reduction. Channels (b, d) run in parallel under
// OpenMP; the backward's sums across channels go to per-thread float64 buffers that are added in
// thread order at the end, so a given thread count always gives the same bits.
#include <algorithm>
#include <cmath>
#include <vector>

#include "common/cpu_threads.h"
#include "common/half_host.h"
#include "selective_scan/scan_args.h"

namespace ssm {
namespace {

// Per-thread buffers for the cross-channel sums of the backward stay under this many bytes in
// all; past it fewer threads run, rather than the reference exhausting host memory.
constexpr double kReductionBudgetBytes = 256.0 * 1024 * 1024;

float softplus(float x) { return x <= 20.f ? std::log1p(std::exp(x)) : x; }
double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

float load(const TensorRef& r, int64_t i) { return load_float(r.data, i, r.dtype); }
void store(const TensorRef& r, int64_t i, float v) { store_float(r.data, i, r.dtype, v); }

int64_t seq_index(const TensorRef& r, int64_t b, int64_t d, int64_t t) {
  return b * r.stride[0] + d * r.stride[1] + t * r.stride[2];
}

// The group of channel d for a variable B or C with `groups` groups.
int64_t group_of(const ScanArgs& a, int64_t groups, int64_t d) { return d / (a.dim / groups); }

// B or C of channel (b, d) copied to [t][n] floats (a single row when fixed).
void load_bc(const ScanArgs& a, const TensorRef& r, bool fixed, int64_t groups, int64_t b,
             int64_t d, float* dst) {
  const int64_t N = a.dstate;
  if (fixed) {
    for (int64_t n = 0; n < N; ++n) dst[n] = load(r, d * r.stride[0] + n * r.stride[1]);
    return;
  }
  const int64_t base = b * r.stride[0] + group_of(a, groups, d) * r.stride[1];
  for (int64_t t = 0; t < a.seqlen; ++t)
    for (int64_t n = 0; n < N; ++n)
      dst[t * N + n] = load(r, base + n * r.stride[2] + t * r.stride[3]);
}

// The per-step inputs of one channel, shared by forward and backward.
struct ChannelInputs {
  std::vector<float> A, B, C;     // A[n]; B and C as [t][n], or one row when fixed
  std::vector<float> u, pre, dt;  // per step: u, delta + delta_bias, dt
  float D = 0.f;

  explicit ChannelInputs(const ScanArgs& a)
      : A(a.dstate),
        B(a.B_fixed ? a.dstate : a.seqlen * a.dstate),
        C(a.C_fixed ? a.dstate : a.seqlen * a.dstate),
        u(a.seqlen),
        pre(a.seqlen),
        dt(a.seqlen) {}

  void load_channel(const ScanArgs& a, int64_t b, int64_t d) {
    const int64_t N = a.dstate;
    for (int64_t n = 0; n < N; ++n) A[n] = load(a.A, d * a.A.stride[0] + n * a.A.stride[1]);
    load_bc(a, a.B, a.B_fixed, a.B_groups, b, d, B.data());
    load_bc(a, a.C, a.C_fixed, a.C_groups, b, d, C.data());
    D = a.D.present() ? load(a.D, d * a.D.stride[0]) : 0.f;
    const float bias =
        a.delta_bias.present() ? load(a.delta_bias, d * a.delta_bias.stride[0]) : 0.f;
    for (int64_t t = 0; t < a.seqlen; ++t) {
      u[t] = load(a.u, seq_index(a.u, b, d, t));
      pre[t] = load(a.delta, seq_index(a.delta, b, d, t)) + bias;
      dt[t] = a.delta_softplus ? softplus(pre[t]) : pre[t];
    }
  }

  const float* B_at(const ScanArgs& a, int64_t t) const {
    return B.data() + (a.B_fixed ? 0 : t * a.dstate);
  }
  const float* C_at(const ScanArgs& a, int64_t t) const {
    return C.data() + (a.C_fixed ? 0 : t * a.dstate);
  }
};

int64_t state_index(const TensorRef& r, int64_t b, int64_t d, int64_t n) {
  return b * r.stride[0] + d * r.stride[1] + n * r.stride[2];
}

void load_initial_state(const ScanArgs& a, int64_t b, int64_t d, float* h) {
  for (int64_t n = 0; n < a.dstate; ++n)
    h[n] = a.initial_state.present() ? load(a.initial_state, state_index(a.initial_state, b, d, n))
                                     : 0.f;
}

// The cross-channel sums of the backward, one set per thread, all float64.
struct GradSums {
  std::vector<double> dA, dD, ddelta_bias;  // (dim, dstate), (dim,), (dim,)
  std::vector<double> dB, dC;               // [b][g][t][n] when variable, (dim, dstate) when fixed

  explicit GradSums(const ScanArgs& a) {
    const int64_t N = a.dstate;
    if (a.dA.present()) dA.assign(a.dim * N, 0.0);
    if (a.dD.present()) dD.assign(a.dim, 0.0);
    if (a.ddelta_bias.present()) ddelta_bias.assign(a.dim, 0.0);
    if (a.dB.present()) dB.assign(bc_size(a, a.B_fixed, a.B_groups), 0.0);
    if (a.dC.present()) dC.assign(bc_size(a, a.C_fixed, a.C_groups), 0.0);
  }

  static int64_t bc_size(const ScanArgs& a, bool fixed, int64_t groups) {
    return fixed ? a.dim * a.dstate : a.batch * groups * a.seqlen * a.dstate;
  }

  static double bytes(const ScanArgs& a) {
    double n = 0;
    if (a.dA.present()) n += double(a.dim) * a.dstate;
    if (a.dD.present()) n += double(a.dim);
    if (a.ddelta_bias.present()) n += double(a.dim);
    if (a.dB.present()) n += double(bc_size(a, a.B_fixed, a.B_groups));
    if (a.dC.present()) n += double(bc_size(a, a.C_fixed, a.C_groups));
    return 8.0 * n;
  }
};

// Where channel (b, d)'s contribution to dB or dC at step t starts: row t of its group's slice,
// or the channel's own row when fixed (whose steps all add to the same row).
double* bc_row(const ScanArgs& a, std::vector<double>& sums, bool fixed, int64_t groups,
               int64_t b, int64_t d, int64_t t) {
  if (sums.empty()) return nullptr;
  if (fixed) return sums.data() + d * a.dstate;
  return sums.data() + ((b * groups + group_of(a, groups, d)) * a.seqlen + t) * a.dstate;
}

void write_bc_grad(const ScanArgs& a, const TensorRef& r, bool fixed, int64_t groups,
                   const std::vector<GradSums>& per_thread, std::vector<double> GradSums::*field) {
  if (!r.present()) return;
  const int64_t N = a.dstate;
  const int64_t count = GradSums::bc_size(a, fixed, groups);
  for (int64_t i = 0; i < count; ++i) {
    double s = 0.0;
    for (const GradSums& g : per_thread) s += (g.*field)[i];
    const int64_t n = i % N;
    int64_t index;
    if (fixed) {
      index = (i / N) * r.stride[0] + n * r.stride[1];
    } else {
      const int64_t t = (i / N) % a.seqlen, bg = i / N / a.seqlen;
      index = (bg / groups) * r.stride[0] + (bg % groups) * r.stride[1] + n * r.stride[2] +
              t * r.stride[3];
    }
    store(r, index, float(s));
  }
}

void write_channel_grad(const TensorRef& r, int64_t count, int64_t inner,
                        const std::vector<GradSums>& per_thread,
                        std::vector<double> GradSums::*field) {
  if (!r.present()) return;
  for (int64_t i = 0; i < count; ++i) {
    double s = 0.0;
    for (const GradSums& g : per_thread) s += (g.*field)[i];
    const int64_t index = inner == 1 ? i * r.stride[0]
                                     : (i / inner) * r.stride[0] + (i % inner) * r.stride[1];
    store(r, index, float(s));
  }
}

// The backward of one channel (b, d): recompute h for every step, then run the adjoint state
// mu backwards, writing the per-element gradients and adding to the thread's sums.
struct ChannelBackward {
  ChannelInputs in;
  std::vector<float> h;       // [t + 1][n]: h[0] is the initial state, h[t + 1] the state after t
  std::vector<float> decay;   // [t][n]: exp(dt_t * A_n)
  std::vector<float> dy, mu;  // per step; per state
  std::vector<double> dA_row;

  explicit ChannelBackward(const ScanArgs& a)
      : in(a),
        h((a.seqlen + 1) * a.dstate),
        decay(a.seqlen * a.dstate),
        dy(a.seqlen),
        mu(a.dstate),
        dA_row(a.dstate) {}

  void run(const ScanArgs& a, int64_t b, int64_t d, GradSums& sums) {
    const int64_t N = a.dstate, T = a.seqlen;
    in.load_channel(a, b, d);
    load_initial_state(a, b, d, h.data());

    for (int64_t t = 0; t < T; ++t) {
      const float dt = in.dt[t], dtu = dt * in.u[t];
      const float* Bt = in.B_at(a, t);
      const float* Ct = in.C_at(a, t);
      const float* prev = h.data() + t * N;
      float* cur = h.data() + (t + 1) * N;
      float* e = decay.data() + t * N;
      double y = double(in.D) * in.u[t];
      for (int64_t n = 0; n < N; ++n) {
        e[n] = std::exp(dt * in.A[n]);
        cur[n] = e[n] * prev[n] + dtu * Bt[n];
        y += double(Ct[n]) * cur[n];
      }
      const double g = load(a.dout, seq_index(a.dout, b, d, t));
      if (a.z.present()) {
        const double z = load(a.z, seq_index(a.z, b, d, t)), s = sigmoid(z);
        dy[t] = float(g * z * s);
        if (a.dz.present())
          store(a.dz, seq_index(a.dz, b, d, t), float(g * y * s * (1.0 + z * (1.0 - s))));
      } else {
        dy[t] = float(g);
      }
    }

    for (int64_t n = 0; n < N; ++n)
      mu[n] = a.dlast_state.present() ? load(a.dlast_state, state_index(a.dlast_state, b, d, n))
                                      : 0.f;
    std::fill(dA_row.begin(), dA_row.end(), 0.0);
    double dD = 0.0, ddelta_bias = 0.0;
    for (int64_t t = T - 1; t >= 0; --t) {
      const float dt = in.dt[t], u = in.u[t], g = dy[t];
      const float* Bt = in.B_at(a, t);
      const float* Ct = in.C_at(a, t);
      const float* prev = h.data() + t * N;
      const float* cur = h.data() + (t + 1) * N;
      const float* e = decay.data() + t * N;
      double* dB = bc_row(a, sums.dB, a.B_fixed, a.B_groups, b, d, t);
      double* dC = bc_row(a, sums.dC, a.C_fixed, a.C_groups, b, d, t);
      double du = 0.0, ddt = 0.0;
      for (int64_t n = 0; n < N; ++n) {
        // mu_t = exp(dt_{t+1} A) mu_{t+1} + C_t dy_t; mu[] holds the first term on entry.
        const float m = mu[n] + Ct[n] * g;
        const double md = m, carried = double(prev[n]) * e[n];
        du += md * Bt[n];
        ddt += md * (double(Bt[n]) * u + carried * in.A[n]);
        dA_row[n] += md * carried * dt;
        if (dB != nullptr) dB[n] += md * dt * u;
        if (dC != nullptr) dC[n] += double(g) * cur[n];
        mu[n] = e[n] * m;
      }
      const double ddelta = a.delta_softplus ? ddt * sigmoid(in.pre[t]) : ddt;
      if (a.du.present()) store(a.du, seq_index(a.du, b, d, t), float(double(g) * in.D + dt * du));
      if (a.ddelta.present()) store(a.ddelta, seq_index(a.ddelta, b, d, t), float(ddelta));
      dD += double(g) * u;
      ddelta_bias += ddelta;
    }

    if (a.dinitial_state.present())
      for (int64_t n = 0; n < N; ++n)
        store(a.dinitial_state, state_index(a.dinitial_state, b, d, n), mu[n]);
    if (!sums.dA.empty())
      for (int64_t n = 0; n < N; ++n) sums.dA[d * N + n] += dA_row[n];
    if (!sums.dD.empty()) sums.dD[d] += dD;
    if (!sums.ddelta_bias.empty()) sums.ddelta_bias[d] += ddelta_bias;
  }
};

}  // namespace

ssm_status selective_scan_fwd_cpu(const ScanArgs& a) {
  const int64_t channels = a.batch * a.dim, N = a.dstate;
  const int threads = int(std::max<int64_t>(
      1, std::min<int64_t>(max_threads(channels * a.seqlen * N), channels)));
  // Scratch is allocated here, outside the parallel region, so an allocation failure throws to
  // the entry point's guard instead of terminating inside OpenMP.
  std::vector<ChannelInputs> inputs(threads, ChannelInputs(a));
  std::vector<std::vector<float>> states(threads, std::vector<float>(N));

#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) schedule(static)
#endif
  for (int64_t ch = 0; ch < channels; ++ch) {
    const int64_t b = ch / a.dim, d = ch % a.dim;
    ChannelInputs& in = inputs[thread_index()];
    float* h = states[thread_index()].data();
    in.load_channel(a, b, d);
    load_initial_state(a, b, d, h);
    for (int64_t t = 0; t < a.seqlen; ++t) {
      const float dt = in.dt[t], dtu = dt * in.u[t];
      const float* Bt = in.B_at(a, t);
      const float* Ct = in.C_at(a, t);
      double y = double(in.D) * in.u[t];
      for (int64_t n = 0; n < N; ++n) {
        h[n] = std::exp(dt * in.A[n]) * h[n] + dtu * Bt[n];
        y += double(Ct[n]) * h[n];
      }
      if (a.z.present()) {
        const double z = load(a.z, seq_index(a.z, b, d, t));
        y *= z * sigmoid(z);
      }
      store(a.out, seq_index(a.out, b, d, t), float(y));
    }
    if (a.last_state.present())
      for (int64_t n = 0; n < N; ++n) store(a.last_state, state_index(a.last_state, b, d, n), h[n]);
  }
  return SSM_SUCCESS;
}

ssm_status selective_scan_bwd_cpu(const ScanArgs& a) {
  const int64_t channels = a.batch * a.dim;
  int threads = int(std::max<int64_t>(
      1, std::min<int64_t>(max_threads(channels * a.seqlen * a.dstate), channels)));
  const double sum_bytes = GradSums::bytes(a);
  if (sum_bytes > 0)
    threads = int(std::max(1.0, std::min(double(threads), kReductionBudgetBytes / sum_bytes)));
  std::vector<GradSums> sums(threads, GradSums(a));
  std::vector<ChannelBackward> work(threads, ChannelBackward(a));

#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) schedule(static)
#endif
  for (int64_t ch = 0; ch < channels; ++ch) {
    const int tid = thread_index();
    work[tid].run(a, ch / a.dim, ch % a.dim, sums[tid]);
  }

  write_channel_grad(a.dA, a.dim * a.dstate, a.dstate, sums, &GradSums::dA);
  write_channel_grad(a.dD, a.dim, 1, sums, &GradSums::dD);
  write_channel_grad(a.ddelta_bias, a.dim, 1, sums, &GradSums::ddelta_bias);
  write_bc_grad(a, a.dB, a.B_fixed, a.B_groups, sums, &GradSums::dB);
  write_bc_grad(a, a.dC, a.C_fixed, a.C_groups, sums, &GradSums::dC);
  return SSM_SUCCESS;
}

}  // namespace ssm
