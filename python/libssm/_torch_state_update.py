"""The selective-state decode step for torch (re-exported by libssm.torch): the direct call (fwd),
the custom op libssm::selective_state_update, which mutates its state argument, with a fake
implementation, and selective_state_update with mamba_ssm's signature.

Inference only: there is no autograd formula, as in mamba_ssm, whose decode kernel has none
either. Eager calls skip the dispatcher (~10-15 us a call, as much as the step itself at batch 1)
and call fwd directly; torch.compile and tensor subclasses go through the registered op, which
functionalisation sees mutating state. libssm.selective_state_update on tensors calls fwd here,
or compiled while torch.compile traces."""

from typing import Optional

import torch
from torch import Tensor

from . import _torch_direct as _direct
from . import state_update as _state_update
from ._torch_direct import describe

__all__ = ["selective_state_update"]

_empty_like = torch.empty_like
_contiguous = torch.contiguous_format


def fwd(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, state_batch_indices, out=None):
    """out (a new contiguous tensor like x unless given), with state updated in place."""
    st = _direct.state()
    slots = st.slots
    if out is None:
        out = _empty_like(x, memory_format=_contiguous)
    status = st.lib.ssm_selective_state_update(
        _state_update.params(st.library, dt_softplus), describe(slots, 0, "state", state),
        describe(slots, 1, "x", x), describe(slots, 2, "dt", dt), describe(slots, 3, "A", A),
        describe(slots, 4, "B", B), describe(slots, 5, "C", C), describe(slots, 6, "D", D),
        describe(slots, 7, "z", z), describe(slots, 8, "dt_bias", dt_bias),
        describe(slots, 9, "state_batch_indices", state_batch_indices),
        describe(slots, 10, "out", out), _direct.stream(x))
    if status:
        st.library.raise_for(status)
    return out


@torch.library.custom_op("libssm::selective_state_update", mutates_args=("state",))
def selective_state_update_op(state: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor,
                              C: Tensor, D: Optional[Tensor], z: Optional[Tensor],
                              dt_bias: Optional[Tensor], dt_softplus: bool,
                              state_batch_indices: Optional[Tensor]) -> Tensor:
    """out, with state updated in place (the op's one mutated argument)."""
    return fwd(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, state_batch_indices)


@selective_state_update_op.register_fake
def _selective_state_update_fake(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus,
                                 state_batch_indices):
    return x.new_empty(x.shape)


def selective_state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None,
                           dt_softplus=False, state_batch_indices=None):
    """One selective-state decode step with mamba_ssm's signature
    (mamba_ssm.ops.triton.selective_state_update.selective_state_update); the formula is in
    libssm/state_update.h. Inference only: no gradient flows through it.

    state: (batch_state, dim, dstate) or (batch_state, nheads, headdim, dstate), updated in
    place in its own dtype. x, dt, z: (batch, dim) or (batch, nheads, headdim); A: (dim,
    dstate) or (nheads, headdim, dstate); B, C: (batch, dstate) or (batch, ngroups, dstate);
    D, dt_bias: (dim,) or (nheads, headdim); any strides, 0 included (Mamba-2 repeats dt,
    dt_bias and A along headdim and dstate). state_batch_indices: (batch,) int32/int64, the
    state row of each batch row, negative for a padding row (out zero, state untouched).
    Returns out, like x. CUDA work runs on torch's current stream; the call can be captured
    in a CUDA graph and compiled with torch.compile(fullgraph=True)."""
    dt_softplus = bool(dt_softplus)
    if _direct.path((x, state, dt, A, B, C, D, z, dt_bias,
                     state_batch_indices)) is _direct.DISPATCHER:
        return torch.ops.libssm.selective_state_update(state, x, dt, A, B, C, D, z, dt_bias,
                                                       dt_softplus, state_batch_indices)
    return fwd(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, state_batch_indices)


def compiled(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, state_batch_indices, out):
    """libssm.selective_state_update on tensors while torch.compile traces: the registered op,
    which the compiler keeps in its graph; a given out is filled by a copy, the op having no
    out= of its own."""
    result = torch.ops.libssm.selective_state_update(state, x, dt, A, B, C, D, z, dt_bias,
                                                     bool(dt_softplus), state_batch_indices)
    return result if out is None else out.copy_(result)
