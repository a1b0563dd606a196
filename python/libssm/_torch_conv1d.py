"""The causal conv1d for torch (re-exported by libssm.torch): the direct calls (fwd, bwd, update),
the custom ops libssm::causal_conv1d_fwd, libssm::causal_conv1d_bwd and
libssm::causal_conv1d_update (which mutates conv_state) with fake implementations and autograd,
and causal_conv1d_fn / causal_conv1d_update with causal-conv1d's signatures.

As for the other families, eager calls skip the dispatcher and call the direct implementation,
through an autograd.Function when a gradient is wanted; torch.compile and other tensor
subclasses go through the registered ops; both share one gradient formula. libssm.causal_conv1d,
causal_conv1d_bwd and causal_conv1d_update on tensors call fwd, bwd and update here, or the
compiled_* functions while torch.compile traces."""

from typing import List, Optional, Tuple

import torch
from torch import Tensor

from . import _torch_direct as _direct
from . import conv1d as _conv1d
from ._torch_direct import describe

__all__ = ["causal_conv1d_fn", "causal_conv1d_update"]

_empty = torch.empty
_empty_like = torch.empty_like
_contiguous = torch.contiguous_format


def _final_states_shape(x, weight):
    """(batch, dim, width-1), or None when x or weight has the wrong rank (the library then
    names it)."""
    if x.dim() != 3 or weight.dim() != 2 or weight.shape[1] < 1:
        return None
    return (x.shape[0], x.shape[1], weight.shape[1] - 1)


def fwd(x, weight, bias, seq_idx, initial_states, return_final_states, silu, out=None,
        final_states_out=None):
    """(out, final_states or None). out and final_states_out: buffers to write, or None to
    allocate (out like x, in x's layout; final_states in x's dtype)."""
    st = _direct.state()
    slots = st.slots
    keep, params = _conv1d.params(st.library, silu)
    if out is None:
        out = _empty_like(x)
    final = final_states_out
    if final is None and return_final_states:
        shape = _final_states_shape(x, weight)
        if shape is not None:
            final = _empty(shape, dtype=x.dtype, device=x.device)
    status = st.lib.ssm_causal_conv1d_fwd(
        params, describe(slots, 0, "x", x), describe(slots, 1, "weight", weight),
        describe(slots, 2, "bias", bias), describe(slots, 3, "initial_states", initial_states),
        describe(slots, 4, "seq_idx", seq_idx), describe(slots, 5, "out", out),
        describe(slots, 6, "final_states", final), _direct.stream(x))
    if status:
        st.library.raise_for(status)
    return out, final


def bwd(x, weight, bias, seq_idx, initial_states, dout, dfinal_states, silu, needs,
        dx_out=None):
    """(dx, dweight, dbias, dinitial_states), None where needs (4 bools) leaves one out; dx in
    x's layout, or written into dx_out when given (a caller's slice of a larger gradient)."""
    need_dx, need_dweight, need_dbias, need_dinit = needs
    st = _direct.state()
    slots = st.slots
    keep, params = _conv1d.params(st.library, silu)
    dx = (dx_out if dx_out is not None else _empty_like(x)) if need_dx else None
    dweight = _empty_like(weight, memory_format=_contiguous) if need_dweight else None
    dbias = _empty_like(bias, memory_format=_contiguous) if need_dbias else None
    dinit = _empty_like(initial_states, memory_format=_contiguous) if need_dinit else None
    args = (params, describe(slots, 0, "x", x), describe(slots, 1, "weight", weight),
            describe(slots, 2, "bias", bias),
            describe(slots, 3, "initial_states", initial_states),
            describe(slots, 4, "seq_idx", seq_idx), describe(slots, 5, "dout", dout),
            describe(slots, 6, "dfinal_states", dfinal_states), describe(slots, 7, "dx", dx),
            describe(slots, 8, "dweight", dweight), describe(slots, 9, "dbias", dbias),
            describe(slots, 10, "dinitial_states", dinit))
    lib = st.lib
    _direct.run(st, lib.ssm_causal_conv1d_bwd, lib.ssm_causal_conv1d_bwd_workspace_size,
                args[:3], args, x)
    return dx, dweight, dbias, dinit


def update(x, conv_state, weight, bias, silu, cache_seqlens, conv_state_indices, out=None):
    """out of one decode step (conv_state updated in place); out: a buffer, or None."""
    st = _direct.state()
    slots = st.slots
    keep, params = _conv1d.params(st.library, silu)
    if out is None:
        out = _empty_like(x, memory_format=_contiguous)
    status = st.lib.ssm_causal_conv1d_update(
        params, describe(slots, 0, "x", x), describe(slots, 1, "conv_state", conv_state),
        describe(slots, 2, "weight", weight), describe(slots, 3, "bias", bias),
        describe(slots, 4, "cache_seqlens", cache_seqlens),
        describe(slots, 5, "conv_state_indices", conv_state_indices),
        describe(slots, 6, "out", out), _direct.stream(x))
    if status:
        st.library.raise_for(status)
    return out


# ---------------------------------------------------------------------------------------------
# The registered ops. Absent outputs are empty tensors (a custom op returns no None).


@torch.library.custom_op("libssm::causal_conv1d_fwd", mutates_args=())
def causal_conv1d_fwd(x: Tensor, weight: Tensor, bias: Optional[Tensor],
                      seq_idx: Optional[Tensor], initial_states: Optional[Tensor],
                      return_final_states: bool, silu: bool) -> Tuple[Tensor, Tensor]:
    """(out, final_states), as fwd; final_states is empty when not asked for."""
    out, final = fwd(x, weight, bias, seq_idx, initial_states, return_final_states, silu)
    return out, x.new_empty((0,)) if final is None else final


@causal_conv1d_fwd.register_fake
def _causal_conv1d_fwd_fake(x, weight, bias, seq_idx, initial_states, return_final_states,
                            silu):
    shape = _final_states_shape(x, weight) if return_final_states else None
    return _empty_like(x), x.new_empty((0,) if shape is None else shape)


@torch.library.custom_op("libssm::causal_conv1d_bwd", mutates_args=())
def causal_conv1d_bwd(x: Tensor, weight: Tensor, bias: Optional[Tensor],
                      seq_idx: Optional[Tensor], initial_states: Optional[Tensor], dout: Tensor,
                      dfinal_states: Optional[Tensor], silu: bool,
                      needs: List[bool]) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dx, dweight, dbias, dinitial_states) as bwd; each not asked for is an empty tensor and
    is not computed."""
    grads = bwd(x, weight, bias, seq_idx, initial_states, dout, dfinal_states, silu, needs)
    return tuple(x.new_empty((0,)) if g is None else g for g in grads)


@causal_conv1d_bwd.register_fake
def _causal_conv1d_bwd_fake(x, weight, bias, seq_idx, initial_states, dout, dfinal_states, silu,
                            needs):
    def like(t, wanted, **kw):
        return _empty_like(t, **kw) if wanted and t is not None else x.new_empty((0,))
    return (like(x, needs[0]), like(weight, needs[1], memory_format=_contiguous),
            like(bias, needs[2], memory_format=_contiguous),
            like(initial_states, needs[3], memory_format=_contiguous))


def _gradients(saved, silu, dout, dfinal_states, needs_input_grad, run_bwd):
    """Gradients of (x, weight, bias, initial_states), None where not needed, shared by the
    registered op's autograd and the eager autograd.Function; run_bwd is the custom op or the
    direct bwd. saved: (x, weight, bias, seq_idx, initial_states). dout or dfinal_states may
    be None (no gradient reached it)."""
    x, weight, bias, seq_idx, initial_states = saved
    need_dx, need_dw, need_db, need_dinit = needs_input_grad
    need_db = need_db and bias is not None
    need_dinit = need_dinit and initial_states is not None
    if not (need_dx or need_dw or need_db or need_dinit):
        return None, None, None, None
    if dout is None:
        dout = torch.zeros_like(x)
    dx, dweight, dbias, dinit = run_bwd(x, weight, bias, seq_idx, initial_states, dout,
                                        dfinal_states, silu,
                                        [need_dx, need_dw, need_db, need_dinit])
    return (dx if need_dx else None, dweight if need_dw else None, dbias if need_db else None,
            dinit if need_dinit else None)


def _setup_context(ctx, inputs, output):
    x, weight, bias, seq_idx, initial_states, return_final_states, silu = inputs
    ctx.save_for_backward(x, weight, bias, seq_idx, initial_states)
    ctx.silu = silu
    ctx.return_final_states = return_final_states


def _backward(ctx, dout, dfinal_states):
    needs = ctx.needs_input_grad
    dx, dweight, dbias, dinit = _gradients(
        ctx.saved_tensors, ctx.silu, dout,
        dfinal_states if ctx.return_final_states else None,
        (needs[0], needs[1], needs[2], needs[4]), torch.ops.libssm.causal_conv1d_bwd)
    return dx, dweight, dbias, None, dinit, None, None


causal_conv1d_fwd.register_autograd(_backward, setup_context=_setup_context)


class _Conv1dFunction(torch.autograd.Function):
    """The eager autograd path: same formula as the registered op, direct calls."""

    @staticmethod
    def forward(ctx, x, weight, bias, seq_idx, initial_states, return_final_states, silu):
        out, final = fwd(x, weight, bias, seq_idx, initial_states, return_final_states, silu)
        ctx.save_for_backward(x, weight, bias, seq_idx, initial_states)
        ctx.silu = silu
        ctx.set_materialize_grads(False)
        return (out, final) if return_final_states else out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, dfinal_states=None):
        needs = ctx.needs_input_grad
        dx, dweight, dbias, dinit = _gradients(ctx.saved_tensors, ctx.silu, dout, dfinal_states,
                                               (needs[0], needs[1], needs[2], needs[4]), bwd)
        return dx, dweight, dbias, None, dinit, None, None


def causal_conv1d_fn(x, weight, bias=None, seq_idx=None, initial_states=None,
                     return_final_states=False, final_states_out=None, activation=None):
    """causal-conv1d's causal_conv1d_fn: the causal depthwise conv1d (libssm/conv1d.h),
    differentiable in x, weight, bias and initial_states, and through final_states.

    x: (batch, dim, seqlen), contiguous along seqlen or channel-last (any strides work);
    weight: (dim, width), 2 <= width <= 8; bias: (dim,); seq_idx: (batch, seqlen) int32;
    initial_states: (batch, dim, width-1); activation: None, "silu" or "swish". Returns out
    (like x), or (out, final_states) when return_final_states, final_states (batch, dim,
    width-1) in x's dtype, written into final_states_out when given. CUDA work runs on torch's
    current stream."""
    silu = _conv1d.silu_of(activation)
    return_final_states = bool(return_final_states)
    path = _direct.path((x, weight, bias, seq_idx, initial_states))
    if path is _direct.DIRECT:
        out, final = fwd(x, weight, bias, seq_idx, initial_states, return_final_states, silu,
                         final_states_out=final_states_out if return_final_states else None)
        return (out, final) if return_final_states else out
    if path is _direct.AUTOGRAD:
        result = _Conv1dFunction.apply(x, weight, bias, seq_idx, initial_states,
                                       return_final_states, silu)
    else:
        out, final = torch.ops.libssm.causal_conv1d_fwd(x, weight, bias, seq_idx,
                                                        initial_states, return_final_states,
                                                        silu)
        result = (out, final) if return_final_states else out
    if return_final_states and final_states_out is not None:
        with torch.no_grad():
            final_states_out.copy_(result[1])
    return result


@torch.library.custom_op("libssm::causal_conv1d_update", mutates_args=("conv_state",))
def causal_conv1d_update_op(x: Tensor, conv_state: Tensor, weight: Tensor,
                            bias: Optional[Tensor], cache_seqlens: Optional[Tensor],
                            conv_state_indices: Optional[Tensor], silu: bool) -> Tensor:
    """out of one decode step, conv_state updated in place, as update."""
    return update(x, conv_state, weight, bias, silu, cache_seqlens, conv_state_indices)


@causal_conv1d_update_op.register_fake
def _causal_conv1d_update_fake(x, conv_state, weight, bias, cache_seqlens, conv_state_indices,
                               silu):
    return _empty_like(x, memory_format=_contiguous)


def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None, cache_seqlens=None,
                         conv_state_indices=None):
    """causal-conv1d's causal_conv1d_update: one decode step (libssm/conv1d.h). x: (batch, dim)
    or (batch, dim, seqlen) new tokens; conv_state: (batch_state, dim, state_len), state_len >=
    width-1, updated in place; weight, bias, activation as for causal_conv1d_fn;
    cache_seqlens: (batch,) int32, making conv_state a circular buffer; conv_state_indices:
    (batch,) int32, each row's state row (negative: a padding row, whose out is zeros and whose
    state is left alone). Returns out like x. Not differentiable (a decode step)."""
    silu = _conv1d.silu_of(activation)
    if _direct.path((x, conv_state, weight, bias, cache_seqlens,
                     conv_state_indices)) is _direct.DISPATCHER:
        return torch.ops.libssm.causal_conv1d_update(x, conv_state, weight, bias, cache_seqlens,
                                                     conv_state_indices, silu)
    return update(x, conv_state, weight, bias, silu, cache_seqlens, conv_state_indices)


# ---------------------------------------------------------------------------------------------
# libssm.causal_conv1d / causal_conv1d_bwd / causal_conv1d_update on tensors while torch.compile
# traces: the registered ops, which the compiler keeps in its graph, where the direct call
# would break it. A given out= is filled by a copy, the ops having no out= of their own.


def compiled_fwd(x, weight, bias, seq_idx, initial_states, return_final_states, silu, out):
    result, final = torch.ops.libssm.causal_conv1d_fwd(x, weight, bias, seq_idx, initial_states,
                                                       bool(return_final_states), bool(silu))
    if out is not None:
        result = out.copy_(result)
    return result, final if return_final_states else None


def compiled_bwd(x, weight, bias, seq_idx, initial_states, dout, dfinal_states, silu, needs):
    needs = [bool(n) for n in needs]
    grads = torch.ops.libssm.causal_conv1d_bwd(x, weight, bias, seq_idx, initial_states, dout,
                                               dfinal_states, bool(silu), needs)
    return tuple(g if w else None for g, w in zip(grads, needs))


def compiled_update(x, conv_state, weight, bias, silu, cache_seqlens, conv_state_indices, out):
    result = torch.ops.libssm.causal_conv1d_update(x, conv_state, weight, bias, cache_seqlens,
                                                   conv_state_indices, bool(silu))
    return result if out is None else out.copy_(result)
