"""libssm: ahead-of-time compiled kernels for state-space models behind a flat C ABI, loaded
with cffi (no compiled Python extension). Ops take any DLPack array (numpy, torch, CuPy, JAX)
and return the caller's own array type; libssm.torch adds torch.library registration and
autograd. The shared library is opened on first use ($LIBSSM_LIBRARY overrides where)."""

from .errors import (CudaError, DeviceError, DTypeError, Error, InternalError,
                     InvalidArgumentError, LayoutError, ShapeError, UnsupportedError,
                     WorkspaceError)
from .conv1d import Conv1dGrads, causal_conv1d, causal_conv1d_bwd, causal_conv1d_update
from .norm import NormForward, NormGrads, layer_norm, norm_bwd, norm_fwd, rms_norm
from .selective_scan import SelectiveScanGrads, selective_scan, selective_scan_bwd
from .state_update import selective_state_update

__all__ = [
    "__version__", "version", "abi_version", "cuda_device_count", "library_path",
    "selective_scan", "selective_scan_bwd", "SelectiveScanGrads",
    "causal_conv1d", "causal_conv1d_bwd", "causal_conv1d_update", "Conv1dGrads",
    "selective_state_update",
    "rms_norm", "layer_norm", "norm_fwd", "norm_bwd", "NormForward", "NormGrads",
    "Error", "InvalidArgumentError", "ShapeError", "DTypeError", "DeviceError", "LayoutError",
    "UnsupportedError", "WorkspaceError", "CudaError", "InternalError",
]


def _load():
    from . import _library
    return _library.load()


def version():
    """The library's release version, "MAJOR.MINOR.PATCH"."""
    return _load().version


def abi_version():
    """The library's ABI major version (the N of libssm.so.N)."""
    return _load().abi


def cuda_device_count():
    """CUDA devices the library can use (0 without CUDA support, driver or GPU)."""
    return _load().cuda_device_count()


def library_path():
    """The path of the shared library in use."""
    return _load().path


def __getattr__(name):
    # __version__ is the loaded library's version, so it cannot disagree with it; it and the
    # torch adapter (which imports torch) are loaded only when first asked for.
    if name == "__version__":
        return version()
    if name == "torch":
        import importlib
        return importlib.import_module(".torch", __name__)
    raise AttributeError("module 'libssm' has no attribute %r" % name)
