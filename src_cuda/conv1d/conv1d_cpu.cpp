// CPU reference of the causal conv1d (libssm/conv1d.h): forward, backward and decode step, every
// sum in float64 and each output rounded once to its dtype. The forward and the decode step run
// rows in parallel under OpenMP; the backward runs channels in parallel, each summing dweight and
// dbias over batch and positions in order, so their bits do not depend on the thread count.
#include <algorithm>
#include <cmath>
#include <vector>

#include "common/cpu_threads.h"
#include "common/error.h"
#include "common/half_host.h"
#include "conv1d/conv1d_args.h"

namespace ssm {
namespace {

double load(const TensorRef& r, int64_t i) { return load_float(r.data, i, r.dtype); }
void store(const TensorRef& r, int64_t i, double v) { store_float(r.data, i, r.dtype, float(v)); }

int64_t load_index(const TensorRef& r, int64_t i) {
  return r.dtype == Dtype::I64 ? static_cast<const int64_t*>(r.data)[i]
                               : static_cast<const int32_t*>(r.data)[i];
}

int64_t at3(const TensorRef& t, int64_t i, int64_t j, int64_t k) {
  return i * t.stride[0] + j * t.stride[1] + k * t.stride[2];
}

double sigmoid(double v) { return 1.0 / (1.0 + std::exp(-v)); }
double dsilu(double v) {
  const double s = sigmoid(v);
  return s * (1.0 + v * (1.0 - s));
}

int threads_for(int64_t work, int64_t units) {
  return int(std::max<int64_t>(1, std::min<int64_t>(max_threads(work), units)));
}

// Per-thread scratch of the whole-sequence conv, allocated before the parallel region so an
// allocation failure throws to the entry point's guard instead of terminating inside OpenMP.
struct Scratch {
  std::vector<double> xs, dz;
  std::vector<int64_t> sid;
  Scratch(const Conv1dArgs& a, bool backward)
      : xs(size_t(a.seqlen + a.width - 1)), dz(backward ? size_t(a.seqlen) : 0),
        sid(a.seq_idx.present() ? xs.size() : 0) {}
};

std::vector<Scratch> scratch_for(const Conv1dArgs& a, int threads, bool backward) {
  return std::vector<Scratch>(size_t(threads), Scratch(a, backward));
}

// One (batch, channel) row of the whole-sequence conv: x at positions -(W-1) .. seqlen-1
// (initial states below 0) and the packed-sequence ids, read once into the scratch.
struct Row {
  const Conv1dArgs& a;
  int W;
  std::vector<double>& xs;    // xs[p + W-1]
  std::vector<int64_t>& sid;  // sid[p + W-1]; positions below 0 take position 0's sequence
  double w[kConv1dMaxWidth] = {};
  double bias = 0.0;

  Row(const Conv1dArgs& args, int64_t b, int64_t c, Scratch& s)
      : a(args), W(args.width), xs(s.xs), sid(s.sid) {
    for (int j = 0; j < W - 1; ++j)
      xs[j] = a.initial_states.present() ? load(a.initial_states, at3(a.initial_states, b, c, j))
                                         : 0.0;
    for (int64_t t = 0; t < a.seqlen; ++t) xs[t + W - 1] = load(a.x, at3(a.x, b, c, t));
    if (a.seq_idx.present()) {
      for (int64_t t = 0; t < a.seqlen; ++t)
        sid[t + W - 1] = load_index(a.seq_idx, b * a.seq_idx.stride[0] + t * a.seq_idx.stride[1]);
      for (int j = 0; j < W - 1; ++j) sid[j] = a.seqlen > 0 ? sid[W - 1] : 0;
    }
    for (int k = 0; k < W; ++k)
      w[k] = load(a.weight, c * a.weight.stride[0] + k * a.weight.stride[1]);
    if (a.bias.present()) bias = load(a.bias, c * a.bias.stride[0]);
  }

  double x_at(int64_t p) const { return xs[size_t(p + W - 1)]; }
  // same(p, t) of the header.
  bool same(int64_t p, int64_t t) const {
    return sid.empty() || sid[size_t(p + W - 1)] == sid[size_t(t + W - 1)];
  }
  // same(p, seqlen-1), which is 1 with seqlen 0.
  bool same_as_last(int64_t p) const { return a.seqlen == 0 || same(p, a.seqlen - 1); }

  double z(int64_t t) const {
    double acc = bias;
    for (int k = 0; k < W; ++k) {
      const int64_t p = t - (W - 1) + k;
      if (same(p, t)) acc += w[k] * x_at(p);
    }
    return acc;
  }
};

void forward_row(const Conv1dArgs& a, int64_t b, int64_t c, Scratch& scratch) {
  const Row row(a, b, c, scratch);
  const int W = a.width;
  for (int64_t t = 0; t < a.seqlen; ++t) {
    const double z = row.z(t);
    store(a.out, at3(a.out, b, c, t), a.silu ? z * sigmoid(z) : z);
  }
  if (a.final_states.present()) {
    for (int j = 0; j < W - 1; ++j) {
      const int64_t p = a.seqlen - (W - 1) + j;
      const double v = row.same_as_last(p) ? row.x_at(p) : 0.0;
      store(a.final_states, at3(a.final_states, b, c, j), v);
    }
  }
}

// The backward of one row: dx and dinitial_states written, dweight/dbias sums added to dw/db.
void backward_row(const Conv1dArgs& a, int64_t b, int64_t c, double* dw, double* db,
                  Scratch& scratch) {
  const Row row(a, b, c, scratch);
  std::vector<double>& dz = scratch.dz;
  const int W = a.width;
  const int64_t L = a.seqlen;
  for (int64_t t = 0; t < L; ++t) {
    const double g = load(a.dout, at3(a.dout, b, c, t));
    dz[t] = a.silu ? g * dsilu(row.z(t)) : g;
  }
  for (int64_t t = 0; t < L; ++t) {
    *db += dz[t];
    for (int k = 0; k < W; ++k) {
      const int64_t p = t - (W - 1) + k;
      if (row.same(p, t)) dw[k] += dz[t] * row.x_at(p);
    }
  }
  // d/dxs(p) for p in -(W-1) .. L-1: dx for p >= 0, dinitial_states below.
  const bool want_dx = a.dx.present(), want_dinit = a.dinitial_states.present();
  for (int64_t p = want_dinit ? -(W - 1) : 0; p < (want_dx ? L : 0); ++p) {
    double g = 0.0;
    for (int k = 0; k < W; ++k) {
      const int64_t t = p + (W - 1) - k;
      if (t >= 0 && t < L && row.same(p, t)) g += row.w[k] * dz[t];
    }
    const int64_t j = p - (L - (W - 1));  // index into the final states
    if (a.dfinal_states.present() && j >= 0 && row.same_as_last(p))
      g += load(a.dfinal_states, at3(a.dfinal_states, b, c, j));
    if (p >= 0) store(a.dx, at3(a.dx, b, c, p), g);
    else store(a.dinitial_states, at3(a.dinitial_states, b, c, p + W - 1), g);
  }
}

// One row of the decode step; s is its state row (checked). v is scratch of W-1+seqlen doubles.
void update_row(const Conv1dUpdateArgs& a, int64_t b, int64_t c, int64_t s,
                std::vector<double>& v) {
  const int W = a.width;
  const int64_t S = a.state_len, n = a.seqlen;
  const TensorRef& st = a.conv_state;
  double w[kConv1dMaxWidth];
  for (int k = 0; k < W; ++k)
    w[k] = load(a.weight, c * a.weight.stride[0] + k * a.weight.stride[1]);
  const double bias = a.bias.present() ? load(a.bias, c * a.bias.stride[0]) : 0.0;
  const bool circular = a.cache_seqlens.present();
  const int64_t q = circular ? load_index(a.cache_seqlens, b * a.cache_seqlens.stride[0]) : 0;
  auto wrap = [S](int64_t i) { return ((i % S) + S) % S; };

  // v: the W-1 state entries before the new tokens, then the tokens.
  for (int j = 0; j < W - 1; ++j) {
    const int64_t i = circular ? wrap(q - (W - 1) + j) : S - (W - 1) + j;
    v[j] = load(st, at3(st, s, c, i));
  }
  for (int64_t t = 0; t < n; ++t) v[W - 1 + t] = load(a.x, at3(a.x, b, c, t));
  for (int64_t t = 0; t < n; ++t) {
    double z = bias;
    for (int k = 0; k < W; ++k) z += w[k] * v[t + k];
    store(a.out, at3(a.out, b, c, t), a.silu ? z * sigmoid(z) : z);
  }
  if (circular) {
    for (int64_t t = std::max<int64_t>(0, n - S); t < n; ++t)
      store(st, at3(st, s, c, wrap(q + t)), v[W - 1 + t]);
    return;
  }
  // The last S entries of state ++ tokens, written in increasing order: entry i reads entry
  // i + n, which no earlier step has overwritten.
  for (int64_t i = 0; i < S; ++i) {
    const int64_t from = i + n;
    const double value = from < S ? load(st, at3(st, s, c, from)) : v[W - 1 + from - S];
    store(st, at3(st, s, c, i), value);
  }
}

}  // namespace

ssm_status conv1d_fwd_cpu(const Conv1dArgs& a) {
  const int64_t rows = a.batch * a.dim;
  const int threads = threads_for(rows * (a.seqlen + 1) * a.width, rows);
  std::vector<Scratch> scratch = scratch_for(a, threads, false);
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) schedule(static)
#endif
  for (int64_t r = 0; r < rows; ++r)
    forward_row(a, r / a.dim, r % a.dim, scratch[thread_index()]);
  return SSM_SUCCESS;
}

ssm_status conv1d_bwd_cpu(const Conv1dArgs& a) {
  const int threads = threads_for(a.batch * a.dim * (a.seqlen + 1) * a.width, a.dim);
  std::vector<Scratch> scratch = scratch_for(a, threads, true);
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) schedule(static)
#endif
  for (int64_t c = 0; c < a.dim; ++c) {
    double dw[kConv1dMaxWidth] = {}, db = 0.0;
    for (int64_t b = 0; b < a.batch; ++b) backward_row(a, b, c, dw, &db, scratch[thread_index()]);
    if (a.dweight.present())
      for (int k = 0; k < a.width; ++k)
        store(a.dweight, c * a.dweight.stride[0] + k * a.dweight.stride[1], dw[k]);
    if (a.dbias.present()) store(a.dbias, c * a.dbias.stride[0], db);
  }
  return SSM_SUCCESS;
}

ssm_status conv1d_update_cpu(const Conv1dUpdateArgs& a) {
  std::vector<int64_t> rows(size_t(a.batch));
  for (int64_t b = 0; b < a.batch; ++b)
    rows[b] = a.conv_state_indices.present()
                  ? load_index(a.conv_state_indices, b * a.conv_state_indices.stride[0])
                  : b;
  if (a.conv_state_indices.present()) {
    std::vector<int64_t> used;
    for (int64_t b = 0; b < a.batch; ++b) {
      if (rows[b] >= a.batch_state)
        return fail(SSM_ERROR_INVALID_ARGUMENT,
                    "conv_state_indices: entry %lld is %lld, but conv_state has %lld rows "
                    "(batch_state); use a negative index for a padding row",
                    (long long)b, (long long)rows[b], (long long)a.batch_state);
      if (rows[b] >= 0) used.push_back(rows[b]);
    }
    std::sort(used.begin(), used.end());
    const auto dup = std::adjacent_find(used.begin(), used.end());
    if (dup != used.end())
      return fail(SSM_ERROR_INVALID_ARGUMENT,
                  "conv_state_indices: state row %lld appears more than once; each row's state "
                  "must be its own",
                  (long long)*dup);
  }
  const int64_t work = a.batch * a.dim;
  const int threads = threads_for(work * (a.seqlen + a.state_len) * a.width, work);
  std::vector<std::vector<double>> v(size_t(threads),
                                     std::vector<double>(size_t(a.width - 1 + a.seqlen)));
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) schedule(static)
#endif
  for (int64_t r = 0; r < work; ++r) {
    const int64_t b = r / a.dim, c = r % a.dim;
    if (rows[b] < 0) {
      for (int64_t t = 0; t < a.seqlen; ++t) store(a.out, at3(a.out, b, c, t), 0.0);
    } else {
      update_row(a, b, c, rows[b], v[thread_index()]);
    }
  }
  return SSM_SUCCESS;
}

}  // namespace ssm
