"""Bad input to the fused norm: each row breaks one argument and expects the libssm exception for
it, a message that starts with the argument's name and says what was expected, and every array
of the call (the NaN-poisoned out= included) left exactly as it was. Rows run through the
generic layer with torch and with NumPy arrays; the rest call ssm_norm_fwd / ssm_norm_bwd
directly, with NaN-poisoned outputs that must stay NaN."""
import pytest
import torch

import libssm
from harness import as_framework, check_error, snapshot
from norm_harness import NormCApi
from references import NormCase

LEAD, HIDDEN, GROUP = (3, 4), 12, 4
ROWS = 12
NAN = float("nan")
CASE = NormCase(kind="layer", lead=LEAD, hidden=HIDDEN, bias=True, residual=True, z=True,
                group_size=GROUP)


def valid_inputs():
    g = torch.Generator().manual_seed(4321)
    shape = LEAD + (HIDDEN,)
    return {
        "x": torch.randn(shape, generator=g),
        "residual": torch.randn(shape, generator=g),
        "z": torch.randn(shape, generator=g),
        "weight": torch.randn(HIDDEN, generator=g),
        "bias": torch.randn(HIDDEN, generator=g),
        "out": torch.full(shape, NAN),
        "eps": 1e-5,
        "group_size": GROUP,
        "kind": "layer",
        "zero_centered_weight": False,
    }


def _set(name, value):
    def mutate(x):
        x[name] = value(x) if callable(value) else value
    return mutate


def _hidden(n):
    def mutate(x):
        for name in ("x", "residual", "z"):
            x[name] = torch.randn(LEAD + (n,))
        x["out"] = torch.full(LEAD + (n,), NAN)
        for name in ("weight", "bias"):
            x[name] = torch.randn(n)
        x["group_size"] = None
    return mutate


def _overlapping_out(x):
    # Rows of 12 elements start 6 apart: neighbouring rows share memory.
    base = torch.full((ROWS * 6 + HIDDEN,), NAN)
    x["out"] = base.as_strided(LEAD + (HIDDEN,), (LEAD[1] * 6, 6, 1))


def _out_overlaps_z(x):
    big = torch.randn(LEAD + (2 * HIDDEN,))
    x["z"] = big[..., :HIDDEN]
    x["out"] = big[..., 1:HIDDEN + 1]


def _x_rows_not_one_stride(x):
    # Leading axes swapped: (3, 4) rows whose strides (12, 36) cannot be flattened into one.
    x["x"] = x["x"].transpose(0, 1).contiguous().transpose(0, 1)


# (id, argument the message must name, mutation, exception, fragments the message must hold)
FORWARD_ROWS = [
    ("x-float64", "x", _set("x", lambda x: x["x"].double()), libssm.DTypeError, ["float64"]),
    ("x-int32", "x", _set("x", lambda x: x["x"].int()), libssm.DTypeError, ["int32"]),
    ("residual-float64", "residual", _set("residual", lambda x: x["residual"].double()),
     libssm.DTypeError, ["float64"]),
    ("z-int64", "z", _set("z", lambda x: x["z"].long()), libssm.DTypeError, ["int64"]),
    ("weight-float64", "weight", _set("weight", lambda x: x["weight"].double()),
     libssm.DTypeError, ["float64"]),
    ("bias-int32", "bias", _set("bias", lambda x: x["bias"].int()), libssm.DTypeError,
     ["int32"]),
    ("weight-hidden", "weight", _set("weight", torch.randn(HIDDEN + 1)), libssm.ShapeError,
     ["(12,)", "(13,)"]),
    ("weight-ndim2", "weight", _set("weight", torch.randn(1, HIDDEN)), libssm.ShapeError,
     ["(hidden,)"]),
    ("bias-hidden", "bias", _set("bias", torch.randn(HIDDEN - 1)), libssm.ShapeError,
     ["(12,)"]),
    ("residual-hidden", "residual", _set("residual", torch.randn(LEAD + (HIDDEN + 1,))),
     libssm.ShapeError, ["(3, 4, 12)"]),
    ("residual-lead-transposed", "residual", _set("residual", torch.randn(4, 3, HIDDEN)),
     libssm.ShapeError, ["(3, 4, 12)", "(4, 3, 12)"]),
    ("z-rows", "z", _set("z", torch.randn(2, 4, HIDDEN)), libssm.ShapeError, ["(3, 4, 12)"]),
    ("out-shape", "out", _set("out", torch.full((3, 4, HIDDEN - 1), NAN)), libssm.ShapeError,
     ["(3, 4, 12)"]),
    ("hidden-0", "x", _hidden(0), libssm.ShapeError, ["hidden"]),
    ("hidden-65537", "x", _hidden(65537), libssm.UnsupportedError, ["65537", "65536"]),
    ("group_size-not-dividing", "params", _set("group_size", 5), libssm.InvalidArgumentError,
     ["group_size", "5", "12"]),
    ("group_size-negative", "params", _set("group_size", -4), libssm.InvalidArgumentError,
     ["group_size", "-4"]),
    ("eps-negative", "params", _set("eps", -1e-3), libssm.InvalidArgumentError, ["eps"]),
    ("eps-nan", "params", _set("eps", NAN), libssm.InvalidArgumentError, ["eps"]),
    ("eps-inf", "params", _set("eps", float("inf")), libssm.InvalidArgumentError, ["eps"]),
    ("kind-unknown", "kind", _set("kind", "batch"), libssm.InvalidArgumentError,
     ["'rms'", "'layer'", "batch"]),
    ("zero-centred-without-weight", "params",
     lambda x: x.update(weight=None, zero_centered_weight=True), libssm.InvalidArgumentError,
     ["zero_centered_weight", "weight"]),
    ("x-hidden-stride-2", "x", _set("x", lambda x: torch.randn(LEAD + (2 * HIDDEN,))[..., ::2]),
     libssm.LayoutError, ["stride", "contiguous"]),
    ("weight-stride-2", "weight", _set("weight", lambda x: torch.randn(2 * HIDDEN)[::2]),
     libssm.LayoutError, ["stride", "contiguous"]),
    ("x-rows-not-one-stride", "x", _x_rows_not_one_stride, libssm.LayoutError,
     ["flattened", "(3, 4, 12)"]),
    ("out-overlaps-itself", "out", _overlapping_out, libssm.LayoutError, ["overlap"]),
    ("out-is-x", "out", _set("out", lambda x: x["x"]), libssm.LayoutError, ["input x"]),
    ("out-overlaps-z", "out", _out_overlaps_z, libssm.LayoutError, ["input z"]),
    ("x-not-an-array", "x", _set("x", lambda x: x["x"].tolist()), libssm.InvalidArgumentError,
     ["__dlpack__"]),
    ("weight-not-an-array", "weight", _set("weight", lambda x: x["weight"].tolist()),
     libssm.InvalidArgumentError, ["__dlpack__"]),
]


def run_norm_fwd(x):
    return libssm.norm_fwd(x["x"], x["weight"], x["bias"], kind=x["kind"], residual=x["residual"],
                           z=x["z"], eps=x["eps"], group_size=x["group_size"],
                           zero_centered_weight=x["zero_centered_weight"], out=x["out"])


@pytest.mark.parametrize("framework", ["torch", "numpy"])
@pytest.mark.parametrize("row", FORWARD_ROWS, ids=[r[0] for r in FORWARD_ROWS])
def test_forward_bad_input(row, framework):
    _, argument, mutate, exc, fragments = row
    x = valid_inputs()
    mutate(x)
    x = as_framework(x, framework)
    before = snapshot(x)
    with pytest.raises(exc) as excinfo:
        run_norm_fwd(x)
    check_error(excinfo, exc, argument, fragments)
    assert snapshot(x) == before, "a failed call changed its arguments"


@pytest.mark.parametrize("framework", ["torch", "numpy"])
def test_valid_inputs_pass(framework):
    # The rows above fail because of their one change: the unchanged inputs are accepted, and
    # the NaN-filled out= is then written.
    x = as_framework(valid_inputs(), framework)
    fwd = run_norm_fwd(x)
    assert fwd.y is x["out"]
    assert not torch.isnan(torch.as_tensor(x["out"])).any()


@pytest.mark.parametrize("fn", [libssm.rms_norm, libssm.layer_norm], ids=["rms", "layer"])
def test_user_calls_name_the_argument(fn):
    # rms_norm / layer_norm report bad input like norm_fwd does.
    x = valid_inputs()
    with pytest.raises(libssm.ShapeError) as excinfo:
        fn(x["x"], torch.randn(HIDDEN + 2), residual=x["residual"])
    check_error(excinfo, libssm.ShapeError, "weight", ["(12,)", "(14,)"])


# ---------------------------------------------------------------------------------------------
# Backward.


def valid_backward_inputs():
    x = valid_inputs()
    fwd = run_norm_fwd(x)
    shape = LEAD + (HIDDEN,)
    g = torch.Generator().manual_seed(99)
    return {"s": fwd.residual_out, "dy": torch.randn(shape, generator=g), "mean": fwd.mean,
            "rstd": fwd.rstd, "weight": x["weight"], "bias": x["bias"], "z": x["z"],
            "dresidual_out": torch.randn(shape, generator=g), "kind": "layer",
            "group_size": GROUP, "needs": None}


def run_norm_bwd(b):
    return libssm.norm_bwd(b["s"], b["dy"], b["mean"], b["rstd"], b["weight"], b["bias"],
                           kind=b["kind"], z=b["z"], dresidual_out=b["dresidual_out"], eps=1e-5,
                           group_size=b["group_size"], needs=b["needs"])


BACKWARD_ROWS = [
    ("dy-shape", "dy", _set("dy", torch.randn(3, 4, HIDDEN + 1)), libssm.ShapeError,
     ["(3, 4, 12)"]),
    ("dy-float64", "dy", _set("dy", lambda b: b["dy"].double()), libssm.DTypeError,
     ["float64"]),
    ("dresidual_out-rows", "dresidual_out", _set("dresidual_out", torch.randn(4, 4, HIDDEN)),
     libssm.ShapeError, ["(3, 4, 12)"]),
    ("x-float64", "x", _set("s", lambda b: b["s"].double()), libssm.DTypeError, ["float64"]),
    ("mean-missing", "mean", _set("mean", None), libssm.InvalidArgumentError, ["NULL"]),
    ("mean-for-rms", "mean", _set("kind", "rms"), libssm.InvalidArgumentError, ["RMSNorm"]),
    ("rstd-float16", "rstd", _set("rstd", lambda b: b["rstd"].half()), libssm.DTypeError,
     ["float32", "float16"]),
    ("rstd-rows", "rstd", _set("rstd", torch.ones(ROWS + 1, HIDDEN // GROUP)), libssm.ShapeError,
     ["(12, 3)"]),
    ("rstd-one-group-shape", "rstd", _set("rstd", torch.ones(ROWS)), libssm.ShapeError,
     ["(rows, ngroups)", "(12, 3)"]),
    ("mean-groups", "mean", _set("mean", torch.zeros(ROWS, 2)), libssm.ShapeError, ["(12, 3)"]),
    ("group_size-other-than-forward", "mean", _set("group_size", 6), libssm.ShapeError,
     ["(12, 2)", "(12, 3)"]),
    ("needs-dweight-without-weight", "needs",
     lambda b: b.update(weight=None, needs=(True, False, True, False, False)),
     libssm.InvalidArgumentError, ["dweight", "weight"]),
    ("needs-wrong-length", "needs", _set("needs", (True, True)), libssm.InvalidArgumentError,
     ["5"]),
]


@pytest.mark.parametrize("framework", ["torch", "numpy"])
@pytest.mark.parametrize("row", BACKWARD_ROWS, ids=[r[0] for r in BACKWARD_ROWS])
def test_backward_bad_input(row, framework):
    _, argument, mutate, exc, fragments = row
    b = valid_backward_inputs()
    mutate(b)
    b = as_framework(b, framework)
    before = snapshot(b)
    with pytest.raises(exc) as excinfo:
        run_norm_bwd(b)
    check_error(excinfo, exc, argument, fragments)
    assert snapshot(b) == before


def test_valid_backward_inputs_pass():
    grads = run_norm_bwd(valid_backward_inputs())
    assert all(torch.isfinite(g).all() for g in grads if g is not None)


# ---------------------------------------------------------------------------------------------
# The C entry points directly: every output starts NaN and must stay NaN after a failure.


class CCall:
    """One ssm_norm_fwd or ssm_norm_bwd call on valid 2-d tensors, NaN-poisoned outputs,
    with any argument replaced by a raw address (0 for NULL)."""

    def __init__(self, api=None):
        self.api = api or NormCApi()
        g = torch.Generator().manual_seed(77)
        r = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
        self.t = {"x": r(ROWS, HIDDEN), "residual": r(ROWS, HIDDEN), "z": r(ROWS, HIDDEN),
                  "weight": r(HIDDEN), "bias": r(HIDDEN), "dy": r(ROWS, HIDDEN),
                  "dresidual_out": r(ROWS, HIDDEN),
                  "mean": r(ROWS, HIDDEN // GROUP), "rstd": r(ROWS, HIDDEN // GROUP).abs()}
        nan = lambda *shape: torch.full(shape, NAN)  # noqa: E731
        self.outputs = {"y": nan(ROWS, HIDDEN), "residual_out": nan(ROWS, HIDDEN),
                        "mean_out": nan(ROWS, HIDDEN // GROUP),
                        "rstd_out": nan(ROWS, HIDDEN // GROUP),
                        "dx": nan(ROWS, HIDDEN), "dresidual": nan(ROWS, HIDDEN),
                        "dweight": nan(HIDDEN), "dbias": nan(HIDDEN), "dz": nan(ROWS, HIDDEN)}

    def dl(self, overrides, name):
        if name in overrides:
            return overrides[name]
        t = self.t.get(name, self.outputs.get(name))
        return self.api.dltensor(t)

    def forward(self, params=None, **overrides):
        api = self.api
        params = api.params(CASE) if params is None else params
        d = lambda n: self.dl(overrides, n)  # noqa: E731
        return api.lib.ssm_norm_fwd(params, d("x"), d("residual"), d("weight"), d("bias"),
                                    d("z"), d("y"), d("residual_out"), d("mean_out"),
                                    d("rstd_out"), 0)

    def backward(self, params=None, workspace=(0, 0), **overrides):
        api = self.api
        params = api.params(CASE) if params is None else params
        d = lambda n: self.dl(overrides, n)  # noqa: E731
        return api.lib.ssm_norm_bwd(params, d("x"), d("weight"), d("bias"), d("z"), d("mean"),
                                    d("rstd"), d("dy"), d("dresidual_out"), d("dx"),
                                    d("dresidual"), d("dweight"), d("dbias"), d("dz"),
                                    workspace[0], workspace[1], 0)

    def check_failed(self, status, exc, argument, fragments=()):
        """The status is exc's, the message names the argument, and no output was written."""
        message = self.api.last_error()
        assert status == exc.status_code, (status, message)
        assert message.startswith(argument + ":"), message
        for fragment in fragments:
            assert fragment in message, (fragment, message)
        for name, t in self.outputs.items():
            assert torch.isnan(t).all(), f"{name} was written by a failed call"


def test_c_valid_calls_write_every_output():
    # The baseline the failing calls below differ from in one argument.
    call = CCall()
    assert call.forward() == 0, call.api.last_error()
    assert call.backward() == 0, call.api.last_error()
    for name, t in call.outputs.items():
        assert torch.isfinite(t).all(), name


def test_c_params_null():
    call = CCall()
    call.check_failed(call.forward(params=0), libssm.InvalidArgumentError, "params", ["NULL"])
    call.check_failed(call.backward(params=0), libssm.InvalidArgumentError, "params", ["NULL"])


@pytest.mark.parametrize("size", [0, 8])
def test_c_params_struct_size_too_small(size):
    call = CCall()
    params = call.api.params(CASE, struct_size=size)
    call.check_failed(call.forward(params=params), libssm.InvalidArgumentError, "params",
                      ["struct_size", str(size)])


@pytest.mark.parametrize("field, value, fragments", [
    ("kind", 2, ["kind", "2"]),
    ("kind", -1, ["kind", "-1"]),
    ("eps", -0.5, ["eps"]),
    ("group_size", -3, ["group_size"]),
    ("group_size", 5, ["group_size", "5", "12"]),
    ("group_size", HIDDEN + GROUP, ["group_size"]),
], ids=["kind-2", "kind-negative", "eps-negative", "group_size-negative",
        "group_size-not-dividing", "group_size-above-hidden"])
@pytest.mark.parametrize("entry", ["forward", "backward"])
def test_c_bad_params(field, value, fragments, entry):
    call = CCall()
    params = call.api.params(CASE, **{field: value})
    status = getattr(call, entry)(params=params)
    call.check_failed(status, libssm.InvalidArgumentError, "params", fragments)


@pytest.mark.parametrize("name", ["x", "y"])
def test_c_forward_required_null(name):
    call = CCall()
    call.check_failed(call.forward(**{name: 0}), libssm.InvalidArgumentError, name, ["NULL"])


@pytest.mark.parametrize("name", ["x", "mean", "rstd", "dy"])
def test_c_backward_required_null(name):
    # mean is required for LayerNorm's backward.
    call = CCall()
    call.check_failed(call.backward(**{name: 0}), libssm.InvalidArgumentError, name, ["NULL"])


def test_c_mean_for_rmsnorm():
    call = CCall()
    params = call.api.params(CASE.replace(kind="rms"))
    call.check_failed(call.forward(params=params), libssm.InvalidArgumentError, "mean",
                      ["RMSNorm"])
    call.check_failed(call.backward(params=params), libssm.InvalidArgumentError, "mean",
                      ["RMSNorm"])


@pytest.mark.parametrize("grad, input_", [("dweight", "weight"), ("dbias", "bias"),
                                          ("dz", "z")])
def test_c_gradient_without_its_input(grad, input_):
    call = CCall()
    call.check_failed(call.backward(**{input_: 0}), libssm.InvalidArgumentError, grad,
                      [input_, "NULL"])


def test_c_zero_centred_weight_without_weight():
    call = CCall()
    params = call.api.params(CASE, zero_centered_weight=1)
    call.check_failed(call.forward(params=params, weight=0),
                      libssm.InvalidArgumentError, "params", ["zero_centered_weight"])


@pytest.mark.parametrize("name, shape, fragment", [
    ("residual", (ROWS, HIDDEN + 1), "(12, 12)"),
    ("z", (ROWS - 1, HIDDEN), "(12, 12)"),
    ("y", (ROWS, HIDDEN, 1), "(rows, hidden)"),
    ("residual_out", (ROWS + 1, HIDDEN), "(12, 12)"),
    ("mean_out", (ROWS,), "(12, 3)"),
    ("rstd_out", (ROWS, 4), "(12, 3)"),
    ("weight", (HIDDEN, 1), "(hidden,)"),
], ids=["residual", "z", "y-ndim3", "residual_out", "mean-1d-with-groups", "rstd-ngroups",
        "weight-ndim2"])
def test_c_forward_bad_shape(name, shape, fragment):
    call = CCall()
    dtype_ok = torch.full(shape, NAN) if name in ("y", "residual_out", "mean_out", "rstd_out") \
        else torch.randn(shape)
    call.api.keep(dtype_ok)
    status = call.forward(**{name: call.api.dltensor(dtype_ok)})
    argument = {"mean_out": "mean", "rstd_out": "rstd"}.get(name, name)
    call.check_failed(status, libssm.ShapeError, argument, [fragment])


@pytest.mark.parametrize("name, dtype", [("mean_out", torch.float16), ("rstd_out", torch.bfloat16),
                                         ("y", torch.float64), ("dweight", torch.float64)])
def test_c_bad_output_dtype(name, dtype):
    call = CCall()
    shape = call.outputs[name].shape
    bad = call.api.keep(torch.full(shape, NAN, dtype=dtype))
    status = (call.backward if name == "dweight" else call.forward)(
        **{name: call.api.dltensor(bad)})
    argument = {"mean_out": "mean", "rstd_out": "rstd"}.get(name, name)
    call.check_failed(status, libssm.DTypeError, argument, [str(dtype)[6:]])
    assert torch.isnan(bad.float()).all()


def test_c_outputs_must_not_alias():
    call = CCall()
    shared = call.api.dltensor(call.outputs["dx"])
    call.check_failed(call.backward(dz=shared), libssm.LayoutError, "dz", ["overlap", "dx"])
    call.check_failed(call.forward(y=call.api.dltensor(call.t["residual"])), libssm.LayoutError,
                      "y", ["overlap", "input residual"])
    call.check_failed(call.forward(residual_out=call.api.dltensor(call.outputs["y"])),
                      libssm.LayoutError, "residual_out", ["overlap", "y"])
    call.check_failed(call.backward(dx=call.api.dltensor(call.t["dy"])), libssm.LayoutError,
                      "dx", ["overlap", "input dy"])


def test_c_hidden_axis_must_be_contiguous():
    call = CCall()
    wide = call.api.keep(torch.full((ROWS, 2 * HIDDEN), NAN))
    status = call.forward(y=call.api.dltensor(wide[:, ::2]))
    call.check_failed(status, libssm.LayoutError, "y", ["stride", "hidden"])
    assert torch.isnan(wide).all()


def test_c_misaligned_data():
    # A float32 tensor starting 2 bytes into its storage cannot be read as floats.
    call = CCall()
    z = call.t["z"]
    status = call.forward(z=call.api.dltensor(z, data=z.data_ptr() + 2))
    call.check_failed(status, libssm.LayoutError, "z", ["aligned"])


@pytest.mark.parametrize("name", ["residual", "weight", "y", "rstd_out"])
def test_c_null_data(name):
    call = CCall()
    t = call.t.get(name, call.outputs.get(name))
    status = call.forward(**{name: call.api.dltensor(t, data=0)})
    argument = {"rstd_out": "rstd"}.get(name, name)
    call.check_failed(status, libssm.InvalidArgumentError, argument, ["NULL"])


@pytest.mark.parametrize("name", ["residual", "bias", "y", "mean_out"])
def test_c_mixed_devices(name):
    # One tensor claims to live on a GPU while x is on the CPU. Its data pointer is host memory,
    # harmless: the device check comes before any access, so this runs without a GPU.
    call = CCall()
    t = call.t.get(name, call.outputs.get(name))
    address = call.api.dltensor(t)
    call.api.ffi.cast("DLTensor *", address).device.device_type = 2  # kDLCUDA, device 0
    argument = {"mean_out": "mean"}.get(name, name)
    call.check_failed(call.forward(**{name: address}), libssm.DeviceError, argument,
                      ["cuda:0", "cpu"])


def test_c_workspace_query():
    api = NormCApi()
    call = CCall(api)
    x, weight = api.dltensor(call.t["x"]), api.dltensor(call.t["weight"])
    status = api.lib.ssm_norm_bwd_workspace_size(api.params(CASE), x, weight, 0)
    assert status == libssm.InvalidArgumentError.status_code
    assert api.last_error().startswith("bytes:")
    size = api.keep(api.ffi.new("size_t *", 12345))
    assert api.lib.ssm_norm_bwd_workspace_size(api.params(CASE), x, weight,
                                               api.address(size)) == 0
    assert size[0] == 0  # the CPU needs none
    size[0] = 12345
    status = api.lib.ssm_norm_bwd_workspace_size(api.params(CASE.replace(group_size=5)), x,
                                                 weight, api.address(size))
    assert status == libssm.InvalidArgumentError.status_code and size[0] == 12345
    assert api.last_error().startswith("params:")


def test_c_last_error_cleared_by_success():
    call = CCall()
    assert call.forward(x=0) != 0 and call.api.last_error().startswith("x:")
    assert call.forward() == 0
    assert call.api.last_error() == ""


# ---------------------------------------------------------------------------------------------
# CUDA-only rows.


@pytest.mark.cuda
@pytest.mark.parametrize("on_cpu", ["residual", "weight", "z", "out"])
def test_mixed_devices(on_cpu):
    x = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in valid_inputs().items()}
    x[on_cpu] = x[on_cpu].cpu()
    before = snapshot(x)
    with pytest.raises(libssm.DeviceError) as excinfo:
        run_norm_fwd(x)
    torch.cuda.synchronize()
    check_error(excinfo, libssm.DeviceError, on_cpu, ["cpu", "cuda:0"])
    assert snapshot(x) == before


@pytest.mark.cuda
def test_mixed_devices_backward():
    b = {k: v.cuda() if isinstance(v, torch.Tensor) else v
         for k, v in valid_backward_inputs().items()}
    b["dy"] = b["dy"].cpu()
    with pytest.raises(libssm.DeviceError) as excinfo:
        run_norm_bwd(b)
    check_error(excinfo, libssm.DeviceError, "dy", ["cpu", "cuda:0"])


@pytest.mark.cuda
def test_cuda_workspace_too_small():
    # The backward demands the bytes its size query reported: one byte fewer is refused, named,
    # and nothing is written. Without any workspace need, a NULL workspace must do.
    api = NormCApi()
    case = CASE.replace(lead=(4096,), hidden=1024, group_size=0)
    g = torch.Generator(device="cuda").manual_seed(5)
    r = lambda *shape: torch.randn(*shape, device="cuda", generator=g)  # noqa: E731
    t = {"x": r(4096, 1024), "weight": r(1024), "bias": r(1024), "dy": r(4096, 1024),
         "mean": r(4096), "rstd": r(4096).abs() + 0.5}
    grads = {n: torch.full_like(t[s], NAN) for n, s in (("dx", "x"), ("dweight", "weight"),
                                                         ("dbias", "bias"))}
    params = api.params(case)
    size = api.keep(api.ffi.new("size_t *"))
    api.check(api.lib.ssm_norm_bwd_workspace_size(params, api.dltensor(t["x"]),
                                                  api.dltensor(t["weight"]), api.address(size)))
    dl = lambda n: api.dltensor(t.get(n, grads.get(n)))  # noqa: E731
    args = (params, dl("x"), dl("weight"), dl("bias"), 0, dl("mean"), dl("rstd"), dl("dy"), 0,
            dl("dx"), 0, dl("dweight"), dl("dbias"), 0)
    stream = torch.cuda.current_stream().cuda_stream
    if size[0] == 0:
        assert api.lib.ssm_norm_bwd(*args, 0, 0, stream) == 0, api.last_error()
        torch.cuda.synchronize()
        assert all(torch.isfinite(v).all() for v in grads.values())
        return
    ws, nbytes = api.workspace(size[0], "cuda")
    status = api.lib.ssm_norm_bwd(*args, ws, nbytes - 1, stream)
    assert status == libssm.WorkspaceError.status_code, api.last_error()
    assert api.last_error().startswith("workspace")
    status = api.lib.ssm_norm_bwd(*args, 0, 0, stream)
    assert status == libssm.WorkspaceError.status_code, api.last_error()
    torch.cuda.synchronize()
    assert all(torch.isnan(v).all() for v in grads.values())
