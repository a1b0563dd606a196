"""The direct path from torch tensors to libssm, used by eager libssm.torch calls, by the
registered custom ops' real kernels and by libssm.selective_scan for torch inputs. CUDA work
goes on torch's current raw stream (never stream 0, which a CUDA graph capture silently leaves
out), and workspace comes from torch's allocator.

DLTensors are written into this thread's slots (see _packer) in one of two ways: torch's own C
function for it (DLPack exchange API, torch >= 2.10; ~0.4 us a tensor, called with the GIL held
so its errors surface as exceptions), else packed in Python from data_ptr(), shape and stride()
(~1 us). Either is far cheaper than __dlpack__ (~5 us) and takes tensors that require grad."""

import ctypes

import torch

from . import _arrays, _dlpack, _library, _packer
from .errors import DeviceError, LayoutError, ShapeError, WorkspaceError
from .selective_scan import INPUT_NAMES, SelectiveScanGrads

GRAD_NAMES = SelectiveScanGrads._fields

_raw_stream = _arrays.torch_raw_stream()
_empty = torch.empty
_empty_like = torch.empty_like
_uint8 = torch.uint8
_float32 = torch.float32
_contiguous = torch.contiguous_format
_strided = torch.strided
_MAX_NDIM, _SLOT_SIZE = _packer.MAX_NDIM, _packer.SLOT_SIZE


class _ExchangeAPIHead(ctypes.Structure):
    # DLPackExchangeAPI (dlpack.h 1.2+): version, prev_api, then the producer's functions.
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32),
                ("prev_api", ctypes.c_void_p), ("managed_tensor_allocator", ctypes.c_void_p),
                ("managed_tensor_from_py_object_no_sync", ctypes.c_void_p),
                ("managed_tensor_to_py_object_no_sync", ctypes.c_void_p),
                ("dltensor_from_py_object_no_sync", ctypes.c_void_p),
                ("current_work_stream", ctypes.c_void_p)]


def _torch_dltensor_function():
    """torch's `int (PyObject*, DLTensor*)` that fills a DLTensor viewing a tensor, as a
    callable that holds the GIL; None where this torch does not offer it."""
    capsule = getattr(torch.Tensor, "__dlpack_c_exchange_api__", None)
    name = b"dlpack_exchange_api"
    if capsule is None or not _dlpack.is_capsule(capsule, name):
        return None
    head = _ExchangeAPIHead.from_address(_dlpack.capsule_pointer(capsule, name))
    if head.major != 1 or head.minor < 2 or not head.dltensor_from_py_object_no_sync:
        return None
    signature = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.c_void_p)
    return signature(head.dltensor_from_py_object_no_sync)


class _State:
    def __init__(self):
        self.library = _library.load()
        self.lib = self.library.lib
        self.params = self.library.scan_params
        self.slots = self.library.slots
        self.workspace_error = WorkspaceError.status_code


_state = None


def _get_state():
    global _state
    if _state is None:
        _state = _State()
    return _state


def _pack(slots, index, name, t):
    """Packs t into slot `index` in Python; returns the DLTensor's address. Tensors libssm
    cannot take are refused here, naming the argument, before torch is asked for a data
    pointer or strides they do not have (a sparse or meta tensor raises a bare RuntimeError)."""
    if t.layout != _strided:
        raise LayoutError("%s: %s tensors are not supported; expected a dense (strided) tensor"
                          % (name, t.layout))
    if t.is_cuda:
        device_type, device_id = _arrays.CUDA, t.get_device()
    elif t.is_cpu:
        device_type, device_id = _arrays.CPU, 0
    else:
        raise DeviceError("%s: tensors on device '%s' are not supported; expected cpu or cuda"
                          % (name, t.device))
    code, bits = _arrays.dlpack_dtype(t.dtype, name)
    if t.dim() > _MAX_NDIM:
        raise ShapeError("%s: expected at most %d dimensions, got %d" % (name, _MAX_NDIM,
                                                                          t.dim()))
    return _packer.pack(slots, index, t.data_ptr(), device_type, device_id, code, bits, t.shape,
                        t.stride())


_torch_dltensor = _torch_dltensor_function()


def describe(slots, index, name, t):
    """The address of a DLTensor describing t (0 for None), valid until t changes."""
    if t is None:
        return 0
    if _torch_dltensor is not None:
        address = slots.base + index * _SLOT_SIZE
        try:
            _torch_dltensor(t, address)
            return address
        except (RuntimeError, TypeError, BufferError):
            pass  # e.g. a meta or sparse tensor: the Python packer says what libssm thinks
    return _pack(slots, index, name, t)


def _workspace(nbytes, like):
    """(tensor holding the memory, 256-byte-aligned address) from torch's allocator, which
    takes it from the graph's private pool while a CUDA graph is being captured."""
    ws = _empty(nbytes + 255, dtype=_uint8, device=like.device)
    return ws, (ws.data_ptr() + 255) & ~255


# (op, on CUDA) -> whether such calls have needed workspace. Calls start without asking (the
# forward needs none, and the size query costs as much as a call's validation); a call that
# fails for want of workspace writes nothing, so the size is then asked for and the call made
# again, and later calls of that kind ask first.
_needs_workspace = {}


def _query(state, kind, args):
    lib, slots = state.lib, state.slots
    query = (lib.ssm_selective_scan_fwd_workspace_size if kind == "fwd"
             else lib.ssm_selective_scan_bwd_workspace_size)
    status = query(args[0], args[1], args[3], args[4], args[5], slots.size_t_address)
    if status:
        state.library.raise_for(status)
    return slots.size_t[0]


def _run(state, kind, args, u):
    """Calls ssm_selective_scan_<kind>(*args, workspace, bytes, stream), where args starts
    (params, u, delta, A, B, C, ...)."""
    lib = state.lib
    op = lib.ssm_selective_scan_fwd if kind == "fwd" else lib.ssm_selective_scan_bwd
    cuda = u.is_cuda
    stream = _raw_stream(u.get_device()) if cuda else 0
    ws, address, nbytes = None, 0, 0
    if _needs_workspace.get((kind, cuda)):
        nbytes = _query(state, kind, args)
        if nbytes:
            ws, address = _workspace(nbytes, u)
    status = op(*args, address, nbytes, stream)
    if status == state.workspace_error and not nbytes:
        _needs_workspace[(kind, cuda)] = True
        nbytes = _query(state, kind, args)
        ws, address = _workspace(nbytes, u)
        status = op(*args, address, nbytes, stream)
    if status:
        state.library.raise_for(status)
    # Dropping ws now is safe: torch's allocator hands the memory only to later work on this
    # stream, which runs after the call.
    del ws


def fwd(u, delta, A, B, C, D, z, delta_bias, initial_state, delta_softplus, return_last_state,
        out=None):
    """(out, last_state or None)."""
    state = _state or _get_state()
    slots = state.slots
    args = (state.params[1 if delta_softplus else 0], describe(slots, 0, "u", u),
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
            _query(state, "fwd", args)  # raises the library's message about u's or A's shape
            raise
        last_state = _empty(shape, dtype=_float32, device=u.device)
    args += (describe(slots, 9, "out", out), describe(slots, 10, "last_state", last_state))
    _run(state, "fwd", args, u)
    return out, last_state


def bwd(u, delta, A, B, C, dout, D, z, delta_bias, initial_state, dlast_state, delta_softplus,
        mask=None, out=None):
    """The 9 gradients (du, ddelta, dA, dB, dC, dD, dz, ddelta_bias, dinitial_state); an entry
    is None where its input is None or mask (9 bools) leaves it out, and is then not computed.
    out: 9 entries, a tensor to write that gradient into or None to allocate it."""
    state = _state or _get_state()
    slots = state.slots
    inputs = (u, delta, A, B, C, D, z, delta_bias, initial_state)
    args = [state.params[1 if delta_softplus else 0]]
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
    _run(state, "bwd", args, u)
    return tuple(grads)
