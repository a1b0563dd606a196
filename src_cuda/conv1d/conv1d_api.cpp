// The C entry points of conv1d.h: validate every argument (common/dlpack_check.h), fill
// Conv1dArgs or Conv1dUpdateArgs, then dispatch by device to the CPU reference or the CUDA
// launchers. Nothing is written before every check has passed.
#include <cstddef>
#include <cstdint>

#include "common/api_guard.h"
#include "common/dlpack_check.h"
#include "common/entry_checks.h"
#include "conv1d/conv1d_args.h"
#include "libssm/conv1d.h"

namespace ssm {
namespace {

// The bytes of version 0 of the params struct; later versions append fields after these.
constexpr size_t kParamsV0Size = offsetof(ssm_causal_conv1d_params, activation) + sizeof(int32_t);
constexpr const char* kWorkspaceQuery = "ssm_causal_conv1d_bwd_workspace_size";

// The shapes a tensor argument of the conv can take.
enum class Shape {
  Seq,       // (batch, dim, seqlen): x, out, dout, dx
  States,    // (batch, dim, width-1): initial/final states and their gradients
  Channels,  // (dim,): bias, dbias
  Weight,    // (dim, width): dweight
  SeqIdx     // (batch, seqlen)
};

// One call being checked: the tensors seen so far and the description being filled.
struct Call {
  TensorChecker ck;
  Conv1dArgs a;
};

ssm_status check_params(const ssm_causal_conv1d_params* p, bool* silu) {
  if (p == nullptr) return fail(SSM_ERROR_INVALID_ARGUMENT, "params: must not be NULL");
  if (p->struct_size < kParamsV0Size)
    return fail(SSM_ERROR_INVALID_ARGUMENT,
                "params: struct_size is %zu, expected at least %zu "
                "(set it to sizeof(ssm_causal_conv1d_params))",
                p->struct_size, kParamsV0Size);
  if (p->activation != SSM_CONV1D_NONE && p->activation != SSM_CONV1D_SILU)
    return fail(SSM_ERROR_INVALID_ARGUMENT,
                "params: activation is %d, expected SSM_CONV1D_NONE (0) or SSM_CONV1D_SILU (1)",
                int(p->activation));
  *silu = p->activation == SSM_CONV1D_SILU;
  return SSM_SUCCESS;
}

// x, out, dout and dx share x's dtype: the kernels are specialised for one activation dtype.
ssm_status check_same_dtype(const TensorArg& t, Dtype x_dtype) {
  if (t.dtype == x_dtype) return SSM_SUCCESS;
  return fail(SSM_ERROR_DTYPE, "%s: expected dtype %s (x's dtype), got %s", t.name,
              dtype_name(x_dtype), dtype_name(t.dtype));
}

ssm_status check_tensor(Call& c, const DLTensor* t, const char* name, bool required,
                        DtypeRule rule, Role role, Shape shape, TensorRef* ref) {
  TensorArg x;
  SSM_RETURN_IF_ERROR(c.ck.add(t, name, required, rule, role, &x));
  if (!x.present()) return SSM_SUCCESS;
  const Conv1dArgs& a = c.a;
  switch (shape) {
    case Shape::Seq:
      SSM_RETURN_IF_ERROR(
          c.ck.expect_shape(x, {"batch", "dim", "seqlen"}, {a.batch, a.dim, a.seqlen}));
      SSM_RETURN_IF_ERROR(check_same_dtype(x, a.x.dtype));
      *ref = x.ref({0, 1, 2});
      break;
    case Shape::States:
      SSM_RETURN_IF_ERROR(
          c.ck.expect_shape(x, {"batch", "dim", "width-1"}, {a.batch, a.dim, a.width - 1}));
      *ref = x.ref({0, 1, 2});
      break;
    case Shape::Channels:
      SSM_RETURN_IF_ERROR(c.ck.expect_shape(x, {"dim"}, {a.dim}));
      *ref = x.ref({0});
      break;
    case Shape::Weight:
      SSM_RETURN_IF_ERROR(c.ck.expect_shape(x, {"dim", "width"}, {a.dim, a.width}));
      *ref = x.ref({0, 1});
      break;
    case Shape::SeqIdx:
      SSM_RETURN_IF_ERROR(c.ck.expect_shape(x, {"batch", "seqlen"}, {a.batch, a.seqlen}));
      *ref = x.ref({0, 1});
      break;
  }
  return SSM_SUCCESS;
}

// A gradient output: optional, and only meaningful if its input is given.
ssm_status check_grad(Call& c, const DLTensor* t, const char* name, const DLTensor* input,
                      const char* input_name, Shape shape, TensorRef* ref) {
  if (t != nullptr && input == nullptr)
    return fail(SSM_ERROR_INVALID_ARGUMENT,
                "%s: given, but %s is NULL; a gradient needs its input", name, input_name);
  return check_tensor(c, t, name, false, DtypeRule::AnyFloat, Role::Output, shape, ref);
}

// The width of weight (dim, width) against the kernels' range; dim must be known.
ssm_status check_width(const TensorArg& w, int* width) {
  const int64_t n = w.size(1);
  if (n < kConv1dMinWidth || n > kConv1dMaxWidth)
    return fail(SSM_ERROR_UNSUPPORTED, "weight: width is %lld; libssm supports widths %d to %d",
                (long long)n, kConv1dMinWidth, kConv1dMaxWidth);
  *width = int(n);
  return SSM_SUCCESS;
}

// params, x and weight: what every whole-sequence entry point, the size query included, takes.
ssm_status check_core(Call& c, const ssm_causal_conv1d_params* params, const DLTensor* x,
                      const DLTensor* weight) {
  Conv1dArgs& a = c.a;
  SSM_RETURN_IF_ERROR(check_params(params, &a.silu));
  TensorArg xa;
  SSM_RETURN_IF_ERROR(c.ck.add(x, "x", true, DtypeRule::AnyFloat, Role::Input, &xa));
  SSM_RETURN_IF_ERROR(c.ck.expect_shape(xa, {"batch", "dim", "seqlen"}, {-1, -1, -1}));
  a.batch = xa.size(0);
  a.dim = xa.size(1);
  a.seqlen = xa.size(2);
  a.x = xa.ref({0, 1, 2});

  TensorArg wa;
  SSM_RETURN_IF_ERROR(c.ck.add(weight, "weight", true, DtypeRule::AnyFloat, Role::Input, &wa));
  SSM_RETURN_IF_ERROR(c.ck.expect_shape(wa, {"dim", "width"}, {a.dim, -1}));
  SSM_RETURN_IF_ERROR(check_width(wa, &a.width));
  a.weight = wa.ref({0, 1});
  return SSM_SUCCESS;
}

// Workspace bytes the backward needs on the tensors' device: none on the CPU. The size depends
// only on what the size query sees (params, x, weight), so its answer is exactly what the
// backward then demands.
ssm_status workspace_needed(const Call& c, size_t* bytes) {
  *bytes = 0;
  if (!c.ck.on_cuda()) return SSM_SUCCESS;
#ifdef SSM_WITH_CUDA
  Conv1dArgs seen;
  const Conv1dArgs& a = c.a;
  seen.batch = a.batch;
  seen.dim = a.dim;
  seen.seqlen = a.seqlen;
  seen.width = a.width;
  seen.silu = a.silu;
  seen.x = a.x;
  seen.weight = a.weight;
  *bytes = conv1d_bwd_cuda_workspace(seen, c.ck.device_id());
  return SSM_SUCCESS;
#else
  return fail_no_cuda();
#endif
}

ssm_status workspace_size(const ssm_causal_conv1d_params* params, const DLTensor* x,
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

// bias, initial_states and seq_idx: the optional inputs the forward and backward share.
ssm_status check_optional_inputs(Call& c, const DLTensor* bias, const DLTensor* initial_states,
                                 const DLTensor* seq_idx) {
  Conv1dArgs& a = c.a;
  const auto in = Role::Input;
  SSM_RETURN_IF_ERROR(check_tensor(c, bias, "bias", false, DtypeRule::AnyFloat, in,
                                   Shape::Channels, &a.bias));
  SSM_RETURN_IF_ERROR(check_tensor(c, initial_states, "initial_states", false,
                                   DtypeRule::AnyFloat, in, Shape::States, &a.initial_states));
  SSM_RETURN_IF_ERROR(check_tensor(c, seq_idx, "seq_idx", false, DtypeRule::Index, in,
                                   Shape::SeqIdx, &a.seq_idx));
  if (a.seq_idx.present() && a.seq_idx.dtype != Dtype::I32)
    return fail(SSM_ERROR_DTYPE, "seq_idx: expected dtype int32, got %s",
                dtype_name(a.seq_idx.dtype));
  return SSM_SUCCESS;
}

ssm_status forward(const ssm_causal_conv1d_params* params, const DLTensor* x,
                   const DLTensor* weight, const DLTensor* bias, const DLTensor* initial_states,
                   const DLTensor* seq_idx, DLTensor* out, DLTensor* final_states,
                   void* stream) {
  Call c;
  Conv1dArgs& a = c.a;
  SSM_RETURN_IF_ERROR(check_core(c, params, x, weight));
  SSM_RETURN_IF_ERROR(check_optional_inputs(c, bias, initial_states, seq_idx));
  const auto out_role = Role::Output;
  SSM_RETURN_IF_ERROR(
      check_tensor(c, out, "out", true, DtypeRule::AnyFloat, out_role, Shape::Seq, &a.out));
  SSM_RETURN_IF_ERROR(check_tensor(c, final_states, "final_states", false, DtypeRule::AnyFloat,
                                   out_role, Shape::States, &a.final_states));
  SSM_RETURN_IF_ERROR(c.ck.check_memory());

  if (!c.ck.on_cuda()) return conv1d_fwd_cpu(a);
#ifdef SSM_WITH_CUDA
  return conv1d_fwd_cuda(a, c.ck.device_id(), stream);
#else
  (void)stream;
  return fail_no_cuda();
#endif
}

ssm_status backward(const ssm_causal_conv1d_params* params, const DLTensor* x,
                    const DLTensor* weight, const DLTensor* bias,
                    const DLTensor* initial_states, const DLTensor* seq_idx,
                    const DLTensor* dout, const DLTensor* dfinal_states, DLTensor* dx,
                    DLTensor* dweight, DLTensor* dbias, DLTensor* dinitial_states,
                    void* workspace, size_t workspace_bytes, void* stream) {
  Call c;
  Conv1dArgs& a = c.a;
  SSM_RETURN_IF_ERROR(check_core(c, params, x, weight));
  SSM_RETURN_IF_ERROR(check_optional_inputs(c, bias, initial_states, seq_idx));
  const auto any = DtypeRule::AnyFloat;
  SSM_RETURN_IF_ERROR(check_tensor(c, dout, "dout", true, any, Role::Input, Shape::Seq, &a.dout));
  SSM_RETURN_IF_ERROR(check_tensor(c, dfinal_states, "dfinal_states", false, any, Role::Input,
                                   Shape::States, &a.dfinal_states));
  SSM_RETURN_IF_ERROR(check_tensor(c, dx, "dx", false, any, Role::Output, Shape::Seq, &a.dx));
  SSM_RETURN_IF_ERROR(check_tensor(c, dweight, "dweight", false, any, Role::Output,
                                   Shape::Weight, &a.dweight));
  SSM_RETURN_IF_ERROR(check_grad(c, dbias, "dbias", bias, "bias", Shape::Channels, &a.dbias));
  SSM_RETURN_IF_ERROR(check_grad(c, dinitial_states, "dinitial_states", initial_states,
                                 "initial_states", Shape::States, &a.dinitial_states));
  SSM_RETURN_IF_ERROR(c.ck.check_memory());
  size_t needed = 0;
  SSM_RETURN_IF_ERROR(workspace_needed(c, &needed));
  SSM_RETURN_IF_ERROR(check_workspace(workspace, workspace_bytes, needed, kWorkspaceQuery));

  if (!c.ck.on_cuda()) return conv1d_bwd_cpu(a);
#ifdef SSM_WITH_CUDA
  return conv1d_bwd_cuda(a, c.ck.device_id(), workspace, stream);
#else
  (void)stream;
  return fail_cuda_dispatch_without_cuda();
#endif
}

// x and out of the decode step: (batch, dim) or (batch, dim, seqlen), seen as 3-d.
ssm_status check_step_tensor(TensorChecker& ck, const TensorArg& t, const Conv1dUpdateArgs& a,
                             bool two_d, TensorRef* ref) {
  if (two_d) {
    SSM_RETURN_IF_ERROR(ck.expect_shape(t, {"batch", "dim"}, {a.batch, a.dim}));
    *ref = t.ref({0, 1, -1});
  } else {
    SSM_RETURN_IF_ERROR(
        ck.expect_shape(t, {"batch", "dim", "seqlen"}, {a.batch, a.dim, a.seqlen}));
    *ref = t.ref({0, 1, 2});
  }
  return SSM_SUCCESS;
}

ssm_status update(const ssm_causal_conv1d_params* params, const DLTensor* x,
                  DLTensor* conv_state, const DLTensor* weight, const DLTensor* bias,
                  const DLTensor* cache_seqlens, const DLTensor* conv_state_indices,
                  DLTensor* out, void* stream) {
  TensorChecker ck;
  Conv1dUpdateArgs a;
  SSM_RETURN_IF_ERROR(check_params(params, &a.silu));
  const auto any = DtypeRule::AnyFloat;
  const auto in = Role::Input;

  TensorArg xa;
  SSM_RETURN_IF_ERROR(ck.add(x, "x", true, any, in, &xa));
  const bool two_d = xa.ndim() == 2;
  if (two_d) {
    SSM_RETURN_IF_ERROR(ck.expect_shape(xa, {"batch", "dim"}, {-1, -1}));
    a.seqlen = 1;
  } else {
    SSM_RETURN_IF_ERROR(ck.expect_shape(xa, {"batch", "dim", "seqlen"}, {-1, -1, -1}));
    a.seqlen = xa.size(2);
  }
  a.batch = xa.size(0);
  a.dim = xa.size(1);
  a.x = two_d ? xa.ref({0, 1, -1}) : xa.ref({0, 1, 2});

  TensorArg wa;
  SSM_RETURN_IF_ERROR(ck.add(weight, "weight", true, any, in, &wa));
  SSM_RETURN_IF_ERROR(ck.expect_shape(wa, {"dim", "width"}, {a.dim, -1}));
  SSM_RETURN_IF_ERROR(check_width(wa, &a.width));
  a.weight = wa.ref({0, 1});

  TensorArg sa;
  SSM_RETURN_IF_ERROR(ck.add(conv_state, "conv_state", true, any, Role::Output, &sa));
  SSM_RETURN_IF_ERROR(
      ck.expect_shape(sa, {"batch_state", "dim", "state_len"}, {-1, a.dim, -1}));
  a.batch_state = sa.size(0);
  a.state_len = sa.size(2);
  if (a.state_len < a.width - 1)
    return fail(SSM_ERROR_SHAPE,
                "conv_state: state_len is %lld, but width %d needs at least %d (width-1)",
                (long long)a.state_len, a.width, a.width - 1);
  a.conv_state = sa.ref({0, 1, 2});

  TensorArg ba, qa, ia, oa;
  SSM_RETURN_IF_ERROR(ck.add(bias, "bias", false, any, in, &ba));
  if (ba.present()) {
    SSM_RETURN_IF_ERROR(ck.expect_shape(ba, {"dim"}, {a.dim}));
    a.bias = ba.ref({0});
  }
  SSM_RETURN_IF_ERROR(ck.add(cache_seqlens, "cache_seqlens", false, DtypeRule::Index, in, &qa));
  if (qa.present()) {
    SSM_RETURN_IF_ERROR(ck.expect_shape(qa, {"batch"}, {a.batch}));
    a.cache_seqlens = qa.ref({0});
  }
  SSM_RETURN_IF_ERROR(
      ck.add(conv_state_indices, "conv_state_indices", false, DtypeRule::Index, in, &ia));
  if (ia.present()) {
    SSM_RETURN_IF_ERROR(ck.expect_shape(ia, {"batch"}, {a.batch}));
    a.conv_state_indices = ia.ref({0});
  } else if (a.batch_state < a.batch) {
    return fail(SSM_ERROR_SHAPE,
                "conv_state: batch_state is %lld, below x's batch %lld; without "
                "conv_state_indices row b uses state row b",
                (long long)a.batch_state, (long long)a.batch);
  }
  SSM_RETURN_IF_ERROR(ck.add(out, "out", true, any, Role::Output, &oa));
  if (oa.ndim() != xa.ndim())
    return fail(SSM_ERROR_SHAPE, "out: expected ndim %d like x, got %d", xa.ndim(), oa.ndim());
  SSM_RETURN_IF_ERROR(check_step_tensor(ck, oa, a, two_d, &a.out));
  SSM_RETURN_IF_ERROR(check_same_dtype(oa, a.x.dtype));
  SSM_RETURN_IF_ERROR(ck.check_memory());

  if (!ck.on_cuda()) return conv1d_update_cpu(a);
#ifdef SSM_WITH_CUDA
  return conv1d_update_cuda(a, ck.device_id(), stream);
#else
  (void)stream;
  return fail_no_cuda();
#endif
}

}  // namespace
}  // namespace ssm

extern "C" {

SSM_API ssm_status ssm_causal_conv1d_fwd(const ssm_causal_conv1d_params* params,
                                         const DLTensor* x, const DLTensor* weight,
                                         const DLTensor* bias, const DLTensor* initial_states,
                                         const DLTensor* seq_idx, DLTensor* out,
                                         DLTensor* final_states, void* stream) {
  return ssm::guarded("ssm_causal_conv1d_fwd", [&] {
    return ssm::forward(params, x, weight, bias, initial_states, seq_idx, out, final_states,
                        stream);
  });
}

SSM_API ssm_status ssm_causal_conv1d_bwd_workspace_size(const ssm_causal_conv1d_params* params,
                                                        const DLTensor* x,
                                                        const DLTensor* weight, size_t* bytes) {
  return ssm::guarded("ssm_causal_conv1d_bwd_workspace_size",
                      [&] { return ssm::workspace_size(params, x, weight, bytes); });
}

SSM_API ssm_status ssm_causal_conv1d_bwd(const ssm_causal_conv1d_params* params,
                                         const DLTensor* x, const DLTensor* weight,
                                         const DLTensor* bias, const DLTensor* initial_states,
                                         const DLTensor* seq_idx, const DLTensor* dout,
                                         const DLTensor* dfinal_states, DLTensor* dx,
                                         DLTensor* dweight, DLTensor* dbias,
                                         DLTensor* dinitial_states, void* workspace,
                                         size_t workspace_bytes, void* stream) {
  return ssm::guarded("ssm_causal_conv1d_bwd", [&] {
    return ssm::backward(params, x, weight, bias, initial_states, seq_idx, dout, dfinal_states,
                         dx, dweight, dbias, dinitial_states, workspace, workspace_bytes,
                         stream);
  });
}

SSM_API ssm_status ssm_causal_conv1d_update(const ssm_causal_conv1d_params* params,
                                            const DLTensor* x, DLTensor* conv_state,
                                            const DLTensor* weight, const DLTensor* bias,
                                            const DLTensor* cache_seqlens,
                                            const DLTensor* conv_state_indices, DLTensor* out,
                                            void* stream) {
  return ssm::guarded("ssm_causal_conv1d_update", [&] {
    return ssm::update(params, x, conv_state, weight, bias, cache_seqlens, conv_state_indices,
                       out, stream);
  });
}

}  // extern "C"
