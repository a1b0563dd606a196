"""Helpers every op's suites share: the dtypes tested and their ids, conversions between torch and
NumPy, NaN-poisoned buffers, CApi (libssm's cffi handle for calling C entry points directly with
DLTensors that describe torch tensors the test owns; each op's harness adds its calls), and the
checks of bad-input tests (the error raised, every argument left as it was)."""
import numpy as np
import torch

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
DTYPE_IDS = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def to_numpy(x):
    """A torch CPU tensor as a NumPy array of the same dtype (None stays None)."""
    return None if x is None else x.detach().cpu().numpy()


def dtype_of(x):
    """The torch dtype of a torch tensor or NumPy array."""
    if isinstance(x, torch.Tensor):
        return x.dtype
    return torch.from_numpy(np.zeros(1, dtype=x.dtype)).dtype


def poisoned_like(t, dtype=None):
    """A NaN-filled tensor shaped like t: whatever the library leaves unwritten stays NaN."""
    return torch.full(t.shape, float("nan"), dtype=dtype or t.dtype, device=t.device)


_DL_DTYPES = {torch.float32: (2, 32), torch.float16: (2, 16), torch.bfloat16: (4, 16),
              torch.float64: (2, 64), torch.int32: (0, 32),
              torch.int64: (0, 64)}


class CApi:
    """libssm's cffi handle: builds DLTensors for torch tensors and calls the C functions.
    Every DLTensor and its shape/strides arrays are kept alive by the instance."""

    def __init__(self):
        from libssm import _library
        self.library = _library.load()
        self.ffi, self.lib = self.library.ffi, self.library.lib
        self._keep = []

    def address(self, cdata):
        return 0 if cdata is None else int(self.ffi.cast("uintptr_t", cdata))

    def dltensor(self, t, data=None):
        """The address of a DLTensor describing torch tensor t (0 for None). data overrides
        the data pointer (0 for NULL)."""
        if t is None:
            return 0
        ffi = self.ffi
        dl = ffi.new("DLTensor *")
        shape = ffi.new("int64_t[]", list(t.shape) or [0])
        strides = ffi.new("int64_t[]", list(t.stride()) or [0])
        dl.data = ffi.cast("void *", t.data_ptr() if data is None else data)
        dl.device.device_type = 2 if t.is_cuda else 1
        dl.device.device_id = t.get_device() if t.is_cuda else 0
        dl.ndim = t.dim()
        dl.dtype.code, dl.dtype.bits = _DL_DTYPES[t.dtype]
        dl.dtype.lanes = 1
        dl.shape, dl.strides, dl.byte_offset = shape, strides, 0
        self._keep += [dl, shape, strides]
        return self.address(dl)

    def check(self, status):
        if status:
            self.library.raise_for(status)

    def last_error(self):
        return self.ffi.string(self.lib.ssm_last_error()).decode()

    def keep(self, obj):
        """Keeps obj (a cffi object or a buffer) alive as long as this instance."""
        self._keep.append(obj)
        return obj

    def workspace(self, nbytes, device):
        """(address, bytes) of a 256-byte aligned workspace of nbytes on device ((0, 0) for 0)."""
        if not nbytes:
            return 0, 0
        buf = self.keep(torch.empty(nbytes + 255, dtype=torch.uint8, device=device))
        return (buf.data_ptr() + 255) & ~255, nbytes

    @staticmethod
    def stream_of(t):
        return torch.cuda.current_stream(t.device).cuda_stream if t.is_cuda else 0


# ---------------------------------------------------------------------------------------------
# Bad input: the error raised and the arguments left as they were.


def as_framework(x, framework):
    """A dict of torch tensors as NumPy arrays (framework "numpy") or unchanged ("torch")."""
    if framework == "numpy":
        return {k: v.numpy() if isinstance(v, torch.Tensor) else v for k, v in x.items()}
    return x


def snapshot(x):
    """Every array's bytes, NaNs included, in logical order."""
    def raw(v):
        if isinstance(v, torch.Tensor):
            return v.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        if isinstance(v, np.ndarray):
            return np.ascontiguousarray(v).tobytes()
        return repr(v)
    return {k: raw(v) for k, v in x.items()}


def check_error(excinfo, exc, argument, fragments):
    """The exception is exactly `exc` with its status, and its message starts with the
    argument's name and holds every fragment."""
    message = str(excinfo.value)
    assert type(excinfo.value) is exc, (type(excinfo.value), message)
    assert excinfo.value.status == exc.status_code
    assert message.startswith(argument + ":"), message
    for fragment in fragments:
        assert fragment in message, (fragment, message)


def capture_cuda_graph(step, warmup=2):
    """(graph, what `step` returned while captured): `step` run `warmup` times on a side stream
    first, as capture requires of code that allocates or initialises lazily."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = step()
    return graph, result


def fresh_leaves(inputs, requires_grad=True, names=None):
    """A copy of `inputs` whose tensors among `names` (default: every one present) are fresh
    leaves; `requires_grad` is True, False or a set of names."""
    result = dict(inputs)
    for name in inputs if names is None else names:
        x = inputs[name]
        if x is not None:
            want = requires_grad if isinstance(requires_grad, bool) else name in requires_grad
            result[name] = x.detach().clone().requires_grad_(want)
    return result


def check_compiled_matches_eager(block, inputs, args_of, cotangents, grad_names, backend,
                                 fwd_tol, grad_tol, names=None):
    """torch.compile(block, fullgraph=True) against eager on fresh leaves of `inputs` (names as in
    fresh_leaves): the same outputs within fwd_tol, and, after backward with `cotangents`, the
    same gradients of grad_names within grad_tol; tolerances are (rtol, atol)."""
    x_eager, x_comp = fresh_leaves(inputs, names=names), fresh_leaves(inputs, names=names)
    eager = block(*args_of(x_eager))
    compiled = torch.compile(block, fullgraph=True, backend=backend)(*args_of(x_comp))
    for e, c in zip(eager, compiled):
        torch.testing.assert_close(c, e, rtol=fwd_tol[0], atol=fwd_tol[1])
    torch.autograd.backward(list(eager), list(cotangents))
    torch.autograd.backward(list(compiled), list(cotangents))
    for n in grad_names:
        torch.testing.assert_close(x_comp[n].grad, x_eager[n].grad, rtol=grad_tol[0],
                                   atol=grad_tol[1])
