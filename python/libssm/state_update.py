"""libssm.selective_state_update: one decode step of the selective scan against a recurrent state
that is updated in place (mamba_ssm's selective_state_update; the formula is in
libssm/state_update.h), for any DLPack array: numpy, torch, CuPy (JAX arrays are immutable, so
they cannot hold the state). Inputs are borrowed through their capsules and out is allocated by
the caller's framework. Torch inputs take the direct path instead (see _torch_state_update), or,
while torch.compile traces, the registered torch.ops.libssm custom op."""

from . import _arrays, _call
from .errors import InvalidArgumentError

__all__ = ["selective_state_update"]

# The two option sets, built once each and only read afterwards, so calls on any thread may
# share them: dt_softplus -> (keep-alive, address).
_params = {}


def params(library, dt_softplus):
    """The address of an ssm_selective_state_update_params for the option."""
    key = bool(dt_softplus)
    entry = _params.get(key)
    if entry is None:
        ffi = library.ffi
        p = ffi.new("ssm_selective_state_update_params *")
        p.struct_size = ffi.sizeof("ssm_selective_state_update_params")
        p.dt_softplus = 1 if key else 0
        entry = _params[key] = (p, library.address(p))
    return entry[1]


def selective_state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, *,
                           dt_softplus=False, state_batch_indices=None, out=None, stream=None):
    """One selective-state decode step; the formula is in libssm/state_update.h. state is
    updated in place, in its own dtype.

    Mamba-1 layout: state (batch_state, dim, dstate); x, dt, z: (batch, dim); A: (dim, dstate);
    B, C: (batch, dstate); D, dt_bias: (dim,).
    Mamba-2 layout: state (batch_state, nheads, headdim, dstate); x, dt, z: (batch, nheads,
    headdim); A: (nheads, headdim, dstate); B, C: (batch, ngroups, dstate) with ngroups dividing
    nheads; D, dt_bias: (nheads, headdim). Any strides, 0 included (Mamba-2's dt, dt_bias and A
    repeated along headdim and dstate).
    state_batch_indices: (batch,) int32 or int64, the state row each batch row uses; a negative
    entry is a padding row (out zero, no state touched). None: row b uses state[b].
    Float operands may each be float32, float16 or bfloat16; arithmetic is float32 (float64 on
    the CPU). out: written and returned if given, else a new array like x. stream: as for
    libssm.selective_scan (required for CUDA arrays other than torch and cupy). Returns out."""
    arrays = (x, state, dt, A, B, C, D, z, dt_bias, state_batch_indices, out)
    if stream is None and _call.torch_arrays(arrays):
        from . import _torch_state_update
        run = (_torch_state_update.compiled if _call.torch_compiling()
               else _torch_state_update.fwd)
        return run(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, state_batch_indices, out)

    if _arrays.framework(state) == "jax":
        raise InvalidArgumentError("state: JAX arrays are immutable, and the decode step updates "
                                   "state in place; pass a NumPy, torch or CuPy array")
    call = _call.Call(x, "x", stream)
    lib = call.library.lib
    pstate = call.borrow(state, "state", writable=True)
    borrowed = [call.borrow(a, name) for a, name in ((x, "x"), (dt, "dt"), (A, "A"), (B, "B"),
                                                    (C, "C"), (D, "D"), (z, "z"),
                                                    (dt_bias, "dt_bias"),
                                                    (state_batch_indices,
                                                     "state_batch_indices"))]
    if out is None:
        out, pout = call.empty(tuple(x.shape), x, "out")
    else:
        pout = call.borrow(out, "out", writable=True)
    status = lib.ssm_selective_state_update(params(call.library, dt_softplus), pstate,
                                            *borrowed, pout, call.stream)
    if status:
        call.library.raise_for(status)
    return call.allocator.result(out)
