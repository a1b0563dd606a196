"""Exceptions raised by libssm: one class per library status code, each carrying the library's
message (which names the offending argument) and the numeric status. The codes are read from
the library's own ssm_status enum (through cffi) when it is loaded, never copied here."""

__all__ = [
    "Error", "InvalidArgumentError", "ShapeError", "DTypeError", "DeviceError", "LayoutError",
    "UnsupportedError", "WorkspaceError", "CudaError", "InternalError", "error_for_status",
]


class _StatusCode:
    """`status_code` until the library is loaded: asking for it loads the library, which binds
    every class's code (bind_status_codes) and so replaces this descriptor."""

    def __get__(self, obj, cls):
        if cls._enum_name is None:
            return None
        from . import _library
        _library.load()
        return cls.status_code


class Error(Exception):
    """Base class of every libssm error; ``status`` is the library's ssm_status code."""

    _enum_name = None  # the ssm_status constant this class stands for
    status_code = _StatusCode()

    def __init__(self, message="", status=None):
        super().__init__(message)
        self.status = self.status_code if status is None else status

    def __str__(self):
        return self.args[0] if self.args else ""

    def __reduce__(self):
        # Keeps the status across pickling (multiprocessing, pytest-xdist).
        return (type(self), (str(self), self.status))


class InvalidArgumentError(Error, ValueError):
    _enum_name = "SSM_ERROR_INVALID_ARGUMENT"


class ShapeError(Error, ValueError):
    _enum_name = "SSM_ERROR_SHAPE"


class DTypeError(Error, TypeError):
    _enum_name = "SSM_ERROR_DTYPE"


class DeviceError(Error, ValueError):
    _enum_name = "SSM_ERROR_DEVICE"


class LayoutError(Error, ValueError):
    _enum_name = "SSM_ERROR_LAYOUT"


class UnsupportedError(Error, ValueError):
    _enum_name = "SSM_ERROR_UNSUPPORTED"


class WorkspaceError(Error):
    _enum_name = "SSM_ERROR_WORKSPACE"


class CudaError(Error, RuntimeError):
    _enum_name = "SSM_ERROR_CUDA"


class InternalError(Error):
    _enum_name = "SSM_ERROR_INTERNAL"


_CLASSES = (InvalidArgumentError, ShapeError, DTypeError, DeviceError, LayoutError,
            UnsupportedError, WorkspaceError, CudaError, InternalError)
_BY_STATUS = {}


def bind_status_codes(lib):
    """Sets each class's status_code from the loaded library's enum (called once, on load)."""
    for cls in _CLASSES:
        cls.status_code = int(getattr(lib, cls._enum_name))
        _BY_STATUS[cls.status_code] = cls


def error_for_status(status, message):
    """The exception for a failed call's status; unknown codes give the base class."""
    return _BY_STATUS.get(status, Error)(message, status)
