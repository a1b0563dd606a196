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


def reference_leaves(inputs, names, precision, grad):
    """The inputs among `names` that are present, as CPU leaves in `precision` (requiring grad
    when asked): what the torch formulas below are evaluated on."""
    return {n: inputs[n].detach().to("cpu", precision).requires_grad_(grad)
            for n in names if inputs.get(n) is not None}


def leaf_gradients(leaves, pairs, precision):
    """d<name> of every leaf for the loss sum(output * cotangent) over the (output, cotangent)
    pairs whose cotangent is given; zeros for a leaf the loss does not reach."""
    loss = sum((out * cot.detach().to("cpu", precision)).sum() for out, cot in pairs
               if cot is not None)
    names = list(leaves)
    grads = torch.autograd.grad(loss, [leaves[n] for n in names], allow_unused=True)
    return {"d" + n: torch.zeros_like(leaves[n]) if g is None else g for n, g in zip(names, grads)}


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
    leaves = reference_leaves(inputs, INPUT_NAMES, precision, dout is not None)
    with torch.set_grad_enabled(dout is not None):
        out, last = selective_scan_torch(delta_softplus=delta_softplus, **leaves)
    result = {"out": out.detach(), "last_state": last.detach()}
    if dout is not None:
        result.update(leaf_gradients(leaves, [(out, dout), (last, dlast_state)], precision))
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


def error_bound(ref64, plain, dtype, slack=1.0):
    tol = TOLERANCES[dtype]
    baseline = (plain.to(dtype).double() - ref64).abs().max().item()
    return slack * (tol.factor * baseline + tol.atol * ref64.abs().max().item())


def assert_close(name, got, ref64, plain, dtype=None, slack=1.0):
    """Checks one result (torch or numpy, any device) against the float64 reference, with the
    tolerance of its dtype (or `dtype`), times `slack` for results of several chained ops.
    Also checks shape and that every element is finite, so a NaN-poisoned output that was
    left unwritten fails."""
    got = _as_torch(got).cpu()
    dtype = dtype or got.dtype
    ref64 = ref64.double().cpu()
    assert tuple(got.shape) == tuple(ref64.shape), f"{name}: shape {tuple(got.shape)}"
    if ref64.numel() == 0:
        return
    got64 = got.double()
    assert torch.isfinite(got64).all(), f"{name}: non-finite values (unwritten output?)"
    err = (got64 - ref64).abs().max().item()
    bound = error_bound(ref64, plain.cpu(), dtype, slack)
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
    leaves = reference_leaves(inputs, NORM_INPUT_NAMES, precision, dy is not None)
    with torch.set_grad_enabled(dy is not None):
        y, s, mean, rstd = norm_torch(**leaves, **options)
    result = {"y": y.detach(), "residual_out": s.detach(), "rstd": rstd.detach()}
    if mean is not None:
        result["mean"] = mean.detach()
    if dy is not None:
        result.update(leaf_gradients(leaves, [(y, dy), (s, dresidual_out)], precision))
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


# ---------------------------------------------------------------------------------------------
# Selective-state decode step (libssm/state_update.h): the formula written in NumPy (the float64
# reference) and in torch (any precision: float32 gives the plain baseline of the tolerance
# table). Both take either layout and return (out, new_state) without touching their inputs;
# new_state is the whole state tensor, slots no row names left as they were.


def _su_silu_np(v):
    return v / (1.0 + np.exp(-v))


def _su_softplus_np(v):
    return np.where(v <= 20.0, np.log1p(np.exp(np.minimum(v, 20.0))), v)


def state_update_numpy(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, *,
                       dt_softplus=False, state_batch_indices=None):
    """(out, new_state) as float64 NumPy arrays, shaped like x and state."""
    mamba1 = np.ndim(state) == 3
    s, x, dt, A, B, C = (_np64(a) for a in (state, x, dt, A, B, C))
    D, z, dt_bias = (_np64(a) for a in (D, z, dt_bias))
    if mamba1:  # as Mamba-2 with one head and one group
        s, x, dt, A, B, C = s[:, None], x[:, None], dt[:, None], A[None], B[:, None], C[:, None]
        D, z, dt_bias = (None if a is None else a[None] if a.ndim == 1 else a[:, None]
                         for a in (D, z, dt_bias))
    batch, nheads = x.shape[0], s.shape[1]
    heads_per_group = nheads // B.shape[1]
    slots = (np.arange(batch) if state_batch_indices is None
             else _np64(state_batch_indices).astype(np.int64))
    d = dt if dt_bias is None else dt + dt_bias
    if dt_softplus:
        d = _su_softplus_np(d)
    Bh = np.repeat(B, heads_per_group, axis=1)[:, :, None, :]  # (batch, nheads, 1, dstate)
    Ch = np.repeat(C, heads_per_group, axis=1)[:, :, None, :]
    live = slots >= 0
    new = s.copy()
    nxt = (s[slots[live]] * np.exp(A[None] * d[live][..., None])
           + Bh[live] * (d * x)[live][..., None])
    new[slots[live]] = nxt
    y = (nxt * Ch[live]).sum(-1)
    if D is not None:
        y = y + D * x[live]
    if z is not None:
        y = y * _su_silu_np(z[live])
    out = np.zeros(x.shape)
    out[live] = y
    if mamba1:
        return out[:, 0], new[:, 0]
    return out, new


def state_update_torch(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, *,
                       dt_softplus=False, state_batch_indices=None, precision=torch.float64):
    """(out, new_state) computed in `precision` on the CPU, as state_update_numpy."""
    def t(a):
        return None if a is None else a.detach().to("cpu", precision)
    mamba1 = state.dim() == 3
    s, x, dt, A, B, C, D, z, dt_bias = (t(a) for a in (state, x, dt, A, B, C, D, z, dt_bias))
    if mamba1:
        s, x, dt, A, B, C = (s[:, None], x[:, None], dt[:, None], A[None], B[:, None],
                             C[:, None])
        D, z, dt_bias = (None if a is None else a[None] if a.dim() == 1 else a[:, None]
                         for a in (D, z, dt_bias))
    batch, nheads = x.shape[0], s.shape[1]
    heads_per_group = nheads // B.shape[1]
    slots = (torch.arange(batch) if state_batch_indices is None
             else state_batch_indices.detach().cpu().long())
    d = dt if dt_bias is None else dt + dt_bias
    if dt_softplus:
        d = torch.where(d <= 20.0, torch.log1p(torch.exp(d.clamp(max=20.0))), d)
    live = slots >= 0
    Bh = B.repeat_interleave(heads_per_group, 1)[live][:, :, None, :]
    Ch = C.repeat_interleave(heads_per_group, 1)[live][:, :, None, :]
    nxt = (s[slots[live]] * torch.exp(A[None] * d[live][..., None])
           + Bh * (d * x)[live][..., None])
    new = s.clone()
    new[slots[live]] = nxt
    y = (nxt * Ch).sum(-1)
    if D is not None:
        y = y + D * x[live]
    if z is not None:
        y = y * torch.nn.functional.silu(z[live])
    out = torch.zeros(x.shape, dtype=precision)
    out[live] = y
    if mamba1:
        return out[:, 0], new[:, 0]
    return out, new


STATE_UPDATE_INPUT_NAMES = ("state", "x", "dt", "A", "B", "C", "D", "z", "dt_bias",
                            "state_batch_indices")


@dataclasses.dataclass(frozen=True)
class StateUpdateCase:
    """One decode-step configuration. layout: "mamba1" (state (batch_state, dim, dstate), where
    headdim is dim) or "mamba2". tie: Mamba-2's broadcast operands, dt (batch, nheads) and
    dt_bias, D and A (nheads,) repeated with stride 0 along headdim (and dstate for A).
    indices: None, "perm" (the rows use a shuffled subset of batch_state slots) or "pad" (the
    same with every third row a padding row, index -1); index_dtype its dtype. extra_slots:
    state rows beyond those the rows use (untouched)."""
    layout: str = "mamba2"
    batch: int = 3
    nheads: int = 4
    headdim: int = 5
    dstate: int = 16
    ngroups: int = 2
    D: bool = False
    z: bool = False
    dt_bias: bool = False
    softplus: bool = False
    tie: bool = False
    indices: str = None
    index_dtype: str = "int64"
    extra_slots: int = 0

    def replace(self, **kw):
        return dataclasses.replace(self, **kw)

    @property
    def batch_state(self):
        return self.batch + self.extra_slots + (2 if self.indices else 0)

    def options(self):
        return dict(dt_softplus=self.softplus)

    def label(self):
        """A short test id: the fields that differ from the default case."""
        base = StateUpdateCase()
        diff = [f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self)
                if getattr(self, f.name) != getattr(base, f.name)]
        return ",".join(diff) or "base"


def make_state_update_inputs(case, dtype, seed, device="cpu", state_dtype=None, dtypes=None):
    """Inputs for `case` as torch tensors on `device`: the state in state_dtype (default
    `dtype`), every other float operand in `dtype` unless `dtypes` names another for it; absent
    operands are None. Values are drawn in float64 and rounded once. A in [-2, -0.1] and dt
    in [0, 0.5) (dt_bias in [-0.25, 0.25)) decay the state by exp(A dt) between 0.37 and 1, as
    trained Mamba layers do."""
    g = torch.Generator().manual_seed(seed)
    dtypes = dict(dtypes or {})
    m2 = case.layout == "mamba2"
    b, h, p, n, G = case.batch, case.nheads, case.headdim, case.dstate, case.ngroups
    rows = (b, h, p) if m2 else (b, p)
    channel = (h, p) if m2 else (p,)

    def draw(name, shape, kind="randn", default=None):
        if kind == "randn":
            a = torch.randn(shape, generator=g, dtype=torch.float64)
        elif kind == "dt":
            a = 0.5 * torch.rand(shape, generator=g, dtype=torch.float64)
        elif kind == "bias":
            a = 0.5 * torch.rand(shape, generator=g, dtype=torch.float64) - 0.25
        else:  # "A"
            a = -0.1 - 1.9 * torch.rand(shape, generator=g, dtype=torch.float64)
        return a.to(dtypes.get(name, default or dtype)).to(device)

    def per_head(name, kind, full_shape):
        """Mamba-2's tied operand: one value per head (and row of dt), stride 0 elsewhere."""
        lead = (b, h) if name == "dt" else (h,)
        base = draw(name, lead, kind)
        return base.reshape(lead + (1,) * (len(full_shape) - len(lead))).expand(full_shape)

    tie = case.tie and m2
    inputs = {
        "state": draw("state", (case.batch_state,) + ((h, p, n) if m2 else (p, n)),
                      default=state_dtype or dtype),
        "x": draw("x", rows),
        "dt": per_head("dt", "dt", rows) if tie else draw("dt", rows, "dt"),
        "A": per_head("A", "A", (h, p, n)) if tie else draw("A", (h, p, n) if m2 else (p, n),
                                                            "A"),
        "B": draw("B", (b, G, n) if m2 else (b, n)),
        "C": draw("C", (b, G, n) if m2 else (b, n)),
        "D": (per_head("D", "randn", channel) if tie else draw("D", channel)) if case.D
        else None,
        "z": draw("z", rows) if case.z else None,
        "dt_bias": ((per_head("dt_bias", "bias", channel) if tie else
                     draw("dt_bias", channel, "bias")) if case.dt_bias else None),
        "state_batch_indices": None,
    }
    if case.indices:
        slots = torch.randperm(case.batch_state, generator=g)[:b]
        if case.indices == "pad":
            slots[::3] = -1
        inputs["state_batch_indices"] = slots.to(getattr(torch, case.index_dtype)).to(device)
    return inputs


def state_update_references(inputs, options):
    """{"out": (float64 reference, plain float32 evaluation), "state": (...)}: the NumPy formula
    is the reference, the torch formula run in float32 the baseline of assert_close."""
    ref_out, ref_state = state_update_numpy(**inputs, **options)
    plain_out, plain_state = state_update_torch(**inputs, **options, precision=torch.float32)
    return {"out": (torch.from_numpy(ref_out), plain_out),
            "state": (torch.from_numpy(ref_state), plain_state)}


# ---------------------------------------------------------------------------------------------
# Causal depthwise conv1d: the formulas in src_cuda/include/libssm/conv1d.h, written in NumPy
# (loops over positions, forward and decode step) and in torch (shifted slices, differentiable in
# every input). Positions -(W-1) .. -1 come from initial_states; with seq_idx an output reads
# only inputs of its own packed sequence, and positions below 0 belong to position 0's.


def conv1d_numpy(x, weight, bias=None, initial_states=None, seq_idx=None, silu=False):
    """Returns (out, final_states) as float64 arrays."""
    x, weight, bias, init = (_np64(a) for a in (x, weight, bias, initial_states))
    sid = None if seq_idx is None else np.asarray(seq_idx.cpu() if isinstance(
        seq_idx, torch.Tensor) else seq_idx)
    batch, dim, seqlen = x.shape
    width = weight.shape[1]

    def xs(b, c, p):
        if p >= 0:
            return x[b, c, p]
        return 0.0 if init is None else init[b, c, p + width - 1]

    def seq(b, p):
        return sid[b, max(p, 0)]

    out = np.empty((batch, dim, seqlen))
    final = np.zeros((batch, dim, width - 1))
    for b in range(batch):
        for c in range(dim):
            for t in range(seqlen):
                z = 0.0 if bias is None else bias[c]
                for k in range(width):
                    p = t - (width - 1) + k
                    if sid is None or seq(b, p) == seq(b, t):
                        z += weight[c, k] * xs(b, c, p)
                out[b, c, t] = z / (1.0 + np.exp(-z)) if silu else z
            for j in range(width - 1):
                p = seqlen - (width - 1) + j
                if sid is None or seqlen == 0 or seq(b, p) == seq(b, seqlen - 1):
                    final[b, c, j] = xs(b, c, p)
    return out, final


def conv1d_torch(x, weight, bias=None, initial_states=None, seq_idx=None, silu=False):
    """The same formula in the inputs' dtype, differentiable in x, weight, bias and
    initial_states. Returns (out, final_states)."""
    batch, dim, seqlen = x.shape
    width = weight.shape[1]
    init = initial_states if initial_states is not None else \
        x.new_zeros((batch, dim, width - 1))
    xs = torch.cat([init, x], dim=-1)  # position p at index p + width - 1
    if seq_idx is not None and seqlen > 0:
        ids = torch.cat([seq_idx[:, :1].expand(batch, width - 1), seq_idx], dim=-1).to(x.device)
    else:
        ids = None
    out = x.new_zeros((batch, dim, seqlen)) if bias is None else \
        bias[None, :, None].expand(batch, dim, seqlen)
    for k in range(width):
        term = weight[None, :, k, None] * xs[..., k:k + seqlen]
        if ids is not None:
            term = term * (ids[:, k:k + seqlen] == ids[:, width - 1:])[:, None, :].to(x.dtype)
        out = out + term
    if silu:
        out = torch.nn.functional.silu(out)
    final = xs[..., seqlen:]
    if ids is not None:
        final = final * (ids[:, seqlen:] == ids[:, -1:])[:, None, :].to(x.dtype)
    return out, final


CONV1D_INPUT_NAMES = ("x", "weight", "bias", "initial_states")


def conv1d_reference(inputs, silu, dout=None, dfinal_states=None, precision=torch.float64):
    """Forward and, when dout is given, the gradients of every float input, from the torch
    formula on the CPU in `precision`. inputs: x, weight, bias, initial_states (tensors or
    None) and seq_idx. Returns CPU tensors: out, final_states and, with dout, d<name> for each
    present input, for the loss sum(out * dout) + sum(final_states * dfinal_states).

    With precision float64 this is the reference; with float32 it is the plain same-precision
    evaluation that assert_close takes as its baseline."""
    leaves = reference_leaves(inputs, CONV1D_INPUT_NAMES, precision, dout is not None)
    seq_idx = inputs.get("seq_idx")
    seq_idx = None if seq_idx is None else seq_idx.cpu()
    with torch.set_grad_enabled(dout is not None):
        out, final = conv1d_torch(leaves["x"], leaves["weight"], leaves.get("bias"),
                                  leaves.get("initial_states"), seq_idx, silu)
    result = {"out": out.detach(), "final_states": final.detach()}
    if dout is not None:
        result.update(leaf_gradients(leaves, [(out, dout), (final, dfinal_states)], precision))
    return result


def conv1d_update_numpy(x, conv_state, weight, bias=None, silu=False, cache_seqlens=None,
                        conv_state_indices=None):
    """One decode step. Returns (out, new conv_state) as float64 arrays; padding rows give zero
    output and leave their state alone."""
    x, state, weight, bias = (_np64(a) for a in (x, conv_state, weight, bias))
    state = state.copy()

    def ints(a):
        return None if a is None else np.asarray(a.cpu() if isinstance(a, torch.Tensor) else a)

    cache_seqlens, conv_state_indices = ints(cache_seqlens), ints(conv_state_indices)
    squeeze = x.ndim == 2
    x3 = x[..., None] if squeeze else x
    batch, dim, seqlen = x3.shape
    width, state_len = weight.shape[1], state.shape[2]
    out = np.zeros((batch, dim, seqlen))
    for b in range(batch):
        s = b if conv_state_indices is None else int(conv_state_indices[b])
        if s < 0:
            continue
        for c in range(dim):
            if cache_seqlens is None:
                v = np.concatenate([state[s, c], x3[b, c]])
                lead = state_len
            else:
                q = int(cache_seqlens[b])
                v = np.concatenate([[state[s, c, (q - (width - 1) + j) % state_len]
                                     for j in range(width - 1)], x3[b, c]])
                lead = width - 1
            for t in range(seqlen):
                z = (0.0 if bias is None else bias[c]) + sum(
                    weight[c, k] * v[lead + t - (width - 1) + k] for k in range(width))
                out[b, c, t] = z / (1.0 + np.exp(-z)) if silu else z
            if cache_seqlens is None:
                state[s, c] = v[seqlen:]
            else:
                for t in range(seqlen):
                    state[s, c, (q + t) % state_len] = x3[b, c, t]
    return (out[..., 0] if squeeze else out), state


@dataclasses.dataclass(frozen=True)
class Conv1dCase:
    """One conv1d configuration. layout: "seq" (contiguous along seqlen) or "channel_last";
    seq_idx: None, or the lengths of the packed sequences of every row, which must add up to
    seqlen (each row uses them in another order)."""
    batch: int = 2
    dim: int = 6
    seqlen: int = 37
    width: int = 4
    bias: bool = True
    silu: bool = True
    initial_states: bool = False
    final_states: bool = False
    seq_idx: tuple = None
    layout: str = "seq"

    def replace(self, **kw):
        return dataclasses.replace(self, **kw)

    def label(self):
        """A short test id: the fields that differ from the default case."""
        base = Conv1dCase()
        diff = [f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self)
                if getattr(self, f.name) != getattr(base, f.name)]
        return ",".join(diff).replace(" ", "") or "base"


def _seq_idx_for(case):
    """(batch, seqlen) int32 ids: row b takes the case's lengths rotated by b, numbered from b
    (so ids differ between rows and packed sequences differ within one)."""
    lengths = list(case.seq_idx)
    assert sum(lengths) == case.seqlen, "seq_idx lengths must add up to seqlen"
    rows = []
    for b in range(case.batch):
        order = lengths[b % len(lengths):] + lengths[:b % len(lengths)]
        rows.append(np.repeat(np.arange(len(order)) + b, order))
    return torch.from_numpy(np.array(rows, dtype=np.int32).reshape(case.batch, case.seqlen))


def in_layout(t, layout):
    """t (batch, dim, seqlen) in the layout: as it is, or channel-last (stride 1 along dim)."""
    if layout == "channel_last":
        return t.transpose(1, 2).contiguous().transpose(1, 2)
    return t.contiguous()


def make_conv1d_inputs(case, dtype, seed, device="cpu", dtypes=None):
    """x in `dtype` and the case's layout; weight, bias, initial_states in `dtype` unless
    `dtypes` names another for one of them; seq_idx int32. Values are drawn in float64 and
    rounded once; weights are scaled by 1/sqrt(width) as in nn.Conv1d's initialisation."""
    g = torch.Generator().manual_seed(seed)
    dtypes = dict(dtypes or {})
    b, d, l, w = case.batch, case.dim, case.seqlen, case.width

    def make(name, shape, scale=1.0):
        a = scale * torch.randn(shape, generator=g, dtype=torch.float64)
        return a.to(dtypes.get(name, dtype)).to(device)

    x = in_layout(make("x", (b, d, l)), case.layout)
    return {
        "x": x,
        "weight": make("weight", (d, w), w ** -0.5),
        "bias": make("bias", (d,), 0.5) if case.bias else None,
        "initial_states": make("initial_states", (b, d, w - 1)) if case.initial_states else None,
        "seq_idx": None if case.seq_idx is None else _seq_idx_for(case).to(device),
    }


def make_conv1d_cotangents(case, dtype, seed, device="cpu"):
    """dout like x (dtype, layout) and dfinal_states (float32) when the case returns final
    states, else None."""
    g = torch.Generator().manual_seed(seed ^ 0xC0417)
    b, d, l, w = case.batch, case.dim, case.seqlen, case.width
    dout = torch.randn((b, d, l), generator=g, dtype=torch.float64).to(dtype)
    dout = in_layout(dout, case.layout).to(device)
    dfinal = None
    if case.final_states:
        dfinal = torch.randn((b, d, w - 1), generator=g, dtype=torch.float64).float().to(device)
    return dout, dfinal
