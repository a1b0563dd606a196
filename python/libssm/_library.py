"""Finds and opens libssm.so.0 with cffi (ABI mode: nothing is compiled), once per process.

Search order: $LIBSSM_LIBRARY, then <entry>/lib/libssm.so.0 for every entry of the package's
__path__ (in an editable install the package's files sit in the source tree while the built
library sits in site-packages, so every entry is searched)."""

import os
import threading

import cffi

from . import _cdef, _packer
from .errors import bind_status_codes, error_for_status

LIBRARY_NAME = "libssm.so.0"
ENV_VAR = "LIBSSM_LIBRARY"


def _package_paths():
    from . import __path__ as paths  # the package's own search path, editable installs included
    return list(paths)


def candidate_paths():
    env = os.environ.get(ENV_VAR)
    if env:
        return [env]
    return [os.path.join(entry, "lib", LIBRARY_NAME) for entry in _package_paths()]


def find_library():
    candidates = candidate_paths()
    for path in candidates:
        if os.path.isfile(path):
            return os.path.abspath(path)
    if os.environ.get(ENV_VAR):
        raise ImportError("libssm: %s=%s does not name a file" % (ENV_VAR, candidates[0]))
    raise ImportError("libssm: cannot find %s; searched: %s. Install the libssm wheel, or set %s "
                      "to the path of a built library." % (LIBRARY_NAME, ", ".join(candidates),
                                                          ENV_VAR))


class Library:
    """The opened library: cffi handles, where it came from, and per-process constants."""

    def __init__(self):
        self.path = find_library()
        self.header_dir = _cdef.find_header_dir(_package_paths(), self.path)
        cdef, self.header_abi = _cdef.build_cdef(self.header_dir)
        self.ffi = cffi.FFI()
        self.ffi.cdef(cdef)
        try:
            self.lib = self.ffi.dlopen(self.path)
        except OSError as e:
            raise ImportError("libssm: cannot load %s: %s" % (self.path, e)) from e
        self.abi = self.lib.ssm_abi_version()
        if self.header_abi is not None and self.abi != self.header_abi:
            raise ImportError("libssm: %s has ABI version %d but the headers in %s declare %d"
                              % (self.path, self.abi, self.header_dir, self.header_abi))
        bind_status_codes(self.lib)
        self.version = self.ffi.string(self.lib.ssm_version()).decode()
        # The two option sets the Python layer uses, built once; index by delta_softplus.
        self._scan_params = []
        for softplus in (0, 1):
            p = self.ffi.new("ssm_selective_scan_params *")
            p.struct_size = self.ffi.sizeof("ssm_selective_scan_params")
            p.delta_softplus = softplus
            self._scan_params.append(p)
        self.scan_params = tuple(self.address(p) for p in self._scan_params)
        _packer.check_layout(self.ffi)
        self.slots = _packer.Slots(self.ffi)

    def address(self, cdata):
        return int(self.ffi.cast("uintptr_t", cdata))

    def last_error(self):
        return self.ffi.string(self.lib.ssm_last_error()).decode("utf-8", "replace")

    def raise_for(self, status):
        """Raises the exception for a nonzero status (call on the thread that made the call)."""
        raise error_for_status(status, self.last_error())

    def cuda_device_count(self):
        count = self.ffi.new("int *")
        status = self.lib.ssm_cuda_device_count(self.address(count))
        if status:
            self.raise_for(status)
        return count[0]

    def cuda_device_name(self, device):
        buf = self.ffi.new("char[]", 256)
        status = self.lib.ssm_cuda_device_name(device, self.address(buf), 256)
        if status:
            self.raise_for(status)
        return self.ffi.string(buf).decode("utf-8", "replace")


_lock = threading.Lock()
_library = None


def load():
    """The process's Library, opened on first use."""
    global _library
    if _library is None:
        with _lock:
            if _library is None:
                _library = Library()
    return _library
