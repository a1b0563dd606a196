"""Bad input to the selective scan: each row breaks one argument and expects the libssm exception
for it, a message that starts with the argument's name and says what was expected, and every
array of the call, the NaN-poisoned out= included, left exactly as it was. Rows run through the
torch path and the NumPy (DLPack) path; a few rows go straight to the C entry points."""
import threading

import numpy as np
import pytest
import torch

import libssm
import libssm.torch as ssm_torch
from references import INPUT_NAMES, ScanCase
from harness import as_framework, check_error, snapshot
from scan_harness import CApi

BATCH, DIM, SEQLEN, DSTATE = 2, 6, 5, 4
NAN = float("nan")


def valid_inputs():
    g = torch.Generator().manual_seed(1234)
    b, d, l, n = BATCH, DIM, SEQLEN, DSTATE
    return {
        "u": torch.randn(b, d, l, generator=g),
        "delta": torch.rand(b, d, l, generator=g),
        "A": -torch.rand(d, n, generator=g),
        "B": torch.randn(b, n, l, generator=g),
        "C": torch.randn(b, n, l, generator=g),
        "D": torch.randn(d, generator=g),
        "z": torch.randn(b, d, l, generator=g),
        "delta_bias": torch.rand(d, generator=g),
        "initial_state": torch.randn(b, d, n, generator=g),
        "out": torch.full((b, d, l), NAN),
    }


def _set(name, value):
    def mutate(x):
        x[name] = value(x) if callable(value) else value
    return mutate


def _dstate(n):
    def mutate(x):
        x["A"] = -torch.rand(DIM, n)
        x["B"] = torch.randn(BATCH, n, SEQLEN)
        x["C"] = torch.randn(BATCH, n, SEQLEN)
        x["initial_state"] = torch.randn(BATCH, DIM, n)
    return mutate


def _u_size(**size):
    def mutate(x):
        b, d, l = size.get("b", BATCH), size.get("d", DIM), size.get("l", SEQLEN)
        for name in ("u", "delta", "z"):
            x[name] = torch.randn(b, d, l)
        x["out"] = torch.full((b, d, l), NAN)
    return mutate


def _expanded_out(x):
    x["out"] = torch.full((1, 1, 1), NAN).expand(BATCH, DIM, SEQLEN)


def _overlapping_out(x):
    # Positive strides, but rows of 5 elements start 3 apart: neighbours share memory.
    base = torch.full((BATCH * DIM * 3 + SEQLEN,), NAN)
    x["out"] = base.as_strided((BATCH, DIM, SEQLEN), (DIM * 3, 3, 1))


def _out_is_u(x):
    x["out"] = x["u"]


def _out_is_slice_of_z(x):
    big = torch.randn(BATCH, DIM, 2 * SEQLEN)
    x["z"] = big[..., :SEQLEN]
    x["out"] = big[..., 1:SEQLEN + 1]  # shares all but one element of each row with z


# (id, argument the message must name, mutation, exception, fragments the message must hold)
FORWARD_ROWS = [
    ("u-float64", "u", _set("u", lambda x: x["u"].double()), libssm.DTypeError, ["float64"]),
    ("u-int32", "u", _set("u", lambda x: x["u"].int()), libssm.DTypeError, ["int32"]),
    ("delta-float64", "delta", _set("delta", lambda x: x["delta"].double()), libssm.DTypeError,
     ["float64"]),
    ("A-float16", "A", _set("A", lambda x: x["A"].half()), libssm.DTypeError,
     ["float32", "float16"]),
    ("B-float64", "B", _set("B", lambda x: x["B"].double()), libssm.DTypeError, ["float64"]),
    ("C-int64", "C", _set("C", lambda x: x["C"].long()), libssm.DTypeError, ["int64"]),
    ("D-float16", "D", _set("D", lambda x: x["D"].half()), libssm.DTypeError, ["float32"]),
    ("z-float64", "z", _set("z", lambda x: x["z"].double()), libssm.DTypeError, ["float64"]),
    ("delta_bias-float16", "delta_bias", _set("delta_bias", lambda x: x["delta_bias"].half()),
     libssm.DTypeError, ["float32"]),
    ("initial_state-float64", "initial_state",
     _set("initial_state", lambda x: x["initial_state"].double()), libssm.DTypeError,
     ["float64"]),
    ("out-float64", "out", _set("out", torch.full((BATCH, DIM, SEQLEN), NAN, dtype=torch.float64)),
     libssm.DTypeError, ["float64"]),
    ("u-ndim2", "u", _set("u", lambda x: x["u"][0]), libssm.ShapeError,
     ["(batch, dim, seqlen)"]),
    ("u-ndim4", "u", _set("u", lambda x: x["u"][None]), libssm.ShapeError,
     ["(batch, dim, seqlen)"]),
    ("delta-seqlen", "delta", _set("delta", lambda x: x["delta"][..., :-1]), libssm.ShapeError,
     ["(2, 6, 5)", "(2, 6, 4)"]),
    ("z-batch", "z", _set("z", lambda x: x["z"][:1]), libssm.ShapeError, ["(2, 6, 5)"]),
    ("A-dim", "A", _set("A", -torch.rand(DIM + 1, DSTATE)), libssm.ShapeError, ["(dim, dstate)"]),
    ("A-ndim1", "A", _set("A", -torch.rand(DIM)), libssm.ShapeError, ["(dim, dstate)"]),
    ("B-dstate", "B", _set("B", torch.randn(BATCH, DSTATE - 1, SEQLEN)), libssm.ShapeError,
     ["(2, 4, 5)", "(2, 3, 5)"]),
    ("B-ndim5", "B", _set("B", torch.randn(BATCH, 1, 1, DSTATE, SEQLEN)), libssm.ShapeError,
     ["(batch, groups, dstate, seqlen)"]),
    ("C-batch", "C", _set("C", torch.randn(BATCH + 1, DSTATE, SEQLEN)), libssm.ShapeError,
     ["(2, 4, 5)"]),
    ("B-groups-not-dividing-dim", "B", _set("B", torch.randn(BATCH, 4, DSTATE, SEQLEN)),
     libssm.ShapeError, ["groups", "4", "dim 6"]),
    ("C-groups-zero", "C", _set("C", torch.randn(BATCH, 0, DSTATE, SEQLEN)), libssm.ShapeError,
     ["groups"]),
    ("C-fixed-dstate", "C", _set("C", torch.randn(DIM, DSTATE + 1)), libssm.ShapeError,
     ["(6, 4)"]),
    ("B-fixed-dim", "B", _set("B", torch.randn(DIM - 1, DSTATE)), libssm.ShapeError, ["(6, 4)"]),
    ("D-dim", "D", _set("D", torch.randn(DIM + 1)), libssm.ShapeError, ["(6,)"]),
    ("delta_bias-ndim2", "delta_bias", _set("delta_bias", torch.rand(DIM, 1)), libssm.ShapeError,
     ["(6,)"]),
    ("initial_state-dstate", "initial_state", _set("initial_state", torch.randn(BATCH, DIM, 5)),
     libssm.ShapeError, ["(2, 6, 4)"]),
    ("out-seqlen", "out", _set("out", torch.full((BATCH, DIM, SEQLEN - 1), NAN)),
     libssm.ShapeError, ["(2, 6, 5)"]),
    ("dstate-257", "A", _dstate(257), libssm.UnsupportedError, ["257", "256"]),
    ("dstate-0", "A", _dstate(0), libssm.ShapeError, ["dstate"]),
    ("seqlen-0", "u", _u_size(l=0), libssm.ShapeError, ["seqlen"]),
    ("dim-0", "u", _u_size(d=0), libssm.ShapeError, ["dim"]),
    ("out-stride-0", "out", _expanded_out, libssm.LayoutError, ["stride"]),
    ("out-overlaps-itself", "out", _overlapping_out, libssm.LayoutError, ["overlap"]),
    ("out-is-u", "out", _out_is_u, libssm.LayoutError, ["input u"]),
    ("out-overlaps-z", "out", _out_is_slice_of_z, libssm.LayoutError, ["input z"]),
    ("u-not-an-array", "u", _set("u", lambda x: x["u"].tolist()), libssm.InvalidArgumentError,
     ["__dlpack__"]),
    ("delta-not-an-array", "delta", _set("delta", lambda x: x["delta"].tolist()),
     libssm.InvalidArgumentError, ["__dlpack__"]),
]


@pytest.mark.parametrize("framework", ["torch", "numpy"])
@pytest.mark.parametrize("row", FORWARD_ROWS, ids=[r[0] for r in FORWARD_ROWS])
def test_forward_bad_input(row, framework):
    _, argument, mutate, exc, fragments = row
    x = valid_inputs()
    mutate(x)
    x = as_framework(x, framework)
    before = snapshot(x)
    with pytest.raises(exc) as excinfo:
        libssm.selective_scan(x["u"], x["delta"], x["A"], x["B"], x["C"], x["D"], x["z"],
                              x["delta_bias"], delta_softplus=True,
                              initial_state=x["initial_state"], return_last_state=True,
                              out=x["out"])
    check_error(excinfo, exc, argument, fragments)
    assert snapshot(x) == before, "a failed call changed its arguments"


def test_valid_inputs_pass():
    # The rows above fail because of their one change: the unchanged inputs are accepted.
    for framework in ("torch", "numpy"):
        x = as_framework(valid_inputs(), framework)
        libssm.selective_scan(x["u"], x["delta"], x["A"], x["B"], x["C"], x["D"], x["z"],
                              x["delta_bias"], delta_softplus=True,
                              initial_state=x["initial_state"], return_last_state=True,
                              out=x["out"])
        assert np.isfinite(np.asarray(x["out"])).all()


def test_read_only_out():
    x = as_framework(valid_inputs(), "numpy")
    x["out"].flags.writeable = False
    before = snapshot(x)
    with pytest.raises(libssm.InvalidArgumentError) as excinfo:
        libssm.selective_scan(x["u"], x["delta"], x["A"], x["B"], x["C"], out=x["out"])
    check_error(excinfo, libssm.InvalidArgumentError, "out", ["read-only"])
    assert snapshot(x) == before


BACKWARD_ROWS = [
    ("dout-shape", "dout", _set("dout", torch.randn(BATCH, DIM, SEQLEN + 1)), libssm.ShapeError,
     ["(2, 6, 5)"]),
    ("dout-float64", "dout", _set("dout", torch.randn(BATCH, DIM, SEQLEN, dtype=torch.float64)),
     libssm.DTypeError, ["float64"]),
    ("dlast_state-shape", "dlast_state", _set("dlast_state", torch.randn(BATCH, DIM)),
     libssm.ShapeError, ["(2, 6, 4)"]),
    ("dlast_state-int32", "dlast_state",
     _set("dlast_state", torch.zeros(BATCH, DIM, DSTATE, dtype=torch.int32)), libssm.DTypeError,
     ["int32"]),
    ("B-dstate", "B", _set("B", torch.randn(BATCH, DSTATE + 1, SEQLEN)), libssm.ShapeError,
     ["(2, 4, 5)"]),
    ("A-float64", "A", _set("A", lambda x: x["A"].double()), libssm.DTypeError, ["float64"]),
    ("dstate-257", "A", _dstate(257), libssm.UnsupportedError, ["256"]),
]


@pytest.mark.parametrize("framework", ["torch", "numpy"])
@pytest.mark.parametrize("row", BACKWARD_ROWS, ids=[r[0] for r in BACKWARD_ROWS])
def test_backward_bad_input(row, framework):
    _, argument, mutate, exc, fragments = row
    x = valid_inputs()
    del x["out"]
    x["dout"] = torch.randn(BATCH, DIM, SEQLEN)
    x["dlast_state"] = torch.randn(BATCH, DIM, DSTATE)
    mutate(x)
    if x["A"].shape[1] != DSTATE:
        x["dlast_state"] = torch.randn(BATCH, DIM, x["A"].shape[1])
    x = as_framework(x, framework)
    before = snapshot(x)
    with pytest.raises(exc) as excinfo:
        libssm.selective_scan_bwd(x["u"], x["delta"], x["A"], x["B"], x["C"], x["dout"],
                                  x["D"], x["z"], x["delta_bias"], delta_softplus=True,
                                  initial_state=x["initial_state"],
                                  dlast_state=x["dlast_state"])
    check_error(excinfo, exc, argument, fragments)
    assert snapshot(x) == before


@pytest.mark.parametrize("framework", ["torch", "numpy"])
def test_backward_bad_gradient_buffer(framework):
    # out= of the backward is checked like the forward's: a dB of the wrong shape is refused,
    # named, and no buffer (all NaN-poisoned, the valid ones too) is written.
    x = valid_inputs()
    del x["out"]
    x["dout"] = torch.randn(BATCH, DIM, SEQLEN)
    for name in ("u", "A", "D", "initial_state"):
        x["d" + name] = torch.full_like(x[name], NAN)
    x["dB"] = torch.full((BATCH, DSTATE, SEQLEN + 1), NAN)
    x = as_framework(x, framework)
    before = snapshot(x)
    with pytest.raises(libssm.ShapeError) as excinfo:
        libssm.selective_scan_bwd(x["u"], x["delta"], x["A"], x["B"], x["C"], x["dout"],
                                  x["D"], x["z"], x["delta_bias"], delta_softplus=True,
                                  initial_state=x["initial_state"],
                                  out={n: x[n] for n in ("du", "dA", "dB", "dD",
                                                         "dinitial_state")})
    check_error(excinfo, libssm.ShapeError, "dB", ["(2, 4, 5)"])
    assert snapshot(x) == before


@pytest.mark.parametrize("api", [libssm.selective_scan, ssm_torch.selective_scan],
                         ids=["generic", "torch"])
@pytest.mark.parametrize("name", ["u", "delta", "B"])
def test_sparse_tensor(api, name):
    # torch itself raises a bare RuntimeError for a sparse tensor's data pointer; libssm names
    # the argument first.
    x = valid_inputs()
    x[name] = x[name].to_sparse()
    with pytest.raises(libssm.LayoutError) as excinfo:
        api(x["u"], x["delta"], x["A"], x["B"], x["C"])
    check_error(excinfo, libssm.LayoutError, name, ["sparse", "strided"])


def test_meta_tensor_among_real_ones():
    x = valid_inputs()
    x["delta"] = x["delta"].to("meta")
    for api in (libssm.selective_scan, ssm_torch.selective_scan):
        with pytest.raises(libssm.DeviceError) as excinfo:
            api(x["u"], x["delta"], x["A"], x["B"], x["C"])
        check_error(excinfo, libssm.DeviceError, "delta", ["meta"])


def test_exceptions_are_python_builtins_too():
    assert issubclass(libssm.ShapeError, ValueError) and issubclass(libssm.DTypeError, TypeError)
    assert issubclass(libssm.CudaError, RuntimeError)
    for cls in (libssm.InvalidArgumentError, libssm.ShapeError, libssm.DTypeError,
                libssm.DeviceError, libssm.LayoutError, libssm.UnsupportedError,
                libssm.WorkspaceError, libssm.CudaError, libssm.InternalError):
        assert issubclass(cls, libssm.Error)


# ---------------------------------------------------------------------------------------------
# The C entry points directly.

CASE = ScanCase(batch=BATCH, dim=DIM, seqlen=SEQLEN, dstate=DSTATE, D=True, z=True,
                delta_bias=True, softplus=True, initial_state=True, last_state=True)


def c_inputs():
    x = valid_inputs()
    out = x.pop("out")
    return x, out


def c_forward_raises(exc, argument, fragments, api=None, params=None, overrides=None):
    """Calls ssm_selective_scan_fwd with DLTensors for valid inputs, some replaced by raw
    addresses in `overrides`, and checks the error and that out stayed NaN."""
    api = api or CApi()
    x, out = c_inputs()
    last_state = torch.full((BATCH, DIM, DSTATE), NAN)
    dl = {n: api.dltensor(t) for n, t in x.items()}
    dl["out"], dl["last_state"] = api.dltensor(out), api.dltensor(last_state)
    dl.update(overrides or {})
    params = api.params(True) if params is None else params
    status = api.lib.ssm_selective_scan_fwd(
        params, dl["u"], dl["delta"], dl["A"], dl["B"], dl["C"], dl["D"], dl["z"],
        dl["delta_bias"], dl["initial_state"], dl["out"], dl["last_state"], 0, 0, 0)
    assert status == exc.status_code, (status, api.last_error())
    message = api.last_error()
    assert message.startswith(argument + ":"), message
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    assert torch.isnan(out).all() and torch.isnan(last_state).all()


def test_c_params_null():
    c_forward_raises(libssm.InvalidArgumentError, "params", ["NULL"], params=0)


@pytest.mark.parametrize("size", [0, 8])
def test_c_params_struct_size_too_small(size):
    api = CApi()
    c_forward_raises(libssm.InvalidArgumentError, "params", ["struct_size", str(size)], api=api,
                     params=api.params(True, struct_size=size))


@pytest.mark.parametrize("name", ["u", "delta", "A", "B", "C", "out"])
def test_c_required_tensor_null(name):
    c_forward_raises(libssm.InvalidArgumentError, name, ["NULL"], overrides={name: 0})


@pytest.mark.parametrize("name", ["delta", "B", "initial_state", "out"])
def test_c_null_data(name):
    api = CApi()
    x, out = c_inputs()
    x["out"] = out
    c_forward_raises(libssm.InvalidArgumentError, name, ["NULL"], api=api,
                     overrides={name: api.dltensor(x[name], data=0)})


def test_c_misaligned_data():
    # A float32 tensor starting 2 bytes into its storage cannot be read as floats.
    api = CApi()
    x, _ = c_inputs()
    c_forward_raises(libssm.LayoutError, "z", ["aligned"], api=api,
                     overrides={"z": api.dltensor(x["z"], data=x["z"].data_ptr() + 2)})


@pytest.mark.parametrize("name", ["delta", "B", "initial_state", "out"])
def test_c_mixed_devices(name):
    # One tensor claims to live on a GPU while u is on the CPU. Its data pointer is host memory,
    # harmless: the device check comes before any access, so this runs without a GPU or a CUDA
    # build.
    api = CApi()
    x, out = c_inputs()
    x["out"] = out
    address = api.dltensor(x[name])
    api.ffi.cast("DLTensor *", address).device.device_type = 2  # kDLCUDA, device 0
    c_forward_raises(libssm.DeviceError, name, ["cuda:0", "cpu"], api=api,
                     overrides={name: address})


def test_c_unsupported_device_type():
    api = CApi()
    x, _ = c_inputs()
    address = api.dltensor(x["D"])
    api.ffi.cast("DLTensor *", address).device.device_type = 13  # kDLCUDAManaged
    c_forward_raises(libssm.DeviceError, "D", ["cuda_managed"], api=api,
                     overrides={"D": address})


def c_backward_status(api, grads, x=None):
    x = x or c_inputs()[0]
    dout = torch.randn(BATCH, DIM, SEQLEN)
    dl = [api.dltensor(x.get(n)) for n in INPUT_NAMES]
    dg = [grads.get("d" + n, 0) for n in INPUT_NAMES]
    return api.lib.ssm_selective_scan_bwd(api.params(True), *dl, api.dltensor(dout), 0, *dg,
                                          0, 0, 0)


def test_c_gradient_without_its_input():
    api = CApi()
    x, _ = c_inputs()
    x["D"] = None
    dD = torch.full((DIM,), NAN)
    status = c_backward_status(api, {"dD": api.dltensor(dD)}, x)
    assert status == libssm.InvalidArgumentError.status_code
    assert api.last_error().startswith("dD:") and "D" in api.last_error()
    assert torch.isnan(dD).all()


@pytest.mark.parametrize("grad, value, exc, fragment", [
    ("dB", torch.full((DIM, DSTATE), NAN), libssm.ShapeError, "(2, 4, 5)"),  # B is variable
    ("dA", torch.full((DIM, DSTATE), NAN, dtype=torch.float16), libssm.DTypeError, "float32"),
    ("du", torch.full((BATCH, DIM, SEQLEN + 1), NAN), libssm.ShapeError, "(2, 6, 5)"),
], ids=["dB-wrong-form", "dA-float16", "du-shape"])
def test_c_bad_gradient_buffer(grad, value, exc, fragment):
    api = CApi()
    du = torch.full((BATCH, DIM, SEQLEN), NAN)
    grads = {"du": api.dltensor(du), grad: api.dltensor(value)}
    assert c_backward_status(api, grads) == exc.status_code
    assert api.last_error().startswith(grad + ":") and fragment in api.last_error()
    assert torch.isnan(du).all() and torch.isnan(value.float()).all()


def test_c_gradient_aliasing():
    api = CApi()
    x, _ = c_inputs()
    shared = torch.full((BATCH, DIM, SEQLEN), NAN)
    status = c_backward_status(api, {"du": api.dltensor(shared), "dz": api.dltensor(shared)}, x)
    assert status == libssm.LayoutError.status_code
    assert "overlap" in api.last_error()
    status = c_backward_status(api, {"du": api.dltensor(x["u"])}, x)
    assert status == libssm.LayoutError.status_code and api.last_error().startswith("du:")
    assert torch.isnan(shared).all()


def test_c_workspace_query_bytes_null():
    api = CApi()
    x, _ = c_inputs()
    status = api.lib.ssm_selective_scan_fwd_workspace_size(
        api.params(), api.dltensor(x["u"]), api.dltensor(x["A"]), api.dltensor(x["B"]),
        api.dltensor(x["C"]), 0)
    assert status == libssm.InvalidArgumentError.status_code
    assert api.last_error().startswith("bytes:")


def test_c_workspace_query_cpu_needs_none():
    api = CApi()
    x, _ = c_inputs()
    size = api.ffi.new("size_t *", 12345)
    for query in (api.lib.ssm_selective_scan_fwd_workspace_size,
                  api.lib.ssm_selective_scan_bwd_workspace_size):
        status = query(api.params(), api.dltensor(x["u"]), api.dltensor(x["A"]),
                       api.dltensor(x["B"]), api.dltensor(x["C"]), api.address(size))
        assert status == 0 and size[0] == 0


def test_c_last_error_describes_the_last_call_only():
    api = CApi()
    with pytest.raises(libssm.ShapeError):
        libssm.selective_scan(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(3, 1),
                              torch.zeros(2, 1, 3), torch.zeros(2, 1, 3))
    assert api.last_error().startswith("u:")
    x, _ = c_inputs()
    libssm.selective_scan(x["u"], x["delta"], x["A"], x["B"], x["C"])
    assert api.last_error() == ""


def test_c_status_strings():
    api = CApi()
    # Each exception class carries the code of its enum constant, and the codes are distinct.
    names = {libssm.InvalidArgumentError: "SSM_ERROR_INVALID_ARGUMENT",
             libssm.ShapeError: "SSM_ERROR_SHAPE", libssm.DTypeError: "SSM_ERROR_DTYPE",
             libssm.DeviceError: "SSM_ERROR_DEVICE", libssm.LayoutError: "SSM_ERROR_LAYOUT",
             libssm.UnsupportedError: "SSM_ERROR_UNSUPPORTED",
             libssm.WorkspaceError: "SSM_ERROR_WORKSPACE", libssm.CudaError: "SSM_ERROR_CUDA",
             libssm.InternalError: "SSM_ERROR_INTERNAL"}
    string = lambda status: api.ffi.string(api.lib.ssm_status_string(status)).decode()
    assert string(api.lib.SSM_SUCCESS) == "SSM_SUCCESS"
    for cls, name in names.items():
        assert cls.status_code == getattr(api.lib, name)
        assert string(cls.status_code) == name
    assert len({cls.status_code for cls in names} | {api.lib.SSM_SUCCESS}) == len(names) + 1
    assert string(99) == "unknown status"


def test_error_messages_are_per_thread():
    # Thread one fails, then thread two fails differently, then thread one reads its message:
    # still its own. The main thread, which last succeeded, still reads "".
    api = CApi()
    x = valid_inputs()
    libssm.selective_scan(x["u"], x["delta"], x["A"], x["B"], x["C"])
    first_failed, second_failed = threading.Event(), threading.Event()
    seen = {}

    def fail_with(name, value):
        y = dict(x, **{name: value})
        with pytest.raises(libssm.ShapeError):
            libssm.selective_scan(y["u"], y["delta"], y["A"], y["B"], y["C"], y["D"])

    def first():
        try:
            fail_with("B", torch.randn(3, 3, 3))
        finally:
            first_failed.set()
        second_failed.wait(30)
        seen["first"] = api.last_error()

    def second():
        first_failed.wait(30)
        try:
            fail_with("D", torch.randn(DIM + 1))
        finally:
            second_failed.set()
        seen["second"] = api.last_error()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen["first"].startswith("B:"), seen
    assert seen["second"].startswith("D:"), seen
    assert api.last_error() == ""


# ---------------------------------------------------------------------------------------------
# CUDA-only rows.


@pytest.mark.cuda
@pytest.mark.parametrize("on_cpu", ["delta", "B", "out", "initial_state"])
def test_mixed_devices(on_cpu):
    x = {k: v.cuda() for k, v in valid_inputs().items()}
    x[on_cpu] = x[on_cpu].cpu()
    before = snapshot(x)
    with pytest.raises(libssm.DeviceError) as excinfo:
        libssm.selective_scan(x["u"], x["delta"], x["A"], x["B"], x["C"], x["D"], x["z"],
                              x["delta_bias"], delta_softplus=True,
                              initial_state=x["initial_state"], return_last_state=True,
                              out=x["out"])
    torch.cuda.synchronize()
    check_error(excinfo, libssm.DeviceError, on_cpu, ["cpu", "cuda:0"])
    assert snapshot(x) == before


@pytest.mark.cuda
def test_mixed_devices_backward():
    x = {k: v.cuda() for k, v in valid_inputs().items()}
    dout = torch.randn(BATCH, DIM, SEQLEN)  # on the CPU
    with pytest.raises(libssm.DeviceError) as excinfo:
        libssm.selective_scan_bwd(x["u"], x["delta"], x["A"], x["B"], x["C"], dout, x["D"])
    check_error(excinfo, libssm.DeviceError, "dout", ["cpu", "cuda:0"])


@pytest.mark.cuda
def test_cuda_bad_shape_leaves_out_untouched():
    x = {k: v.cuda() for k, v in valid_inputs().items()}
    x["B"] = torch.randn(BATCH, DSTATE + 1, SEQLEN, device="cuda")
    with pytest.raises(libssm.ShapeError) as excinfo:
        libssm.selective_scan(x["u"], x["delta"], x["A"], x["B"], x["C"], out=x["out"])
    torch.cuda.synchronize()
    check_error(excinfo, libssm.ShapeError, "B", ["(2, 4, 5)"])
    assert torch.isnan(x["out"]).all()
