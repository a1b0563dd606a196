"""Borrows the DLTensor inside a producer's DLPack capsule. The capsule is read, kept alive by
the caller across the libssm call, and never renamed to "used_dltensor": it stays unconsumed, so
its own destructor frees it when dropped. Both capsule kinds are accepted: numpy, torch and CuPy
send `dltensor_versioned` when asked with max_version=(1, 0); JAX still sends `dltensor`."""

import ctypes

from .errors import InvalidArgumentError, UnsupportedError

# Private prototypes, so that setting argtypes on the shared ctypes.pythonapi attributes
# neither disturbs nor is disturbed by other code in the process.
_is_valid = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_IsValid", ctypes.pythonapi))
_get_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi))


def is_capsule(obj, name):
    return bool(_is_valid(obj, name))


def capsule_pointer(capsule, name):
    return _get_pointer(capsule, name)


VERSIONED = b"dltensor_versioned"
LEGACY = b"dltensor"
FLAG_READ_ONLY = 1


class _DLManagedTensorVersionedHead(ctypes.Structure):
    # Everything before dl_tensor in DLManagedTensorVersioned (DLPack 1.x).
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32),
                ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p),
                ("flags", ctypes.c_uint64)]


_VERSIONED_TENSOR_OFFSET = ctypes.sizeof(_DLManagedTensorVersionedHead)  # 32 on LP64


def request(obj, name, stream):
    """obj's capsule, asking for a versioned one first. stream: the DLPack `stream` argument
    (None for host arrays; for CUDA the consumer's stream, never 0)."""
    if not hasattr(obj, "__dlpack__"):
        raise InvalidArgumentError("%s: expected an array with __dlpack__ (numpy, torch, cupy, "
                                   "jax), got %s" % (name, type(obj).__name__))
    if getattr(obj, "requires_grad", False):
        obj = obj.detach()  # torch refuses to export a tensor that requires grad
    try:
        try:
            return obj.__dlpack__(stream=stream, max_version=(1, 0))
        except TypeError:
            pass  # a producer that predates DLPack 1.0 has no max_version keyword
        try:
            return obj.__dlpack__(stream=stream)
        except TypeError:
            if stream is not None:
                raise
            return obj.__dlpack__()
    except BufferError as e:  # the producer cannot describe this array (dtype, layout, ...)
        raise InvalidArgumentError("%s: cannot be passed through DLPack: %s" % (name, e)) from e


def tensor_address(capsule, name, writable=False):
    """The address of the DLTensor in `capsule`, which the caller must keep alive."""
    if _is_valid(capsule, VERSIONED):
        head = _get_pointer(capsule, VERSIONED)
        meta = _DLManagedTensorVersionedHead.from_address(head)
        if meta.major != 1:
            raise UnsupportedError("%s: DLPack version %d.%d is not supported (expected 1.x)"
                                   % (name, meta.major, meta.minor))
        if writable and meta.flags & FLAG_READ_ONLY:
            raise InvalidArgumentError("%s: the array is read-only" % name)
        return head + _VERSIONED_TENSOR_OFFSET
    if _is_valid(capsule, LEGACY):
        return _get_pointer(capsule, LEGACY)
    raise InvalidArgumentError("%s: __dlpack__ returned %r, not an unconsumed DLPack capsule"
                               % (name, capsule))
