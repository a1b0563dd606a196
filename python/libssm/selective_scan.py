"""libssm.selective_scan and libssm.selective_scan_bwd for any DLPack array (numpy, torch, CuPy,
JAX): inputs are borrowed through their capsules, asked for on the stream the op runs on, and
outputs are allocated by the caller's framework on the caller's device. Torch inputs take the
direct data_ptr path instead (see _torch_scan), or, while torch.compile traces, the registered
torch.ops.libssm custom ops, so the call stays in the graph."""

import collections

from . import _call
from .errors import InvalidArgumentError

__all__ = ["selective_scan", "selective_scan_bwd", "SelectiveScanGrads"]

# The op's inputs in C argument order; each has its gradient, named "d" + name.
INPUT_NAMES = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias", "initial_state")
SelectiveScanGrads = collections.namedtuple("SelectiveScanGrads", ["d" + n for n in INPUT_NAMES])


def _grad_buffers(out):
    """out= of selective_scan_bwd as 9 entries (None: allocate) in SelectiveScanGrads order."""
    names = SelectiveScanGrads._fields
    if out is None:
        return (None,) * len(names)
    if isinstance(out, dict):
        unknown = sorted(set(out) - set(names))
        if unknown:
            raise InvalidArgumentError("out: unknown gradient name(s) %s; expected some of %s"
                                       % (", ".join(map(repr, unknown)), ", ".join(names)))
        return tuple(out.get(name) for name in names)
    if isinstance(out, (tuple, list)):
        if len(out) == len(names):
            return tuple(out)
        got = "%s of %d entries" % (type(out).__name__, len(out))
    else:
        got = type(out).__name__
    raise InvalidArgumentError("out: expected a SelectiveScanGrads, a tuple of %d entries (None "
                               "where a gradient is to be allocated) or a dict name -> array; "
                               "got %s" % (len(names), got))


def _scan_operands(call, delta_softplus, query, u, A, B, C):
    """The params for the options, the borrowed u, A, B, C, and the workspace that `query`
    asks for (it also validates u, A, B and C, so their shapes can be trusted afterwards):
    (params, (u, A, B, C) addresses, (keep-alive, address, bytes))."""
    params = call.library.scan_params[1 if delta_softplus else 0]
    operands = (call.borrow(u, "u"), call.borrow(A, "A"), call.borrow(B, "B"),
                call.borrow(C, "C"))
    return params, operands, call.workspace(query, params, *operands)


def selective_scan(u, delta, A, B, C, D=None, z=None, delta_bias=None, *, delta_softplus=False,
                   initial_state=None, return_last_state=False, out=None, stream=None):
    """Selective scan forward (Mamba-1); the formula is in libssm/selective_scan.h.

    u, delta, z: (batch, dim, seqlen); A: (dim, dstate) float32; B, C: (batch, dstate, seqlen),
    (batch, groups, dstate, seqlen) or (dim, dstate); D, delta_bias: (dim,) float32;
    initial_state: (batch, dim, dstate). Arrays: anything with __dlpack__, all on one device.
    out: written and returned if given, else a new array like u (framework, device, dtype).
    stream: CUDA stream to run on (int cudaStream_t, torch/cupy stream, or an object with
    __cuda_stream__). Left None, torch and cupy arrays run on their framework's current
    stream; CUDA arrays of any other producer (JAX included) have no current stream libssm can
    ask for, so stream= is then required (InvalidArgumentError otherwise): libssm never picks
    stream 0 on its own. Ignored on the CPU. Torch tensors inside torch.compile are traced as
    the torch.ops.libssm.selective_scan_fwd custom op (no graph break) when stream is None.
    Returns out, or (out, last_state) with last_state float32 (batch, dim, dstate) when
    return_last_state."""
    arrays = (u, delta, A, B, C, D, z, delta_bias, initial_state, out)
    if stream is None and _call.torch_arrays(arrays):
        if _call.torch_compiling():
            from ._torch_scan import compiled_fwd
            result = compiled_fwd(u, delta, A, B, C, D, z, delta_bias, initial_state,
                                  delta_softplus, return_last_state, out)
        else:
            from . import _torch_scan
            result = _torch_scan.fwd(u, delta, A, B, C, D, z, delta_bias, initial_state,
                                     delta_softplus, return_last_state, out)
        return result if return_last_state else result[0]

    call = _call.Call(u, "u", stream)
    lib = call.library.lib
    params, (pu, pA, pB, pC), (ws, ws_address, ws_bytes) = _scan_operands(
        call, delta_softplus, lib.ssm_selective_scan_fwd_workspace_size, u, A, B, C)
    if out is None:
        out, pout = call.empty(tuple(u.shape), u, "out")
    else:
        pout = call.borrow(out, "out", writable=True)
    last_state, plast = None, 0
    if return_last_state:
        last_state, plast = call.empty((u.shape[0], u.shape[1], A.shape[1]), "float32",
                                       "last_state")
    status = lib.ssm_selective_scan_fwd(
        params, pu, call.borrow(delta, "delta"), pA, pB, pC, call.borrow(D, "D"),
        call.borrow(z, "z"), call.borrow(delta_bias, "delta_bias"),
        call.borrow(initial_state, "initial_state"), pout, plast, ws_address, ws_bytes,
        call.stream)
    if status:
        call.library.raise_for(status)
    out = call.allocator.result(out)
    if return_last_state:
        return out, call.allocator.result(last_state)
    return out


def selective_scan_bwd(u, delta, A, B, C, dout, D=None, z=None, delta_bias=None, *,
                       delta_softplus=False, initial_state=None, dlast_state=None, out=None,
                       stream=None):
    """Selective scan backward: gradients of a loss L given dout = dL/dout and
    dlast_state = dL/dlast_state (None: zero). Inputs as given to selective_scan.

    out: buffers for any subset of the gradients, as a SelectiveScanGrads or 9-tuple (None
    where one is to be allocated) or a dict gradient name -> array; each is checked like the
    forward's out= (shape, dtype, device, no overlap, named in the error), written and returned.
    stream: as for selective_scan (required for CUDA arrays other than torch and cupy).

    Returns SelectiveScanGrads(du, ddelta, dA, dB, dC, dD, dz, ddelta_bias, dinitial_state):
    each has its input's shape and dtype (dA, dD, ddelta_bias float32), and is None when its
    input is None."""
    inputs = (u, delta, A, B, C, D, z, delta_bias, initial_state)
    buffers = _grad_buffers(out)
    if stream is None and _call.torch_arrays(inputs + (dout, dlast_state) + buffers):
        if _call.torch_compiling():
            from ._torch_scan import compiled_bwd
            grads = compiled_bwd(u, delta, A, B, C, dout, D, z, delta_bias, initial_state,
                                 dlast_state, delta_softplus, buffers)
        else:
            from . import _torch_scan
            grads = _torch_scan.bwd(u, delta, A, B, C, dout, D, z, delta_bias, initial_state,
                                    dlast_state, delta_softplus, out=buffers)
        return SelectiveScanGrads(*grads)

    call = _call.Call(u, "u", stream)
    lib = call.library.lib
    params, (pu, pA, pB, pC), (ws, ws_address, ws_bytes) = _scan_operands(
        call, delta_softplus, lib.ssm_selective_scan_bwd_workspace_size, u, A, B, C)
    grads, addresses = [], []
    for x, buffer, name in zip(inputs, buffers, SelectiveScanGrads._fields):
        if buffer is not None:
            # Passed even when x is None: the library then refuses it, naming it.
            g, address = buffer, call.borrow(buffer, name, writable=True)
        elif x is not None:
            g, address = call.empty(tuple(x.shape), x, name)
        else:
            g, address = None, 0
        grads.append(g)
        addresses.append(address)
    status = lib.ssm_selective_scan_bwd(
        params, pu, call.borrow(delta, "delta"), pA, pB, pC, call.borrow(D, "D"),
        call.borrow(z, "z"), call.borrow(delta_bias, "delta_bias"),
        call.borrow(initial_state, "initial_state"), call.borrow(dout, "dout"),
        call.borrow(dlast_state, "dlast_state"), *addresses, ws_address, ws_bytes, call.stream)
    if status:
        call.library.raise_for(status)
    return SelectiveScanGrads(*(call.allocator.result(g) for g in grads))
