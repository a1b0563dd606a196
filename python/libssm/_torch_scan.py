"""The selective scan for torch (re-exported by libssm.torch): the direct calls (fwd, bwd), the
differentiable function, and the custom ops.

The op is registered with torch.library as libssm::selective_scan_fwd and
libssm::selective_scan_bwd (custom ops with fake implementations and autograd), so it runs
under torch.compile(fullgraph=True) with no graph break and inside CUDA graphs. Eager calls skip
the dispatcher (it adds ~10-15 us a call) and call the direct implementation, through an
autograd.Function when a gradient is wanted; both paths share one gradient formula.
libssm.selective_scan and selective_scan_bwd on tensors under torch.compile call the ops
through compiled_fwd and compiled_bwd here, and on tensors in eager mode through fwd and bwd."""

from typing import List, Optional, Tuple

import torch
from torch import Tensor

from . import _torch_direct as _direct
from ._torch_direct import describe
from .errors import InvalidArgumentError
from .selective_scan import INPUT_NAMES, SelectiveScanGrads

__all__ = ["selective_scan"]

GRAD_NAMES = SelectiveScanGrads._fields
_empty = torch.empty
_empty_like = torch.empty_like
_float32 = torch.float32
_contiguous = torch.contiguous_format


def _run(st, kind, args, u):
    """Calls ssm_selective_scan_<kind>(*args, workspace, bytes, stream), where args starts
    (params, u, delta, A, B, C, ...)."""
    lib = st.lib
    if kind == "fwd":
        op, query = lib.ssm_selective_scan_fwd, lib.ssm_selective_scan_fwd_workspace_size
    else:
        op, query = lib.ssm_selective_scan_bwd, lib.ssm_selective_scan_bwd_workspace_size
    _direct.run(st, op, query, (args[0], args[1], args[3], args[4], args[5]), args, u)


def fwd(u, delta, A, B, C, D, z, delta_bias, initial_state, delta_softplus, return_last_state,
        out=None):
    """(out, last_state or None)."""
    st = _direct.state()
    slots = st.slots
    args = (st.library.scan_params[1 if delta_softplus else 0], describe(slots, 0, "u", u),
            describe(slots, 1, "delta", delta), describe(slots, 2, "A", A),
            describe(slots, 3, "B", B), describe(slots, 4, "C", C), describe(slots, 5, "D", D),
            describe(slots, 6, "z", z), describe(slots, 7, "delta_bias", delta_bias),
            describe(slots, 8, "initial_state", initial_state))
    if out is None:
        out = _empty_like(u, memory_format=_contiguous)
    last_state = None
    if return_last_state:
        try:
            shape = (u.shape[0], u.shape[1], A.shape[1])
        except IndexError:
            # The size query raises the library's message about u's or A's shape.
            _direct.workspace_size(st, st.lib.ssm_selective_scan_fwd_workspace_size,
                                   (args[0], args[1], args[3], args[4], args[5]))
            raise
        last_state = _empty(shape, dtype=_float32, device=u.device)
    args += (describe(slots, 9, "out", out), describe(slots, 10, "last_state", last_state))
    _run(st, "fwd", args, u)
    return out, last_state


def bwd(u, delta, A, B, C, dout, D, z, delta_bias, initial_state, dlast_state, delta_softplus,
        mask=None, out=None):
    """The 9 gradients (du, ddelta, dA, dB, dC, dD, dz, ddelta_bias, dinitial_state); an entry
    is None where its input is None or mask (9 bools) leaves it out, and is then not computed.
    out: 9 entries, a tensor to write that gradient into or None to allocate it."""
    st = _direct.state()
    slots = st.slots
    inputs = (u, delta, A, B, C, D, z, delta_bias, initial_state)
    args = [st.library.scan_params[1 if delta_softplus else 0]]
    for i, x in enumerate(inputs):
        args.append(describe(slots, i, INPUT_NAMES[i], x))
    args.append(describe(slots, 9, "dout", dout))
    args.append(describe(slots, 10, "dlast_state", dlast_state))
    grads = [None] * 9
    for i, x in enumerate(inputs):
        g = None if out is None else out[i]
        if g is None and x is not None and (mask is None or mask[i]):
            g = _empty_like(x, memory_format=_contiguous)
        # A buffer given for an absent input is passed on: the library refuses it, naming it.
        grads[i] = g
        args.append(describe(slots, 11 + i, GRAD_NAMES[i], g))
    _run(st, "bwd", args, u)
    return tuple(grads)


@torch.library.custom_op("libssm::selective_scan_fwd", mutates_args=())
def selective_scan_fwd(u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor,
                       D: Optional[Tensor], z: Optional[Tensor], delta_bias: Optional[Tensor],
                       initial_state: Optional[Tensor], delta_softplus: bool,
                       return_last_state: bool) -> Tuple[Tensor, Tensor]:
    """(out, last_state); last_state is an empty tensor unless return_last_state."""
    out, last_state = fwd(u, delta, A, B, C, D, z, delta_bias, initial_state, delta_softplus,
                          return_last_state)
    if last_state is None:
        last_state = u.new_empty((0,), dtype=torch.float32)
    return out, last_state


@selective_scan_fwd.register_fake
def _selective_scan_fwd_fake(u, delta, A, B, C, D, z, delta_bias, initial_state, delta_softplus,
                             return_last_state):
    last_shape = (u.shape[0], u.shape[1], A.shape[1]) if return_last_state else (0,)
    return u.new_empty(u.shape), u.new_empty(last_shape, dtype=torch.float32)


@torch.library.custom_op("libssm::selective_scan_bwd", mutates_args=())
def selective_scan_bwd(u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, dout: Tensor,
                       D: Optional[Tensor], z: Optional[Tensor], delta_bias: Optional[Tensor],
                       initial_state: Optional[Tensor], dlast_state: Optional[Tensor],
                       delta_softplus: bool, grad_mask: List[bool]
                       ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
                                  Tensor]:
    """(du, ddelta, dA, dB, dC, dD, dz, ddelta_bias, dinitial_state); an entry left out by
    grad_mask, or whose input is None, is an empty tensor and is not computed."""
    grads = bwd(u, delta, A, B, C, dout, D, z, delta_bias, initial_state, dlast_state,
                delta_softplus, grad_mask)
    return tuple(u.new_empty((0,)) if g is None else g for g in grads)


@selective_scan_bwd.register_fake
def _selective_scan_bwd_fake(u, delta, A, B, C, dout, D, z, delta_bias, initial_state,
                             dlast_state, delta_softplus, grad_mask):
    inputs = (u, delta, A, B, C, D, z, delta_bias, initial_state)
    return tuple(x.new_empty(x.shape) if x is not None and wanted else u.new_empty((0,))
                 for x, wanted in zip(inputs, grad_mask))


def _gradients(saved, dout, dlast_state, needs_input_grad, delta_softplus, run_bwd):
    """The 9 input gradients (None where not needed), shared by the registered op's autograd
    and the eager autograd.Function. run_bwd computes them: the custom op, or the direct call."""
    mask = [bool(need) and x is not None for need, x in zip(needs_input_grad, saved)]
    if not any(mask):
        return (None,) * 9
    u, delta, A, B, C, D, z, delta_bias, initial_state = saved
    if dout is None:  # only last_state reached the loss
        dout = torch.zeros_like(u)
    grads = run_bwd(u, delta, A, B, C, dout, D, z, delta_bias, initial_state, dlast_state,
                    delta_softplus, mask)
    return tuple(g if wanted else None for g, wanted in zip(grads, mask))


def _setup_context(ctx, inputs, output):
    *tensors, delta_softplus, return_last_state = inputs
    ctx.save_for_backward(*tensors)
    ctx.delta_softplus = delta_softplus
    ctx.return_last_state = return_last_state


def _backward(ctx, dout, dlast_state):
    grads = _gradients(ctx.saved_tensors, dout, dlast_state if ctx.return_last_state else None,
                       ctx.needs_input_grad[:9], ctx.delta_softplus,
                       torch.ops.libssm.selective_scan_bwd)
    return grads + (None, None)


selective_scan_fwd.register_autograd(_backward, setup_context=_setup_context)


class _SelectiveScanFunction(torch.autograd.Function):
    """The eager autograd path: same formula as the registered op, direct calls."""

    @staticmethod
    def forward(ctx, u, delta, A, B, C, D, z, delta_bias, initial_state, delta_softplus,
                return_last_state):
        out, last_state = fwd(u, delta, A, B, C, D, z, delta_bias, initial_state,
                              delta_softplus, return_last_state)
        ctx.save_for_backward(u, delta, A, B, C, D, z, delta_bias, initial_state)
        ctx.delta_softplus = delta_softplus
        ctx.set_materialize_grads(False)
        return (out, last_state) if return_last_state else out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, dlast_state=None):
        grads = _gradients(ctx.saved_tensors, dout, dlast_state, ctx.needs_input_grad[:9],
                           ctx.delta_softplus, bwd)
        return grads + (None, None)


def selective_scan(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False, *,
                   initial_state=None, return_last_state=False):
    """Selective scan (Mamba-1), differentiable in every tensor input (initial_state too); the
    gradient of last_state is honoured. Shapes as for libssm.selective_scan: u, delta, z
    (batch, dim, seqlen); A (dim, dstate) float32; B, C (batch, dstate, seqlen),
    (batch, groups, dstate, seqlen) or (dim, dstate); D, delta_bias (dim,) float32;
    initial_state (batch, dim, dstate). Returns out, or (out, last_state) when
    return_last_state. CUDA work runs on torch's current stream.

    The arguments up to delta_softplus may be positional, in the order of mamba_ssm's
    selective_scan_fn, so its call sites (`selective_scan_fn(u, delta, A, B, C, D, z,
    delta_bias, True)`) port unchanged; initial_state and return_last_state are keyword-only,
    so a call passing return_last_state positionally, as selective_scan_fn allows, fails
    instead of binding it to initial_state."""
    delta_softplus, return_last_state = bool(delta_softplus), bool(return_last_state)
    tensors = (u, delta, A, B, C, D, z, delta_bias, initial_state)
    path = _direct.path(tensors)
    if path is _direct.DIRECT:
        out, last_state = fwd(u, delta, A, B, C, D, z, delta_bias, initial_state,
                              delta_softplus, return_last_state)
    elif path is _direct.AUTOGRAD:
        return _SelectiveScanFunction.apply(u, delta, A, B, C, D, z, delta_bias, initial_state,
                                            delta_softplus, return_last_state)
    else:
        out, last_state = torch.ops.libssm.selective_scan_fwd(
            u, delta, A, B, C, D, z, delta_bias, initial_state, delta_softplus,
            return_last_state)
    return (out, last_state) if return_last_state else out


def compiled_fwd(u, delta, A, B, C, D, z, delta_bias, initial_state, delta_softplus,
                 return_last_state, out):
    """libssm.selective_scan on tensors while torch.compile traces: the registered op, which
    the compiler keeps in its graph, where the direct call would break it. (out, last_state or
    None); a given out is filled by a copy, the op having no out= of its own."""
    result, last_state = torch.ops.libssm.selective_scan_fwd(
        u, delta, A, B, C, D, z, delta_bias, initial_state, bool(delta_softplus),
        bool(return_last_state))
    if out is not None:
        result = out.copy_(result)
    return result, (last_state if return_last_state else None)


def compiled_bwd(u, delta, A, B, C, dout, D, z, delta_bias, initial_state, dlast_state,
                 delta_softplus, out):
    """libssm.selective_scan_bwd on tensors while torch.compile traces, as compiled_fwd: the
    9 gradients, those with a buffer in `out` (9 entries) copied into it."""
    inputs = (u, delta, A, B, C, D, z, delta_bias, initial_state)
    for x, buffer, name in zip(inputs, out, SelectiveScanGrads._fields):
        if x is None and buffer is not None:
            # The op would ignore the buffer; the eager path's library check refuses it.
            raise InvalidArgumentError("%s: given, but %s is None; a gradient needs its input"
                                       % (name, name[1:]))
    grads = torch.ops.libssm.selective_scan_bwd(
        u, delta, A, B, C, dout, D, z, delta_bias, initial_state, dlast_state,
        bool(delta_softplus), [x is not None for x in inputs])
    return tuple(None if x is None else g if buffer is None else buffer.copy_(g)
                 for x, g, buffer in zip(inputs, grads, out))
