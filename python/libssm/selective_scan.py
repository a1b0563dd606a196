"""libssm.selective_scan and libssm.selective_scan_bwd for any DLPack array (numpy, torch, CuPy,
JAX): inputs are borrowed through their capsules, asked for on the stream the op runs on, and
outputs are allocated by the caller's framework on the caller's device. Torch inputs take the
direct data_ptr path instead (see _torch_direct), or, while torch.compile traces, the registered
torch.ops.libssm custom ops, so the call stays in the graph."""

import collections
import sys

from . import _arrays, _dlpack, _library
from .errors import InvalidArgumentError

__all__ = ["selective_scan", "selective_scan_bwd", "SelectiveScanGrads"]

# The op's inputs in C argument order; each has its gradient, named "d" + name.
INPUT_NAMES = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias", "initial_state")
SelectiveScanGrads = collections.namedtuple("SelectiveScanGrads", ["d" + n for n in INPUT_NAMES])


def _torch_arrays(arrays):
    """Whether every array is a torch tensor or None (u, arrays[0], is one). Checked through
    sys.modules: a caller who never imported torch cannot be passing tensors."""
    torch = sys.modules.get("torch")
    return (torch is not None and isinstance(arrays[0], torch.Tensor)
            and all(a is None or isinstance(a, torch.Tensor) for a in arrays))


def _torch_compiling():
    # Only asked once the inputs are known to be tensors, so torch is imported.
    return sys.modules["torch"].compiler.is_compiling()


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


class _Call:
    """One call's device, stream, borrowed capsules and output allocator."""

    def __init__(self, u, stream):
        self.library = _library.load()
        self.device_type, self.device_id = _arrays.device(u, "u")
        handle = _arrays.stream_handle(stream)
        if handle is None:
            handle = (_arrays.current_stream(_arrays.framework(u), self.device_id)
                      if self.device_type == _arrays.CUDA else 0)
        self.stream = handle
        self.capsules = []
        self.next_slot = 0
        self.allocator = _arrays.Allocator(u, self.device_type, self.device_id, handle)

    def borrow(self, obj, name, writable=False):
        """The address of obj's DLTensor (0 for None), valid while this call lives."""
        if obj is None:
            return 0
        if writable and _arrays.framework(obj) == "jax":
            raise InvalidArgumentError("%s: JAX arrays are immutable; leave it None to get a "
                                       "new array" % name)
        on_cuda = _arrays.device(obj, name)[0] == _arrays.CUDA
        capsule = _dlpack.request(obj, name,
                                  _arrays.producer_stream(self.stream) if on_cuda else None)
        self.capsules.append(capsule)
        return _dlpack.tensor_address(capsule, name, writable)

    def scan_operands(self, delta_softplus, query, u, A, B, C):
        """The params for the options, the borrowed u, A, B, C, and the workspace that `query`
        asks for: (params, (u, A, B, C) addresses, (keep-alive, address, bytes))."""
        params = self.library.scan_params[1 if delta_softplus else 0]
        operands = (self.borrow(u, "u"), self.borrow(A, "A"), self.borrow(B, "B"),
                    self.borrow(C, "C"))
        return params, operands, self.workspace(query, params, *operands)

    def workspace(self, query, params, u, A, B, C):
        """(keep-alive array, address, bytes) after the op's size query (which also validates
        u, A, B and C, so their shapes can be trusted afterwards)."""
        size = self.library.ffi.new("size_t *")
        status = query(params, u, A, B, C, self.library.address(size))
        if status:
            self.library.raise_for(status)
        if not size[0]:
            return None, 0, 0
        with self.allocator.on_stream():
            buf, address = self.allocator.workspace(size[0])
        return buf, address, size[0]

    def empty(self, shape, like, name):
        """A new output and the address of its DLTensor."""
        with self.allocator.on_stream():
            array = self.allocator.empty(shape, like)
        self.next_slot += 1
        return array, self.allocator.describe(self.library.slots, self.next_slot, name, array)


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
    if stream is None and _torch_arrays(arrays):
        if _torch_compiling():
            from .torch import compiled_fwd
            result = compiled_fwd(u, delta, A, B, C, D, z, delta_bias, initial_state,
                                  delta_softplus, return_last_state, out)
        else:
            from . import _torch_direct
            result = _torch_direct.fwd(u, delta, A, B, C, D, z, delta_bias, initial_state,
                                       delta_softplus, return_last_state, out)
        return result if return_last_state else result[0]

    call = _Call(u, stream)
    lib = call.library.lib
    params, (pu, pA, pB, pC), (ws, ws_address, ws_bytes) = call.scan_operands(
        delta_softplus, lib.ssm_selective_scan_fwd_workspace_size, u, A, B, C)
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
    if stream is None and _torch_arrays(inputs + (dout, dlast_state) + buffers):
        if _torch_compiling():
            from .torch import compiled_bwd
            grads = compiled_bwd(u, delta, A, B, C, dout, D, z, delta_bias, initial_state,
                                 dlast_state, delta_softplus, buffers)
        else:
            from . import _torch_direct
            grads = _torch_direct.bwd(u, delta, A, B, C, dout, D, z, delta_bias, initial_state,
                                      dlast_state, delta_softplus, out=buffers)
        return SelectiveScanGrads(*grads)

    call = _Call(u, stream)
    lib = call.library.lib
    params, (pu, pA, pB, pC), (ws, ws_address, ws_bytes) = call.scan_operands(
        delta_softplus, lib.ssm_selective_scan_bwd_workspace_size, u, A, B, C)
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
