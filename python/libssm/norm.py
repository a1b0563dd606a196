"""libssm.rms_norm, layer_norm, norm_fwd and norm_bwd (fused residual add, RMSNorm or LayerNorm
and SiLU gate; the formula is in libssm/norm.h) for any DLPack array: numpy, torch, CuPy, JAX.
Arrays are (..., hidden); the leading axes are handed to the library as one row axis with its
stride, so no copy is made. Inputs are borrowed through their capsules, outputs allocated by the
caller's framework. Torch inputs take the direct path instead (see _torch_norm), or, while
torch.compile traces, the registered torch.ops.libssm custom ops."""

import collections

from . import _call, _packer
from .errors import InvalidArgumentError, LayoutError, ShapeError, error_for_status

__all__ = ["rms_norm", "layer_norm", "norm_fwd", "norm_bwd", "NormForward", "NormGrads"]

NormForward = collections.namedtuple("NormForward", ["y", "residual_out", "mean", "rstd"])
NormGrads = collections.namedtuple("NormGrads", ["dx", "dresidual", "dweight", "dbias", "dz"])

KINDS = ("rms", "layer")


def check_kind(kind):
    """The library cannot see the kind string, only the code made from it."""
    if kind not in KINDS:
        raise InvalidArgumentError("kind: expected 'rms' or 'layer', got %r" % (kind,))


# Option sets already built, by (kind, eps, group_size, zero_centered_weight,
# norm_before_gate): each struct is written once and only read afterwards, so calls on any
# thread may share it. Bounded, for callers who vary eps call after call.
_params = {}
_MAX_PARAMS = 256


def params(library, kind, eps, group_size, zero_centered_weight, norm_before_gate):
    """(keep-alive, address) of an ssm_norm_params; kind is "rms" or "layer". The keep-alive
    must be held until the call returns."""
    key = (kind, eps, group_size, zero_centered_weight, norm_before_gate)
    entry = _params.get(key)
    if entry is None:
        ffi = library.ffi
        p = ffi.new("ssm_norm_params *")
        p.struct_size = ffi.sizeof("ssm_norm_params")
        p.kind = library.lib.SSM_NORM_LAYER if kind == "layer" else library.lib.SSM_NORM_RMS
        p.eps = eps
        p.group_size = group_size or 0
        p.zero_centered_weight = 1 if zero_centered_weight else 0
        p.norm_before_gate = 1 if norm_before_gate else 0
        entry = (p, library.address(p))
        if len(_params) >= _MAX_PARAMS:
            _params.clear()  # callers hold the structs they use, so none is freed under a call
        _params[key] = entry
    return entry


def raise_forward_error(library, status, out_given):
    """Raises the failed forward's error. The library calls the output y; when the caller
    passed it as out=, the message names it by that argument."""
    message = library.last_error()
    if out_given and message.startswith("y:"):
        message = "out:" + message[2:]
    raise error_for_status(status, message)


def stats_shape(rows, hidden, group_size):
    """Shape of mean and rstd: (rows,) for one group, else (rows, ngroups). A group_size the
    library will refuse gets a harmless shape, so its own message is the one raised."""
    if not group_size or group_size == hidden:
        return (rows,)
    return (rows, hidden // group_size if group_size > 0 else 1)


def leading_rows(shape):
    rows = 1
    for n in shape[:-1]:
        rows *= n
    return rows


def row_stride(shape, strides, name):
    """The one stride (in elements) that steps between the rows of an array (..., hidden)
    whose leading axes are flattened into rows; LayoutError naming it if there is none."""
    stride, step = shape[-1], None
    for n, s in zip(reversed(shape[:-1]), reversed(strides[:-1])):
        if n == 0:
            return shape[-1]  # no rows: no stride is ever followed
        if n == 1:
            continue
        if step is None:
            stride = s
        elif s != step:
            raise LayoutError("%s: the leading axes of shape %s (strides %s) cannot be "
                              "flattened into rows with one stride; pass a contiguous array"
                              % (name, tuple(shape), tuple(strides)))
        step = s * n
    return stride


def check_like(t, shape, name, like="x"):
    """ShapeError unless t (given) has exactly `shape`: flattening would hide a mismatch of
    leading axes that the library, seeing only rows, cannot notice."""
    if tuple(t.shape) != tuple(shape):
        raise ShapeError("%s: expected shape %s like %s, got %s"
                         % (name, tuple(shape), like, tuple(t.shape)))


def dtype_name(dtype):
    """'float32', 'bfloat16', ... of a dtype name, a torch dtype or a numpy-like dtype."""
    if isinstance(dtype, str):
        return dtype
    text = str(dtype)
    if text.startswith("torch."):
        return text[6:]
    import numpy
    return numpy.dtype(dtype).name


def _wants_residual_out(x, residual_dtype, want):
    """Whether residual_out is made even without a residual: when asked for, or when it would
    differ from x by its dtype."""
    return want or (residual_dtype is not None
                    and dtype_name(residual_dtype) != dtype_name(x.dtype))


def _borrow_rows(call, obj, name, shape=None, writable=False):
    """(address of a 2-d (rows, hidden) DLTensor viewing obj, obj's shape). obj must have
    `shape` when given."""
    address = call.borrow(obj, name, writable)
    t = call.library.ffi.cast("DLTensor *", address)
    ndim = t.ndim
    got = tuple(t.shape[i] for i in range(ndim))
    if shape is not None and got != shape:
        raise ShapeError("%s: expected shape %s like x, got %s" % (name, shape, got))
    if ndim == 2:
        return address, got
    if ndim == 0:
        raise ShapeError("%s: expected an array (..., hidden), got a 0-d array" % name)
    if t.strides == call.library.ffi.NULL:
        strides, step = [], 1
        for n in reversed(got):
            strides.append(step)
            step *= n
        strides = tuple(reversed(strides))
    else:
        strides = tuple(t.strides[i] for i in range(ndim))
    data = int(call.library.ffi.cast("uintptr_t", t.data)) + t.byte_offset
    rows_2d = (leading_rows(got), got[-1])
    return _packer.pack(call.library.slots, call.slot(), data, t.device.device_type,
                        t.device.device_id, t.dtype.code, t.dtype.bits, rows_2d,
                        (row_stride(got, strides, name), strides[-1])), got


def _forward(x, weight, bias, residual, z, kind, eps, group_size, norm_before_gate,
             zero_centered_weight, residual_dtype, want_residual_out, stats, out, stream):
    """NormForward; mean and rstd only when `stats`."""
    check_kind(kind)
    want_residual_out = _wants_residual_out(x, residual_dtype, want_residual_out)
    if stream is None and _call.torch_arrays((x, weight, bias, residual, z, out)):
        from . import _torch_norm
        run = _torch_norm.compiled_fwd if _call.torch_compiling() else _torch_norm.fwd
        if residual_dtype is not None:
            residual_dtype = _torch_norm.torch_dtype(residual_dtype)
        return NormForward(*run(x, weight, bias, residual, z, kind, eps, group_size,
                                norm_before_gate, zero_centered_weight, residual_dtype,
                                want_residual_out, stats, out))

    call = _call.Call(x, "x", stream)
    keep, pparams = params(call.library, kind, float(eps), group_size, zero_centered_weight,
                           norm_before_gate)
    px, shape = _borrow_rows(call, x, "x")
    rows, hidden = leading_rows(shape), shape[-1]
    pres = 0 if residual is None else _borrow_rows(call, residual, "residual", shape)[0]
    pz = 0 if z is None else _borrow_rows(call, z, "z", shape)[0]
    if out is None:
        y, py = call.empty((rows, hidden), x, "y")
    else:
        y, py = out, _borrow_rows(call, out, "out", shape, writable=True)[0]
    residual_out = mean = rstd = None
    pro = pmean = prstd = 0
    if want_residual_out or (stats and residual is not None):
        like = dtype_name(residual_dtype) if residual_dtype is not None else \
            residual if residual is not None else x
        residual_out, pro = call.empty((rows, hidden), like, "residual_out")
    if stats:
        stat = stats_shape(rows, hidden, group_size)
        if kind == "layer":
            mean, pmean = call.empty(stat, "float32", "mean")
        rstd, prstd = call.empty(stat, "float32", "rstd")
    status = call.library.lib.ssm_norm_fwd(
        pparams, px, pres, call.borrow(weight, "weight"), call.borrow(bias, "bias"), pz, py,
        pro, pmean, prstd, call.stream)
    if status:
        raise_forward_error(call.library, status, out is not None)
    result = call.allocator.result
    if out is None:
        y = result(y.reshape(shape))
    if residual_out is not None:
        residual_out = result(residual_out.reshape(shape))
    return NormForward(y, residual_out, result(mean), result(rstd))


def norm_fwd(x, weight=None, bias=None, *, kind, residual=None, z=None, eps, group_size=None,
             norm_before_gate=True, zero_centered_weight=False, residual_dtype=None,
             want_residual_out=False, out=None, stream=None):
    """Fused norm forward, keeping what the backward needs; the formula is in libssm/norm.h.

    kind: "rms" or "layer". x, residual, z: (..., hidden), the leading axes flattened into rows
    (they must collapse to one row stride; the hidden axis must be contiguous). weight, bias:
    (hidden,). group_size: columns per normalised group (None or 0: hidden). residual_dtype:
    dtype of residual_out (a name such as "float32", or the framework's dtype); default
    residual's dtype, else x's. out: written as y and returned if given, else y is a new array
    like x. stream: as for libssm.selective_scan (required for CUDA arrays other than torch and
    cupy).

    Returns NormForward(y, residual_out, mean, rstd): residual_out (the pre-norm stream
    x + residual, shaped like x) is None unless want_residual_out, a residual was added, or
    residual_dtype differs from x's dtype; mean (LayerNorm only, else None) and rstd are float32
    (rows,) for one group, else (rows, ngroups). Pass residual_out (when a residual was added,
    else x), mean and rstd to norm_bwd."""
    return _forward(x, weight, bias, residual, z, kind, eps, group_size, norm_before_gate,
                    zero_centered_weight, residual_dtype, want_residual_out, True, out, stream)


def _norm(kind, x, weight, bias, residual, z, eps, group_size, norm_before_gate,
          zero_centered_weight, prenorm, residual_dtype, out, stream):
    result = _forward(x, weight, bias, residual, z, kind, eps, group_size, norm_before_gate,
                      zero_centered_weight, residual_dtype, prenorm, False, out, stream)
    return (result.y, result.residual_out) if prenorm else result.y


def rms_norm(x, weight=None, bias=None, *, residual=None, z=None, eps=1e-6, group_size=None,
             norm_before_gate=True, zero_centered_weight=False, prenorm=False,
             residual_dtype=None, out=None, stream=None):
    """RMSNorm of the last axis, with an optional residual added before it and an optional SiLU
    gate z (libssm/norm.h): y = (s / rms(s)) * weight + bias, s = x + residual.

    x, residual, z: (..., hidden); weight, bias: (hidden,); options and out, stream as for
    norm_fwd. Returns y (like x), or (y, residual_out) when prenorm, residual_out being s in
    residual_dtype (default residual's dtype, else x's)."""
    return _norm("rms", x, weight, bias, residual, z, eps, group_size, norm_before_gate,
                 zero_centered_weight, prenorm, residual_dtype, out, stream)


def layer_norm(x, weight=None, bias=None, *, residual=None, z=None, eps=1e-5, group_size=None,
               norm_before_gate=True, zero_centered_weight=False, prenorm=False,
               residual_dtype=None, out=None, stream=None):
    """LayerNorm of the last axis, as rms_norm but with the mean subtracted:
    y = (s - mean(s)) / std(s) * weight + bias. Returns y, or (y, residual_out) when
    prenorm."""
    return _norm("layer", x, weight, bias, residual, z, eps, group_size, norm_before_gate,
                 zero_centered_weight, prenorm, residual_dtype, out, stream)


def _needs(needs, weight, bias, z, x, residual_dtype):
    """needs as 5 booleans (dx, dresidual, dweight, dbias, dz)."""
    if needs is None:
        differs = (residual_dtype is not None
                   and dtype_name(residual_dtype) != dtype_name(x.dtype))
        return (True, differs, weight is not None, bias is not None, z is not None)
    needs = tuple(bool(n) for n in needs)
    if len(needs) != 5:
        raise InvalidArgumentError("needs: expected 5 booleans (dx, dresidual, dweight, dbias, "
                                   "dz) or None, got %d" % len(needs))
    for wanted, input_, name in zip(needs[2:], (weight, bias, z), ("weight", "bias", "z")):
        if wanted and input_ is None:
            raise InvalidArgumentError("needs: d%s asked for, but %s is None; a gradient needs "
                                       "its input" % (name, name))
    return needs


def norm_bwd(x, dy, mean, rstd, weight=None, bias=None, *, kind, z=None, dresidual_out=None,
             eps, group_size=None, norm_before_gate=True, zero_centered_weight=False,
             residual_dtype=None, needs=None, stream=None):
    """Fused norm backward: gradients of a loss L given dy = dL/dy and dresidual_out =
    dL/dresidual_out (None: zero). x is the forward's normalised input s: its residual_out
    when it added a residual, else its x; mean and rstd as norm_fwd returned them (mean None
    for RMSNorm); weight, bias, z and the options as given to norm_fwd.

    needs: (dx, dresidual, dweight, dbias, dz) booleans; None means dx, dweight/dbias/dz where
    weight/bias/z are given, and dresidual when residual_dtype differs from x's dtype.
    Returns NormGrads(dx, dresidual, dweight, dbias, dz), None where not computed: dx = dL/ds
    (the gradient of both the forward's x and its residual) like x; dresidual the same values
    in residual_dtype (default x's dtype); dweight, dbias, dz like weight, bias, z."""
    check_kind(kind)
    needs = _needs(needs, weight, bias, z, x, residual_dtype)
    if stream is None and _call.torch_arrays((x, dy, mean, rstd, weight, bias, z,
                                              dresidual_out)):
        from . import _torch_norm
        run = _torch_norm.compiled_bwd if _call.torch_compiling() else _torch_norm.bwd
        dresidual_dtype = None
        if needs[1]:
            dresidual_dtype = (x.dtype if residual_dtype is None
                               else _torch_norm.torch_dtype(residual_dtype))
        return NormGrads(*run(x, dy, mean, rstd, weight, bias, z, dresidual_out, kind, eps,
                              group_size, norm_before_gate, zero_centered_weight,
                              x.dtype if needs[0] else None, dresidual_dtype, needs[2:]))

    call = _call.Call(x, "x", stream)
    lib = call.library.lib
    keep, pparams = params(call.library, kind, float(eps), group_size, zero_centered_weight,
                           norm_before_gate)
    px, shape = _borrow_rows(call, x, "x")
    rows, hidden = leading_rows(shape), shape[-1]
    pw = call.borrow(weight, "weight")
    ws, ws_address, ws_bytes = call.workspace(lib.ssm_norm_bwd_workspace_size, pparams, px, pw)
    pz = 0 if z is None else _borrow_rows(call, z, "z", shape)[0]
    pdy = _borrow_rows(call, dy, "dy", shape)[0]
    pdro = 0 if dresidual_out is None else \
        _borrow_rows(call, dresidual_out, "dresidual_out", shape)[0]
    grads, addresses = [], []
    likes = (x, dtype_name(residual_dtype) if residual_dtype is not None else x, weight, bias, z)
    for wanted, like, name, index in zip(needs, likes, NormGrads._fields, range(5)):
        g, address = None, 0
        if wanted:
            row_shaped = index in (0, 1, 4)
            g, address = call.empty((rows, hidden) if row_shaped else tuple(like.shape), like,
                                    name)
        grads.append(g)
        addresses.append(address)
    status = lib.ssm_norm_bwd(pparams, px, pw, call.borrow(bias, "bias"), pz,
                              call.borrow(mean, "mean"), call.borrow(rstd, "rstd"), pdy, pdro,
                              *addresses, ws_address, ws_bytes, call.stream)
    if status:
        call.library.raise_for(status)
    result = call.allocator.result
    return NormGrads(*(None if g is None else
                       result(g.reshape(shape) if index in (0, 1, 4) else g)
                       for index, g in enumerate(grads)))
