"""Exceptions raised by libssm: one class per library status code, each carrying the library's
message (which names the offending argument) and the numeric status."""

__all__ = [
    "Error", "InvalidArgumentError", "ShapeError", "DTypeError", "DeviceError", "LayoutError",
    "UnsupportedError", "WorkspaceError", "CudaError", "InternalError", "error_for_status",
]


class Error(Exception):
    """Base class of every libssm error; ``status`` is the library's ssm_status code."""

    status_code = None

    def __init__(self, message="", status=None):
        super().__init__(message)
        self.status = self.status_code if status is None else status

    def __str__(self):
        return self.args[0] if self.args else ""

    def __reduce__(self):
        # Keeps the status across pickling (multiprocessing, pytest-xdist).
        return (type(self), (str(self), self.status))


class InvalidArgumentError(Error, ValueError):
    status_code = 1


class ShapeError(Error, ValueError):
    status_code = 2


class DTypeError(Error, TypeError):
    status_code = 3


class DeviceError(Error, ValueError):
    status_code = 4


class LayoutError(Error, ValueError):
    status_code = 5


class UnsupportedError(Error, ValueError):
    status_code = 6


class WorkspaceError(Error):
    status_code = 7


class CudaError(Error, RuntimeError):
    status_code = 8


class InternalError(Error):
    status_code = 9


_BY_STATUS = {cls.status_code: cls for cls in (
    InvalidArgumentError, ShapeError, DTypeError, DeviceError, LayoutError, UnsupportedError,
    WorkspaceError, CudaError, InternalError)}


def error_for_status(status, message):
    """The exception for a failed call's status; unknown codes give the base class."""
    return _BY_STATUS.get(status, Error)(message, status)
