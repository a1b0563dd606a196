"""The direct path from torch tensors to libssm, shared by every op family's torch adapter
(_torch_scan, _torch_norm): their eager calls, the registered custom ops' real kernels and the
generic layer's calls on torch inputs. CUDA work goes on torch's current raw stream (never
stream 0, which a CUDA graph capture silently leaves out), and workspace comes from torch's
allocator.

DLTensors are written into this thread's slots (see _packer) in one of two ways: torch's own C
function for it (DLPack exchange API, torch >= 2.10; ~0.4 us a tensor, called with the GIL held
so its errors surface as exceptions), else packed in Python from data_ptr(), shape and stride()
(~1 us). Either is far cheaper than __dlpack__ (~5 us) and takes tensors that require grad."""

import ctypes

import torch

from . import _arrays, _dlpack, _library, _packer
from .errors import DeviceError, LayoutError, ShapeError, WorkspaceError

_raw_stream = _arrays.torch_raw_stream()
_empty = torch.empty
_uint8 = torch.uint8
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


class State:
    """The loaded library's handles, fetched once for the per-call path."""

    def __init__(self):
        self.library = _library.load()
        self.lib = self.library.lib
        self.slots = self.library.slots
        self.workspace_error = WorkspaceError.status_code


_state = None


def state():
    global _state
    if _state is None:
        _state = State()
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


_dlpack_dtypes = {}  # torch dtype -> (DLPack code, bits)


def describe_packed(slots, index, name, t, shape, strides):
    """The address of a DLTensor viewing t's memory with another shape and strides (in
    elements), packed in Python: t reshaped to the rows an op takes, with no torch view made
    (a view costs more than the packing). t must be a plain strided CPU or CUDA tensor."""
    code_bits = _dlpack_dtypes.get(t.dtype)
    if code_bits is None:
        code_bits = _dlpack_dtypes[t.dtype] = _arrays.dlpack_dtype(t.dtype, name)
    if t.is_cuda:
        device_type, device_id = _arrays.CUDA, t.get_device()
    else:
        device_type, device_id = _arrays.CPU, 0
    return _packer.pack(slots, index, t.data_ptr(), device_type, device_id, code_bits[0],
                        code_bits[1], shape, strides)


def _workspace(nbytes, like):
    """(tensor holding the memory, 256-byte-aligned address) from torch's allocator, which
    takes it from the graph's private pool while a CUDA graph is being captured."""
    ws = _empty(nbytes + 255, dtype=_uint8, device=like.device)
    return ws, (ws.data_ptr() + 255) & ~255


def stream(t):
    """The stream a call on t's device runs on: torch's current one on CUDA, 0 on the CPU."""
    return _raw_stream(t.get_device()) if t.is_cuda else 0


# (op, on CUDA) -> whether such calls have needed workspace. Calls start without asking (a
# forward needs none, and the size query costs as much as a call's validation); a call that
# fails for want of workspace writes nothing, so the size is then asked for and the call made
# again, and later calls of that kind ask first.
_needs_workspace = {}


def workspace_size(st, query, query_args):
    """Bytes of workspace from query(*query_args, &bytes); raises for a failed status."""
    status = query(*query_args, st.slots.size_t_address)
    if status:
        st.library.raise_for(status)
    return st.slots.size_t[0]


def run(st, op, query, query_args, args, like):
    """Calls op(*args, workspace, bytes, stream) on like's device and raises for a failed
    status; query(*query_args, &bytes) is the op's workspace size query."""
    cuda = like.is_cuda
    stream_handle = _raw_stream(like.get_device()) if cuda else 0
    ws, address, nbytes = None, 0, 0
    if _needs_workspace.get((op, cuda)):
        nbytes = workspace_size(st, query, query_args)
        if nbytes:
            ws, address = _workspace(nbytes, like)
    status = op(*args, address, nbytes, stream_handle)
    if status == st.workspace_error and not nbytes:
        _needs_workspace[(op, cuda)] = True
        nbytes = workspace_size(st, query, query_args)
        ws, address = _workspace(nbytes, like)
        status = op(*args, address, nbytes, stream_handle)
    if status:
        st.library.raise_for(status)
    # Dropping ws now is safe: torch's allocator hands the memory only to later work on this
    # stream, which runs after the call.
    del ws


DIRECT, AUTOGRAD, DISPATCHER = "direct", "autograd", "dispatcher"
_is_compiling = torch.compiler.is_compiling
_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
_grad_enabled = torch.is_grad_enabled
_functorch_active = getattr(torch._C, "_are_functorch_transforms_active", lambda: False)


def path(tensors):
    """How a call on these tensors (tensors[0] the op's first input, never None) runs: while
    torch.compile traces, and for anything but plain tensors in real memory (fake, meta,
    functorch-wrapped, other subclasses), through the dispatcher (the registered custom op),
    which knows them; otherwise direct, through the op's autograd.Function when a gradient is
    wanted. The dispatcher adds ~10-15 us a call, which eager calls skip."""
    if _is_compiling():
        return DISPATCHER
    grad = _grad_enabled()
    wants_grad = False
    for t in tensors:
        if t is not None:
            if type(t) not in _PLAIN_TENSOR_TYPES:
                return DISPATCHER
            if grad and t.requires_grad:
                wants_grad = True
    if tensors[0].is_meta or _functorch_active():
        return DISPATCHER
    return AUTOGRAD if wants_grad else DIRECT
