"""What every op's generic layer (any DLPack array) shares: one call's device, stream, borrowed
capsules, output allocator and workspace, and the test that sends all-torch calls to the
direct path (or, while torch.compile traces, to the registered custom ops) instead."""

import sys

from . import _arrays, _dlpack, _library
from .errors import InvalidArgumentError


def torch_arrays(arrays):
    """Whether every array is a torch tensor or None (arrays[0], the op's first input, is
    one). Checked through sys.modules: a caller who never imported torch cannot be passing
    tensors."""
    torch = sys.modules.get("torch")
    return (torch is not None and isinstance(arrays[0], torch.Tensor)
            and all(a is None or isinstance(a, torch.Tensor) for a in arrays))


def torch_compiling():
    # Only asked once the inputs are known to be tensors, so torch is imported.
    return sys.modules["torch"].compiler.is_compiling()


class Call:
    """One call's device, stream, borrowed capsules and output allocator. `first` is the op's
    first input (named `name` in errors): it fixes the device and the framework that
    allocates."""

    def __init__(self, first, name, stream):
        self.library = _library.load()
        self.device_type, self.device_id = _arrays.device(first, name)
        handle = _arrays.stream_handle(stream)
        if handle is None:
            handle = (_arrays.current_stream(_arrays.framework(first), self.device_id)
                      if self.device_type == _arrays.CUDA else 0)
        self.stream = handle
        self.capsules = []
        self.next_slot = 0
        self.allocator = _arrays.Allocator(first, name, self.device_type, self.device_id,
                                           handle)

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

    def slot(self):
        """A fresh slot index in this thread's DLTensor slots, for a struct written here."""
        self.next_slot += 1
        return self.next_slot

    def workspace(self, query, *args):
        """(keep-alive array, address, bytes) after the op's size query query(*args, &bytes)
        (which also validates the tensors it is given, so their shapes can be trusted
        afterwards)."""
        slots = self.library.slots
        status = query(*args, slots.size_t_address)
        if status:
            self.library.raise_for(status)
        nbytes = slots.size_t[0]
        if not nbytes:
            return None, 0, 0
        with self.allocator.on_stream():
            buf, address = self.allocator.workspace(nbytes)
        return buf, address, nbytes

    def empty(self, shape, like, name):
        """A new output and the address of its DLTensor."""
        with self.allocator.on_stream():
            array = self.allocator.empty(shape, like)
        return array, self.allocator.describe(self.library.slots, self.slot(), name, array)
