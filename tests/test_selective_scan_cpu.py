"""libssm.selective_scan and selective_scan_bwd on the CPU (torch and NumPy arrays) against the
float64 references: every option alone and together, every B/C form, sizes chosen to reach the
edges (seqlen 1, dstate 1 and 256, dim 1, batch 0), strided and reversed views, out=, and
gradient buffers poisoned with NaN so that anything left unwritten shows."""
import threading

import numpy as np
import pytest
import torch

import libssm
from references import (ScanCase, assert_close, make_cotangents, make_inputs, reference_outputs,
                        selective_scan_numpy, selective_scan_torch)
from harness import DTYPE_IDS, DTYPES, poisoned_like, to_numpy
from scan_harness import (FULL, ROWS, CApi, case_id, check_backward, check_forward,
                          extreme_delta_and_z, mamba_layout, poisoned_grads, run_backward,
                          run_forward, strided_views, transposed_poison)

dtypes = pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
rows = pytest.mark.parametrize("case", ROWS, ids=case_id)


# ---------------------------------------------------------------------------------------------
# The references themselves.


def test_reference_by_hand():
    # One channel, one state, two steps, every option: worked out on paper.
    u = np.array([[[1.0, 2.0]]])
    delta = np.array([[[0.5, -1.0]]])
    delta_bias = np.array([0.25])
    A = np.array([[-0.5]])
    B = np.array([[[2.0, -1.0]]])
    C = np.array([[[1.0, 3.0]]])
    D = np.array([0.5])
    z = np.array([[[0.5, 1.0]]])
    h0 = np.array([[[4.0]]])
    dt = np.log1p(np.exp(np.array([0.75, -0.75])))
    h1 = np.exp(-0.5 * dt[0]) * 4.0 + dt[0] * 2.0 * 1.0
    h2 = np.exp(-0.5 * dt[1]) * h1 + dt[1] * -1.0 * 2.0
    y = np.array([1.0 * h1 + 0.5 * 1.0, 3.0 * h2 + 0.5 * 2.0])
    expected = y * np.array([0.5 / (1.0 + np.exp(-0.5)), 1.0 / (1.0 + np.exp(-1.0))])
    out, last = selective_scan_numpy(u, delta, A, B, C, D, z, delta_bias, True, h0)
    np.testing.assert_allclose(out[0, 0], expected, rtol=1e-14)
    np.testing.assert_allclose(last[0, 0, 0], h2, rtol=1e-14)


@pytest.mark.parametrize("case", [FULL, FULL.replace(B_form="group", C_form="fixed", groups=3),
                                  FULL.replace(B_form="fixed", C_form="group", groups=2)],
                         ids=case_id)
def test_numpy_and_torch_references_agree(case):
    inputs = make_inputs(case, torch.float64, 7, dtypes={"A": torch.float64})
    out_np, last_np = selective_scan_numpy(delta_softplus=True, **inputs)
    out_t, last_t = selective_scan_torch(delta_softplus=True, **inputs)
    np.testing.assert_allclose(out_t.numpy(), out_np, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(last_t.numpy(), last_np, rtol=1e-12, atol=1e-12)


def test_reference_gradients_match_finite_differences():
    # The gradients every backward test trusts, checked once against finite differences.
    case = ScanCase(batch=1, dim=3, seqlen=5, dstate=2, B_form="group", groups=3,
                    **dict(D=True, z=True, delta_bias=True, softplus=True, initial_state=True))
    inputs = {k: (None if v is None else v.double().requires_grad_())
              for k, v in make_inputs(case, torch.float64, 3).items()}
    names = [n for n, v in inputs.items() if v is not None]

    def f(*xs):
        out, last = selective_scan_torch(delta_softplus=True, **dict(zip(names, xs)))
        return out, last

    assert torch.autograd.gradcheck(f, [inputs[n] for n in names])


# ---------------------------------------------------------------------------------------------
# Forward and backward, torch CPU tensors.


@rows
@dtypes
def test_forward(case, dtype, seed):
    inputs = make_inputs(case, dtype, seed)
    out, last_state = run_forward(case, inputs)
    check_forward(case, inputs, out, last_state)


@rows
@dtypes
def test_backward(case, dtype, seed):
    inputs = make_inputs(case, dtype, seed)
    dout, dlast = make_cotangents(case, dtype, seed)
    check_backward(case, inputs, dout, dlast, run_backward(case, inputs, dout, dlast))


MIXED_DTYPES = {"u": torch.float16, "delta": torch.bfloat16, "B": torch.float32,
                "C": torch.float16, "z": torch.bfloat16, "initial_state": torch.float16}


def test_mixed_dtypes(seed):
    # Each of u, delta, B, C, z, initial_state (and dout) takes its own dtype.
    case = FULL
    inputs = make_inputs(case, torch.float32, seed, dtypes=MIXED_DTYPES)
    out, last_state = run_forward(case, inputs)
    check_forward(case, inputs, out, last_state)
    dout, dlast = make_cotangents(case, torch.bfloat16, seed)
    check_backward(case, inputs, dout, dlast, run_backward(case, inputs, dout, dlast))


def test_softplus_changes_result(seed):
    # delta_softplus must reach the computation: with it on, the result is softplus's.
    case = FULL.replace(softplus=False)
    inputs = make_inputs(case, torch.float32, seed)
    plain, _ = run_forward(case, inputs)
    soft, _ = run_forward(case.replace(softplus=True), inputs)
    assert (plain - soft).abs().max() > 1e-2
    check_forward(case.replace(softplus=True), inputs, *run_forward(case.replace(softplus=True),
                                                                    inputs))


def test_dlast_state_alone(seed):
    # A loss on last_state only: dout is zero, the gradients come from dlast_state alone.
    case = FULL
    inputs = make_inputs(case, torch.float32, seed)
    _, dlast = make_cotangents(case, torch.float32, seed)
    dout = torch.zeros_like(inputs["u"])
    check_backward(case, inputs, dout, dlast, run_backward(case, inputs, dout, dlast))


def test_backward_without_dlast_state(seed):
    # dlast_state None is a zero cotangent, whether or not the forward returned last_state.
    case = FULL.replace(last_state=False)
    inputs = make_inputs(case, torch.float32, seed)
    dout, _ = make_cotangents(case, torch.float32, seed)
    check_backward(case, inputs, dout, None, run_backward(case, inputs, dout, None))


# ---------------------------------------------------------------------------------------------
# NumPy arrays (the DLPack path).

NUMPY_ROWS = [FULL, FULL.replace(B_form="group", C_form="group", groups=3),
              FULL.replace(B_form="fixed", C_form="var"), FULL.replace(seqlen=1)]


@pytest.mark.parametrize("case", NUMPY_ROWS, ids=case_id)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=DTYPE_IDS.get)
def test_numpy_forward_backward(case, dtype, seed):
    inputs = make_inputs(case, dtype, seed)
    np_inputs = {k: to_numpy(v) for k, v in inputs.items()}
    out, last_state = run_forward(case, np_inputs)
    assert isinstance(out, np.ndarray)
    assert last_state is None or isinstance(last_state, np.ndarray)
    check_forward(case, inputs, out, last_state)
    dout, dlast = make_cotangents(case, dtype, seed)
    grads = run_backward(case, np_inputs, to_numpy(dout), to_numpy(dlast))
    assert all(g is None or isinstance(g, np.ndarray) for g in grads)
    check_backward(case, inputs, dout, dlast, grads)


# ---------------------------------------------------------------------------------------------
# Layouts: strided views and out=.


@pytest.mark.parametrize("case", [FULL, FULL.replace(B_form="group", C_form="group", groups=2),
                                  FULL.replace(B_form="fixed", C_form="fixed")], ids=case_id)
@dtypes
def test_strided_inputs(case, dtype, seed):
    inputs = make_inputs(case, dtype, seed)
    views = strided_views(inputs)
    assert not views["u"].is_contiguous() and views["delta"].storage_offset() == 3
    check_forward(case, inputs, *run_forward(case, views))
    dout, dlast = make_cotangents(case, dtype, seed)
    dout_view = dout.transpose(0, 2).contiguous().transpose(0, 2)
    check_backward(case, inputs, dout, dlast, run_backward(case, views, dout_view, dlast))


def test_numpy_strided_inputs(seed):
    # The same views through NumPy, whose DLPack export carries the strides (and offsets folded
    # into the data pointer).
    case = FULL.replace(B_form="group", C_form="group", groups=3)
    inputs = make_inputs(case, torch.float16, seed)
    views = {k: to_numpy(v) for k, v in strided_views(inputs).items()}
    assert not views["u"].flags.c_contiguous and not views["delta"].flags.c_contiguous
    check_forward(case, inputs, *run_forward(case, views))
    dout, dlast = make_cotangents(case, torch.float16, seed)
    grads = run_backward(case, views, to_numpy(dout.transpose(1, 2).contiguous()).swapaxes(1, 2),
                         to_numpy(dlast))
    check_backward(case, inputs, dout, dlast, grads)


def test_numpy_reversed_and_broadcast_inputs(seed):
    # Negative strides (a reversed view) and stride-0 broadcasts are honoured for inputs.
    case = FULL
    inputs = make_inputs(case, torch.float32, seed)
    inputs["D"] = torch.full((case.dim,), 0.75)
    np_inputs = {k: to_numpy(v) for k, v in inputs.items()}
    for name in ("u", "B", "initial_state"):
        reversed_copy = np.ascontiguousarray(np_inputs[name][..., ::-1])
        np_inputs[name] = reversed_copy[..., ::-1]
        assert np_inputs[name].strides[-1] < 0
    np_inputs["D"] = np.broadcast_to(np.float32(0.75), (case.dim,))
    check_forward(case, inputs, *run_forward(case, np_inputs))


@pytest.mark.parametrize("framework", ["torch", "numpy"])
def test_out_given(framework, seed):
    case = FULL
    inputs = make_inputs(case, torch.float16, seed)
    if framework == "numpy":
        inputs_fw = {k: to_numpy(v) for k, v in inputs.items()}
        out = np.full(inputs["u"].shape, np.nan, dtype=np.float16)
    else:
        inputs_fw = inputs
        out = poisoned_like(inputs["u"])
    result, last_state = run_forward(case, inputs_fw, out=out)
    assert result is out
    check_forward(case, inputs, out, last_state)


def test_out_given_strided(seed):
    # out as a transposed view of a larger buffer: written through its strides, nothing else.
    case = FULL
    inputs = make_inputs(case, torch.float32, seed)
    b, d, l = case.batch, case.dim, case.seqlen
    storage = torch.full((l + 1, b, d), float("nan"))
    out = storage[1:].permute(1, 2, 0)
    result, last_state = run_forward(case, inputs, out=out)
    assert result is out
    check_forward(case, inputs, out, last_state)
    assert torch.isnan(storage[0]).all()


def test_out_different_dtype(seed):
    # out's dtype is its own: fp32 inputs can be written to a bf16 out.
    case = FULL
    inputs = make_inputs(case, torch.float32, seed)
    out = poisoned_like(inputs["u"], dtype=torch.bfloat16)
    run_forward(case, inputs, out=out)
    ref, _ = selective_scan_numpy(delta_softplus=True, **inputs)
    plain = reference_outputs(inputs, True, precision=torch.float32)["out"]
    assert_close("out", out, torch.from_numpy(ref), plain)


@pytest.mark.parametrize("form", ["namedtuple", "tuple", "dict"])
@pytest.mark.parametrize("framework", ["torch", "numpy"])
def test_backward_out_given(form, framework, seed):
    # Buffers for a subset of the gradients (one strided) are written and returned as given;
    # the others are allocated as without out=.
    case = FULL
    inputs = make_inputs(case, torch.float32, seed)
    dout, dlast = make_cotangents(case, torch.float32, seed)
    given = {"dB": poisoned_like(inputs["B"]), "dD": poisoned_like(inputs["D"]),
             "dinitial_state": transposed_poison(inputs["initial_state"].shape, torch.float32)}
    fw_inputs = inputs
    if framework == "numpy":
        fw_inputs = {k: to_numpy(v) for k, v in inputs.items()}
        given = {k: to_numpy(v) for k, v in given.items()}
        dout_fw, dlast_fw = to_numpy(dout), to_numpy(dlast)
    else:
        dout_fw, dlast_fw = dout, dlast
    names = libssm.SelectiveScanGrads._fields
    out = {"namedtuple": libssm.SelectiveScanGrads(*(given.get(n) for n in names)),
           "tuple": tuple(given.get(n) for n in names), "dict": given}[form]
    grads = run_backward(case, fw_inputs, dout_fw, dlast_fw, out=out)
    for name in names:
        if name in given:
            assert getattr(grads, name) is given[name], name
        else:
            assert type(getattr(grads, name)) is type(given["dB"]), name
    check_backward(case, inputs, dout, dlast, grads)


@pytest.mark.parametrize("out", [{"dq": None}, (None,) * 8, [None] * 10, "du"],
                         ids=["unknown-name", "short-tuple", "long-list", "str"])
def test_backward_out_malformed(out, seed):
    inputs = make_inputs(FULL, torch.float32, seed)
    dout, dlast = make_cotangents(FULL, torch.float32, seed)
    with pytest.raises(libssm.InvalidArgumentError) as excinfo:
        run_backward(FULL, inputs, dout, dlast, out=out)
    assert str(excinfo.value).startswith("out:"), str(excinfo.value)


# ---------------------------------------------------------------------------------------------
# Batch 0, and every gradient written (C entry points with NaN-poisoned buffers).


@pytest.mark.parametrize("case", [FULL.replace(batch=0),
                                  FULL.replace(batch=0, B_form="fixed", C_form="fixed")],
                         ids=case_id)
def test_batch_zero(case, seed):
    inputs = make_inputs(case, torch.float32, seed)
    out, last_state = run_forward(case, inputs)
    assert out.shape == (0, case.dim, case.seqlen) and last_state.shape == (0, case.dim,
                                                                             case.dstate)
    dout, dlast = make_cotangents(case, torch.float32, seed)
    # The sums over batches (dA, dD, ddelta_bias, fixed dB/dC) are zero and must be written.
    grads = poisoned_grads(inputs)
    CApi().backward(case, inputs, dout, dlast, grads)
    check_backward(case, inputs, dout, dlast, libssm.SelectiveScanGrads(**grads))
    for name in ("dA", "dD", "ddelta_bias"):
        assert torch.equal(grads[name], torch.zeros_like(grads[name])), name


@pytest.mark.parametrize("case", [FULL, FULL.replace(B_form="fixed", C_form="group", groups=2),
                                  FULL.replace(seqlen=1, dstate=1)], ids=case_id)
@dtypes
def test_poisoned_outputs_all_written(case, dtype, seed):
    inputs = make_inputs(case, dtype, seed)
    api = CApi()
    out = poisoned_like(inputs["u"])
    last_state = torch.full((case.batch, case.dim, case.dstate), float("nan"))
    api.forward(case, inputs, out, last_state)
    check_forward(case, inputs, out, last_state)
    dout, dlast = make_cotangents(case, dtype, seed)
    grads = poisoned_grads(inputs)
    api.backward(case, inputs, dout, dlast, grads)
    check_backward(case, inputs, dout, dlast, libssm.SelectiveScanGrads(**grads))


def test_backward_subset_of_gradients(seed):
    # Any gradient may be NULL; the ones asked for are still right, and only they are written.
    case = FULL
    inputs = make_inputs(case, torch.float32, seed)
    dout, dlast = make_cotangents(case, torch.float32, seed)
    ref = reference_outputs(inputs, True, dout, dlast)
    plain = reference_outputs(inputs, True, dout, dlast, precision=torch.float32)
    grads = {k: v for k, v in poisoned_grads(inputs).items() if k in ("dB", "dD", "dinitial_state")}
    CApi().backward(case, inputs, dout, dlast, grads)
    for name, g in grads.items():
        assert_close(name, g, ref[name], plain[name])


@pytest.mark.parametrize("case", [FULL, FULL.replace(B_form="fixed", C_form="fixed"),
                                  FULL.replace(B_form="group", C_form="group", groups=3)],
                         ids=case_id)
def test_strided_output_buffers(case, seed):
    # Outputs (out, last_state and every gradient) written through reversed-order strides.
    inputs = make_inputs(case, torch.float32, seed)
    api = CApi()
    out = transposed_poison(inputs["u"].shape, torch.float32)
    last_state = transposed_poison((case.batch, case.dim, case.dstate), torch.float32)
    api.forward(case, inputs, out, last_state)
    check_forward(case, inputs, out, last_state)
    dout, dlast = make_cotangents(case, torch.float32, seed)
    grads = {"d" + n: transposed_poison(x.shape, x.dtype) for n, x in inputs.items()
             if x is not None}
    assert not grads["dB"].is_contiguous() and not grads["dA"].is_contiguous()
    api.backward(case, inputs, dout, dlast, grads)
    check_backward(case, inputs, dout, dlast, libssm.SelectiveScanGrads(**grads))


@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16], ids=DTYPE_IDS.get)
def test_output_rounding_is_nearest_even(out_dtype, seed):
    # With C = 0 and D = 1 the output is exactly u, so a lower-precision out must hold u rounded
    # to nearest-even, the one correct rounding (torch's .to() rounds that way), overflow to inf
    # included.
    case = FULL.replace(z=False, seqlen=64)
    inputs = make_inputs(case, torch.float32, seed)
    inputs["C"] = torch.zeros_like(inputs["C"])
    inputs["D"] = torch.ones(case.dim)
    u = inputs["u"]
    u.view(-1)[:4] = torch.tensor([70000.0, -1e6, 1.0 + 2.0 ** -11, 1.0 + 3 * 2.0 ** -11])
    u.view(-1)[4:8] = torch.tensor([1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8, 6e-8, -3e-39])
    out = poisoned_like(u, dtype=out_dtype)
    run_forward(case, inputs, out=out)
    assert torch.equal(out, u.to(out_dtype)), (out.view(-1)[:8], u.to(out_dtype).view(-1)[:8])


# ---------------------------------------------------------------------------------------------
# Layouts real callers produce, DLTensor fields the frameworks above never set, extreme values.


@dtypes
def test_mamba_layout(dtype, seed):
    case = FULL
    inputs = make_inputs(case, dtype, seed, dtypes={"z": dtype})
    views = mamba_layout(inputs, case)
    check_forward(case, inputs, *run_forward(case, views))
    dout, dlast = make_cotangents(case, dtype, seed)
    check_backward(case, inputs, dout, dlast, run_backward(case, views, dout, dlast))


def test_inputs_may_alias_each_other(seed):
    # Inputs are only read, so one tensor may serve as several: u as delta, B as C.
    case = FULL.replace(B_form="group", C_form="group", groups=2)
    inputs = make_inputs(case, torch.float32, seed)
    inputs["u"] = inputs["delta"]
    inputs["C"] = inputs["B"]
    check_forward(case, inputs, *run_forward(case, inputs))
    dout, dlast = make_cotangents(case, torch.float32, seed)
    check_backward(case, inputs, dout, dlast, run_backward(case, inputs, dout, dlast))


def test_c_byte_offset_and_null_strides(seed):
    # DLTensor.byte_offset is added to data, and NULL strides mean compact row-major.
    case = FULL
    inputs = make_inputs(case, torch.float32, seed)
    api = CApi()
    dl = {}
    for name, x in inputs.items():
        padded = torch.cat([torch.full((5,), float("nan")), x.reshape(-1)])
        address = api.dltensor(x.contiguous())
        tensor = api.ffi.cast("DLTensor *", address)
        tensor.data = api.ffi.cast("void *", padded.data_ptr())
        tensor.byte_offset = 5 * 4
        tensor.strides = api.ffi.NULL
        api._keep.append(padded)
        dl[name] = address
    out = poisoned_like(inputs["u"])
    last_state = torch.full((case.batch, case.dim, case.dstate), float("nan"))
    out_dl = api.ffi.cast("DLTensor *", api.dltensor(out))
    out_dl.strides = api.ffi.NULL
    params = api.params(True)
    api.check(api.lib.ssm_selective_scan_fwd(
        params, *(dl[n] for n in ("u", "delta", "A", "B", "C", "D", "z", "delta_bias",
                                  "initial_state")),
        api.address(out_dl), api.dltensor(last_state), 0, 0, 0))
    check_forward(case, inputs, out, last_state)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS.get)
def test_extreme_delta_and_z(dtype, seed):
    case = FULL
    inputs = extreme_delta_and_z(case, dtype, seed)
    check_forward(case, inputs, *run_forward(case, inputs))
    dout, dlast = make_cotangents(case, dtype, seed)
    check_backward(case, inputs, dout, dlast, run_backward(case, inputs, dout, dlast))


def test_numpy_batch_zero(seed):
    case = FULL.replace(batch=0)
    inputs = make_inputs(case, torch.float16, seed)
    np_inputs = {k: to_numpy(v) for k, v in inputs.items()}
    out, last_state = run_forward(case, np_inputs)
    assert out.shape == (0, case.dim, case.seqlen) and out.dtype == np.float16
    dout, dlast = make_cotangents(case, torch.float16, seed)
    grads = run_backward(case, np_inputs, to_numpy(dout), to_numpy(dlast))
    check_backward(case, inputs, dout, dlast, grads)


@pytest.mark.parametrize("framework", ["torch", "numpy"])
def test_concurrent_calls_from_threads(framework, seed):
    # The library runs without the GIL, so calls from several threads overlap; each must get
    # its own result (the forward is per channel, so equal to the single-threaded bits).
    case = FULL.replace(seqlen=1500, dim=16)
    per_thread = [make_inputs(case, torch.float32, seed + i) for i in range(4)]
    if framework == "numpy":
        per_thread = [{k: to_numpy(v) for k, v in x.items()} for x in per_thread]
    expected = [run_forward(case, x) for x in per_thread]
    results = [None] * len(per_thread)

    def work(i):
        results[i] = [run_forward(case, per_thread[i]) for _ in range(20)]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(per_thread))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for want, got in zip(expected, results):
        for out, last_state in got:
            assert np.array_equal(np.asarray(out), np.asarray(want[0]))
            assert np.array_equal(np.asarray(last_state), np.asarray(want[1]))
