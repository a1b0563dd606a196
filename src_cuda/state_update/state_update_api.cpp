// The C entry point of state_update.h: validate every argument (common/dlpack_check.h), fill
// StateUpdateArgs in Mamba-2 axes whichever layout came in, then dispatch by device to the CPU
// reference or the CUDA launcher. Nothing is written before every check has passed.
#include <cstddef>
#include <cstdint>

#include "common/api_guard.h"
#include "common/dlpack_check.h"
#include "common/entry_checks.h"
#include "libssm/state_update.h"
#include "state_update/state_update_args.h"

namespace ssm {
namespace {

constexpr int64_t kMaxDstate = 256;
// The bytes of version 0 of the params struct; later versions append fields after these.
constexpr size_t kParamsV0Size =
    offsetof(ssm_selective_state_update_params, dt_softplus) + sizeof(int32_t);

// The shapes a tensor argument can take besides state's: per-row like x, A's, per-group like B,
// per-channel like D, and the (batch,) indices.
enum class Shape { Rows, AMatrix, Groups, Channel, Indices };

// One call being checked: the tensors seen so far, the layout state chose and the description
// being filled.
struct Call {
  TensorChecker ck;
  StateUpdateArgs a;
  bool mamba2 = false;
};

ssm_status check_params(const ssm_selective_state_update_params* p, StateUpdateArgs& a) {
  if (p == nullptr) return fail(SSM_ERROR_INVALID_ARGUMENT, "params: must not be NULL");
  if (p->struct_size < kParamsV0Size)
    return fail(SSM_ERROR_INVALID_ARGUMENT,
                "params: struct_size is %zu, expected at least %zu "
                "(set it to sizeof(ssm_selective_state_update_params))",
                p->struct_size, kParamsV0Size);
  a.dt_softplus = p->dt_softplus != 0;
  return SSM_SUCCESS;
}

// state fixes the layout (by its ndim) and nheads, headdim, dstate and batch_state.
ssm_status check_state(Call& c, DLTensor* state) {
  StateUpdateArgs& a = c.a;
  TensorArg s;
  SSM_RETURN_IF_ERROR(
      c.ck.add(state, "state", true, DtypeRule::AnyFloat, Role::Output, &s));
  char got[128];
  if (s.ndim() != 3 && s.ndim() != 4)
    return fail(SSM_ERROR_SHAPE,
                "state: expected shape (batch_state, dim, dstate) (Mamba-1) or (batch_state, "
                "nheads, headdim, dstate) (Mamba-2), got %s",
                format_shape(got, sizeof got, s.t->shape, s.ndim() < 8 ? s.ndim() : 8));
  c.mamba2 = s.ndim() == 4;
  a.batch_state = s.size(0);
  a.nheads = c.mamba2 ? s.size(1) : 1;
  a.headdim = s.size(s.ndim() - 2);
  a.dstate = s.size(s.ndim() - 1);
  if (a.dstate < 1)
    return fail(SSM_ERROR_SHAPE, "state: dstate (its last axis) must be at least 1, got shape %s",
                format_shape(got, sizeof got, s.t->shape, s.ndim()));
  if (a.dstate > kMaxDstate)
    return fail(SSM_ERROR_UNSUPPORTED, "state: dstate is %lld; libssm supports dstate up to %lld",
                (long long)a.dstate, (long long)kMaxDstate);
  a.state = c.mamba2 ? s.ref({0, 1, 2, 3}) : s.ref({0, -1, 1, 2});
  return SSM_SUCCESS;
}

ssm_status check_tensor(Call& c, const DLTensor* t, const char* name, bool required,
                        DtypeRule rule, Role role, Shape shape, TensorRef* ref) {
  TensorArg x;
  SSM_RETURN_IF_ERROR(c.ck.add(t, name, required, rule, role, &x));
  if (!x.present()) return SSM_SUCCESS;
  const StateUpdateArgs& a = c.a;
  const bool m2 = c.mamba2;
  // batch is -1 (any) until x, the first row-shaped tensor, has fixed it.
  switch (shape) {
    case Shape::Rows:
      SSM_RETURN_IF_ERROR(
          m2 ? c.ck.expect_shape(x, {"batch", "nheads", "headdim"}, {a.batch, a.nheads, a.headdim})
             : c.ck.expect_shape(x, {"batch", "dim"}, {a.batch, a.headdim}));
      *ref = m2 ? x.ref({0, 1, 2}) : x.ref({0, -1, 1});
      break;
    case Shape::AMatrix:
      SSM_RETURN_IF_ERROR(m2 ? c.ck.expect_shape(x, {"nheads", "headdim", "dstate"},
                                                 {a.nheads, a.headdim, a.dstate})
                             : c.ck.expect_shape(x, {"dim", "dstate"}, {a.headdim, a.dstate}));
      *ref = m2 ? x.ref({0, 1, 2}) : x.ref({-1, 0, 1});
      break;
    case Shape::Groups:
      // ngroups is -1 (any) until B has fixed it; C must then agree.
      SSM_RETURN_IF_ERROR(m2 ? c.ck.expect_shape(x, {"batch", "ngroups", "dstate"},
                                                 {a.batch, a.ngroups, a.dstate})
                             : c.ck.expect_shape(x, {"batch", "dstate"}, {a.batch, a.dstate}));
      *ref = m2 ? x.ref({0, 1, 2}) : x.ref({0, -1, 1});
      break;
    case Shape::Channel:
      SSM_RETURN_IF_ERROR(
          m2 ? c.ck.expect_shape(x, {"nheads", "headdim"}, {a.nheads, a.headdim})
             : c.ck.expect_shape(x, {"dim"}, {a.headdim}));
      *ref = m2 ? x.ref({0, 1}) : x.ref({-1, 0});
      break;
    case Shape::Indices:
      SSM_RETURN_IF_ERROR(c.ck.expect_shape(x, {"batch"}, {a.batch}));
      *ref = x.ref({0});
      break;
  }
  return SSM_SUCCESS;
}

ssm_status check_batch_and_groups(Call& c, const DLTensor* x, const DLTensor* B) {
  StateUpdateArgs& a = c.a;
  a.batch = -1;
  SSM_RETURN_IF_ERROR(check_tensor(c, x, "x", true, DtypeRule::AnyFloat, Role::Input,
                                   Shape::Rows, &a.x));
  a.batch = x->shape[0];
  a.ngroups = c.mamba2 ? -1 : 1;
  SSM_RETURN_IF_ERROR(check_tensor(c, B, "B", true, DtypeRule::AnyFloat, Role::Input,
                                   Shape::Groups, &a.B));
  if (c.mamba2) {
    a.ngroups = B->shape[1];
    if (a.ngroups < 1 || a.nheads % a.ngroups != 0)
      return fail(SSM_ERROR_SHAPE,
                  "B: ngroups (axis 1) is %lld, which does not divide nheads %lld (state's "
                  "axis 1)",
                  (long long)a.ngroups, (long long)a.nheads);
  }
  return SSM_SUCCESS;
}

ssm_status state_update(const ssm_selective_state_update_params* params, DLTensor* state,
                        const DLTensor* x, const DLTensor* dt, const DLTensor* A,
                        const DLTensor* B, const DLTensor* C, const DLTensor* D,
                        const DLTensor* z, const DLTensor* dt_bias,
                        const DLTensor* state_batch_indices, DLTensor* out, void* stream) {
  Call c;
  StateUpdateArgs& a = c.a;
  SSM_RETURN_IF_ERROR(check_params(params, a));
  SSM_RETURN_IF_ERROR(check_state(c, state));
  SSM_RETURN_IF_ERROR(check_batch_and_groups(c, x, B));
  const auto in = Role::Input;
  const auto any = DtypeRule::AnyFloat;
  SSM_RETURN_IF_ERROR(check_tensor(c, dt, "dt", true, any, in, Shape::Rows, &a.dt));
  SSM_RETURN_IF_ERROR(check_tensor(c, A, "A", true, any, in, Shape::AMatrix, &a.A));
  SSM_RETURN_IF_ERROR(check_tensor(c, C, "C", true, any, in, Shape::Groups, &a.C));
  SSM_RETURN_IF_ERROR(check_tensor(c, D, "D", false, any, in, Shape::Channel, &a.D));
  SSM_RETURN_IF_ERROR(check_tensor(c, z, "z", false, any, in, Shape::Rows, &a.z));
  SSM_RETURN_IF_ERROR(
      check_tensor(c, dt_bias, "dt_bias", false, any, in, Shape::Channel, &a.dt_bias));
  SSM_RETURN_IF_ERROR(check_tensor(c, state_batch_indices, "state_batch_indices", false,
                                   DtypeRule::Index, in, Shape::Indices,
                                   &a.state_batch_indices));
  SSM_RETURN_IF_ERROR(
      check_tensor(c, out, "out", true, any, Role::Output, Shape::Rows, &a.out));
  if (state_batch_indices == nullptr && a.batch_state < a.batch)
    return fail(SSM_ERROR_SHAPE,
                "state: batch_state (axis 0) is %lld, less than batch %lld (x's axis 0); "
                "without state_batch_indices row b updates state[b]",
                (long long)a.batch_state, (long long)a.batch);
  SSM_RETURN_IF_ERROR(c.ck.check_memory());
  a.heads_per_group = a.nheads == 0 ? 1 : a.nheads / a.ngroups;

  const bool empty = a.batch == 0 || a.nheads == 0 || a.headdim == 0;
  if (!c.ck.on_cuda()) return empty ? SSM_SUCCESS : selective_state_update_cpu(a);
#ifdef SSM_WITH_CUDA
  if (empty) return SSM_SUCCESS;
  return selective_state_update_cuda(a, c.ck.device_id(), stream);
#else
  (void)stream;
  return fail_no_cuda();
#endif
}

}  // namespace
}  // namespace ssm

extern "C" {

SSM_API ssm_status ssm_selective_state_update(const ssm_selective_state_update_params* params,
                                              DLTensor* state, const DLTensor* x,
                                              const DLTensor* dt, const DLTensor* A,
                                              const DLTensor* B, const DLTensor* C,
                                              const DLTensor* D, const DLTensor* z,
                                              const DLTensor* dt_bias,
                                              const DLTensor* state_batch_indices, DLTensor* out,
                                              void* stream) {
  return ssm::guarded("ssm_selective_state_update", [&] {
    return ssm::state_update(params, state, x, dt, A, B, C, D, z, dt_bias, state_batch_indices,
                             out, stream);
  });
}

}  // extern "C"
