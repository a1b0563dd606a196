// CPU reference of the fused norm (libssm/norm.h), forward and backward: s = x + residual in
// float32 as the header specifies, every later step and every reduction in float64, each output
// rounded once to its dtype. Rows run in parallel under OpenMP; dweight and dbias are summed in a
// separate pass over blocks of columns, each column in row order, so their bits do not depend on
// the thread count.
#include <algorithm>
#include <cmath>
#include <vector>

#include "common/cpu_threads.h"
#include "common/half_host.h"
#include "norm/norm_args.h"

namespace ssm {
namespace {

// Columns one thread sums dweight and dbias for at a time: each row then contributes a short
// contiguous run of x, z and dy, and the partial sums stay in registers and L1.
constexpr int64_t kColumnBlock = 64;

float load(const TensorRef& r, int64_t i) { return load_float(r.data, i, r.dtype); }
void store(const TensorRef& r, int64_t i, double v) {
  store_float(r.data, i, r.dtype, float(v));
}

// Element j of row r of a (rows, hidden) tensor, whose hidden axis is contiguous.
int64_t at(const TensorRef& t, int64_t r, int64_t j) { return r * t.stride[0] + j; }
int64_t stat_at(const TensorRef& t, int64_t r, int64_t group) {
  return r * t.stride[0] + group * t.stride[1];
}

double sigmoid(double v) { return 1.0 / (1.0 + std::exp(-v)); }
double silu(double v) { return v * sigmoid(v); }
double dsilu(double v) {
  const double s = sigmoid(v);
  return s * (1.0 + v * (1.0 - s));
}

bool gate_before_norm(const NormArgs& a) { return a.z.present() && !a.norm_before_gate; }
bool gate_after_norm(const NormArgs& a) { return a.z.present() && a.norm_before_gate; }

double weight_at(const NormArgs& a, int64_t j) {
  if (!a.weight.present()) return 1.0;
  const double w = load(a.weight, j);
  return a.zero_centered_weight ? w + 1.0 : w;
}
double bias_at(const NormArgs& a, int64_t j) { return a.bias.present() ? load(a.bias, j) : 0.0; }

// Threads for `work` elements split into `units` independent pieces.
int threads_for(int64_t work, int64_t units) {
  return int(std::max<int64_t>(1, std::min<int64_t>(max_threads(work), units)));
}

// The forward of row r; g is scratch for its hidden normalised inputs.
void forward_row(const NormArgs& a, int64_t r, double* g) {
  for (int64_t j = 0; j < a.hidden; ++j) {
    float s = load(a.x, at(a.x, r, j));
    if (a.residual.present()) s += load(a.residual, at(a.residual, r, j));
    if (a.residual_out.present()) store(a.residual_out, at(a.residual_out, r, j), s);
    g[j] = gate_before_norm(a) ? s * silu(load(a.z, at(a.z, r, j))) : double(s);
  }
  const int64_t n = a.group_size;
  for (int64_t G = 0; G < a.ngroups; ++G) {
    const double* gg = g + G * n;
    double mean = 0.0;
    if (a.layer_norm) {
      for (int64_t k = 0; k < n; ++k) mean += gg[k];
      mean /= double(n);
    }
    // A second pass over (g - mean) rather than E[g^2] - mean^2, which cancels badly when the
    // mean is large against the spread.
    double var = 0.0;
    for (int64_t k = 0; k < n; ++k) var += (gg[k] - mean) * (gg[k] - mean);
    var /= double(n);
    const double rstd = 1.0 / std::sqrt(var + double(a.eps));
    if (a.mean.present()) store(a.mean, stat_at(a.mean, r, G), mean);
    if (a.rstd.present()) store(a.rstd, stat_at(a.rstd, r, G), rstd);
    for (int64_t k = 0; k < n; ++k) {
      const int64_t j = G * n + k;
      double o = (gg[k] - mean) * rstd * weight_at(a, j) + bias_at(a, j);
      if (gate_after_norm(a)) o *= silu(load(a.z, at(a.z, r, j)));
      store(a.y, at(a.y, r, j), o);
    }
  }
}

// The forward of element (r, j) recomputed from s, z and the saved statistics, and the gradient
// dy_eff reaching o (dy, times silu(z) when the gate follows the norm).
struct Element {
  double s = 0, z = 0, xhat = 0, dy_eff = 0;
  double dz = 0;  // dL/dz when the gate follows the norm (then the whole of it)
};

Element element(const NormArgs& a, int64_t r, int64_t j, double mean, double rstd, double w,
                bool want_dz) {
  Element e;
  e.s = load(a.x, at(a.x, r, j));
  if (a.z.present()) e.z = load(a.z, at(a.z, r, j));
  const double g = gate_before_norm(a) ? e.s * silu(e.z) : e.s;
  e.xhat = (g - mean) * rstd;
  e.dy_eff = load(a.dy, at(a.dy, r, j));
  if (gate_after_norm(a)) {
    if (want_dz) e.dz = e.dy_eff * (e.xhat * w + bias_at(a, j)) * dsilu(e.z);
    e.dy_eff *= silu(e.z);
  }
  return e;
}

void load_stats(const NormArgs& a, int64_t r, int64_t G, double* mean, double* rstd) {
  *mean = a.layer_norm ? load(a.mean, stat_at(a.mean, r, G)) : 0.0;
  *rstd = load(a.rstd, stat_at(a.rstd, r, G));
}

// dx, dresidual and dz of row r; xhat and wdy are scratch of hidden doubles.
void backward_row(const NormArgs& a, int64_t r, double* xhat, double* wdy) {
  const int64_t n = a.group_size;
  for (int64_t G = 0; G < a.ngroups; ++G) {
    double mean, rstd;
    load_stats(a, r, G, &mean, &rstd);
    double sum_wdy_xhat = 0.0, sum_wdy = 0.0;
    for (int64_t j = G * n; j < (G + 1) * n; ++j) {
      const double w = weight_at(a, j);
      const Element e = element(a, r, j, mean, rstd, w, a.dz.present());
      if (gate_after_norm(a) && a.dz.present()) store(a.dz, at(a.dz, r, j), e.dz);
      xhat[j] = e.xhat;
      wdy[j] = e.dy_eff * w;
      sum_wdy_xhat += wdy[j] * e.xhat;
      sum_wdy += wdy[j];
    }
    // Exact for the rstd that includes eps: d xhat_i / d g_k = rstd (delta_ik - 1/n [LayerNorm]
    // - xhat_i xhat_k / n).
    const double c_xhat = sum_wdy_xhat / double(n);
    const double c_mean = a.layer_norm ? sum_wdy / double(n) : 0.0;
    for (int64_t j = G * n; j < (G + 1) * n; ++j) {
      const double dg = rstd * (wdy[j] - xhat[j] * c_xhat - c_mean);
      double ds = dg;
      if (gate_before_norm(a)) {
        const double s = load(a.x, at(a.x, r, j)), z = load(a.z, at(a.z, r, j));
        ds = dg * silu(z);
        if (a.dz.present()) store(a.dz, at(a.dz, r, j), dg * s * dsilu(z));
      }
      if (a.dresidual_out.present()) ds += load(a.dresidual_out, at(a.dresidual_out, r, j));
      if (a.dx.present()) store(a.dx, at(a.dx, r, j), ds);
      if (a.dresidual.present()) store(a.dresidual, at(a.dresidual, r, j), ds);
    }
  }
}

// dweight and dbias for columns [j0, j1): sums over rows in row order, float64.
void column_sums(const NormArgs& a, int64_t j0, int64_t j1) {
  double dw[kColumnBlock] = {}, db[kColumnBlock] = {};
  for (int64_t r = 0; r < a.rows; ++r) {
    int64_t G = -1;
    double mean = 0.0, rstd = 0.0;
    for (int64_t j = j0; j < j1; ++j) {
      if (j / a.group_size != G) {
        G = j / a.group_size;
        load_stats(a, r, G, &mean, &rstd);
      }
      const Element e = element(a, r, j, mean, rstd, weight_at(a, j), false);
      dw[j - j0] += e.dy_eff * e.xhat;
      db[j - j0] += e.dy_eff;
    }
  }
  for (int64_t j = j0; j < j1; ++j) {
    if (a.dweight.present()) store(a.dweight, j, dw[j - j0]);
    if (a.dbias.present()) store(a.dbias, j, db[j - j0]);
  }
}

}  // namespace

ssm_status norm_fwd_cpu(const NormArgs& a) {
  const int threads = threads_for(a.rows * a.hidden, a.rows);
  // Scratch is allocated here, outside the parallel region, so an allocation failure throws to
  // the entry point's guard instead of terminating inside OpenMP.
  std::vector<std::vector<double>> g(threads, std::vector<double>(a.hidden));
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) schedule(static)
#endif
  for (int64_t r = 0; r < a.rows; ++r) forward_row(a, r, g[thread_index()].data());
  return SSM_SUCCESS;
}

ssm_status norm_bwd_cpu(const NormArgs& a) {
  if (a.dx.present() || a.dresidual.present() || a.dz.present()) {
    const int threads = threads_for(a.rows * a.hidden, a.rows);
    std::vector<std::vector<double>> xhat(threads, std::vector<double>(a.hidden));
    std::vector<std::vector<double>> wdy(threads, std::vector<double>(a.hidden));
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) schedule(static)
#endif
    for (int64_t r = 0; r < a.rows; ++r)
      backward_row(a, r, xhat[thread_index()].data(), wdy[thread_index()].data());
  }
  if (a.dweight.present() || a.dbias.present()) {
    const int64_t blocks = (a.hidden + kColumnBlock - 1) / kColumnBlock;
    [[maybe_unused]] const int threads = threads_for(a.rows * a.hidden, blocks);
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) schedule(static)
#endif
    for (int64_t b = 0; b < blocks; ++b)
      column_sums(a, b * kColumnBlock, std::min(a.hidden, (b + 1) * kColumnBlock));
  }
  return SSM_SUCCESS;
}

}  // namespace ssm
