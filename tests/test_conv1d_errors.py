"""Bad input to the causal conv1d: each row breaks one argument and expects the libssm exception
for it, a message that starts with the argument's name and says what was expected, and every
array of the call (the NaN-poisoned out= and conv_state included) left exactly as it was. Rows
run through the generic layer with torch and with NumPy arrays; the rest call the C entry points
directly, with NaN-poisoned outputs that must stay NaN."""
import pytest
import torch

import libssm
from conv1d_harness import Conv1dCApi
from harness import as_framework, check_error, snapshot

BATCH, DIM, SEQLEN, WIDTH = 2, 5, 9, 4
NAN = float("nan")


def valid_inputs():
    g = torch.Generator().manual_seed(4321)
    r = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    return {
        "x": r(BATCH, DIM, SEQLEN),
        "weight": r(DIM, WIDTH),
        "bias": r(DIM),
        "initial_states": r(BATCH, DIM, WIDTH - 1),
        "seq_idx": torch.tensor([[0] * 4 + [1] * 5, [0] * 9], dtype=torch.int32),
        "out": torch.full((BATCH, DIM, SEQLEN), NAN),
        "activation": "silu",
    }


def _set(name, value):
    def mutate(x):
        x[name] = value(x) if callable(value) else value
    return mutate


def _overlapping_out(x):
    # Channels of 9 positions start 4 apart: neighbouring channels share memory.
    base = torch.full((BATCH * DIM * 4 + SEQLEN,), NAN)
    x["out"] = base.as_strided((BATCH, DIM, SEQLEN), (DIM * 4, 4, 1))


def _out_overlaps_x(x):
    big = torch.randn(BATCH, DIM, 2 * SEQLEN)
    x["x"] = big[..., :SEQLEN]
    x["out"] = big[..., 1:SEQLEN + 1]


# (id, argument the message must name, mutation, exception, fragments the message must hold)
FORWARD_ROWS = [
    ("x-float64", "x", _set("x", lambda x: x["x"].double()), libssm.DTypeError, ["float64"]),
    ("x-int32", "x", _set("x", lambda x: x["x"].int()), libssm.DTypeError, ["int32"]),
    ("x-2d", "x", _set("x", lambda x: x["x"][0]), libssm.ShapeError,
     ["(batch, dim, seqlen)", "(5, 9)"]),
    ("weight-float64", "weight", _set("weight", lambda x: x["weight"].double()),
     libssm.DTypeError, ["float64"]),
    ("weight-dim", "weight", _set("weight", torch.randn(DIM + 1, WIDTH)), libssm.ShapeError,
     ["(dim, width)", "(5, width)", "(6, 4)"]),
    ("weight-nn-conv1d-shape", "weight", _set("weight", torch.randn(DIM, 1, WIDTH)),
     libssm.ShapeError, ["(dim, width)", "(5, 1, 4)"]),
    ("width-9", "weight", _set("weight", torch.randn(DIM, 9)), libssm.UnsupportedError,
     ["9", "2 to 8"]),
    ("width-1", "weight", _set("weight", torch.randn(DIM, 1)), libssm.UnsupportedError,
     ["1", "2 to 8"]),
    ("bias-dim", "bias", _set("bias", torch.randn(DIM - 1)), libssm.ShapeError, ["(5,)", "(4,)"]),
    ("bias-int32", "bias", _set("bias", lambda x: x["bias"].int()), libssm.DTypeError,
     ["int32"]),
    ("initial_states-width", "initial_states",
     _set("initial_states", torch.randn(BATCH, DIM, WIDTH)), libssm.ShapeError,
     ["(batch, dim, width-1)", "(2, 5, 3)", "(2, 5, 4)"]),
    ("initial_states-float64", "initial_states",
     _set("initial_states", lambda x: x["initial_states"].double()), libssm.DTypeError,
     ["float64"]),
    ("seq_idx-int64", "seq_idx", _set("seq_idx", lambda x: x["seq_idx"].long()),
     libssm.DTypeError, ["int32", "int64"]),
    ("seq_idx-float", "seq_idx", _set("seq_idx", lambda x: x["seq_idx"].float()),
     libssm.DTypeError, ["int32", "float32"]),
    ("seq_idx-shape", "seq_idx", _set("seq_idx", torch.zeros(BATCH, SEQLEN + 1,
                                                             dtype=torch.int32)),
     libssm.ShapeError, ["(2, 9)", "(2, 10)"]),
    ("out-shape", "out", _set("out", torch.full((BATCH, DIM, SEQLEN - 1), NAN)),
     libssm.ShapeError, ["(2, 5, 9)"]),
    ("out-dtype", "out", _set("out", torch.full((BATCH, DIM, SEQLEN), NAN,
                                                dtype=torch.float16)),
     libssm.DTypeError, ["float32", "float16"]),
    ("out-overlaps-itself", "out", _overlapping_out, libssm.LayoutError, ["overlap"]),
    ("out-is-x", "out", _set("out", lambda x: x["x"]), libssm.LayoutError, ["input x"]),
    ("out-overlaps-x", "out", _out_overlaps_x, libssm.LayoutError, ["input x"]),
    ("activation-relu", "activation", _set("activation", "relu"), libssm.InvalidArgumentError,
     ["'silu'", "relu"]),
    ("x-not-an-array", "x", _set("x", lambda x: x["x"].tolist()), libssm.InvalidArgumentError,
     ["__dlpack__"]),
]


def run_forward(x, return_final_states=True):
    return libssm.causal_conv1d(x["x"], x["weight"], x["bias"], activation=x["activation"],
                                initial_states=x["initial_states"], seq_idx=x["seq_idx"],
                                return_final_states=return_final_states, out=x["out"])


@pytest.mark.parametrize("framework", ["torch", "numpy"])
@pytest.mark.parametrize("row", FORWARD_ROWS, ids=[r[0] for r in FORWARD_ROWS])
def test_forward_bad_input(row, framework):
    _, argument, mutate, exc, fragments = row
    x = valid_inputs()
    mutate(x)
    x = as_framework(x, framework)
    before = snapshot(x)
    with pytest.raises(exc) as excinfo:
        run_forward(x)
    check_error(excinfo, exc, argument, fragments)
    assert snapshot(x) == before, "a failed call changed its arguments"


@pytest.mark.parametrize("framework", ["torch", "numpy"])
def test_valid_inputs_pass(framework):
    # The rows above fail because of their one change: the unchanged inputs are accepted, and
    # the NaN-filled out= is then written.
    x = as_framework(valid_inputs(), framework)
    out, final = run_forward(x)
    assert out is x["out"]
    assert not torch.isnan(torch.as_tensor(x["out"])).any()
    assert tuple(final.shape) == (BATCH, DIM, WIDTH - 1)


def test_torch_fn_names_the_argument():
    # libssm.torch.causal_conv1d_fn reports bad input like the generic layer.
    import libssm.torch as ssm_torch
    x = valid_inputs()
    with pytest.raises(libssm.ShapeError) as excinfo:
        ssm_torch.causal_conv1d_fn(x["x"], torch.randn(DIM, 1, WIDTH))
    check_error(excinfo, libssm.ShapeError, "weight", ["(dim, width)"])
    with pytest.raises(libssm.InvalidArgumentError) as excinfo:
        ssm_torch.causal_conv1d_fn(x["x"], x["weight"], activation="gelu")
    check_error(excinfo, libssm.InvalidArgumentError, "activation", ["gelu"])


# ---------------------------------------------------------------------------------------------
# Backward.


def valid_backward_inputs():
    x = valid_inputs()
    g = torch.Generator().manual_seed(99)
    return dict(x, dout=torch.randn(BATCH, DIM, SEQLEN, generator=g),
                dfinal_states=torch.randn(BATCH, DIM, WIDTH - 1, generator=g), needs=None)


def run_backward(b):
    return libssm.causal_conv1d_bwd(b["x"], b["weight"], b["dout"], b["bias"],
                                    activation=b["activation"],
                                    initial_states=b["initial_states"], seq_idx=b["seq_idx"],
                                    dfinal_states=b["dfinal_states"], needs=b["needs"])


BACKWARD_ROWS = [
    ("dout-shape", "dout", _set("dout", torch.randn(BATCH, DIM, SEQLEN + 1)), libssm.ShapeError,
     ["(2, 5, 9)"]),
    ("dout-dtype", "dout", _set("dout", lambda b: b["dout"].half()), libssm.DTypeError,
     ["float32", "float16"]),
    ("dfinal_states-shape", "dfinal_states",
     _set("dfinal_states", torch.randn(BATCH, DIM, WIDTH)), libssm.ShapeError, ["(2, 5, 3)"]),
    ("x-float64", "x", _set("x", lambda b: b["x"].double()), libssm.DTypeError, ["float64"]),
    ("width-9", "weight", _set("weight", torch.randn(DIM, 9)), libssm.UnsupportedError, ["9"]),
    ("needs-dbias-without-bias", "needs",
     lambda b: b.update(bias=None, needs=(True, True, True, False)),
     libssm.InvalidArgumentError, ["dbias", "bias"]),
    ("needs-dinitial-without-initial", "needs",
     lambda b: b.update(initial_states=None, needs=(True, False, False, True)),
     libssm.InvalidArgumentError, ["dinitial_states", "initial_states"]),
    ("needs-wrong-length", "needs", _set("needs", (True, True)), libssm.InvalidArgumentError,
     ["4"]),
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
        run_backward(b)
    check_error(excinfo, exc, argument, fragments)
    assert snapshot(b) == before


def test_valid_backward_inputs_pass():
    grads = run_backward(valid_backward_inputs())
    assert all(torch.isfinite(g).all() for g in grads)


# ---------------------------------------------------------------------------------------------
# The decode step.


def valid_update_inputs():
    g = torch.Generator().manual_seed(777)
    r = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    return {"x": r(BATCH, DIM), "conv_state": r(BATCH + 2, DIM, WIDTH - 1),
            "weight": r(DIM, WIDTH), "bias": r(DIM),
            "cache_seqlens": torch.tensor([3, 7], dtype=torch.int32),
            "conv_state_indices": torch.tensor([3, -1], dtype=torch.int32),
            "out": torch.full((BATCH, DIM), NAN), "activation": None}


def run_update(u):
    return libssm.causal_conv1d_update(u["x"], u["conv_state"], u["weight"], u["bias"],
                                       activation=u["activation"],
                                       cache_seqlens=u["cache_seqlens"],
                                       conv_state_indices=u["conv_state_indices"], out=u["out"])


UPDATE_ROWS = [
    ("x-4d", "x", _set("x", torch.randn(BATCH, DIM, 1, 1)), libssm.ShapeError,
     ["(batch, dim, seqlen)"]),
    ("x-float64", "x", _set("x", lambda u: u["x"].double()), libssm.DTypeError, ["float64"]),
    ("conv_state-dim", "conv_state", _set("conv_state", torch.randn(BATCH + 2, DIM + 1, 3)),
     libssm.ShapeError, ["(batch_state, dim, state_len)", "(4, 6, 3)"]),
    ("conv_state-short", "conv_state", _set("conv_state", torch.randn(BATCH + 2, DIM, 2)),
     libssm.ShapeError, ["state_len is 2", "width 4", "3"]),
    ("conv_state-float64", "conv_state", _set("conv_state", lambda u: u["conv_state"].double()),
     libssm.DTypeError, ["float64"]),
    ("weight-width-9", "weight", _set("weight", torch.randn(DIM, 9)), libssm.UnsupportedError,
     ["9"]),
    ("weight-dim", "weight", _set("weight", torch.randn(DIM + 1, WIDTH)), libssm.ShapeError,
     ["(dim, width)"]),
    ("bias-dim", "bias", _set("bias", torch.randn(DIM + 1)), libssm.ShapeError, ["(5,)"]),
    ("cache_seqlens-float", "cache_seqlens",
     _set("cache_seqlens", lambda u: u["cache_seqlens"].float()), libssm.DTypeError,
     ["int32 or int64", "float32"]),
    ("cache_seqlens-shape", "cache_seqlens",
     _set("cache_seqlens", torch.zeros(BATCH + 1, dtype=torch.int32)), libssm.ShapeError,
     ["(2,)", "(3,)"]),
    ("indices-shape", "conv_state_indices",
     _set("conv_state_indices", torch.zeros(1, dtype=torch.int32)), libssm.ShapeError,
     ["(2,)", "(1,)"]),
    ("index-past-state", "conv_state_indices",
     _set("conv_state_indices", torch.tensor([1, 4], dtype=torch.int32)),
     libssm.InvalidArgumentError, ["entry 1 is 4", "4 rows"]),
    ("index-repeated", "conv_state_indices",
     _set("conv_state_indices", torch.tensor([2, 2], dtype=torch.int64)),
     libssm.InvalidArgumentError, ["2", "more than once"]),
    ("no-indices-small-state", "conv_state",
     lambda u: u.update(conv_state_indices=None, conv_state=torch.randn(1, DIM, 3)),
     libssm.ShapeError, ["batch_state is 1", "batch 2"]),
    ("out-shape", "out", _set("out", torch.full((BATCH, DIM, 1), NAN)), libssm.ShapeError,
     ["ndim 2"]),
    ("out-dtype", "out", _set("out", torch.full((BATCH, DIM), NAN, dtype=torch.float16)),
     libssm.DTypeError, ["float32", "float16"]),
    ("out-is-conv_state", "out",
     lambda u: u.update(out=u["conv_state"][:BATCH, :, 0]), libssm.LayoutError, ["overlap"]),
    ("activation-tanh", "activation", _set("activation", "tanh"), libssm.InvalidArgumentError,
     ["tanh"]),
]


@pytest.mark.parametrize("framework", ["torch", "numpy"])
@pytest.mark.parametrize("row", UPDATE_ROWS, ids=[r[0] for r in UPDATE_ROWS])
def test_update_bad_input(row, framework):
    _, argument, mutate, exc, fragments = row
    u = valid_update_inputs()
    mutate(u)
    u = as_framework(u, framework)
    before = snapshot(u)
    with pytest.raises(exc) as excinfo:
        run_update(u)
    check_error(excinfo, exc, argument, fragments)
    assert snapshot(u) == before, "a failed call changed its arguments"


@pytest.mark.parametrize("framework", ["torch", "numpy"])
def test_valid_update_inputs_pass(framework):
    u = as_framework(valid_update_inputs(), framework)
    out = run_update(u)
    assert out is u["out"]
    assert not torch.isnan(torch.as_tensor(out)).any()


# ---------------------------------------------------------------------------------------------
# The C entry points directly: every output starts NaN and must stay NaN after a failure.


class CCall:
    """One forward, backward or decode-step call on valid tensors with NaN-poisoned outputs,
    with any argument replaced by a raw address (0 for NULL)."""

    def __init__(self):
        self.api = Conv1dCApi()
        x = valid_backward_inputs()
        u = valid_update_inputs()
        self.t = {n: x[n] for n in ("x", "weight", "bias", "initial_states", "dout",
                                    "dfinal_states")}
        self.ints = {"seq_idx": x["seq_idx"], "cache_seqlens": u["cache_seqlens"],
                     "conv_state_indices": u["conv_state_indices"]}
        self.t.update(step_x=u["x"], conv_state=u["conv_state"])
        nan = lambda *shape: torch.full(shape, NAN)  # noqa: E731
        self.outputs = {"out": nan(BATCH, DIM, SEQLEN),
                        "final_states": nan(BATCH, DIM, WIDTH - 1),
                        "dx": nan(BATCH, DIM, SEQLEN), "dweight": nan(DIM, WIDTH),
                        "dbias": nan(DIM), "dinitial_states": nan(BATCH, DIM, WIDTH - 1),
                        "step_out": nan(BATCH, DIM)}
        self.state_before = u["conv_state"].clone()

    def dl(self, overrides, name):
        if name in overrides:
            return overrides[name]
        if name in self.ints:
            return self.api.dltensor(self.ints[name])
        return self.api.dltensor(self.t.get(name, self.outputs.get(name)))

    def forward(self, params=None, **overrides):
        api = self.api
        params = api.params(True) if params is None else params
        d = lambda n: self.dl(overrides, n)  # noqa: E731
        return api.lib.ssm_causal_conv1d_fwd(params, d("x"), d("weight"), d("bias"),
                                             d("initial_states"), d("seq_idx"), d("out"),
                                             d("final_states"), 0)

    def backward(self, params=None, workspace=(0, 0), **overrides):
        api = self.api
        params = api.params(True) if params is None else params
        d = lambda n: self.dl(overrides, n)  # noqa: E731
        return api.lib.ssm_causal_conv1d_bwd(params, d("x"), d("weight"), d("bias"),
                                             d("initial_states"), d("seq_idx"), d("dout"),
                                             d("dfinal_states"), d("dx"), d("dweight"),
                                             d("dbias"), d("dinitial_states"), workspace[0],
                                             workspace[1], 0)

    def update(self, params=None, **overrides):
        api = self.api
        params = api.params(False) if params is None else params
        d = lambda n: self.dl(overrides, n)  # noqa: E731
        return api.lib.ssm_causal_conv1d_update(params, d("step_x"), d("conv_state"),
                                                d("weight"), d("bias"), d("cache_seqlens"),
                                                d("conv_state_indices"), d("step_out"), 0)

    def check_failed(self, status, exc, argument, fragments=()):
        """The status is exc's, the message names the argument, and nothing was written."""
        message = self.api.last_error()
        assert status == exc.status_code, (status, message)
        assert message.startswith(argument + ":"), message
        for fragment in fragments:
            assert fragment in message, (fragment, message)
        for name, t in self.outputs.items():
            assert torch.isnan(t).all(), f"{name} was written by a failed call"
        assert torch.equal(self.t["conv_state"], self.state_before), "conv_state was written"


def test_c_valid_calls_write_every_output():
    # The baseline the failing calls below differ from in one argument.
    call = CCall()
    assert call.forward() == 0, call.api.last_error()
    assert call.backward() == 0, call.api.last_error()
    assert call.update() == 0, call.api.last_error()
    for name, t in call.outputs.items():
        if name == "step_out":
            assert torch.equal(t[1], torch.zeros(DIM)), "padding row not zero"
        assert torch.isfinite(t).all(), name


@pytest.mark.parametrize("entry", ["forward", "backward", "update"])
def test_c_params_null(entry):
    call = CCall()
    call.check_failed(getattr(call, entry)(params=0), libssm.InvalidArgumentError, "params",
                      ["NULL"])


@pytest.mark.parametrize("size", [0, 8])
@pytest.mark.parametrize("entry", ["forward", "update"])
def test_c_params_struct_size_too_small(size, entry):
    call = CCall()
    params = call.api.params(True, struct_size=size)
    call.check_failed(getattr(call, entry)(params=params), libssm.InvalidArgumentError, "params",
                      ["struct_size", str(size)])


@pytest.mark.parametrize("value", [2, -1])
@pytest.mark.parametrize("entry", ["forward", "backward", "update"])
def test_c_bad_activation(value, entry):
    call = CCall()
    params = call.api.params(True, activation=value)
    call.check_failed(getattr(call, entry)(params=params), libssm.InvalidArgumentError, "params",
                      ["activation", str(value)])


@pytest.mark.parametrize("entry, name", [("forward", "x"), ("forward", "weight"),
                                         ("forward", "out"), ("backward", "x"),
                                         ("backward", "weight"), ("backward", "dout"),
                                         ("update", "step_x"), ("update", "conv_state"),
                                         ("update", "weight"), ("update", "step_out")])
def test_c_required_null(entry, name):
    call = CCall()
    argument = {"step_x": "x", "step_out": "out"}.get(name, name)
    call.check_failed(getattr(call, entry)(**{name: 0}), libssm.InvalidArgumentError, argument,
                      ["NULL"])


@pytest.mark.parametrize("grad, input_", [("dbias", "bias"),
                                          ("dinitial_states", "initial_states")])
def test_c_gradient_without_its_input(grad, input_):
    call = CCall()
    call.check_failed(call.backward(**{input_: 0}), libssm.InvalidArgumentError, grad,
                      [input_, "NULL"])


def test_c_dfinal_states_without_initial_states_is_fine():
    # The final states exist whatever the initial ones: their gradient reaches x.
    call = CCall()
    assert call.backward(initial_states=0, dinitial_states=0) == 0, call.api.last_error()
    assert torch.isfinite(call.outputs["dx"]).all()


@pytest.mark.parametrize("name, shape, fragment", [
    ("final_states", (BATCH, DIM, WIDTH), "(2, 5, 3)"),
    ("dx", (BATCH, DIM, SEQLEN + 1), "(2, 5, 9)"),
    ("dweight", (DIM, WIDTH + 1), "(5, 4)"),
    ("dinitial_states", (BATCH + 1, DIM, WIDTH - 1), "(2, 5, 3)"),
])
def test_c_bad_output_shape(name, shape, fragment):
    call = CCall()
    bad = call.api.keep(torch.full(shape, NAN))
    entry = call.forward if name == "final_states" else call.backward
    call.check_failed(entry(**{name: call.api.dltensor(bad)}), libssm.ShapeError, name,
                      [fragment])
    assert torch.isnan(bad).all()


@pytest.mark.parametrize("name", ["dx", "final_states", "dweight"])
def test_c_bad_output_dtype(name):
    call = CCall()
    shape = call.outputs[name].shape
    bad = call.api.keep(torch.full(shape, NAN, dtype=torch.float64))
    entry = call.forward if name == "final_states" else call.backward
    call.check_failed(entry(**{name: call.api.dltensor(bad)}), libssm.DTypeError, name,
                      ["float64"])


def test_c_outputs_must_not_alias():
    call = CCall()
    dx_view = call.api.dltensor(call.outputs["dx"][..., :3])
    call.check_failed(call.backward(dinitial_states=dx_view), libssm.LayoutError,
                      "dinitial_states", ["overlap", "dx"])
    call.check_failed(call.forward(final_states=call.api.dltensor(call.t["initial_states"])),
                      libssm.LayoutError, "final_states", ["overlap", "input initial_states"])
    shared = call.api.keep(torch.randn(BATCH * DIM + (BATCH + 2) * DIM * (WIDTH - 1)))
    step_x = shared[:BATCH * DIM].view(BATCH, DIM)
    state = shared[BATCH * DIM - 1:BATCH * DIM - 1 + (BATCH + 2) * DIM * (WIDTH - 1)]
    call.check_failed(call.update(step_x=call.api.dltensor(step_x),
                                  conv_state=call.api.dltensor(state.view(BATCH + 2, DIM, 3))),
                      libssm.LayoutError, "conv_state", ["overlap", "input x"])


def test_c_misaligned_data():
    call = CCall()
    x = call.t["x"]
    call.check_failed(call.forward(x=call.api.dltensor(x, data=x.data_ptr() + 2)),
                      libssm.LayoutError, "x", ["aligned"])


@pytest.mark.parametrize("name", ["bias", "out", "initial_states"])
def test_c_mixed_devices(name):
    # One tensor claims to live on a GPU while x is on the CPU: the device check comes before
    # any access, so this runs without a GPU.
    call = CCall()
    t = call.t.get(name, call.outputs.get(name))
    address = call.api.dltensor(t)
    call.api.ffi.cast("DLTensor *", address).device.device_type = 2
    call.check_failed(call.forward(**{name: address}), libssm.DeviceError, name,
                      ["cuda:0", "cpu"])


def test_c_workspace_query():
    call = CCall()
    api = call.api
    x, weight = api.dltensor(call.t["x"]), api.dltensor(call.t["weight"])
    status = api.lib.ssm_causal_conv1d_bwd_workspace_size(api.params(True), x, weight, 0)
    assert status == libssm.InvalidArgumentError.status_code
    assert api.last_error().startswith("bytes:")
    size = api.keep(api.ffi.new("size_t *", 12345))
    assert api.lib.ssm_causal_conv1d_bwd_workspace_size(api.params(True), x, weight,
                                                        api.address(size)) == 0
    assert size[0] == 0  # the CPU needs none
    size[0] = 12345
    bad = api.dltensor(api.keep(torch.randn(DIM, 9)))
    status = api.lib.ssm_causal_conv1d_bwd_workspace_size(api.params(True), x, bad,
                                                          api.address(size))
    assert status == libssm.UnsupportedError.status_code and size[0] == 12345
    assert api.last_error().startswith("weight:")


def test_c_last_error_cleared_by_success():
    call = CCall()
    assert call.forward(x=0) != 0 and call.api.last_error().startswith("x:")
    assert call.forward() == 0
    assert call.api.last_error() == ""


# ---------------------------------------------------------------------------------------------
# CUDA-only rows.


@pytest.mark.cuda
@pytest.mark.parametrize("on_cpu", ["weight", "initial_states", "seq_idx", "out"])
def test_mixed_devices(on_cpu):
    x = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in valid_inputs().items()}
    x[on_cpu] = x[on_cpu].cpu()
    before = snapshot(x)
    with pytest.raises(libssm.DeviceError) as excinfo:
        run_forward(x)
    torch.cuda.synchronize()
    check_error(excinfo, libssm.DeviceError, on_cpu, ["cpu", "cuda:0"])
    assert snapshot(x) == before


@pytest.mark.cuda
def test_mixed_devices_update():
    u = {k: v.cuda() if isinstance(v, torch.Tensor) else v
         for k, v in valid_update_inputs().items()}
    u["conv_state_indices"] = u["conv_state_indices"].cpu()
    with pytest.raises(libssm.DeviceError) as excinfo:
        run_update(u)
    check_error(excinfo, libssm.DeviceError, "conv_state_indices", ["cpu", "cuda:0"])


@pytest.mark.cuda
def test_cuda_workspace_too_small():
    # The backward demands the bytes its size query reported: one byte fewer is refused, named,
    # and nothing is written.
    api = Conv1dCApi()
    g = torch.Generator(device="cuda").manual_seed(5)
    r = lambda *shape: torch.randn(*shape, device="cuda", generator=g)  # noqa: E731
    x, weight, dout = r(4, 64, 512), r(64, 4), r(4, 64, 512)
    grads = {"dx": torch.full_like(x, NAN), "dweight": torch.full_like(weight, NAN)}
    params = api.params(True)
    size = api.keep(api.ffi.new("size_t *"))
    api.check(api.lib.ssm_causal_conv1d_bwd_workspace_size(params, api.dltensor(x),
                                                           api.dltensor(weight),
                                                           api.address(size)))
    assert size[0] > 0
    args = (params, api.dltensor(x), api.dltensor(weight), 0, 0, 0, api.dltensor(dout), 0,
            api.dltensor(grads["dx"]), api.dltensor(grads["dweight"]), 0, 0)
    stream = torch.cuda.current_stream().cuda_stream
    ws, nbytes = api.workspace(size[0], "cuda")
    status = api.lib.ssm_causal_conv1d_bwd(*args, ws, nbytes - 1, stream)
    assert status == libssm.WorkspaceError.status_code, api.last_error()
    assert api.last_error().startswith("workspace")
    status = api.lib.ssm_causal_conv1d_bwd(*args, 0, 0, stream)
    assert status == libssm.WorkspaceError.status_code, api.last_error()
    torch.cuda.synchronize()
    assert all(torch.isnan(v).all() for v in grads.values())
    assert api.lib.ssm_causal_conv1d_bwd(*args, ws, nbytes, stream) == 0, api.last_error()
    torch.cuda.synchronize()
    assert all(torch.isfinite(v).all() for v in grads.values())
