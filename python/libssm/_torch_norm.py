"""The fused norms for torch (re-exported by libssm.torch): the direct calls (fwd, bwd), the
custom ops libssm::norm_fwd and libssm::norm_bwd with fake implementations and autograd, the
differentiable functions rms_norm and layer_norm, and the modules RMSNorm and LayerNorm.

As for the selective scan (_torch_scan), eager calls skip the dispatcher and call the direct
implementation, through an autograd.Function when a gradient is wanted; torch.compile and other
tensor subclasses go through the registered ops; both share one gradient formula.
libssm.norm_fwd and norm_bwd on tensors call fwd and bwd here, or compiled_fwd and compiled_bwd
while torch.compile traces."""

from typing import List, Optional, Tuple

import torch
from torch import Tensor

from . import _torch_direct as _direct
from . import norm as _norm
from ._torch_direct import describe
from .errors import ShapeError

__all__ = ["rms_norm", "layer_norm", "RMSNorm", "LayerNorm"]

_empty = torch.empty
_empty_like = torch.empty_like
_float32 = torch.float32
_contiguous = torch.contiguous_format
_strided = torch.strided


def torch_dtype(dtype):
    """A torch dtype from a torch dtype, a name ("float32") or a numpy-like dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    return getattr(torch, _norm.dtype_name(dtype))


def _rows_of(shape, name):
    if not shape:
        raise ShapeError("%s: expected a tensor (..., hidden), got a 0-d tensor" % name)
    return _norm.leading_rows(shape)


def _rows(slots, index, name, t, shape, rows):
    """The address of a DLTensor viewing t (..., hidden), which must have `shape`, as the 2-d
    (rows, hidden) the library takes; 0 for None."""
    if t is None:
        return 0
    if t.shape != shape:
        raise ShapeError("%s: expected shape %s like x, got %s"
                         % (name, tuple(shape), tuple(t.shape)))
    if len(shape) == 2 or t.layout != _strided or not (t.is_cpu or t.is_cuda):
        return describe(slots, index, name, t)  # which names what the library cannot take
    strides = t.stride()
    return _direct.describe_packed(slots, index, name, t, (rows, shape[-1]),
                                   (_norm.row_stride(shape, strides, name), strides[-1]))


def _new_rows(slots, index, name, like, dtype, rows):
    """A new contiguous tensor shaped like `like` in dtype, and its (rows, hidden) DLTensor."""
    t = _empty_like(like, dtype=dtype, memory_format=_contiguous)
    if like.dim() == 2:
        return t, describe(slots, index, name, t)
    hidden = like.shape[-1]
    return t, _direct.describe_packed(slots, index, name, t, (rows, hidden), (hidden, 1))


def fwd(x, weight, bias, residual, z, kind, eps, group_size, norm_before_gate,
        zero_centered_weight, residual_dtype, want_residual_out, stats, out=None):
    """(y, residual_out, mean, rstd), None where not made. residual_out (dtype residual_dtype,
    else residual's, else x's) is made when want_residual_out, or when `stats` (for the
    backward) and a residual is added; mean (LayerNorm) and rstd when `stats`. out: y's
    buffer, or None to allocate it."""
    st = _direct.state()
    slots = st.slots
    keep, params = _norm.params(st.library, kind, eps, group_size, zero_centered_weight,
                                norm_before_gate)
    shape = x.shape
    rows = _rows_of(shape, "x")
    if out is None:
        y, py = _new_rows(slots, 5, "y", x, x.dtype, rows)
    else:
        y, py = out, _rows(slots, 5, "out", out, shape, rows)
    residual_out = mean = rstd = None
    pro = 0
    if want_residual_out or (stats and residual is not None):
        dtype = residual_dtype if residual_dtype is not None else \
            residual.dtype if residual is not None else x.dtype
        residual_out, pro = _new_rows(slots, 6, "residual_out", x, dtype, rows)
    if stats:
        stat = _norm.stats_shape(rows, shape[-1], group_size)
        if kind == "layer":
            mean = _empty(stat, dtype=_float32, device=x.device)
        rstd = _empty(stat, dtype=_float32, device=x.device)
    status = st.lib.ssm_norm_fwd(
        params, _rows(slots, 0, "x", x, shape, rows),
        _rows(slots, 1, "residual", residual, shape, rows), describe(slots, 2, "weight", weight),
        describe(slots, 3, "bias", bias), _rows(slots, 4, "z", z, shape, rows), py, pro,
        describe(slots, 7, "mean", mean), describe(slots, 8, "rstd", rstd), _direct.stream(x))
    if status:
        _norm.raise_forward_error(st.library, status, out is not None)
    return y, residual_out, mean, rstd


def bwd(x, dy, mean, rstd, weight, bias, z, dresidual_out, kind, eps, group_size,
        norm_before_gate, zero_centered_weight, dx_dtype, dresidual_dtype, needs):
    """(dx, dresidual, dweight, dbias, dz), None where not asked for: dx in dx_dtype and
    dresidual in dresidual_dtype (each None to skip), dweight, dbias, dz where needs (3 bools)
    asks. x is the forward's normalised input s."""
    need_dweight, need_dbias, need_dz = needs
    st = _direct.state()
    slots = st.slots
    keep, params = _norm.params(st.library, kind, eps, group_size, zero_centered_weight,
                                norm_before_gate)
    shape = x.shape
    rows = _rows_of(shape, "x")
    dx = dres = dz = None
    pdx = pdres = pdz = 0
    if dx_dtype is not None:
        dx, pdx = _new_rows(slots, 8, "dx", x, dx_dtype, rows)
    if dresidual_dtype is not None:
        dres, pdres = _new_rows(slots, 9, "dresidual", x, dresidual_dtype, rows)
    if need_dz:
        dz, pdz = _new_rows(slots, 12, "dz", x, z.dtype, rows)
    dweight = _empty_like(weight, memory_format=_contiguous) if need_dweight else None
    dbias = _empty_like(bias, memory_format=_contiguous) if need_dbias else None
    args = (params, _rows(slots, 0, "x", x, shape, rows), describe(slots, 1, "weight", weight),
            describe(slots, 2, "bias", bias), _rows(slots, 3, "z", z, shape, rows),
            describe(slots, 4, "mean", mean), describe(slots, 5, "rstd", rstd),
            _rows(slots, 6, "dy", dy, shape, rows),
            _rows(slots, 7, "dresidual_out", dresidual_out, shape, rows), pdx, pdres,
            describe(slots, 10, "dweight", dweight), describe(slots, 11, "dbias", dbias), pdz)
    lib = st.lib
    _direct.run(st, lib.ssm_norm_bwd, lib.ssm_norm_bwd_workspace_size, args[:3], args, x)
    return dx, dres, dweight, dbias, dz


# ---------------------------------------------------------------------------------------------
# The registered ops. Absent outputs are empty tensors (a custom op returns no None).


def _makes_residual_out(residual, want_residual_out):
    return want_residual_out or residual is not None


@torch.library.custom_op("libssm::norm_fwd", mutates_args=())
def norm_fwd(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor],
             residual: Optional[Tensor], z: Optional[Tensor], kind: str, eps: float,
             group_size: int, norm_before_gate: bool, zero_centered_weight: bool,
             residual_dtype: Optional[torch.dtype], want_residual_out: bool
             ) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """(y, residual_out, mean, rstd), as fwd with stats; residual_out and (for RMSNorm) mean
    are empty when not made."""
    _norm.check_kind(kind)
    y, residual_out, mean, rstd = fwd(x, weight, bias, residual, z, kind, eps, group_size,
                                      norm_before_gate, zero_centered_weight, residual_dtype,
                                      want_residual_out, True)
    if residual_out is None:
        residual_out = x.new_empty((0,))
    if mean is None:
        mean = x.new_empty((0,), dtype=_float32)
    return y, residual_out, mean, rstd


@norm_fwd.register_fake
def _norm_fwd_fake(x, weight, bias, residual, z, kind, eps, group_size, norm_before_gate,
                   zero_centered_weight, residual_dtype, want_residual_out):
    _norm.check_kind(kind)
    shape = x.shape
    stat = _norm.stats_shape(_rows_of(shape, "x"), shape[-1], group_size)
    if _makes_residual_out(residual, want_residual_out):
        dtype = residual_dtype if residual_dtype is not None else \
            residual.dtype if residual is not None else x.dtype
        residual_out = x.new_empty(shape, dtype=dtype)
    else:
        residual_out = x.new_empty((0,))
    mean = x.new_empty(stat if kind == "layer" else (0,), dtype=_float32)
    return x.new_empty(shape), residual_out, mean, x.new_empty(stat, dtype=_float32)


@torch.library.custom_op("libssm::norm_bwd", mutates_args=())
def norm_bwd(x: Tensor, dy: Tensor, mean: Optional[Tensor], rstd: Tensor,
             weight: Optional[Tensor], bias: Optional[Tensor], z: Optional[Tensor],
             dresidual_out: Optional[Tensor], kind: str, eps: float, group_size: int,
             norm_before_gate: bool, zero_centered_weight: bool,
             dx_dtype: Optional[torch.dtype], dresidual_dtype: Optional[torch.dtype],
             needs: List[bool]) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dx, dresidual, dweight, dbias, dz), as bwd with needs = (dweight, dbias, dz); each
    gradient not asked for is an empty tensor and is not computed."""
    _norm.check_kind(kind)
    grads = bwd(x, dy, mean, rstd, weight, bias, z, dresidual_out, kind, eps, group_size,
                norm_before_gate, zero_centered_weight, dx_dtype, dresidual_dtype, needs)
    return tuple(x.new_empty((0,)) if g is None else g for g in grads)


@norm_bwd.register_fake
def _norm_bwd_fake(x, dy, mean, rstd, weight, bias, z, dresidual_out, kind, eps, group_size,
                   norm_before_gate, zero_centered_weight, dx_dtype, dresidual_dtype, needs):
    def like(t, wanted, dtype=None):
        if not wanted or t is None:
            return x.new_empty((0,))
        return t.new_empty(t.shape, dtype=dtype or t.dtype)
    return (like(x, dx_dtype is not None, dx_dtype),
            like(x, dresidual_dtype is not None, dresidual_dtype),
            like(weight, needs[0]), like(bias, needs[1]), like(z, needs[2]))


def _gradients(saved, info, dy, dresidual_out, needs_input_grad, run_bwd):
    """Gradients of (x, weight, bias, residual, z), None where not needed, shared by the
    registered op's autograd and the eager autograd.Function; run_bwd is the custom op or the
    direct bwd. saved: (s, weight, bias, z, mean, rstd); info: the forward's dtypes (x, residual
    or None, y) and options. dy or dresidual_out may be None (no gradient reached it)."""
    s, weight, bias, z, mean, rstd = saved
    x_dtype, residual_dtype, y_dtype, kind, eps, group_size, before_gate, zero_centered = info
    need_x, need_w, need_b, need_r, need_z = needs_input_grad
    need_w, need_b, need_z = (need_w and weight is not None, need_b and bias is not None,
                              need_z and z is not None)
    need_r = need_r and residual_dtype is not None
    if not (need_x or need_w or need_b or need_r or need_z):
        return (None,) * 5
    # ds serves x and residual alike: one tensor when their dtypes agree, else a second copy
    # in the residual's dtype, made by the same kernel.
    dx_dtype = x_dtype if need_x else residual_dtype if need_r else None
    dres_dtype = residual_dtype if need_x and need_r and residual_dtype != x_dtype else None
    # The kernels need a contiguous hidden axis; autograd may hand in expanded gradients.
    dy = torch.zeros(s.shape, dtype=y_dtype, device=s.device) if dy is None else \
        dy.contiguous()
    if dresidual_out is not None:
        dresidual_out = dresidual_out.contiguous()
    dx, dres, dweight, dbias, dz = run_bwd(
        s, dy, mean if kind == "layer" else None, rstd, weight, bias, z, dresidual_out, kind,
        eps, group_size, before_gate, zero_centered, dx_dtype, dres_dtype,
        [need_w, need_b, need_z])
    return (dx if need_x else None, dweight if need_w else None, dbias if need_b else None,
            (dx if dres_dtype is None else dres) if need_r else None, dz if need_z else None)


def _info(x, residual, y, kind, eps, group_size, norm_before_gate, zero_centered_weight):
    return (x.dtype, None if residual is None else residual.dtype, y.dtype, kind, eps,
            group_size, norm_before_gate, zero_centered_weight)


def _setup_context(ctx, inputs, output):
    (x, weight, bias, residual, z, kind, eps, group_size, norm_before_gate,
     zero_centered_weight, residual_dtype, want_residual_out) = inputs
    y, residual_out, mean, rstd = output
    ctx.save_for_backward(residual_out if residual is not None else x, weight, bias, z, mean,
                          rstd)
    ctx.info = _info(x, residual, y, kind, eps, group_size, norm_before_gate,
                     zero_centered_weight)
    ctx.makes_residual_out = _makes_residual_out(residual, want_residual_out)


def _backward(ctx, dy, dresidual_out, dmean, drstd):
    grads = _gradients(ctx.saved_tensors, ctx.info, dy,
                       dresidual_out if ctx.makes_residual_out else None,
                       ctx.needs_input_grad[:5], torch.ops.libssm.norm_bwd)
    return grads + (None,) * 7


norm_fwd.register_autograd(_backward, setup_context=_setup_context)


class _NormFunction(torch.autograd.Function):
    """The eager autograd path: same formula as the registered op, direct calls."""

    @staticmethod
    def forward(ctx, x, weight, bias, residual, z, kind, eps, group_size, norm_before_gate,
                zero_centered_weight, residual_dtype, prenorm):
        y, residual_out, mean, rstd = fwd(x, weight, bias, residual, z, kind, eps, group_size,
                                          norm_before_gate, zero_centered_weight,
                                          residual_dtype, prenorm, True)
        ctx.save_for_backward(residual_out if residual is not None else x, weight, bias, z,
                              mean, rstd)
        ctx.info = _info(x, residual, y, kind, eps, group_size, norm_before_gate,
                         zero_centered_weight)
        ctx.set_materialize_grads(False)
        return (y, residual_out) if prenorm else y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy, dresidual_out=None):
        return _gradients(ctx.saved_tensors, ctx.info, dy, dresidual_out,
                          ctx.needs_input_grad[:5], bwd) + (None,) * 7


def _norm_call(kind, x, weight, bias, residual, z, eps, group_size, norm_before_gate,
               zero_centered_weight, prenorm, residual_dtype):
    if eps is None:
        eps = torch.finfo(x.dtype).eps
    if residual_dtype is not None:
        residual_dtype = torch_dtype(residual_dtype)
    group_size = group_size or 0
    prenorm = bool(prenorm)
    path = _direct.path((x, weight, bias, residual, z))
    if path is _direct.DIRECT:
        y, residual_out, _, _ = fwd(x, weight, bias, residual, z, kind, eps, group_size,
                                    norm_before_gate, zero_centered_weight, residual_dtype,
                                    prenorm, False)
    elif path is _direct.AUTOGRAD:
        return _NormFunction.apply(x, weight, bias, residual, z, kind, eps, group_size,
                                   norm_before_gate, zero_centered_weight, residual_dtype,
                                   prenorm)
    else:
        y, residual_out, _, _ = torch.ops.libssm.norm_fwd(
            x, weight, bias, residual, z, kind, float(eps), group_size, bool(norm_before_gate),
            bool(zero_centered_weight), residual_dtype, prenorm)
    return (y, residual_out) if prenorm else y


def rms_norm(x, weight=None, bias=None, residual=None, z=None, eps=1e-6, group_size=None,
             norm_before_gate=True, zero_centered_weight=False, prenorm=False,
             residual_dtype=None):
    """RMSNorm of the last axis with an optional residual added first and an optional SiLU
    gate z (libssm/norm.h), differentiable in x, weight, bias, residual and z, and through
    residual_out when prenorm. x, residual, z: (..., hidden); weight, bias: (hidden,).
    eps None means torch.finfo(x.dtype).eps. Returns y, or (y, residual_out) when prenorm,
    residual_out = x + residual in residual_dtype (default residual's dtype, else x's). CUDA
    work runs on torch's current stream."""
    return _norm_call("rms", x, weight, bias, residual, z, eps, group_size, norm_before_gate,
                      zero_centered_weight, prenorm, residual_dtype)


def layer_norm(x, weight=None, bias=None, residual=None, z=None, eps=1e-5, group_size=None,
               norm_before_gate=True, zero_centered_weight=False, prenorm=False,
               residual_dtype=None):
    """LayerNorm of the last axis, as rms_norm but with the mean subtracted."""
    return _norm_call("layer", x, weight, bias, residual, z, eps, group_size, norm_before_gate,
                      zero_centered_weight, prenorm, residual_dtype)


# ---------------------------------------------------------------------------------------------
# Modules: subclasses of torch's own, so parameters, state_dict keys, initialisation and repr
# are torch's, and a state_dict loads unchanged either way.


def _module_forward(module, kind, eps, bias, x, residual, prenorm, residual_dtype):
    """The module's norm over its normalized_shape, whose axes are flattened into hidden."""
    normalized = module.normalized_shape
    weight = module.weight
    ndim = len(normalized)
    if (x.shape[-1:] != normalized if ndim == 1 else
            ndim > x.dim() or tuple(x.shape[x.dim() - ndim:]) != tuple(normalized)):
        raise ShapeError("x: expected shape (..., %s) (normalized_shape), got %s"
                         % (", ".join(map(str, normalized)), tuple(x.shape)))
    if ndim != 1:
        lead = x.shape[:x.dim() - ndim]
        hidden = _norm.leading_rows(normalized + (1,))
        x = x.reshape(lead + (hidden,))
        if residual is not None:
            residual = residual.reshape(lead + (hidden,))
        weight = None if weight is None else weight.reshape(hidden)
        bias = None if bias is None else bias.reshape(hidden)
    result = _norm_call(kind, x, weight, bias, residual, None, eps, None, True, False, prenorm,
                        residual_dtype)
    if ndim == 1:
        return result
    shape = lead + tuple(normalized)
    if prenorm:
        return result[0].reshape(shape), result[1].reshape(shape)
    return result.reshape(shape)


class RMSNorm(torch.nn.RMSNorm):
    """torch.nn.RMSNorm (same arguments, parameters and state_dict) computed by libssm, with a
    fused residual add: forward(x, residual=None, prenorm=False, residual_dtype=None) returns
    y, or (y, residual_out) when prenorm, as libssm.torch.rms_norm. eps None means
    torch.finfo(x.dtype).eps, as in torch."""

    def forward(self, x, residual=None, prenorm=False, residual_dtype=None):
        return _module_forward(self, "rms", self.eps, None, x, residual, prenorm,
                               residual_dtype)


class LayerNorm(torch.nn.LayerNorm):
    """torch.nn.LayerNorm (same arguments, parameters and state_dict) computed by libssm, with
    a fused residual add: forward(x, residual=None, prenorm=False, residual_dtype=None) returns
    y, or (y, residual_out) when prenorm, as libssm.torch.layer_norm."""

    def forward(self, x, residual=None, prenorm=False, residual_dtype=None):
        return _module_forward(self, "layer", self.eps, self.bias, x, residual, prenorm,
                               residual_dtype)


# ---------------------------------------------------------------------------------------------
# libssm.norm_fwd / norm_bwd on tensors while torch.compile traces: the registered ops, which
# the compiler keeps in its graph, where the direct call would break it.


def compiled_fwd(x, weight, bias, residual, z, kind, eps, group_size, norm_before_gate,
                 zero_centered_weight, residual_dtype, want_residual_out, stats, out):
    """As fwd; a given out is filled by a copy, the op having no out= of its own."""
    y, residual_out, mean, rstd = torch.ops.libssm.norm_fwd(
        x, weight, bias, residual, z, kind, float(eps), group_size or 0,
        bool(norm_before_gate), bool(zero_centered_weight), residual_dtype,
        bool(want_residual_out))
    if out is not None:
        y = out.copy_(y)
    if not (want_residual_out or (stats and residual is not None)):
        residual_out = None
    if not stats:
        return y, residual_out, None, None
    return y, residual_out, mean if kind == "layer" else None, rstd


def compiled_bwd(x, dy, mean, rstd, weight, bias, z, dresidual_out, kind, eps, group_size,
                 norm_before_gate, zero_centered_weight, dx_dtype, dresidual_dtype, needs):
    """As bwd."""
    needs = [bool(n) for n in needs]
    grads = torch.ops.libssm.norm_bwd(
        x, dy, mean, rstd, weight, bias, z, dresidual_out, kind, float(eps), group_size or 0,
        bool(norm_before_gate), bool(zero_centered_weight), dx_dtype, dresidual_dtype, needs)
    wanted = [dx_dtype is not None, dresidual_dtype is not None] + needs
    return tuple(g if w else None for g, w in zip(grads, wanted))
