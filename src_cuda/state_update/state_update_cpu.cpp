// CPU reference of the selective-state decode step (libssm/state_update.h): every step in float64
// from the operands as stored, the new state rounded once to state's dtype and out once to out's.
// Rows (b, h, p) are independent and run in parallel under OpenMP; the indices are checked
// (range, repeats) before anything is written.
#include <algorithm>
#include <cmath>
#include <vector>

#include "common/cpu_threads.h"
#include "common/error.h"
#include "common/half_host.h"
#include "state_update/state_update_args.h"

namespace ssm {
namespace {

double load(const TensorRef& r, int64_t i) { return load_float(r.data, i, r.dtype); }

int64_t load_index(const TensorRef& r, int64_t b) {
  const int64_t i = b * r.stride[0];
  return r.dtype == Dtype::I32 ? int64_t(static_cast<const int32_t*>(r.data)[i])
                               : static_cast<const int64_t*>(r.data)[i];
}

// Same threshold as the CUDA kernel and mamba_ssm: above 20, softplus(v) and v agree to within
// float32 rounding.
double softplus(double v) { return v <= 20.0 ? std::log1p(std::exp(v)) : v; }
double silu(double v) { return v / (1.0 + std::exp(-v)); }

// The state slot of every row (-1: padding), or an error naming state_batch_indices.
ssm_status state_slots(const StateUpdateArgs& a, std::vector<int64_t>* slots) {
  slots->resize(size_t(a.batch));
  if (!a.state_batch_indices.present()) {
    for (int64_t b = 0; b < a.batch; ++b) (*slots)[size_t(b)] = b;
    return SSM_SUCCESS;
  }
  std::vector<int64_t> owner(size_t(a.batch_state), -1);
  for (int64_t b = 0; b < a.batch; ++b) {
    const int64_t s = load_index(a.state_batch_indices, b);
    (*slots)[size_t(b)] = s < 0 ? -1 : s;
    if (s < 0) continue;
    if (s >= a.batch_state)
      return fail(SSM_ERROR_INVALID_ARGUMENT,
                  "state_batch_indices: entry %lld is %lld, past the %lld state slots (state's "
                  "axis 0)",
                  (long long)b, (long long)s, (long long)a.batch_state);
    if (owner[size_t(s)] >= 0)
      return fail(SSM_ERROR_INVALID_ARGUMENT,
                  "state_batch_indices: entries %lld and %lld both name state slot %lld; each "
                  "row needs a slot of its own",
                  (long long)owner[size_t(s)], (long long)b, (long long)s);
    owner[size_t(s)] = b;
  }
  return SSM_SUCCESS;
}

int64_t row_at(const TensorRef& t, int64_t b, int64_t h, int64_t p) {
  return b * t.stride[0] + h * t.stride[1] + p * t.stride[2];
}

int64_t channel_at(const TensorRef& t, int64_t h, int64_t p) {
  return h * t.stride[0] + p * t.stride[1];
}

// One row: the new state written to slot s and out[b, h, p] returned.
double update_row(const StateUpdateArgs& a, int64_t b, int64_t s, int64_t h, int64_t p) {
  const int64_t g = h / a.heads_per_group;
  const double x = load(a.x, row_at(a.x, b, h, p));
  double dt = load(a.dt, row_at(a.dt, b, h, p));
  if (a.dt_bias.present()) dt += load(a.dt_bias, channel_at(a.dt_bias, h, p));
  if (a.dt_softplus) dt = softplus(dt);
  const TensorRef& st = a.state;
  const int64_t state_row = s * st.stride[0] + h * st.stride[1] + p * st.stride[2];
  const int64_t a_row = h * a.A.stride[0] + p * a.A.stride[1];
  const int64_t b_row = b * a.B.stride[0] + g * a.B.stride[1];
  const int64_t c_row = b * a.C.stride[0] + g * a.C.stride[1];
  double y = 0.0;
  for (int64_t n = 0; n < a.dstate; ++n) {
    const int64_t si = state_row + n * st.stride[3];
    const double decay = std::exp(load(a.A, a_row + n * a.A.stride[2]) * dt);
    const double next = load(st, si) * decay + load(a.B, b_row + n * a.B.stride[2]) * dt * x;
    store_float(st.data, si, st.dtype, float(next));
    y += next * load(a.C, c_row + n * a.C.stride[2]);
  }
  if (a.D.present()) y += load(a.D, channel_at(a.D, h, p)) * x;
  if (a.z.present()) y *= silu(load(a.z, row_at(a.z, b, h, p)));
  return y;
}

}  // namespace

ssm_status selective_state_update_cpu(const StateUpdateArgs& a) {
  std::vector<int64_t> slots;
  const ssm_status checked = state_slots(a, &slots);
  if (checked != SSM_SUCCESS) return checked;
  const int64_t rows = a.batch * a.nheads * a.headdim;
  [[maybe_unused]] const int threads =
      int(std::max<int64_t>(1, std::min<int64_t>(max_threads(rows * a.dstate), rows)));
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t p = r % a.headdim, h = (r / a.headdim) % a.nheads, b = r / a.headdim / a.nheads;
    const int64_t s = slots[size_t(b)];
    const double y = s < 0 ? 0.0 : update_row(a, b, s, h, p);
    store_float(a.out.data, row_at(a.out, b, h, p), a.out.dtype, float(y));
  }
  return SSM_SUCCESS;
}

}  // namespace ssm
