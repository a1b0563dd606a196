// The C entry points of selective_scan.h: validate every argument (common/dlpack_check.h), fill
// ScanArgs, then dispatch by device to the CPU reference or the CUDA launchers. Nothing is
// written before every check has passed.
#include <cstddef>
#include <cstdint>

#include "common/api_guard.h"
#include "common/dlpack_check.h"
#include "common/entry_checks.h"
#include "libssm/selective_scan.h"
#include "selective_scan/scan_args.h"

namespace ssm {
namespace {

constexpr int64_t kMaxDstate = 256;
// The bytes of version 0 of the params struct; later versions append fields after these.
constexpr size_t kParamsV0Size =
    offsetof(ssm_selective_scan_params, delta_softplus) + sizeof(int32_t);

// The shapes a tensor argument can take, apart from the three forms of B and C.
enum class Shape { Seq, State, Channel, AMatrix };

// One call being checked: the tensors seen so far and the description being filled.
struct Call {
  TensorChecker ck;
  ScanArgs a;
  int B_ndim = 0, C_ndim = 0;  // the form B and C came in, which dB and dC must repeat
};

ssm_status check_params(const ssm_selective_scan_params* p, ScanArgs& a) {
  if (p == nullptr) return fail(SSM_ERROR_INVALID_ARGUMENT, "params: must not be NULL");
  if (p->struct_size < kParamsV0Size)
    return fail(SSM_ERROR_INVALID_ARGUMENT,
                "params: struct_size is %zu, expected at least %zu "
                "(set it to sizeof(ssm_selective_scan_params))",
                p->struct_size, kParamsV0Size);
  a.delta_softplus = p->delta_softplus != 0;
  return SSM_SUCCESS;
}

ssm_status check_tensor(Call& c, const DLTensor* t, const char* name, bool required,
                        DtypeRule rule, Role role, Shape shape, TensorRef* ref) {
  TensorArg x;
  SSM_RETURN_IF_ERROR(c.ck.add(t, name, required, rule, role, &x));
  if (!x.present()) return SSM_SUCCESS;
  const ScanArgs& a = c.a;
  switch (shape) {
    case Shape::Seq:
      SSM_RETURN_IF_ERROR(
          c.ck.expect_shape(x, {"batch", "dim", "seqlen"}, {a.batch, a.dim, a.seqlen}));
      *ref = x.ref({0, 1, 2});
      break;
    case Shape::State:
      SSM_RETURN_IF_ERROR(
          c.ck.expect_shape(x, {"batch", "dim", "dstate"}, {a.batch, a.dim, a.dstate}));
      *ref = x.ref({0, 1, 2});
      break;
    case Shape::Channel:
      SSM_RETURN_IF_ERROR(c.ck.expect_shape(x, {"dim"}, {a.dim}));
      *ref = x.ref({0});
      break;
    case Shape::AMatrix:
      SSM_RETURN_IF_ERROR(c.ck.expect_shape(x, {"dim", "dstate"}, {a.dim, a.dstate}));
      *ref = x.ref({0, 1});
      break;
  }
  return SSM_SUCCESS;
}

// A gradient output: optional, shaped like its input, and only meaningful if the input is given.
ssm_status check_grad(Call& c, const DLTensor* t, const char* name, const DLTensor* input,
                      const char* input_name, DtypeRule rule, Shape shape, TensorRef* ref) {
  if (t != nullptr && input == nullptr)
    return fail(SSM_ERROR_INVALID_ARGUMENT,
                "%s: given, but %s is NULL; a gradient needs its input", name, input_name);
  return check_tensor(c, t, name, false, rule, Role::Output, shape, ref);
}

// B or C (any of the three forms, chosen by ndim), or dB or dC (form_ndim and form_groups: the
// form of the input they are the gradient of). The ref comes out normalised to
// (batch, groups, dstate, seqlen), or (dim, dstate) when fixed.
ssm_status check_bc(Call& c, const DLTensor* t, const char* name, bool required, Role role,
                    int form_ndim, int64_t form_groups, TensorRef* ref, bool* fixed,
                    int64_t* groups, int* ndim_out) {
  TensorArg x;
  SSM_RETURN_IF_ERROR(c.ck.add(t, name, required, DtypeRule::AnyFloat, role, &x));
  if (!x.present()) return SSM_SUCCESS;
  const ScanArgs& a = c.a;
  const int ndim = form_ndim != 0 ? form_ndim : x.ndim();
  switch (ndim) {
    case 2:
      SSM_RETURN_IF_ERROR(c.ck.expect_shape(x, {"dim", "dstate"}, {a.dim, a.dstate}));
      *ref = x.ref({0, 1});
      break;
    case 3:
      SSM_RETURN_IF_ERROR(c.ck.expect_shape(x, {"batch", "dstate", "seqlen"},
                                            {a.batch, a.dstate, a.seqlen}));
      *ref = x.ref({0, -1, 1, 2});
      break;
    case 4: {
      const int64_t g = form_ndim != 0 ? form_groups : x.size(1);
      SSM_RETURN_IF_ERROR(c.ck.expect_shape(x, {"batch", "groups", "dstate", "seqlen"},
                                            {a.batch, g, a.dstate, a.seqlen}));
      if (g < 1 || a.dim % g != 0)
        return fail(SSM_ERROR_SHAPE, "%s: groups is %lld, which does not divide dim %lld", name,
                    (long long)g, (long long)a.dim);
      *ref = x.ref({0, 1, 2, 3});
      break;
    }
    default: {
      char got[128];
      format_shape(got, sizeof got, x.t->shape, x.ndim() < 8 ? x.ndim() : 8);
      return fail(SSM_ERROR_SHAPE,
                  "%s: expected shape (dim, dstate), (batch, dstate, seqlen) or "
                  "(batch, groups, dstate, seqlen), got %s",
                  name, got);
    }
  }
  if (fixed != nullptr) *fixed = ndim == 2;
  if (groups != nullptr) *groups = ndim == 4 ? x.size(1) : 1;
  if (ndim_out != nullptr) *ndim_out = ndim;
  return SSM_SUCCESS;
}

// params, u, A, B and C: what every entry point, the size queries included, takes.
ssm_status check_core(Call& c, const ssm_selective_scan_params* params, const DLTensor* u,
                      const DLTensor* A, const DLTensor* B, const DLTensor* C) {
  ScanArgs& a = c.a;
  SSM_RETURN_IF_ERROR(check_params(params, a));

  TensorArg x;
  char got[128];
  SSM_RETURN_IF_ERROR(c.ck.add(u, "u", true, DtypeRule::AnyFloat, Role::Input, &x));
  SSM_RETURN_IF_ERROR(c.ck.expect_shape(x, {"batch", "dim", "seqlen"}, {-1, -1, -1}));
  a.batch = x.size(0);
  a.dim = x.size(1);
  a.seqlen = x.size(2);
  if (a.dim < 1 || a.seqlen < 1)
    return fail(SSM_ERROR_SHAPE, "u: %s must be at least 1, got shape %s",
                a.dim < 1 ? "dim" : "seqlen", format_shape(got, sizeof got, u->shape, 3));
  a.u = x.ref({0, 1, 2});

  SSM_RETURN_IF_ERROR(c.ck.add(A, "A", true, DtypeRule::Float32, Role::Input, &x));
  SSM_RETURN_IF_ERROR(c.ck.expect_shape(x, {"dim", "dstate"}, {a.dim, -1}));
  a.dstate = x.size(1);
  if (a.dstate < 1)
    return fail(SSM_ERROR_SHAPE, "A: dstate must be at least 1, got shape %s",
                format_shape(got, sizeof got, A->shape, 2));
  if (a.dstate > kMaxDstate)
    return fail(SSM_ERROR_UNSUPPORTED, "A: dstate is %lld; libssm supports dstate up to %lld",
                (long long)a.dstate, (long long)kMaxDstate);
  a.A = x.ref({0, 1});

  SSM_RETURN_IF_ERROR(check_bc(c, B, "B", true, Role::Input, 0, 0, &a.B, &a.B_fixed,
                               &a.B_groups, &c.B_ndim));
  return check_bc(c, C, "C", true, Role::Input, 0, 0, &a.C, &a.C_fixed, &a.C_groups,
                  &c.C_ndim);
}

// The inputs of the forward besides the core: the backward takes them too.
ssm_status check_forward_inputs(Call& c, const DLTensor* delta, const DLTensor* D,
                                const DLTensor* z, const DLTensor* delta_bias,
                                const DLTensor* initial_state) {
  ScanArgs& a = c.a;
  const auto in = Role::Input;
  SSM_RETURN_IF_ERROR(check_tensor(c, delta, "delta", true, DtypeRule::AnyFloat, in, Shape::Seq,
                                   &a.delta));
  SSM_RETURN_IF_ERROR(check_tensor(c, D, "D", false, DtypeRule::Float32, in, Shape::Channel, &a.D));
  SSM_RETURN_IF_ERROR(check_tensor(c, z, "z", false, DtypeRule::AnyFloat, in, Shape::Seq, &a.z));
  SSM_RETURN_IF_ERROR(check_tensor(c, delta_bias, "delta_bias", false, DtypeRule::Float32, in,
                                   Shape::Channel, &a.delta_bias));
  return check_tensor(c, initial_state, "initial_state", false, DtypeRule::AnyFloat, in,
                      Shape::State, &a.initial_state);
}

// Workspace bytes the call needs on the tensors' device: none on the CPU.
ssm_status workspace_needed(const Call& c, bool backward, size_t* bytes) {
  *bytes = 0;
  if (!c.ck.on_cuda()) return SSM_SUCCESS;
#ifdef SSM_WITH_CUDA
  *bytes = backward ? selective_scan_bwd_cuda_workspace(c.a)
                    : selective_scan_fwd_cuda_workspace(c.a);
  return SSM_SUCCESS;
#else
  (void)backward;
  return fail_no_cuda();
#endif
}

ssm_status workspace_size(const ssm_selective_scan_params* params, const DLTensor* u,
                          const DLTensor* A, const DLTensor* B, const DLTensor* C, size_t* bytes,
                          bool backward) {
  if (bytes == nullptr) return fail(SSM_ERROR_INVALID_ARGUMENT, "bytes: must not be NULL");
  Call c;
  SSM_RETURN_IF_ERROR(check_core(c, params, u, A, B, C));
  SSM_RETURN_IF_ERROR(c.ck.check_memory());
  size_t needed = 0;
  SSM_RETURN_IF_ERROR(workspace_needed(c, backward, &needed));
  *bytes = needed;
  return SSM_SUCCESS;
}

ssm_status forward(const ssm_selective_scan_params* params, const DLTensor* u,
                   const DLTensor* delta, const DLTensor* A, const DLTensor* B, const DLTensor* C,
                   const DLTensor* D, const DLTensor* z, const DLTensor* delta_bias,
                   const DLTensor* initial_state, DLTensor* out, DLTensor* last_state,
                   void* workspace, size_t workspace_bytes, void* stream) {
  Call c;
  ScanArgs& a = c.a;
  SSM_RETURN_IF_ERROR(check_core(c, params, u, A, B, C));
  SSM_RETURN_IF_ERROR(check_forward_inputs(c, delta, D, z, delta_bias, initial_state));
  const auto o = Role::Output;
  SSM_RETURN_IF_ERROR(
      check_tensor(c, out, "out", true, DtypeRule::AnyFloat, o, Shape::Seq, &a.out));
  SSM_RETURN_IF_ERROR(check_tensor(c, last_state, "last_state", false, DtypeRule::AnyFloat, o,
                                   Shape::State, &a.last_state));
  SSM_RETURN_IF_ERROR(c.ck.check_memory());
  size_t needed = 0;
  SSM_RETURN_IF_ERROR(workspace_needed(c, false, &needed));
  SSM_RETURN_IF_ERROR(check_workspace(workspace, workspace_bytes, needed,
                                      "ssm_selective_scan_fwd_workspace_size"));

  if (a.batch == 0) return SSM_SUCCESS;
  if (!c.ck.on_cuda()) return selective_scan_fwd_cpu(a);
#ifdef SSM_WITH_CUDA
  return selective_scan_fwd_cuda(a, c.ck.device_id(), workspace, stream);
#else
  (void)stream;
  return fail_cuda_dispatch_without_cuda();
#endif
}

ssm_status backward(const ssm_selective_scan_params* params, const DLTensor* u,
                    const DLTensor* delta, const DLTensor* A, const DLTensor* B,
                    const DLTensor* C, const DLTensor* D, const DLTensor* z,
                    const DLTensor* delta_bias, const DLTensor* initial_state,
                    const DLTensor* dout, const DLTensor* dlast_state, DLTensor* du,
                    DLTensor* ddelta, DLTensor* dA, DLTensor* dB, DLTensor* dC, DLTensor* dD,
                    DLTensor* dz, DLTensor* ddelta_bias, DLTensor* dinitial_state,
                    void* workspace, size_t workspace_bytes, void* stream) {
  Call c;
  ScanArgs& a = c.a;
  SSM_RETURN_IF_ERROR(check_core(c, params, u, A, B, C));
  SSM_RETURN_IF_ERROR(check_forward_inputs(c, delta, D, z, delta_bias, initial_state));
  const auto in = Role::Input;
  const auto any = DtypeRule::AnyFloat, f32 = DtypeRule::Float32;
  SSM_RETURN_IF_ERROR(check_tensor(c, dout, "dout", true, any, in, Shape::Seq, &a.dout));
  SSM_RETURN_IF_ERROR(check_tensor(c, dlast_state, "dlast_state", false, any, in, Shape::State,
                                   &a.dlast_state));

  SSM_RETURN_IF_ERROR(check_grad(c, du, "du", u, "u", any, Shape::Seq, &a.du));
  SSM_RETURN_IF_ERROR(check_grad(c, ddelta, "ddelta", delta, "delta", any, Shape::Seq, &a.ddelta));
  SSM_RETURN_IF_ERROR(check_grad(c, dA, "dA", A, "A", f32, Shape::AMatrix, &a.dA));
  SSM_RETURN_IF_ERROR(check_bc(c, dB, "dB", false, Role::Output, c.B_ndim, a.B_groups, &a.dB,
                               nullptr, nullptr, nullptr));
  SSM_RETURN_IF_ERROR(check_bc(c, dC, "dC", false, Role::Output, c.C_ndim, a.C_groups, &a.dC,
                               nullptr, nullptr, nullptr));
  SSM_RETURN_IF_ERROR(check_grad(c, dD, "dD", D, "D", f32, Shape::Channel, &a.dD));
  SSM_RETURN_IF_ERROR(check_grad(c, dz, "dz", z, "z", any, Shape::Seq, &a.dz));
  SSM_RETURN_IF_ERROR(check_grad(c, ddelta_bias, "ddelta_bias", delta_bias, "delta_bias", f32,
                                 Shape::Channel, &a.ddelta_bias));
  SSM_RETURN_IF_ERROR(check_grad(c, dinitial_state, "dinitial_state", initial_state,
                                 "initial_state", any, Shape::State, &a.dinitial_state));
  SSM_RETURN_IF_ERROR(c.ck.check_memory());
  size_t needed = 0;
  SSM_RETURN_IF_ERROR(workspace_needed(c, true, &needed));
  SSM_RETURN_IF_ERROR(check_workspace(workspace, workspace_bytes, needed,
                                      "ssm_selective_scan_bwd_workspace_size"));

  if (!c.ck.on_cuda()) return selective_scan_bwd_cpu(a);  // batch 0 still zeroes dA, dD, ...
#ifdef SSM_WITH_CUDA
  // With batch 0 the sums over batches (dA, dD, ddelta_bias, fixed dB and dC) are zero and must
  // still be written; every other gradient is empty.
  const bool batch_sums = a.dA.present() || a.dD.present() || a.ddelta_bias.present() ||
                          (a.B_fixed && a.dB.present()) || (a.C_fixed && a.dC.present());
  if (a.batch == 0 && !batch_sums) return SSM_SUCCESS;
  return selective_scan_bwd_cuda(a, c.ck.device_id(), workspace, stream);
#else
  (void)stream;
  return fail_cuda_dispatch_without_cuda();
#endif
}

}  // namespace
}  // namespace ssm

extern "C" {

SSM_API ssm_status ssm_selective_scan_fwd_workspace_size(const ssm_selective_scan_params* params,
                                                         const DLTensor* u, const DLTensor* A,
                                                         const DLTensor* B, const DLTensor* C,
                                                         size_t* bytes) {
  return ssm::guarded("ssm_selective_scan_fwd_workspace_size",
                      [&] { return ssm::workspace_size(params, u, A, B, C, bytes, false); });
}

SSM_API ssm_status ssm_selective_scan_bwd_workspace_size(const ssm_selective_scan_params* params,
                                                         const DLTensor* u, const DLTensor* A,
                                                         const DLTensor* B, const DLTensor* C,
                                                         size_t* bytes) {
  return ssm::guarded("ssm_selective_scan_bwd_workspace_size",
                      [&] { return ssm::workspace_size(params, u, A, B, C, bytes, true); });
}

SSM_API ssm_status ssm_selective_scan_fwd(const ssm_selective_scan_params* params,
                                          const DLTensor* u, const DLTensor* delta,
                                          const DLTensor* A, const DLTensor* B, const DLTensor* C,
                                          const DLTensor* D, const DLTensor* z,
                                          const DLTensor* delta_bias,
                                          const DLTensor* initial_state, DLTensor* out,
                                          DLTensor* last_state, void* workspace,
                                          size_t workspace_bytes, void* stream) {
  return ssm::guarded("ssm_selective_scan_fwd", [&] {
    return ssm::forward(params, u, delta, A, B, C, D, z, delta_bias, initial_state, out,
                        last_state, workspace, workspace_bytes, stream);
  });
}

SSM_API ssm_status ssm_selective_scan_bwd(
    const ssm_selective_scan_params* params, const DLTensor* u, const DLTensor* delta,
    const DLTensor* A, const DLTensor* B, const DLTensor* C, const DLTensor* D,
    const DLTensor* z, const DLTensor* delta_bias, const DLTensor* initial_state,
    const DLTensor* dout, const DLTensor* dlast_state, DLTensor* du, DLTensor* ddelta,
    DLTensor* dA, DLTensor* dB, DLTensor* dC, DLTensor* dD, DLTensor* dz, DLTensor* ddelta_bias,
    DLTensor* dinitial_state, void* workspace, size_t workspace_bytes, void* stream) {
  return ssm::guarded("ssm_selective_scan_bwd", [&] {
    return ssm::backward(params, u, delta, A, B, C, D, z, delta_bias, initial_state, dout,
                         dlast_state, du, ddelta, dA, dB, dC, dD, dz, ddelta_bias,
                         dinitial_state, workspace, workspace_bytes, stream);
  });
}

}  // extern "C"
