"""Per-thread slots for DLTensor structs that libssm writes itself (torch tensors on the direct
path, outputs it allocates), each slot holding the struct, its shape and its strides at fixed
addresses, and the writer for tensors whose pointer, shape and strides are known: one
precompiled struct.Struct.pack_into call a tensor. Per-thread because cffi releases the GIL
during a call, so another thread may write while this one's call still reads its slots."""

import struct
import threading


MAX_NDIM = 8
# DLTensor (data, device_type, device_id, ndim, dtype code/bits/lanes, shape, strides,
# byte_offset) in native byte order with no padding: 48 bytes on LP64 ABIs.
_HEADER = "=QiiiBBHQQQ"
_HEADER_SIZE = struct.calcsize(_HEADER)
SHAPE_OFFSET = _HEADER_SIZE
STRIDES_OFFSET = SHAPE_OFFSET + 8 * MAX_NDIM
SLOT_SIZE = STRIDES_OFFSET + 8 * MAX_NDIM
SLOTS = 24  # the most tensors one call passes (backward: 11 in + 9 gradients) plus headroom

# One Struct per ndim, each writing header + shape + strides in a single call.
PACKERS = tuple(
    struct.Struct("%s%dq%dx%dq" % (_HEADER, n, 8 * (MAX_NDIM - n), n)).pack_into
    for n in range(MAX_NDIM + 1))


def check_layout(ffi):
    """Fails loudly if the headers' DLTensor differs from the layout packed here."""
    expect = {"data": 0, "device": 8, "ndim": 16, "dtype": 20, "shape": 24, "strides": 32,
              "byte_offset": 40}
    got = {f: ffi.offsetof("DLTensor", f) for f in expect}
    if got != expect or ffi.sizeof("DLTensor") != _HEADER_SIZE:
        raise ImportError("libssm: unexpected DLTensor layout %r (size %d)"
                          % (got, ffi.sizeof("DLTensor")))


class Slots(threading.local):
    """This thread's buffer of SLOTS DLTensor slots and a size_t for workspace queries."""

    def __init__(self, ffi):
        self.memory = ffi.new("char[]", SLOTS * SLOT_SIZE + 8)
        self.buffer = ffi.buffer(self.memory)
        self.base = int(ffi.cast("uintptr_t", self.memory))
        self.size_t = ffi.cast("size_t *", self.memory + SLOTS * SLOT_SIZE)
        self.size_t_address = self.base + SLOTS * SLOT_SIZE



def pack(slots, index, data, device_type, device_id, code, bits, shape, strides):
    """Writes slot `index` (strides in elements); returns the DLTensor's address."""
    offset = index * SLOT_SIZE
    address = slots.base + offset
    PACKERS[len(shape)](slots.buffer, offset, data, device_type, device_id, len(shape), code,
                        bits, 1, address + SHAPE_OFFSET, address + STRIDES_OFFSET, 0, *shape,
                        *strides)
    return address
