"""How the selective-scan suites call libssm and judge what comes back: the rows of cases the CPU
and CUDA suites share, calls through the Python API, calls straight into the C entry points
through libssm's cffi handle (to hand in NaN-poisoned gradient buffers, or a bad params struct),
and the checks of every output and gradient against the float64 references."""
import torch

import harness
import libssm
from harness import dtype_of, poisoned_like
from references import (ALL_OPTIONS, INPUT_NAMES, ScanCase, assert_close, assert_close_to,
                        make_inputs, reference_outputs, selective_scan_numpy)

# Rows vary one axis at a time. Options are varied on the plain base; forms and sizes on the
# base with every option on, since that is what Mamba layers run and it exercises each input.
BASE = ScanCase()
FULL = BASE.replace(**ALL_OPTIONS)
OPTION_ROWS = (
    BASE,
    BASE.replace(D=True),
    BASE.replace(z=True),
    BASE.replace(delta_bias=True),
    BASE.replace(softplus=True),
    BASE.replace(delta_bias=True, softplus=True),
    BASE.replace(initial_state=True),
    BASE.replace(last_state=True),
    FULL,
)
FORM_ROWS = (
    FULL.replace(B_form="group", C_form="group", groups=1),
    FULL.replace(B_form="group", C_form="group", groups=2),
    FULL.replace(B_form="group", C_form="group", groups=3),
    FULL.replace(B_form="fixed", C_form="fixed"),
    FULL.replace(B_form="fixed", C_form="var"),
    FULL.replace(B_form="var", C_form="fixed"),
    FULL.replace(B_form="fixed", C_form="group", groups=3),
    FULL.replace(B_form="group", C_form="var", groups=2),
)
SIZE_ROWS = (
    FULL.replace(seqlen=1),
    FULL.replace(seqlen=64),
    FULL.replace(seqlen=129),
    FULL.replace(dstate=1),
    FULL.replace(dstate=7),
    FULL.replace(dstate=16),
    FULL.replace(dstate=64),
    FULL.replace(dstate=256, seqlen=19),
    FULL.replace(dim=1),
    FULL.replace(batch=1),
    FULL.replace(batch=3, dim=5),
)
ROWS = OPTION_ROWS + FORM_ROWS + SIZE_ROWS


def case_id(case):
    return case.label()


# ---------------------------------------------------------------------------------------------
# Calls through the Python API.


def forward_kwargs(case, inputs):
    return dict(D=inputs["D"], z=inputs["z"], delta_bias=inputs["delta_bias"],
                delta_softplus=case.softplus, initial_state=inputs["initial_state"],
                return_last_state=case.last_state)


def run_forward(case, inputs, out=None, **extra):
    """(out, last_state or None) from libssm.selective_scan."""
    result = libssm.selective_scan(inputs["u"], inputs["delta"], inputs["A"], inputs["B"],
                                   inputs["C"], out=out, **forward_kwargs(case, inputs), **extra)
    return result if case.last_state else (result, None)


def run_backward(case, inputs, dout, dlast_state, **extra):
    return libssm.selective_scan_bwd(
        inputs["u"], inputs["delta"], inputs["A"], inputs["B"], inputs["C"], dout,
        D=inputs["D"], z=inputs["z"], delta_bias=inputs["delta_bias"],
        delta_softplus=case.softplus, initial_state=inputs["initial_state"],
        dlast_state=dlast_state, **extra)


# ---------------------------------------------------------------------------------------------
# Checks.


def check_forward(case, inputs, out, last_state):
    """out against the NumPy float64 reference, in u's dtype; last_state float32 likewise, and
    absent when the case does not ask for it. Returns {name: (reference, plain evaluation)}
    for the outputs checked, for further comparisons."""
    ref_out, ref_last = selective_scan_numpy(delta_softplus=case.softplus, **inputs)
    plain = reference_outputs(inputs, case.softplus, precision=torch.float32)
    refs = {"out": (torch.from_numpy(ref_out), plain["out"])}
    assert dtype_of(out) == inputs["u"].dtype
    assert_close("out", out, *refs["out"])
    if case.last_state:
        refs["last_state"] = (torch.from_numpy(ref_last), plain["last_state"])
        assert dtype_of(last_state) == torch.float32
        assert_close("last_state", last_state, *refs["last_state"])
    else:
        assert last_state is None
    return refs


def check_backward(case, inputs, dout, dlast_state, grads, refs=None):
    """Every gradient against float64 autograd of the torch reference: present exactly for the
    inputs given, with its input's shape and dtype (dA, dD, ddelta_bias float32). Returns
    {name: (reference, plain evaluation)} like check_forward; pass that back as `refs` to check
    another set of gradients for the same inputs without recomputing."""
    if refs is None:
        ref = reference_outputs(inputs, case.softplus, dout, dlast_state)
        plain = reference_outputs(inputs, case.softplus, dout, dlast_state,
                                  precision=torch.float32)
        refs = {"d" + n: (ref["d" + n], plain["d" + n]) for n in INPUT_NAMES
                if inputs[n] is not None}
    assert tuple(grads._fields) == tuple("d" + n for n in INPUT_NAMES)
    for name in INPUT_NAMES:
        g = getattr(grads, "d" + name)
        if inputs[name] is None:
            assert g is None, f"d{name} given for an absent {name}"
            continue
        assert g is not None, f"d{name} missing"
        assert dtype_of(g) == inputs[name].dtype, f"d{name}: dtype {dtype_of(g)}"
        assert_close("d" + name, g, *refs["d" + name])
    return refs


def check_agree(results, expected, refs):
    """Two implementations' results (dicts by output name, e.g. GPU and the library's CPU path)
    agree within the bound each must meet against the reference."""
    for name, (ref64, plain) in refs.items():
        got = results[name]
        assert_close_to(name + " vs CPU", got, expected[name], ref64, plain, dtype_of(got))


# ---------------------------------------------------------------------------------------------
# Calls straight into the C entry points, with buffers the test owns.


class CApi(harness.CApi):
    """The shared cffi handle plus the selective scan's params, forward and backward."""

    def params(self, delta_softplus=False, struct_size=None):
        p = self.ffi.new("ssm_selective_scan_params *")
        p.struct_size = (self.ffi.sizeof("ssm_selective_scan_params")
                         if struct_size is None else struct_size)
        p.delta_softplus = int(delta_softplus)
        self._keep.append(p)
        return self.address(p)

    def _workspace(self, query, params, inputs):
        size = self.ffi.new("size_t *")
        self.check(query(params, *(self.dltensor(inputs[n]) for n in ("u", "A", "B", "C")),
                         self.address(size)))
        return self.workspace(size[0], inputs["u"].device)

    def forward(self, case, inputs, out, last_state=None, params=None):
        """ssm_selective_scan_fwd into the given out / last_state; raises libssm errors."""
        params = self.params(case.softplus) if params is None else params
        ws, nbytes = self._workspace(self.lib.ssm_selective_scan_fwd_workspace_size, params,
                                     inputs)
        dl = [self.dltensor(inputs[n]) for n in INPUT_NAMES]
        self.check(self.lib.ssm_selective_scan_fwd(
            params, *dl, self.dltensor(out), self.dltensor(last_state), ws, nbytes,
            self.stream_of(inputs["u"])))

    def backward(self, case, inputs, dout, dlast_state, grads, params=None):
        """ssm_selective_scan_bwd into grads (a dict d<name> -> tensor or None)."""
        params = self.params(case.softplus) if params is None else params
        ws, nbytes = self._workspace(self.lib.ssm_selective_scan_bwd_workspace_size, params,
                                     inputs)
        dl = [self.dltensor(inputs[n]) for n in INPUT_NAMES]
        dgrads = [self.dltensor(grads.get("d" + n)) for n in INPUT_NAMES]
        self.check(self.lib.ssm_selective_scan_bwd(
            params, *dl, self.dltensor(dout), self.dltensor(dlast_state), *dgrads, ws, nbytes,
            self.stream_of(inputs["u"])))


def poisoned_grads(inputs):
    return {"d" + n: poisoned_like(x) for n, x in inputs.items() if x is not None}


# ---------------------------------------------------------------------------------------------
# Layouts.


def _inside(x, pad_before, pad_after, step=1):
    """x's values in a view of a larger zero buffer: along the last axis, `pad_before` elements
    of storage offset, every `step`-th element, `pad_after` elements of slack."""
    length = x.shape[-1]
    big = torch.zeros(*x.shape[:-1], pad_before + step * length + pad_after, dtype=x.dtype,
                      device=x.device)
    view = big[..., pad_before:pad_before + step * length:step]
    view.copy_(x)
    return view


def _reordered(x, order):
    """x's values in memory laid out in axis order `order` (outermost first)."""
    inverse = [order.index(i) for i in range(x.dim())]
    return x.permute(*order).contiguous().permute(*inverse)


def strided_views(inputs):
    """The same values as `inputs`, each held by a non-contiguous view: transposed storage,
    every-other-element slices and storage offsets."""
    views = {
        "u": _reordered(inputs["u"], [0, 2, 1]),
        "delta": _inside(inputs["delta"], 3, 1, step=2),
        "A": _reordered(inputs["A"], [1, 0]),
        "B": _reordered(inputs["B"], list(range(inputs["B"].dim() - 2)) +
                        [inputs["B"].dim() - 1, inputs["B"].dim() - 2]),
        "C": _inside(inputs["C"], 2, 5),
        "D": _inside(inputs["D"], 1, 0, step=2),
        "z": _reordered(inputs["z"], [2, 0, 1]),
        "delta_bias": _inside(inputs["delta_bias"], 0, 2, step=3),
        "initial_state": _reordered(inputs["initial_state"], [2, 1, 0]),
    }
    for name, view in views.items():
        assert torch.equal(view, inputs[name]), name
    return views


def transposed_poison(shape, dtype, device="cpu"):
    """A NaN-filled tensor of `shape` whose memory runs in the opposite axis order."""
    return torch.full(tuple(reversed(shape)), float("nan"), dtype=dtype, device=device).permute(
        *reversed(range(len(shape))))


def mamba_layout(inputs, case):
    """Inputs laid out as a Mamba layer makes them: u and z the two halves of one in-projection;
    B and C column slices of one (batch * seqlen, dt_rank + 2 * dstate) projection viewed as
    (batch, dstate, seqlen), so they interleave in one buffer; delta in the (batch, seqlen, dim)
    memory order a linear layer leaves it in."""
    b, d, l, n = case.batch, case.dim, case.seqlen, case.dstate
    xz = torch.cat([inputs["u"], inputs["z"]], dim=1)
    rank = 3
    x_dbl = torch.zeros(b * l, rank + 2 * n, dtype=inputs["B"].dtype,
                        device=inputs["B"].device)
    x_dbl[:, rank:rank + n] = inputs["B"].transpose(1, 2).reshape(b * l, n)
    x_dbl[:, rank + n:] = inputs["C"].transpose(1, 2).reshape(b * l, n)
    views = dict(inputs)
    views["u"], views["z"] = xz[:, :d], xz[:, d:]
    views["B"] = x_dbl[:, rank:rank + n].reshape(b, l, n).transpose(1, 2)
    views["C"] = x_dbl[:, rank + n:].reshape(b, l, n).transpose(1, 2)
    views["delta"] = inputs["delta"].transpose(1, 2).contiguous().transpose(1, 2)
    for name in ("u", "z", "B", "C"):
        assert torch.equal(views[name], inputs[name]), name
    return views


def extreme_delta_and_z(case, dtype, seed):
    """Inputs whose delta and z sit far out on both sides: softplus(100) is 100 while exp(100)
    overflows float32 (a softplus without a threshold gives inf), and softplus(-100) and
    silu(-100) vanish."""
    inputs = make_inputs(case, dtype, seed)
    g = torch.Generator().manual_seed(seed)
    spread = torch.tensor([-100.0, -30.0, -5.0, 0.0, 5.0, 19.0, 21.0, 30.0, 100.0])
    for name in ("delta", "z"):
        picks = torch.randint(0, len(spread), inputs[name].shape, generator=g)
        inputs[name] = spread[picks].to(dtype)
    return inputs
