"""Independent float64 references for the selective scan, the inputs the tests feed it, and the
one tolerance table every numeric test compares against.

The formula is the one in src_cuda/include/libssm/selective_scan.h, written twice: once in NumPy
(forward only) and once in torch (differentiable, for gradients of every input)."""
import dataclasses
import zlib

import numpy as np
import torch

# ---------------------------------------------------------------------------------------------
# NumPy float64 forward.


def _np64(x):
    if x is None:
        return None
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu", torch.float64).numpy()
    return np.asarray(x, dtype=np.float64)


def _bc_at_step_np(X, t, batch, dim):
    """B or C at step t as a (batch, dim, dstate) array, for any of the three forms."""
    if X.ndim == 2:  # fixed (dim, dstate)
        return np.broadcast_to(X[None, :, :], (batch, dim, X.shape[1]))
    if X.ndim == 3:  # (batch, dstate, seqlen): one group
        return np.broadcast_to(X[:, None, :, t], (batch, dim, X.shape[1]))
    groups = X.shape[1]  # (batch, groups, dstate, seqlen)
    return X[:, :, :, t][:, np.arange(dim) // (dim // groups), :]


def selective_scan_numpy(u, delta, A, B, C, D=None, z=None, delta_bias=None,
                         delta_softplus=False, initial_state=None):
    """Returns (out, last_state) as float64 NumPy arrays; inputs may be numpy or torch."""
    u, delta, A, B, C = (_np64(x) for x in (u, delta, A, B, C))
    D, z, delta_bias, initial_state = (_np64(x) for x in (D, z, delta_bias, initial_state))
    batch, dim, seqlen = u.shape
    dstate = A.shape[1]
    dt = delta if delta_bias is None else delta + delta_bias[None, :, None]
    if delta_softplus:
        dt = np.logaddexp(0.0, dt)
    h = np.zeros((batch, dim, dstate)) if initial_state is None else initial_state.copy()
    y = np.empty((batch, dim, seqlen))
    for t in range(seqlen):
        decay = np.exp(dt[:, :, t, None] * A[None, :, :])
        h = decay * h + (dt[:, :, t] * u[:, :, t])[:, :, None] * _bc_at_step_np(B, t, batch, dim)
        y[:, :, t] = np.sum(_bc_at_step_np(C, t, batch, dim) * h, axis=-1)
    if D is not None:
        y = y + D[None, :, None] * u
    if z is not None:
        y = y * (z / (1.0 + np.exp(-z)))
    return y, h


# ---------------------------------------------------------------------------------------------
# torch forward in any precision, differentiable in every input.


def _bc_full_torch(X, batch, dim, seqlen):
    """B or C as (batch, dim, dstate, seqlen), for any of the three forms."""
    if X.dim() == 2:
        return X[None, :, :, None].expand(batch, dim, X.shape[1], seqlen)
    if X.dim() == 3:
        return X[:, None, :, :].expand(batch, dim, X.shape[1], seqlen)
    groups = X.shape[1]
    return X.repeat_interleave(dim // groups, dim=1)


def selective_scan_torch(u, delta, A, B, C, D=None, z=None, delta_bias=None,
                         delta_softplus=False, initial_state=None):
    """Returns (out, last_state) computed in the inputs' dtype, on their device."""
    batch, dim, seqlen = u.shape
    dstate = A.shape[1]
    dt = delta if delta_bias is None else delta + delta_bias[None, :, None]
    if delta_softplus:
        dt = torch.logaddexp(dt, torch.zeros((), dtype=dt.dtype, device=dt.device))
    Bf = _bc_full_torch(B, batch, dim, seqlen)
    Cf = _bc_full_torch(C, batch, dim, seqlen)
    decay = torch.exp(dt[:, :, None, :] * A[None, :, :, None])
    drive = (dt * u)[:, :, None, :] * Bf
    h = (torch.zeros(batch, dim, dstate, dtype=u.dtype, device=u.device)
         if initial_state is None else initial_state)
    ys = []
    # unbind, not indexing per step: the backward of x[..., t] materialises a full-size zero
    # gradient at every step (quadratic in seqlen), unbind's backward stacks once.
    steps = zip(decay.movedim(-1, 0).unbind(0), drive.movedim(-1, 0).unbind(0),
                Cf.movedim(-1, 0).unbind(0))
    for decay_t, drive_t, C_t in steps:
        h = decay_t * h + drive_t
        ys.append((C_t * h).sum(-1))
    y = torch.stack(ys, dim=-1) if ys else u * 0
    if D is not None:
        y = y + D[None, :, None] * u
    if z is not None:
        y = y * torch.nn.functional.silu(z)
    return y, h


INPUT_NAMES = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias", "initial_state")
GRAD_NAMES = tuple("d" + n for n in INPUT_NAMES)


def reference_outputs(inputs, delta_softplus, dout=None, dlast_state=None,
                      precision=torch.float64):
    """Forward (and, when dout is given, every gradient) of the torch formula, computed on the CPU
    in `precision` from the given inputs. Returns a dict of CPU tensors in `precision`:
    out, last_state and, with dout, d<name> for each present input.

    With precision float64 this is the reference. With float32 it is a plain same-precision
    evaluation: the error a straightforward fp32-state implementation makes, which the
    tolerance check uses as its baseline."""
    leaves = {}
    for name in INPUT_NAMES:
        x = inputs.get(name)
        if x is not None:
            leaves[name] = x.detach().to("cpu", precision).requires_grad_(dout is not None)
    with torch.set_grad_enabled(dout is not None):
        out, last = selective_scan_torch(delta_softplus=delta_softplus, **leaves)
    result = {"out": out.detach(), "last_state": last.detach()}
    if dout is not None:
        loss = (out * dout.detach().to("cpu", precision)).sum()
        if dlast_state is not None:
            loss = loss + (last * dlast_state.detach().to("cpu", precision)).sum()
        names = list(leaves)
        grads = torch.autograd.grad(loss, [leaves[n] for n in names], allow_unused=True)
        for n, g in zip(names, grads):
            result["d" + n] = torch.zeros_like(leaves[n]) if g is None else g
    return result


# ---------------------------------------------------------------------------------------------
# Test inputs.


@dataclasses.dataclass(frozen=True)
class ScanCase:
    """One configuration. B_form / C_form: "var" (batch, dstate, seqlen), "group" (batch,
    groups, dstate, seqlen) or "fixed" (dim, dstate)."""
    batch: int = 2
    dim: int = 6
    seqlen: int = 37
    dstate: int = 8
    B_form: str = "var"
    C_form: str = "var"
    groups: int = 1
    D: bool = False
    z: bool = False
    delta_bias: bool = False
    softplus: bool = False
    initial_state: bool = False
    last_state: bool = False

    def replace(self, **kw):
        return dataclasses.replace(self, **kw)

    def label(self):
        """A short test id: what differs from the plain base, or from the base with every
        option on ("full")."""
        full = ScanCase(**ALL_OPTIONS)
        ref, head = (full, ["full"]) if all(getattr(self, k) for k in ALL_OPTIONS) else \
            (ScanCase(), [])
        diff = [f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self)
                if getattr(self, f.name) != getattr(ref, f.name)]
        return ",".join(head + diff) or "base"


# Options all on: the configuration Mamba layers actually run.
ALL_OPTIONS = dict(D=True, z=True, delta_bias=True, softplus=True, initial_state=True,
                   last_state=True)


def seed_for(text):
    """A fixed seed per test, different between tests (so each test sees fresh inputs)."""
    return zlib.crc32(text.encode())


def _bc_shape(case, form):
    if form == "fixed":
        return (case.dim, case.dstate)
    if form == "group":
        return (case.batch, case.groups, case.dstate, case.seqlen)
    return (case.batch, case.dstate, case.seqlen)


def make_inputs(case, dtype, seed, device="cpu", dtypes=None):
    """Inputs for `case` as torch tensors on `device`. Each of u, delta, B, C, z, initial_state
    has `dtype` unless `dtypes` names another for it; A, D, delta_bias are float32. Values are
    drawn in float64 and rounded once, so the reference sees exactly what the kernel sees.
    Ranges follow Mamba's tests: A in (-0.5, 0] and delta in [0, 0.5), so the recurrence
    decays, some channels slowly enough to carry state across many steps."""
    g = torch.Generator().manual_seed(seed)
    b, d, l, n = case.batch, case.dim, case.seqlen, case.dstate
    dtypes = dict(dtypes or {})

    def make(name, shape, kind, default_dtype):
        if kind == "randn":
            x = torch.randn(shape, generator=g, dtype=torch.float64)
        elif kind == "delta":
            x = 0.5 * torch.rand(shape, generator=g, dtype=torch.float64)
        else:  # "A"
            x = -0.5 * torch.rand(shape, generator=g, dtype=torch.float64)
        return x.to(dtypes.get(name, default_dtype)).to(device)

    f32 = torch.float32
    inputs = {
        "u": make("u", (b, d, l), "randn", dtype),
        "delta": make("delta", (b, d, l), "delta", dtype),
        "A": make("A", (d, n), "A", f32),
        "B": make("B", _bc_shape(case, case.B_form), "randn", dtype),
        "C": make("C", _bc_shape(case, case.C_form), "randn", dtype),
        "D": make("D", (d,), "randn", f32) if case.D else None,
        "z": make("z", (b, d, l), "randn", dtype) if case.z else None,
        "delta_bias": make("delta_bias", (d,), "delta", f32) if case.delta_bias else None,
        "initial_state": (make("initial_state", (b, d, n), "randn", dtype)
                          if case.initial_state else None),
    }
    return inputs


def make_cotangents(case, dtype, seed, device="cpu"):
    """dout (batch, dim, seqlen) in `dtype` and dlast_state (batch, dim, dstate) float32, or
    None when the case does not return the last state."""
    g = torch.Generator().manual_seed(seed ^ 0x5EED)
    b, d, l, n = case.batch, case.dim, case.seqlen, case.dstate
    dout = torch.randn((b, d, l), generator=g, dtype=torch.float64).to(dtype).to(device)
    dlast = None
    if case.last_state:
        dlast = torch.randn((b, d, n), generator=g, dtype=torch.float64).float().to(device)
    return dout, dlast


# ---------------------------------------------------------------------------------------------
# Tolerances: the one table.
#
# A result passes when  max|got - ref64| <= factor * max|plain - ref64| + atol * max|ref64|,
# where ref64 is the float64 reference and `plain` is the same formula evaluated in float32 and
# rounded to the result's dtype (a straightforward implementation: for fp16/bf16 results the
# baseline is essentially the output rounding, for fp32 the fp32 accumulation error). atol
# allows a few units in the last place that the baseline happened not to show (exp
# implementations, summation order, atomics).


@dataclasses.dataclass(frozen=True)
class Tolerance:
    factor: float
    atol: float


TOLERANCES = {
    # float32 atol: the kernels take exp(x) as the special function unit's 2^(x * log2 e), a few
    # ulp off correctly rounded expf, and that error compounds along recurrences thousands of
    # steps long (seen: dA over seqlen 2048 at 1.9e-5 of max|ref|).
    torch.float32: Tolerance(factor=3.0, atol=3e-5),
    torch.float16: Tolerance(factor=3.0, atol=1e-3),
    torch.bfloat16: Tolerance(factor=3.0, atol=8e-3),
}


def _as_torch(x):
    if isinstance(x, torch.Tensor):
        return x.detach()
    return torch.from_numpy(np.array(x))


def error_bound(ref64, plain, dtype):
    tol = TOLERANCES[dtype]
    baseline = (plain.to(dtype).double() - ref64).abs().max().item()
    return tol.factor * baseline + tol.atol * ref64.abs().max().item()


def assert_close(name, got, ref64, plain, dtype=None):
    """Checks one result (torch or numpy, any device) against the float64 reference, with the
    tolerance of its dtype (or `dtype`). Also checks shape and that every element is finite,
    so a NaN-poisoned output that was left unwritten fails."""
    got = _as_torch(got).cpu()
    dtype = dtype or got.dtype
    ref64 = ref64.double().cpu()
    assert tuple(got.shape) == tuple(ref64.shape), f"{name}: shape {tuple(got.shape)}"
    if ref64.numel() == 0:
        return
    got64 = got.double()
    assert torch.isfinite(got64).all(), f"{name}: non-finite values (unwritten output?)"
    err = (got64 - ref64).abs().max().item()
    bound = error_bound(ref64, plain.cpu(), dtype)
    assert err <= bound, (f"{name} ({dtype}): max error {err:.3g} > bound {bound:.3g} "
                          f"(max |ref| {ref64.abs().max().item():.3g})")


def assert_close_to(name, got, expected, ref64, plain, dtype):
    """Checks `got` against another implementation's result `expected` (e.g. GPU against the
    library's CPU path) with the bound that each of them must meet against the reference."""
    got = _as_torch(got).cpu().double()
    expected = _as_torch(expected).cpu().double()
    assert got.shape == expected.shape, f"{name}: shape {tuple(got.shape)}"
    if got.numel() == 0:
        return
    err = (got - expected).abs().max().item()
    bound = error_bound(ref64.double().cpu(), plain.cpu(), dtype)
    assert err <= bound, f"{name} ({dtype}): differs by {err:.3g} > bound {bound:.3g}"


# ---------------------------------------------------------------------------------------------
# Fused norm (RMSNorm / LayerNorm with residual and gate): the formula in
# src_cuda/include/libssm/norm.h, written in NumPy (forward) and in torch (differentiable).
# Both take x, residual, z as (..., hidden) and return mean/rstd as (rows,) for one group, else
# (rows, ngroups), like the library.


def _norm_eps(eps):
    """eps as the library sees it: the params struct holds a float32."""
    return float(np.float32(eps))


def norm_numpy(x, weight=None, bias=None, residual=None, z=None, *, kind="rms", eps=1e-6,
               group_size=None, norm_before_gate=True, zero_centered_weight=False):
    """Returns {"y", "residual_out", "mean" (None for RMSNorm), "rstd"} as float64 arrays."""
    x, weight, bias, residual, z = (_np64(a) for a in (x, weight, bias, residual, z))
    shape, hidden = x.shape, x.shape[-1]
    s = x.reshape(-1, hidden)
    if residual is not None:
        s = s + residual.reshape(-1, hidden)
    rows, size = s.shape[0], group_size or hidden
    silu = None if z is None else (lambda v: v / (1.0 + np.exp(-v)))(z.reshape(-1, hidden))
    g = s * silu if silu is not None and not norm_before_gate else s
    grouped = g.reshape(rows, hidden // size, size)
    mean = grouped.mean(-1) if kind == "layer" else np.zeros(grouped.shape[:2])
    centred = grouped - mean[..., None]
    rstd = 1.0 / np.sqrt((centred ** 2).mean(-1) + _norm_eps(eps))
    w = np.ones(hidden) if weight is None else weight + 1.0 if zero_centered_weight else weight
    o = (centred * rstd[..., None]).reshape(rows, hidden) * w
    if bias is not None:
        o = o + bias
    y = o * silu if silu is not None and norm_before_gate else o
    stat_shape = (rows,) if size == hidden else (rows, hidden // size)
    return {"y": y.reshape(shape), "residual_out": s.reshape(shape),
            "mean": mean.reshape(stat_shape) if kind == "layer" else None,
            "rstd": rstd.reshape(stat_shape)}


def norm_torch(x, weight=None, bias=None, residual=None, z=None, *, kind="rms", eps=1e-6,
               group_size=None, norm_before_gate=True, zero_centered_weight=False):
    """The same formula in the inputs' dtype, differentiable in every input. Returns
    (y, s, mean or None, rstd), s being the pre-norm stream (residual_out)."""
    shape, hidden = x.shape, x.shape[-1]
    s = x.reshape(-1, hidden)
    if residual is not None:
        s = s + residual.reshape(-1, hidden)
    rows, size = s.shape[0], group_size or hidden
    silu = None if z is None else torch.nn.functional.silu(z.reshape(-1, hidden))
    g = s * silu if silu is not None and not norm_before_gate else s
    grouped = g.reshape(rows, hidden // size, size)
    mean = grouped.mean(-1) if kind == "layer" else torch.zeros_like(grouped[..., 0])
    centred = grouped - mean[..., None]
    rstd = torch.rsqrt((centred * centred).mean(-1) + _norm_eps(eps))
    o = (centred * rstd[..., None]).reshape(rows, hidden)
    if weight is not None:
        o = o * (weight + 1.0 if zero_centered_weight else weight)
    if bias is not None:
        o = o + bias
    y = o * silu if silu is not None and norm_before_gate else o
    stat_shape = (rows,) if size == hidden else (rows, hidden // size)
    return (y.reshape(shape), s.reshape(shape),
            mean.reshape(stat_shape) if kind == "layer" else None, rstd.reshape(stat_shape))


NORM_INPUT_NAMES = ("x", "weight", "bias", "residual", "z")


def norm_reference(inputs, options, dy=None, dresidual_out=None, precision=torch.float64):
    """Forward and, when dy is given, every gradient of the torch formula on the CPU in
    `precision`. inputs: x, weight, bias, residual, z (tensors or None); options: the keyword
    options of norm_torch. Returns CPU tensors in `precision`: y, residual_out, rstd, mean
    (LayerNorm) and, with dy, d<name> for each present input. The loss is
    sum(y * dy) + sum(residual_out * dresidual_out), so dx and dresidual are both dL/ds.

    With precision float64 this is the reference; with float32 it is the plain same-precision
    evaluation the tolerance check takes as its baseline."""
    leaves = {}
    for name in NORM_INPUT_NAMES:
        a = inputs.get(name)
        if a is not None:
            leaves[name] = a.detach().to("cpu", precision).requires_grad_(dy is not None)
    with torch.set_grad_enabled(dy is not None):
        y, s, mean, rstd = norm_torch(**leaves, **options)
    result = {"y": y.detach(), "residual_out": s.detach(), "rstd": rstd.detach()}
    if mean is not None:
        result["mean"] = mean.detach()
    if dy is not None:
        loss = (y * dy.detach().to("cpu", precision)).sum()
        if dresidual_out is not None:
            loss = loss + (s * dresidual_out.detach().to("cpu", precision)).sum()
        names = list(leaves)
        grads = torch.autograd.grad(loss, [leaves[n] for n in names], allow_unused=True)
        for n, g in zip(names, grads):
            result["d" + n] = torch.zeros_like(leaves[n]) if g is None else g
    return result


@dataclasses.dataclass(frozen=True)
class NormCase:
    """One norm configuration. lead: the leading axes of x (flattened to rows); group_size 0 is
    one group; prenorm asks for residual_out (always returned when residual is set)."""
    kind: str = "rms"
    lead: tuple = (3, 5)
    hidden: int = 48
    weight: bool = True
    bias: bool = False
    residual: bool = False
    z: bool = False
    norm_before_gate: bool = True
    zero_centered_weight: bool = False
    group_size: int = 0
    prenorm: bool = False
    eps: float = 1e-6

    @property
    def rows(self):
        return int(np.prod(self.lead, dtype=np.int64))

    @property
    def ngroups(self):
        return self.hidden // (self.group_size or self.hidden)

    def replace(self, **kw):
        return dataclasses.replace(self, **kw)

    def options(self):
        """The keyword options of norm_numpy / norm_torch."""
        return dict(kind=self.kind, eps=self.eps, group_size=self.group_size or None,
                    norm_before_gate=self.norm_before_gate,
                    zero_centered_weight=self.zero_centered_weight)

    def label(self):
        """A short test id: the fields that differ from the default case."""
        base = NormCase()
        diff = [f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self)
                if getattr(self, f.name) != getattr(base, f.name)]
        return ",".join(diff).replace(" ", "") or "base"


def make_norm_inputs(case, dtype, seed, device="cpu", dtypes=None):
    """x, residual, z in `dtype`, weight and bias in `dtype` too unless `dtypes` names another
    for any of them (e.g. {"weight": torch.float32}); absent inputs are None. Values are drawn
    in float64 and rounded once. weight sits around 1 (around 0 when zero-centred, so that
    1 + weight does), bias is small, as in trained layers.

    With a residual, x and residual lie on a grid (multiples of 1/16 below 4 in magnitude) on
    which their sum is exact in every dtype. The backward then gets s = residual_out exactly as
    the forward normalised it, so the statistics it is handed agree with it; a rounded s would
    make the gradient ill-defined where it cancels (at hidden 1 it is proportional to
    eps / (s^2 + eps), which rounding s by one part in 256 swamps)."""
    g = torch.Generator().manual_seed(seed)
    dtypes = dict(dtypes or {})
    row_shape = tuple(case.lead) + (case.hidden,)

    def make(name, shape, scale=1.0, offset=0.0, grid=False):
        a = offset + scale * torch.randn(shape, generator=g, dtype=torch.float64)
        if grid:
            a = torch.round(a.clamp(-3.9, 3.9) * 16.0) / 16.0
        return a.to(dtypes.get(name, dtype)).to(device)

    return {
        "x": make("x", row_shape, grid=case.residual),
        "weight": (make("weight", (case.hidden,), 0.3, 0.0 if case.zero_centered_weight else 1.0)
                   if case.weight else None),
        "bias": make("bias", (case.hidden,), 0.2) if case.bias else None,
        "residual": make("residual", row_shape, grid=True) if case.residual else None,
        "z": make("z", row_shape, 1.5) if case.z else None,
    }


def make_norm_cotangents(case, dtype, seed, device="cpu", dresidual_dtype=None):
    """dy in `dtype`, and dresidual_out (in dresidual_dtype, default `dtype`) when the case
    returns residual_out, else None."""
    g = torch.Generator().manual_seed(seed ^ 0x5EED)
    row_shape = tuple(case.lead) + (case.hidden,)
    dy = torch.randn(row_shape, generator=g, dtype=torch.float64).to(dtype).to(device)
    dres = None
    if case.prenorm or case.residual:
        dres = torch.randn(row_shape, generator=g, dtype=torch.float64)
        dres = dres.to(dresidual_dtype or dtype).to(device)
    return dy, dres
