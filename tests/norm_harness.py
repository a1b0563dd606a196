"""How the fused-norm suites call libssm and judge what comes back: the rows of cases the CPU and
CUDA suites share, calls through the generic Python API (libssm.norm_fwd / norm_bwd and
rms_norm / layer_norm), calls straight into ssm_norm_fwd / ssm_norm_bwd with buffers the test
owns (NaN-poisoned, any dtype, any row stride), and the checks of every output and gradient
against the float64 references."""
import torch

import harness
import libssm
from harness import dtype_of, poisoned_like
from references import NormCase, assert_close, assert_close_to, norm_numpy, norm_reference

# Rows vary one axis at a time from BASE (RMSNorm with a weight, the common case). GATED is the
# Mamba-2 configuration (residual, gate applied before the norm, groups), the base for groups
# and sizes because it exercises every input.
BASE = NormCase()
LAYER = BASE.replace(kind="layer", bias=True, eps=1e-5)
GATED = BASE.replace(residual=True, prenorm=True, z=True, norm_before_gate=False, group_size=16)
OPTION_ROWS = (
    BASE,
    BASE.replace(weight=False),
    BASE.replace(bias=True),
    BASE.replace(zero_centered_weight=True),
    BASE.replace(residual=True),
    BASE.replace(prenorm=True),
    BASE.replace(residual=True, prenorm=True),
    BASE.replace(z=True),
    BASE.replace(z=True, norm_before_gate=False),
    BASE.replace(group_size=16),
    BASE.replace(eps=0.5),
    LAYER,
    LAYER.replace(bias=False),
    LAYER.replace(weight=False, bias=False),
    LAYER.replace(zero_centered_weight=True),
    LAYER.replace(residual=True, prenorm=True),
    LAYER.replace(z=True),
    LAYER.replace(z=True, norm_before_gate=False),
    LAYER.replace(group_size=12),
    GATED,
)
GROUP_ROWS = (
    GATED.replace(norm_before_gate=True),
    GATED.replace(group_size=1),
    GATED.replace(group_size=48),
    GATED.replace(kind="layer", bias=True, group_size=8),
    GATED.replace(zero_centered_weight=True, bias=True),
)
SIZE_ROWS = (
    GATED.replace(hidden=1, group_size=0),
    LAYER.replace(hidden=1, residual=True, z=True),
    GATED.replace(hidden=7, group_size=7),
    GATED.replace(hidden=7, group_size=1),
    LAYER.replace(hidden=7, residual=True, z=True),
    GATED.replace(lead=(1,)),
    LAYER.replace(lead=(1,), residual=True, z=True, norm_before_gate=False),
    GATED.replace(lead=(0,)),
    LAYER.replace(lead=(2, 0), residual=True),
    GATED.replace(lead=(37,), hidden=130, group_size=26),
    BASE.replace(lead=(2, 3, 4)),
)
ROWS = OPTION_ROWS + GROUP_ROWS + SIZE_ROWS


def case_id(case):
    return case.label()


def run_forward(case, inputs, **extra):
    """libssm.norm_fwd for the case: a NormForward."""
    return libssm.norm_fwd(inputs["x"], inputs["weight"], inputs["bias"], kind=case.kind,
                           residual=inputs["residual"], z=inputs["z"], eps=case.eps,
                           group_size=case.group_size or None,
                           norm_before_gate=case.norm_before_gate,
                           zero_centered_weight=case.zero_centered_weight,
                           want_residual_out=case.prenorm, **extra)


def run_norm(case, inputs, **extra):
    """libssm.rms_norm or libssm.layer_norm for the case: y, or (y, residual_out) if prenorm."""
    fn = libssm.layer_norm if case.kind == "layer" else libssm.rms_norm
    return fn(inputs["x"], inputs["weight"], inputs["bias"], residual=inputs["residual"],
              z=inputs["z"], eps=case.eps, group_size=case.group_size or None,
              norm_before_gate=case.norm_before_gate,
              zero_centered_weight=case.zero_centered_weight, prenorm=case.prenorm, **extra)


def run_backward(case, inputs, fwd, dy, dresidual_out, **extra):
    """libssm.norm_bwd for the case, given the forward's NormForward: a NormGrads."""
    return libssm.norm_bwd(backward_input(case, inputs, fwd.residual_out), dy, fwd.mean,
                           fwd.rstd, inputs["weight"], inputs["bias"], kind=case.kind,
                           z=inputs["z"], dresidual_out=dresidual_out, eps=case.eps,
                           group_size=case.group_size or None,
                           norm_before_gate=case.norm_before_gate,
                           zero_centered_weight=case.zero_centered_weight, **extra)


def backward_input(case, inputs, residual_out):
    """The normalised input s the backward takes: residual_out when a residual was added."""
    return residual_out if case.residual else inputs["x"]


def to_cpu(tensors):
    return {k: None if v is None else v.detach().cpu() for k, v in tensors.items()}


# ---------------------------------------------------------------------------------------------
# Checks.


def reference_forward(case, inputs):
    """{name: (float64 reference, plain float32 evaluation)} for y, residual_out, rstd and (for
    LayerNorm) mean. The NumPy formula is the reference; the torch formula run in float32 is the
    baseline."""
    ref = norm_numpy(**to_cpu(inputs), **case.options())
    plain = norm_reference(to_cpu(inputs), case.options(), precision=torch.float32)
    names = ("y", "residual_out", "rstd") + (("mean",) if case.kind == "layer" else ())
    return {n: (torch.from_numpy(ref[n]), plain[n]) for n in names}


def check_forward(case, inputs, fwd, residual_dtype=None, refs=None):
    """Every field of a NormForward against the references: y in x's dtype; residual_out in
    residual_dtype (else residual's, else x's dtype), present exactly when asked for, when a
    residual was added or when its dtype differs from x's; mean (LayerNorm only) and rstd
    float32, (rows,) for one group, else (rows, ngroups). Returns the references used."""
    refs = refs or reference_forward(case, inputs)
    x = inputs["x"]
    assert tuple(fwd._fields) == ("y", "residual_out", "mean", "rstd")
    assert dtype_of(fwd.y) == dtype_of(x)
    assert_close("y", fwd.y, *refs["y"])
    stream_dtype = residual_dtype or dtype_of(inputs["residual"] if case.residual else x)
    if case.residual or case.prenorm or stream_dtype != dtype_of(x):
        assert fwd.residual_out is not None, "residual_out missing"
        assert dtype_of(fwd.residual_out) == stream_dtype, dtype_of(fwd.residual_out)
        assert_close("residual_out", fwd.residual_out, *refs["residual_out"])
    else:
        assert fwd.residual_out is None, "residual_out returned but not asked for"
    if case.kind == "layer":
        assert dtype_of(fwd.mean) == torch.float32
        assert_close("mean", fwd.mean, *refs["mean"])
    else:
        assert fwd.mean is None, "mean returned for RMSNorm"
    assert dtype_of(fwd.rstd) == torch.float32
    assert_close("rstd", fwd.rstd, *refs["rstd"])
    return refs


def reference_backward(case, s, inputs, dy, dresidual_out):
    """{name: (float64 reference, plain float32 evaluation)} for dx, dweight, dbias, dz: the
    formula's gradients at the s the backward is given (the forward's rounded residual_out)."""
    at_s = to_cpu(dict(inputs, x=s, residual=None))
    dy, dres = to_cpu({"dy": dy, "dres": dresidual_out}).values()
    ref = norm_reference(at_s, case.options(), dy, dres)
    plain = norm_reference(at_s, case.options(), dy, dres, precision=torch.float32)
    return {n: (ref[n], plain[n]) for n in ("dx", "dweight", "dbias", "dz") if n in ref}


def check_backward(case, s, inputs, dy, dresidual_out, grads, dresidual_dtype=None, refs=None):
    """Every field of a NormGrads against float64 autograd of the torch formula: dx in s's dtype,
    dresidual (the same values) in dresidual_dtype when given, else None; dweight, dbias, dz in
    their inputs' dtypes, None when the input is absent. Returns the references used."""
    refs = refs or reference_backward(case, s, inputs, dy, dresidual_out)
    assert tuple(grads._fields) == ("dx", "dresidual", "dweight", "dbias", "dz")
    assert dtype_of(grads.dx) == dtype_of(s), dtype_of(grads.dx)
    assert_close("dx", grads.dx, *refs["dx"])
    if dresidual_dtype is None:
        assert grads.dresidual is None, "dresidual returned but not asked for"
    else:
        assert dtype_of(grads.dresidual) == dresidual_dtype, dtype_of(grads.dresidual)
        assert_close("dresidual", grads.dresidual, *refs["dx"])
    for name in ("weight", "bias", "z"):
        g = getattr(grads, "d" + name)
        if inputs[name] is None:
            assert g is None, f"d{name} given for an absent {name}"
            continue
        assert g is not None, f"d{name} missing"
        assert dtype_of(g) == dtype_of(inputs[name]), f"d{name}: dtype {dtype_of(g)}"
        assert_close("d" + name, g, *refs["d" + name])
    return refs


def check_agree(got, expected, refs):
    """Two implementations' results (dicts by name, e.g. GPU and the library's CPU path) agree
    within the bound each must meet against the reference; `refs` maps result names to
    (reference, plain), and `got` may use other names for the same values (dresidual: dx)."""
    for name, value in got.items():
        if value is None:
            continue
        ref64, plain = refs["dx" if name == "dresidual" else name]
        assert_close_to(name + " vs CPU", value, expected[name], ref64, plain, dtype_of(value))


# ---------------------------------------------------------------------------------------------
# Calls straight into the C entry points, with buffers the test owns.


class NormCApi(harness.CApi):
    """The shared cffi handle plus ssm_norm_fwd / ssm_norm_bwd on torch tensors (2-d row views,
    or anything the test wants to hand over as it is)."""

    def params(self, case, struct_size=None, **override):
        p = self.keep(self.ffi.new("ssm_norm_params *"))
        p.struct_size = self.ffi.sizeof("ssm_norm_params") if struct_size is None else struct_size
        fields = dict(kind=int(case.kind == "layer"), eps=case.eps, group_size=case.group_size,
                      zero_centered_weight=int(case.zero_centered_weight),
                      norm_before_gate=int(case.norm_before_gate))
        fields.update(override)
        for name, value in fields.items():
            setattr(p, name, value)
        return self.address(p)

    def forward(self, case, inputs, y, residual_out=None, mean=None, rstd=None, params=None):
        """ssm_norm_fwd into the given outputs; raises libssm errors."""
        params = self.params(case) if params is None else params
        dl = {n: self.dltensor(rows2d(inputs[n])) for n in ("x", "residual", "weight", "bias",
                                                          "z")}
        self.check(self.lib.ssm_norm_fwd(
            params, dl["x"], dl["residual"], dl["weight"], dl["bias"], dl["z"],
            self.dltensor(rows2d(y)), self.dltensor(rows2d(residual_out)), self.dltensor(mean),
            self.dltensor(rstd), self.stream_of(inputs["x"])))

    def backward(self, case, s, inputs, mean, rstd, dy, dresidual_out, grads, params=None):
        """ssm_norm_bwd into grads (a dict dx/dresidual/dweight/dbias/dz -> tensor or None),
        with a workspace of the size the library asks for."""
        params = self.params(case) if params is None else params
        x, weight = self.dltensor(rows2d(s)), self.dltensor(inputs["weight"])
        size = self.keep(self.ffi.new("size_t *"))
        self.check(self.lib.ssm_norm_bwd_workspace_size(params, x, weight, self.address(size)))
        ws, nbytes = self.workspace(size[0], s.device)
        out = [self.dltensor(rows2d(grads.get(n))) for n in ("dx", "dresidual", "dweight",
                                                             "dbias", "dz")]
        self.check(self.lib.ssm_norm_bwd(
            params, x, weight, self.dltensor(inputs["bias"]), self.dltensor(rows2d(inputs["z"])),
            self.dltensor(mean), self.dltensor(rstd), self.dltensor(rows2d(dy)),
            self.dltensor(rows2d(dresidual_out)), *out, ws, nbytes, self.stream_of(s)))


def rows2d(t):
    """A (..., hidden) tensor as the (rows, hidden) view the C API takes (vectors unchanged). A
    view, never a copy, so outputs are written in place."""
    if t is None or t.dim() <= 2:
        return t
    return t.view(-1, t.shape[-1])


def stats_shape(case):
    return (case.rows,) if case.ngroups == 1 else (case.rows, case.ngroups)


def poisoned_forward(case, inputs, y_dtype=None, residual_dtype=None):
    """NaN-filled y, residual_out (None when the case has no residual stream), mean (LayerNorm)
    and rstd for the C forward."""
    x = inputs["x"]
    stream = case.residual or case.prenorm or residual_dtype is not None
    stats = torch.full(stats_shape(case), float("nan"), device=x.device)
    return {"y": poisoned_like(x, y_dtype),
            "residual_out": poisoned_like(x, residual_dtype) if stream else None,
            "mean": stats.clone() if case.kind == "layer" else None,
            "rstd": stats}


def poisoned_grads(s, inputs, dresidual_dtype=None):
    """NaN-filled buffers for every gradient that applies: dx like s (the backward's input),
    dresidual in dresidual_dtype when given, dweight, dbias, dz like their inputs."""
    grads = {"dx": poisoned_like(s),
             "dresidual": poisoned_like(s, dresidual_dtype) if dresidual_dtype else None}
    for name in ("weight", "bias", "z"):
        grads["d" + name] = None if inputs[name] is None else poisoned_like(inputs[name])
    return grads


def c_forward_backward(case, inputs, dy, dresidual_out, y_dtype=None, residual_dtype=None,
                       dresidual_dtype=None):
    """The forward and backward through the C entry points into NaN-poisoned buffers:
    (NormForward, s, NormGrads) as the library wrote them."""
    api = NormCApi()
    out = poisoned_forward(case, inputs, y_dtype, residual_dtype)
    api.forward(case, inputs, **out)
    fwd = libssm.NormForward(**out)
    s = backward_input(case, inputs, fwd.residual_out)
    grads = poisoned_grads(s, inputs, dresidual_dtype)
    api.backward(case, s, inputs, fwd.mean, fwd.rstd, dy, dresidual_out, grads)
    return fwd, s, libssm.NormGrads(**grads)


def row_strided(t, pad=5, offset=3):
    """t's values in a view whose rows sit `pad` elements apart beyond hidden, `offset` elements
    into a larger buffer: the hidden axis stays contiguous, the rows do not."""
    hidden = t.shape[-1]
    big = torch.zeros(*t.shape[:-1], hidden + pad, dtype=t.dtype, device=t.device)
    flat = torch.zeros(big.numel() + offset, dtype=t.dtype, device=t.device)
    view = flat[offset:].view(big.shape)[..., :hidden]
    view.copy_(t)
    return view


def storage_copy(view):
    """A copy of the whole storage under `view`, for only_view_written."""
    return torch.empty(0, dtype=view.dtype, device=view.device).set_(
        view.untyped_storage()).clone()


def only_view_written(view, before):
    """Whether the storage under `view` differs from `before` (its storage_copy taken earlier)
    only inside the view: strided outputs must leave the gaps between rows alone."""
    after = storage_copy(view)
    for flat in (after, before):
        torch.as_strided(flat, view.shape, view.stride(), view.storage_offset()).fill_(0)
    return torch.equal(after, before)
