"""What libssm needs to know about the caller's arrays: which framework made them, where they
live, which stream the caller is working on, and how to allocate outputs and workspace with the
caller's own allocator so results come back as the caller's array type on the caller's device."""

import contextlib
import functools
import importlib
import sys

from . import _packer
from .errors import DeviceError, DTypeError, InvalidArgumentError

CPU, CUDA = 1, 2  # DLPack device types libssm runs on (the C layer refuses kDLCUDAHost too)


def framework(obj):
    """'torch', 'numpy', 'cupy', 'jax' or None, from the module that defines obj's type."""
    root = type(obj).__module__.partition(".")[0]
    if root == "jaxlib":
        return "jax"
    return root if root in ("torch", "numpy", "cupy", "jax") else None


def device(obj, name):
    """(DLPack device type, device id) of an array."""
    try:
        dev = obj.__dlpack_device__()
    except AttributeError:
        raise InvalidArgumentError("%s: expected an array with __dlpack__ (numpy, torch, cupy, "
                                   "jax), got %s" % (name, type(obj).__name__)) from None
    return int(dev[0]), int(dev[1])


def stream_handle(stream):
    """A cudaStream_t as an int from what a caller may pass as `stream=`: an int, a
    torch.cuda.Stream, a cupy Stream, or any object with __cuda_stream__."""
    if stream is None or isinstance(stream, int):
        return stream
    if hasattr(stream, "__cuda_stream__"):
        return int(stream.__cuda_stream__()[1])
    for attr in ("cuda_stream", "ptr"):
        value = getattr(stream, attr, None)
        if isinstance(value, int):
            return value
    raise InvalidArgumentError("stream: expected an int (cudaStream_t), a torch or cupy stream, "
                               "or an object with __cuda_stream__; got %s" % type(stream).__name__)


@functools.lru_cache(maxsize=None)
def torch_raw_stream():
    """torch's `device index -> current cudaStream_t as an int`. The private C binding is used
    where it exists because it builds no Stream object on the per-call path; a torch without it
    gets the same value from the public API."""
    import torch
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return raw
    return lambda device_id: torch.cuda.current_stream(device_id).cuda_stream


def current_stream(fw, device_id):
    """The stream the caller's framework (torch or cupy) is working on for this CUDA device.
    Other producers (JAX, unknown ones) give no way to ask, and guessing stream 0 would race
    with the caller's own streams (and escape CUDA graph capture), so `stream=` is required."""
    if fw == "torch":
        return torch_raw_stream()(device_id)
    if fw == "cupy":
        import cupy
        with cupy.cuda.Device(device_id):
            return cupy.cuda.get_current_stream().ptr
    raise InvalidArgumentError(
        "stream: required for CUDA arrays from %s, whose current stream libssm cannot know; "
        "pass stream= (a cudaStream_t int, a torch or cupy stream, or an object with "
        "__cuda_stream__)" % (fw or "an unknown producer"))


def producer_stream(stream):
    """The DLPack `stream` argument for a CUDA producer: 0 is not allowed there, the legacy
    default stream is spelled 1."""
    return 1 if stream == 0 else stream


def _module(name):
    return sys.modules.get(name) or importlib.import_module(name)


def _backing_framework(device_type, name):
    """The framework that allocates for callers whose own cannot (JAX arrays are immutable)."""
    if device_type != CUDA:
        return "numpy"
    for name in ("torch", "cupy"):
        try:
            _module(name)
            return name
        except ImportError:
            pass
    raise DeviceError("%s: a JAX array on CUDA; libssm allocates its outputs there with torch "
                      "or cupy, and neither is installed" % name)


class Allocator:
    """Allocates outputs like `template` (same framework, same device) on `stream`; `name` is
    the template's argument name, for errors."""

    def __init__(self, template, name, device_type, device_id, stream):
        self.caller = framework(template)
        self.device_type, self.device_id = device_type, device_id
        self.backing = self.caller if self.caller in ("torch", "numpy", "cupy") else \
            _backing_framework(device_type, name)
        if self.backing == "numpy" and device_type != CPU:
            raise DeviceError("%s: arrays on DLPack device type %d are not supported"
                              % (name, device_type))
        self.module = _module(self.backing)
        self.template = template
        self.stream = stream
        if self.backing == "torch":
            self.torch_device = template.device if self.caller == "torch" else \
                self.module.device("cuda", device_id) if device_type == CUDA else "cpu"

    def dtype(self, like):
        """The backing framework's dtype for `like` (an array, or a dtype name)."""
        if not isinstance(like, str):
            if framework(like) == self.backing:
                return like.dtype
            like = str(like.dtype).rpartition(".")[2]  # torch.bfloat16 -> bfloat16
        if self.backing == "torch":
            return getattr(self.module, like)
        if like == "bfloat16" and self.backing == "numpy":
            return _module("ml_dtypes").bfloat16
        return self.module.dtype(like)

    @contextlib.contextmanager
    def on_stream(self):
        """Allocations made inside belong to the stream the op runs on, so a stream-ordered
        allocator does not hand the memory to other work while the op still uses it."""
        if self.device_type != CUDA:
            yield
        elif self.backing == "torch":
            torch = self.module
            if torch_raw_stream()(self.device_id) == self.stream:
                yield
            else:
                with torch.cuda.stream(torch.cuda.ExternalStream(self.stream,
                                                                 device=self.torch_device)):
                    yield
        else:
            cupy = self.module
            with cupy.cuda.Device(self.device_id):
                if cupy.cuda.get_current_stream().ptr == self.stream:
                    yield
                else:
                    with cupy.cuda.ExternalStream(self.stream):
                        yield

    def empty(self, shape, like):
        dtype = self.dtype(like)
        if self.backing == "torch":
            return self.module.empty(shape, dtype=dtype, device=self.torch_device)
        return self.module.empty(shape, dtype=dtype)

    def describe(self, slots, index, name, array):
        """The address of a DLTensor for an array this allocator made, written into slot
        `index`: outputs are described directly rather than through the backing framework's
        DLPack export, which numpy lacks for bfloat16."""
        if self.backing == "torch":
            from . import _torch_direct
            return _torch_direct.describe(slots, index, name, array)
        code, bits = dlpack_dtype(array.dtype, name)
        if self.backing == "cupy":
            data, device_type, device_id = array.data.ptr, CUDA, self.device_id
        else:
            data, device_type, device_id = array.ctypes.data, CPU, 0
        strides = tuple(s // array.itemsize for s in array.strides)
        return _packer.pack(slots, index, data, device_type, device_id, code, bits, array.shape,
                            strides)

    def workspace(self, nbytes):
        """(array keeping the memory alive, 256-byte-aligned address) for nbytes > 0."""
        buf = self.empty((nbytes + 255,), "uint8")
        if self.backing == "torch":
            base = buf.data_ptr()
        elif self.backing == "cupy":
            base = buf.data.ptr
        else:
            base = buf.ctypes.data
        return buf, (base + 255) & ~255

    def result(self, array):
        """An output as the caller's own array type."""
        if array is None or self.caller == self.backing:
            return array
        if self.caller == "jax":
            if self.backing == "numpy":  # numpy cannot export bfloat16 through DLPack
                return _module("jax.numpy").asarray(array)
            return _module("jax.dlpack").from_dlpack(array)
        return array


# (DLPack type code, bits) by dtype name, the same in numpy, cupy, ml_dtypes and torch.
_DLPACK_DTYPES = {
    "float16": (2, 16), "float32": (2, 32), "float64": (2, 64), "bfloat16": (4, 16),
    "complex64": (5, 64), "complex128": (5, 128), "bool": (6, 8),
    "int8": (0, 8), "int16": (0, 16), "int32": (0, 32), "int64": (0, 64),
    "uint8": (1, 8), "uint16": (1, 16), "uint32": (1, 32), "uint64": (1, 64),
}


def dlpack_dtype(dtype, name):
    """(DLPack type code, bits) of a numpy, cupy or torch dtype."""
    code_bits = _DLPACK_DTYPES.get(str(dtype).rpartition(".")[2])  # torch.float32 -> float32
    if code_bits is None:
        raise DTypeError("%s: dtype %s has no DLPack equivalent libssm accepts" % (name, dtype))
    return code_bits
