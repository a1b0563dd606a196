// The C entry points of norm.h: validate every argument (common/dlpack_check.h), fill NormArgs,
// then dispatch by device to the CPU reference or the CUDA launchers. Nothing is written before
// every check has passed.
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "common/api_guard.h"
#include "common/dlpack_check.h"
#include "common/entry_checks.h"
#include "libssm/norm.h"
#include "norm/norm_args.h"

namespace ssm {
namespace {

constexpr int64_t kMaxHidden = 65536;
// The bytes of version 0 of the params struct; later versions append fields after these.
constexpr size_t kParamsV0Size = offsetof(ssm_norm_params, norm_before_gate) + sizeof(int32_t);
constexpr const char* kWorkspaceQuery = "ssm_norm_bwd_workspace_size";

// The shapes a tensor argument can take: a row-shaped (rows, hidden) tensor, a per-column
// (hidden,) vector, or per-(row, group) statistics (rows, ngroups), also (rows,) for one group.
enum class Shape { Rows, Hidden, Stats };

// One call being checked: the tensors seen so far and the description being filled.
struct Call {
  TensorChecker ck;
  NormArgs a;
};

ssm_status check_params(const ssm_norm_params* p, NormArgs& a) {
  if (p == nullptr) return fail(SSM_ERROR_INVALID_ARGUMENT, "params: must not be NULL");
  if (p->struct_size < kParamsV0Size)
    return fail(SSM_ERROR_INVALID_ARGUMENT,
                "params: struct_size is %zu, expected at least %zu "
                "(set it to sizeof(ssm_norm_params))",
                p->struct_size, kParamsV0Size);
  if (p->kind != SSM_NORM_RMS && p->kind != SSM_NORM_LAYER)
    return fail(SSM_ERROR_INVALID_ARGUMENT,
                "params: kind is %d, expected SSM_NORM_RMS (0) or SSM_NORM_LAYER (1)",
                int(p->kind));
  if (!std::isfinite(p->eps) || p->eps < 0.f)
    return fail(SSM_ERROR_INVALID_ARGUMENT, "params: eps is %g, expected a finite value >= 0",
                double(p->eps));
  if (p->group_size < 0)
    return fail(SSM_ERROR_INVALID_ARGUMENT,
                "params: group_size is %lld, expected 0 (one group) or a divisor of hidden",
                (long long)p->group_size);
  a.layer_norm = p->kind == SSM_NORM_LAYER;
  a.eps = p->eps;
  a.group_size = p->group_size;
  a.zero_centered_weight = p->zero_centered_weight != 0;
  a.norm_before_gate = p->norm_before_gate != 0;
  return SSM_SUCCESS;
}

// The kernels read the hidden axis as contiguous vectors. A stride that is never followed (one
// column, or no elements at all) is not checked: frameworks give those axes arbitrary strides
// (NumPy exports 0 for every axis of an empty array).
ssm_status check_contiguous_hidden(const TensorArg& x, int axis) {
  if (x.size(axis) <= 1 || x.stride[axis] == 1) return SSM_SUCCESS;
  for (int i = 0; i < x.ndim(); ++i)
    if (x.size(i) == 0) return SSM_SUCCESS;
  if (x.ndim() == 1)
    return fail(SSM_ERROR_LAYOUT, "%s: stride is %lld, expected 1 (it must be contiguous)",
                x.name, (long long)x.stride[axis]);
  return fail(SSM_ERROR_LAYOUT,
              "%s: stride along hidden (axis %d) is %lld, expected 1 (the hidden axis must be "
              "contiguous; rows may have any stride)",
              x.name, axis, (long long)x.stride[axis]);
}

ssm_status check_tensor(Call& c, const DLTensor* t, const char* name, bool required,
                        DtypeRule rule, Role role, Shape shape, TensorRef* ref) {
  TensorArg x;
  SSM_RETURN_IF_ERROR(c.ck.add(t, name, required, rule, role, &x));
  if (!x.present()) return SSM_SUCCESS;
  const NormArgs& a = c.a;
  switch (shape) {
    case Shape::Rows:
      SSM_RETURN_IF_ERROR(c.ck.expect_shape(x, {"rows", "hidden"}, {a.rows, a.hidden}));
      SSM_RETURN_IF_ERROR(check_contiguous_hidden(x, 1));
      *ref = x.ref({0, 1});
      break;
    case Shape::Hidden:
      SSM_RETURN_IF_ERROR(c.ck.expect_shape(x, {"hidden"}, {a.hidden}));
      SSM_RETURN_IF_ERROR(check_contiguous_hidden(x, 0));
      *ref = x.ref({0});
      break;
    case Shape::Stats:
      if (a.ngroups == 1 && x.ndim() == 1) {
        SSM_RETURN_IF_ERROR(c.ck.expect_shape(x, {"rows"}, {a.rows}));
        *ref = x.ref({0, -1});
      } else {
        SSM_RETURN_IF_ERROR(c.ck.expect_shape(x, {"rows", "ngroups"}, {a.rows, a.ngroups}));
        *ref = x.ref({0, 1});
      }
      break;
  }
  return SSM_SUCCESS;
}

// A gradient output: optional, shaped like its input, and only meaningful if the input is given.
ssm_status check_grad(Call& c, const DLTensor* t, const char* name, const DLTensor* input,
                      const char* input_name, Shape shape, TensorRef* ref) {
  if (t != nullptr && input == nullptr)
    return fail(SSM_ERROR_INVALID_ARGUMENT,
                "%s: given, but %s is NULL; a gradient needs its input", name, input_name);
  return check_tensor(c, t, name, false, DtypeRule::AnyFloat, Role::Output, shape, ref);
}

// mean: LayerNorm's statistic, so it must be absent for RMSNorm; the backward needs it for
// LayerNorm (`required`).
ssm_status check_mean(Call& c, const DLTensor* mean, bool required, Role role) {
  if (!c.a.layer_norm) {
    if (mean != nullptr)
      return fail(SSM_ERROR_INVALID_ARGUMENT,
                  "mean: must be NULL for RMSNorm (kind SSM_NORM_RMS), which subtracts no mean");
    return SSM_SUCCESS;
  }
  if (required && mean == nullptr)
    return fail(SSM_ERROR_INVALID_ARGUMENT,
                "mean: must not be NULL for LayerNorm (kind SSM_NORM_LAYER); pass the mean the "
                "forward wrote");
  return check_tensor(c, mean, "mean", false, DtypeRule::Float32, role, Shape::Stats,
                      &c.a.mean);
}

// params, x and weight: what every entry point, the size query included, takes.
ssm_status check_core(Call& c, const ssm_norm_params* params, const DLTensor* x,
                      const DLTensor* weight) {
  NormArgs& a = c.a;
  SSM_RETURN_IF_ERROR(check_params(params, a));

  TensorArg xa;
  char got[128];
  SSM_RETURN_IF_ERROR(c.ck.add(x, "x", true, DtypeRule::AnyFloat, Role::Input, &xa));
  SSM_RETURN_IF_ERROR(c.ck.expect_shape(xa, {"rows", "hidden"}, {-1, -1}));
  a.rows = xa.size(0);
  a.hidden = xa.size(1);
  if (a.hidden < 1)
    return fail(SSM_ERROR_SHAPE, "x: hidden must be at least 1, got shape %s",
                format_shape(got, sizeof got, x->shape, 2));
  if (a.hidden > kMaxHidden)
    return fail(SSM_ERROR_UNSUPPORTED, "x: hidden is %lld; libssm supports hidden up to %lld",
                (long long)a.hidden, (long long)kMaxHidden);
  if (a.group_size == 0) a.group_size = a.hidden;
  if (a.hidden % a.group_size != 0)
    return fail(SSM_ERROR_INVALID_ARGUMENT,
                "params: group_size is %lld, which does not divide hidden %lld (x's last axis)",
                (long long)a.group_size, (long long)a.hidden);
  a.ngroups = a.hidden / a.group_size;
  SSM_RETURN_IF_ERROR(check_contiguous_hidden(xa, 1));
  a.x = xa.ref({0, 1});

  SSM_RETURN_IF_ERROR(check_tensor(c, weight, "weight", false, DtypeRule::AnyFloat, Role::Input,
                                   Shape::Hidden, &a.weight));
  if (a.zero_centered_weight && weight == nullptr)
    return fail(SSM_ERROR_INVALID_ARGUMENT,
                "params: zero_centered_weight is set, but weight is NULL; it scales by "
                "1 + weight");
  return SSM_SUCCESS;
}

// Workspace bytes the backward needs on the tensors' device: none on the CPU. The size depends
// only on what ssm_norm_bwd_workspace_size sees (params, x, weight), so the query's answer is
// exactly what the backward then demands.
ssm_status workspace_needed(const Call& c, size_t* bytes) {
  *bytes = 0;
  if (!c.ck.on_cuda()) return SSM_SUCCESS;
#ifdef SSM_WITH_CUDA
  NormArgs seen;
  const NormArgs& a = c.a;
  seen.rows = a.rows;
  seen.hidden = a.hidden;
  seen.group_size = a.group_size;
  seen.ngroups = a.ngroups;
  seen.layer_norm = a.layer_norm;
  seen.zero_centered_weight = a.zero_centered_weight;
  seen.norm_before_gate = a.norm_before_gate;
  seen.eps = a.eps;
  seen.x = a.x;
  seen.weight = a.weight;
  *bytes = norm_bwd_cuda_workspace(seen, c.ck.device_id());
  return SSM_SUCCESS;
#else
  return fail_no_cuda();
#endif
}

ssm_status workspace_size(const ssm_norm_params* params, const DLTensor* x,
                          const DLTensor* weight, size_t* bytes) {
  if (bytes == nullptr) return fail(SSM_ERROR_INVALID_ARGUMENT, "bytes: must not be NULL");
  Call c;
  SSM_RETURN_IF_ERROR(check_core(c, params, x, weight));
  SSM_RETURN_IF_ERROR(c.ck.check_memory());
  size_t needed = 0;
  SSM_RETURN_IF_ERROR(workspace_needed(c, &needed));
  *bytes = needed;
  return SSM_SUCCESS;
}

ssm_status forward(const ssm_norm_params* params, const DLTensor* x, const DLTensor* residual,
                   const DLTensor* weight, const DLTensor* bias, const DLTensor* z, DLTensor* y,
                   DLTensor* residual_out, DLTensor* mean, DLTensor* rstd, void* stream) {
  Call c;
  NormArgs& a = c.a;
  SSM_RETURN_IF_ERROR(check_core(c, params, x, weight));
  const auto in = Role::Input, out = Role::Output;
  const auto any = DtypeRule::AnyFloat;
  SSM_RETURN_IF_ERROR(
      check_tensor(c, residual, "residual", false, any, in, Shape::Rows, &a.residual));
  SSM_RETURN_IF_ERROR(check_tensor(c, bias, "bias", false, any, in, Shape::Hidden, &a.bias));
  SSM_RETURN_IF_ERROR(check_tensor(c, z, "z", false, any, in, Shape::Rows, &a.z));
  SSM_RETURN_IF_ERROR(check_tensor(c, y, "y", true, any, out, Shape::Rows, &a.y));
  SSM_RETURN_IF_ERROR(check_tensor(c, residual_out, "residual_out", false, any, out, Shape::Rows,
                                   &a.residual_out));
  SSM_RETURN_IF_ERROR(check_mean(c, mean, false, out));
  SSM_RETURN_IF_ERROR(check_tensor(c, rstd, "rstd", false, DtypeRule::Float32, out, Shape::Stats,
                                   &a.rstd));
  SSM_RETURN_IF_ERROR(c.ck.check_memory());

  if (!c.ck.on_cuda()) return a.rows == 0 ? SSM_SUCCESS : norm_fwd_cpu(a);
#ifdef SSM_WITH_CUDA
  if (a.rows == 0) return SSM_SUCCESS;
  return norm_fwd_cuda(a, c.ck.device_id(), stream);
#else
  (void)stream;
  return fail_no_cuda();
#endif
}

ssm_status backward(const ssm_norm_params* params, const DLTensor* x, const DLTensor* weight,
                    const DLTensor* bias, const DLTensor* z, const DLTensor* mean,
                    const DLTensor* rstd, const DLTensor* dy, const DLTensor* dresidual_out,
                    DLTensor* dx, DLTensor* dresidual, DLTensor* dweight, DLTensor* dbias,
                    DLTensor* dz, void* workspace, size_t workspace_bytes, void* stream) {
  Call c;
  NormArgs& a = c.a;
  SSM_RETURN_IF_ERROR(check_core(c, params, x, weight));
  const auto in = Role::Input, out = Role::Output;
  const auto any = DtypeRule::AnyFloat;
  SSM_RETURN_IF_ERROR(check_tensor(c, bias, "bias", false, any, in, Shape::Hidden, &a.bias));
  SSM_RETURN_IF_ERROR(check_tensor(c, z, "z", false, any, in, Shape::Rows, &a.z));
  SSM_RETURN_IF_ERROR(check_mean(c, mean, true, in));
  SSM_RETURN_IF_ERROR(
      check_tensor(c, rstd, "rstd", true, DtypeRule::Float32, in, Shape::Stats, &a.rstd));
  SSM_RETURN_IF_ERROR(check_tensor(c, dy, "dy", true, any, in, Shape::Rows, &a.dy));
  SSM_RETURN_IF_ERROR(check_tensor(c, dresidual_out, "dresidual_out", false, any, in,
                                   Shape::Rows, &a.dresidual_out));

  SSM_RETURN_IF_ERROR(check_tensor(c, dx, "dx", false, any, out, Shape::Rows, &a.dx));
  SSM_RETURN_IF_ERROR(
      check_tensor(c, dresidual, "dresidual", false, any, out, Shape::Rows, &a.dresidual));
  SSM_RETURN_IF_ERROR(
      check_grad(c, dweight, "dweight", weight, "weight", Shape::Hidden, &a.dweight));
  SSM_RETURN_IF_ERROR(check_grad(c, dbias, "dbias", bias, "bias", Shape::Hidden, &a.dbias));
  SSM_RETURN_IF_ERROR(check_grad(c, dz, "dz", z, "z", Shape::Rows, &a.dz));
  SSM_RETURN_IF_ERROR(c.ck.check_memory());
  size_t needed = 0;
  SSM_RETURN_IF_ERROR(workspace_needed(c, &needed));
  SSM_RETURN_IF_ERROR(check_workspace(workspace, workspace_bytes, needed, kWorkspaceQuery));

  if (!c.ck.on_cuda()) return norm_bwd_cpu(a);  // rows 0 still zeroes dweight and dbias
#ifdef SSM_WITH_CUDA
  // With rows 0 the sums over rows (dweight, dbias) are zero and must still be written; every
  // other gradient is empty.
  if (a.rows == 0 && !a.dweight.present() && !a.dbias.present()) return SSM_SUCCESS;
  return norm_bwd_cuda(a, c.ck.device_id(), workspace, stream);
#else
  (void)stream;
  return fail_cuda_dispatch_without_cuda();
#endif
}

}  // namespace
}  // namespace ssm

extern "C" {

SSM_API ssm_status ssm_norm_fwd(const ssm_norm_params* params, const DLTensor* x,
                                const DLTensor* residual, const DLTensor* weight,
                                const DLTensor* bias, const DLTensor* z, DLTensor* y,
                                DLTensor* residual_out, DLTensor* mean, DLTensor* rstd,
                                void* stream) {
  return ssm::guarded("ssm_norm_fwd", [&] {
    return ssm::forward(params, x, residual, weight, bias, z, y, residual_out, mean, rstd,
                        stream);
  });
}

SSM_API ssm_status ssm_norm_bwd_workspace_size(const ssm_norm_params* params,
                                               const DLTensor* x, const DLTensor* weight,
                                               size_t* bytes) {
  return ssm::guarded("ssm_norm_bwd_workspace_size",
                      [&] { return ssm::workspace_size(params, x, weight, bytes); });
}

SSM_API ssm_status ssm_norm_bwd(const ssm_norm_params* params, const DLTensor* x,
                                const DLTensor* weight, const DLTensor* bias,
                                const DLTensor* z, const DLTensor* mean, const DLTensor* rstd,
                                const DLTensor* dy, const DLTensor* dresidual_out, DLTensor* dx,
                                DLTensor* dresidual, DLTensor* dweight, DLTensor* dbias,
                                DLTensor* dz, void* workspace, size_t workspace_bytes,
                                void* stream) {
  return ssm::guarded("ssm_norm_bwd", [&] {
    return ssm::backward(params, x, weight, bias, z, mean, rstd, dy, dresidual_out, dx, dresidual,
                         dweight, dbias, dz, workspace, workspace_bytes, stream);
  });
}

}  // extern "C"
