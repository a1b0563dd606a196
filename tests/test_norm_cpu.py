"""The fused norm on the CPU (libssm.norm_fwd / norm_bwd, rms_norm / layer_norm; torch and NumPy
arrays) against the float64 references: each option alone and the Mamba-2 combination, groups,
awkward sizes (hidden 1, 7 and 65536, rows 0 and 1), every dtype and dtype mixes (float32
residual stream beside bfloat16 x, float32 weight), strided rows, NaN-poisoned outputs through
the C entry points, and bit-identical dweight/dbias from run to run."""
import numpy as np
import pytest
import torch

import libssm
from harness import DTYPE_IDS, DTYPES, poisoned_like, to_numpy
from norm_harness import (BASE, GATED, LAYER, ROWS, NormCApi, backward_input, c_forward_backward,
                          case_id, check_backward, check_forward, only_view_written,
                          poisoned_forward, reference_forward, row_strided, run_backward,
                          run_forward, run_norm, storage_copy)
from references import (NormCase, assert_close, make_norm_cotangents, make_norm_inputs,
                        norm_numpy, norm_torch)

dtypes = pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
rows = pytest.mark.parametrize("case", ROWS, ids=case_id)


# ---------------------------------------------------------------------------------------------
# The references themselves.


def test_reference_by_hand():
    # One row of four, worked out on paper: LayerNorm of g = s * silu(z) (gate before the norm),
    # RMSNorm of s with the gate after it, each with a zero-centred weight and a bias.
    x = np.array([[1.0, 2.0, 3.0, 6.0]])
    residual = np.array([[1.0, 0.0, -1.0, -2.0]])
    z = np.array([[0.0, 1.0, 2.0, -1.0]])
    weight = np.array([0.0, 1.0, -0.5, 0.25])
    bias = np.array([0.5, 0.0, 0.0, -1.0])
    s = np.array([2.0, 2.0, 2.0, 4.0])
    silu = z[0] / (1.0 + np.exp(-z[0]))
    eps = float(np.float32(1e-3))

    g = s * silu
    mean = g.mean()
    rstd = 1.0 / np.sqrt(((g - mean) ** 2).mean() + eps)
    want = (g - mean) * rstd * np.array([1.0, 2.0, 0.5, 1.25]) + bias
    got = norm_numpy(x, weight, bias, residual, z, kind="layer", eps=1e-3,
                     norm_before_gate=False, zero_centered_weight=True)
    np.testing.assert_allclose(got["y"][0], want, rtol=1e-14)
    np.testing.assert_allclose(got["residual_out"][0], s, rtol=0)
    np.testing.assert_allclose(got["mean"], [mean], rtol=1e-14)
    np.testing.assert_allclose(got["rstd"], [rstd], rtol=1e-14)

    rstd = 1.0 / np.sqrt((4 + 4 + 4 + 16) / 4 + eps)
    want = (s * rstd * np.array([1.0, 2.0, 0.5, 1.25]) + bias) * silu
    got = norm_numpy(x, weight, bias, residual, z, kind="rms", eps=1e-3,
                     zero_centered_weight=True)
    np.testing.assert_allclose(got["y"][0], want, rtol=1e-14)
    assert got["mean"] is None
    np.testing.assert_allclose(got["rstd"], [rstd], rtol=1e-14)


def test_reference_groups_by_hand():
    # Two groups of two are normalised on their own: [3, 4] and [0, -2] by RMS.
    got = norm_numpy(np.array([[3.0, 4.0, 0.0, -2.0]]), kind="rms", eps=0.0, group_size=2)
    r1, r2 = 1.0 / np.sqrt(12.5), 1.0 / np.sqrt(2.0)
    np.testing.assert_allclose(got["y"][0], [3 * r1, 4 * r1, 0.0, -2 * r2], rtol=1e-14)
    np.testing.assert_allclose(got["rstd"], [[r1, r2]], rtol=1e-14)


@pytest.mark.parametrize("case", ROWS, ids=case_id)
def test_numpy_and_torch_references_agree(case):
    inputs = make_norm_inputs(case, torch.float64, 11)
    want = norm_numpy(**inputs, **case.options())
    y, s, mean, rstd = norm_torch(**inputs, **case.options())
    np.testing.assert_allclose(y.numpy(), want["y"], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(s.numpy(), want["residual_out"], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(rstd.numpy(), want["rstd"], rtol=1e-12, atol=1e-12)
    if case.kind == "layer":
        np.testing.assert_allclose(mean.numpy(), want["mean"], rtol=1e-12, atol=1e-12)
    else:
        assert mean is None and want["mean"] is None


@pytest.mark.parametrize("case", [GATED.replace(lead=(3,), hidden=8, group_size=4, bias=True),
                                  LAYER.replace(lead=(3,), hidden=6, residual=True, z=True,
                                                zero_centered_weight=True)], ids=case_id)
def test_reference_gradients_match_finite_differences(case):
    # The gradients every backward test trusts, checked once against finite differences.
    inputs = {k: v.requires_grad_() for k, v in make_norm_inputs(case, torch.float64, 5).items()
              if v is not None}
    names = list(inputs)

    def f(*xs):
        y, s, _, _ = norm_torch(**dict(zip(names, xs)), **case.options())
        return y, s

    assert torch.autograd.gradcheck(f, [inputs[n] for n in names])


# ---------------------------------------------------------------------------------------------
# Forward and backward through the generic API, torch CPU tensors.


@rows
@dtypes
def test_forward(case, dtype, seed):
    inputs = make_norm_inputs(case, dtype, seed)
    check_forward(case, inputs, run_forward(case, inputs))


@rows
@dtypes
def test_backward(case, dtype, seed):
    inputs = make_norm_inputs(case, dtype, seed)
    fwd = run_forward(case, inputs)
    dy, dres = make_norm_cotangents(case, dtype, seed)
    grads = run_backward(case, inputs, fwd, dy, dres)
    check_backward(case, backward_input(case, inputs, fwd.residual_out), inputs, dy, dres, grads)


@pytest.mark.parametrize("case", [BASE, BASE.replace(prenorm=True), GATED, LAYER,
                                  LAYER.replace(residual=True, prenorm=True, weight=False,
                                                bias=False)], ids=case_id)
@dtypes
def test_rms_norm_and_layer_norm(case, dtype, seed):
    # The user-facing calls: y, or (y, residual_out) with prenorm, like norm_fwd's fields.
    inputs = make_norm_inputs(case, dtype, seed)
    result = run_norm(case, inputs)
    refs = reference_forward(case, inputs)
    y, residual_out = result if case.prenorm else (result, None)
    assert isinstance(y, torch.Tensor) and y.dtype == dtype and y.shape == inputs["x"].shape
    assert_close("y", y, *refs["y"])
    if case.prenorm:
        assert residual_out.dtype == dtype
        assert_close("residual_out", residual_out, *refs["residual_out"])


def test_default_eps():
    # rms_norm's eps defaults to 1e-6, layer_norm's to 1e-5: visible on values of size 1e-3,
    # whose mean square is comparable to either.
    x = 1e-3 * torch.randn(3, 8, generator=torch.Generator().manual_seed(3))
    weight = torch.ones(8)
    for fn, eps, kind in ((libssm.rms_norm, 1e-6, "rms"), (libssm.layer_norm, 1e-5, "layer")):
        y = fn(x, weight).double().numpy()
        want = norm_numpy(x, weight, kind=kind, eps=eps)["y"]
        other = norm_numpy(x, weight, kind=kind, eps=eps * 10)["y"]
        np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)
        assert np.abs(other - want).max() > 0.1


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("case", [BASE.replace(bias=True), GATED.replace(bias=True),
                                  LAYER.replace(residual=True, z=True)], ids=case_id)
def test_float32_weight_beside_low_precision_x(case, dtype, seed):
    # weight and bias float32 (a model kept in fp32 parameters) while x, residual, z are not;
    # dweight and dbias come back float32.
    inputs = make_norm_inputs(case, dtype, seed, dtypes={"weight": torch.float32,
                                                         "bias": torch.float32})
    fwd = run_forward(case, inputs)
    check_forward(case, inputs, fwd)
    dy, dres = make_norm_cotangents(case, dtype, seed)
    grads = run_backward(case, inputs, fwd, dy, dres)
    assert grads.dweight.dtype == torch.float32
    check_backward(case, backward_input(case, inputs, fwd.residual_out), inputs, dy, dres, grads)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("residual_in", ["fp32", "low"])
def test_float32_residual_stream(residual_in, dtype, seed):
    # Mamba's residual_in_fp32: the stream is kept in float32 beside low-precision x. The
    # residual may arrive in float32 or in x's dtype; residual_dtype=float32 makes residual_out
    # float32 either way. The backward takes that float32 s, so dx is float32, and
    # residual_dtype=x's dtype adds dresidual, the same gradient in x's dtype.
    case = GATED.replace(bias=True)
    residual_dtype = torch.float32 if residual_in == "fp32" else dtype
    inputs = make_norm_inputs(case, dtype, seed, dtypes={"residual": residual_dtype})
    fwd = run_forward(case, inputs, residual_dtype=torch.float32)
    check_forward(case, inputs, fwd, residual_dtype=torch.float32)
    dy, dres = make_norm_cotangents(case, dtype, seed, dresidual_dtype=torch.float32)
    s = backward_input(case, inputs, fwd.residual_out)
    assert s.dtype == torch.float32
    grads = run_backward(case, inputs, fwd, dy, dres, residual_dtype=dtype)
    check_backward(case, s, inputs, dy, dres, grads, dresidual_dtype=dtype)
    same = run_backward(case, inputs, fwd, dy, dres, residual_dtype=torch.float32)
    check_backward(case, s, inputs, dy, dres, same)


def test_residual_dtype_without_residual(seed):
    # residual_dtype alone starts a float32 stream from bf16 x: residual_out is x in float32.
    case = BASE
    inputs = make_norm_inputs(case, torch.bfloat16, seed)
    fwd = run_forward(case, inputs, residual_dtype=torch.float32)
    check_forward(case, inputs, fwd, residual_dtype=torch.float32)
    assert torch.equal(fwd.residual_out, inputs["x"].float())


def test_c_every_dtype_independent(seed):
    # Through the C entry points each row-shaped tensor and each of weight/bias takes its own
    # dtype, outputs included: y float32 from bf16 x, residual_out fp16, dresidual float32.
    case = GATED.replace(bias=True)
    dtypes = {"x": torch.bfloat16, "residual": torch.float32, "z": torch.float16,
              "weight": torch.bfloat16, "bias": torch.float32}
    inputs = make_norm_inputs(case, torch.float32, seed, dtypes=dtypes)
    dy, dres = make_norm_cotangents(case, torch.float16, seed, dresidual_dtype=torch.bfloat16)
    fwd, s, grads = c_forward_backward(case, inputs, dy, dres, y_dtype=torch.float32,
                                       residual_dtype=torch.float16,
                                       dresidual_dtype=torch.float32)
    refs = reference_forward(case, inputs)
    assert_close("y", fwd.y, *refs["y"])
    assert_close("residual_out", fwd.residual_out, *refs["residual_out"])
    assert_close("rstd", fwd.rstd, *refs["rstd"])
    check_backward(case, s, inputs, dy, dres, grads, dresidual_dtype=torch.float32)


# ---------------------------------------------------------------------------------------------
# NumPy arrays (the DLPack path), out=, strided rows.


@pytest.mark.parametrize("case", [BASE, GATED, LAYER.replace(residual=True, z=True)],
                         ids=case_id)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=DTYPE_IDS.get)
def test_numpy_forward_backward(case, dtype, seed):
    inputs = make_norm_inputs(case, dtype, seed)
    np_inputs = {k: to_numpy(v) for k, v in inputs.items()}
    fwd = run_forward(case, np_inputs)
    assert all(a is None or isinstance(a, np.ndarray) for a in fwd)
    check_forward(case, inputs, fwd)
    dy, dres = make_norm_cotangents(case, dtype, seed)
    grads = run_backward(case, np_inputs, fwd, to_numpy(dy), to_numpy(dres))
    assert all(g is None or isinstance(g, np.ndarray) for g in grads)
    s = backward_input(case, inputs, None if fwd.residual_out is None
                       else torch.from_numpy(fwd.residual_out))
    check_backward(case, s, inputs, dy, dres, grads)


@pytest.mark.parametrize("case", [GATED, LAYER.replace(residual=True, z=True, lead=(2, 3, 4))],
                         ids=case_id)
@dtypes
def test_strided_rows(case, dtype, seed):
    # Rows of x, residual, z and dy sit apart in larger buffers (an offset and slack after each
    # row); results equal the contiguous inputs'.
    inputs = make_norm_inputs(case, dtype, seed)
    views = dict(inputs, **{n: row_strided(inputs[n]) for n in ("x", "residual", "z")})
    assert not views["x"].is_contiguous() and views["x"].storage_offset() == 3
    fwd = run_forward(case, views)
    check_forward(case, inputs, fwd)
    dy, dres = make_norm_cotangents(case, dtype, seed)
    grads = run_backward(case, views, fwd, row_strided(dy, pad=2), row_strided(dres, pad=9))
    check_backward(case, backward_input(case, inputs, fwd.residual_out), inputs, dy, dres, grads)


def test_numpy_strided_rows(seed):
    case = GATED
    inputs = make_norm_inputs(case, torch.float32, seed)
    views = {k: to_numpy(row_strided(v) if k in ("x", "residual", "z") else v)
             for k, v in inputs.items()}
    assert not views["x"].flags.c_contiguous
    check_forward(case, inputs, run_forward(case, views))


def test_c_strided_outputs(seed):
    # y, residual_out, dx, dresidual and dz written through row strides, nothing else touched;
    # mean and rstd through a column stride (a transposed (rows, ngroups) buffer).
    case = GATED.replace(kind="layer", bias=True, lead=(6,))
    inputs = make_norm_inputs(case, torch.float32, seed)
    api = NormCApi()
    out = {n: row_strided(poisoned_like(inputs["x"])) for n in ("y", "residual_out")}
    storages = {n: storage_copy(t) for n, t in out.items()}
    stats = {n: torch.full((case.ngroups, case.rows), float("nan")).t()
             for n in ("mean", "rstd")}
    api.forward(case, inputs, **out, **stats)
    fwd = libssm.NormForward(out["y"], out["residual_out"], stats["mean"], stats["rstd"])
    check_forward(case, inputs, fwd)
    for name, t in out.items():
        assert only_view_written(t, storages[name]), name
    dy, dres = make_norm_cotangents(case, torch.float32, seed)
    grads = {n: row_strided(poisoned_like(inputs["x"])) for n in ("dx", "dresidual", "dz")}
    grads.update(dweight=poisoned_like(inputs["weight"]), dbias=poisoned_like(inputs["bias"]))
    s = fwd.residual_out
    api.backward(case, s, inputs, fwd.mean, fwd.rstd, dy, dres, grads)
    check_backward(case, s, inputs, dy, dres, libssm.NormGrads(**grads),
                   dresidual_dtype=torch.float32)


@pytest.mark.parametrize("framework", ["torch", "numpy"])
def test_out_given(framework, seed):
    # out= is written and returned as given, in its own dtype.
    case = GATED
    inputs = make_norm_inputs(case, torch.float32, seed)
    out = poisoned_like(inputs["x"], torch.bfloat16 if framework == "torch" else None)
    if framework == "numpy":
        inputs_fw = {k: to_numpy(v) for k, v in inputs.items()}
        out = to_numpy(out)
    else:
        inputs_fw = inputs
    y, _ = run_norm(case, inputs_fw, out=out)
    assert y is out
    refs = reference_forward(case, inputs)
    assert_close("y", out, *refs["y"])


# ---------------------------------------------------------------------------------------------
# Every output written: the C entry points with NaN-poisoned buffers.


@pytest.mark.parametrize("case", [BASE, GATED, LAYER.replace(residual=True, z=True, hidden=7),
                                  GATED.replace(hidden=1, group_size=0), GATED.replace(lead=(1,))],
                         ids=case_id)
@dtypes
def test_poisoned_outputs_all_written(case, dtype, seed):
    inputs = make_norm_inputs(case, dtype, seed)
    dy, dres = make_norm_cotangents(case, dtype, seed)
    fwd, s, grads = c_forward_backward(case, inputs, dy, dres, dresidual_dtype=torch.float32)
    check_forward(case, inputs, fwd, refs=None)
    check_backward(case, s, inputs, dy, dres, grads, dresidual_dtype=torch.float32)


@pytest.mark.parametrize("case", [GATED.replace(lead=(0,), bias=True),
                                  LAYER.replace(lead=(0, 4), residual=True, z=True)],
                         ids=case_id)
def test_rows_zero(case, seed):
    # No rows: the outputs are empty, and dweight and dbias, sums over no rows, are written as
    # zeros (NaN-poisoned before).
    inputs = make_norm_inputs(case, torch.float32, seed)
    fwd = run_forward(case, inputs)
    assert fwd.y.shape == inputs["x"].shape and fwd.rstd.shape[0] == 0
    dy, dres = make_norm_cotangents(case, torch.float32, seed)
    fwd, s, grads = c_forward_backward(case, inputs, dy, dres)
    for name in ("dweight", "dbias"):
        g = getattr(grads, name)
        assert torch.equal(g, torch.zeros_like(g)), name
    check_backward(case, s, inputs, dy, dres, grads)


@pytest.mark.parametrize("case", [BASE.replace(lead=(2,), hidden=65536, bias=True),
                                  GATED.replace(kind="layer", lead=(1,), hidden=65536,
                                                group_size=16384)], ids=case_id)
def test_hidden_at_the_limit(case, seed):
    inputs = make_norm_inputs(case, torch.bfloat16, seed, dtypes={"weight": torch.float32})
    fwd = run_forward(case, inputs)
    check_forward(case, inputs, fwd)
    dy, dres = make_norm_cotangents(case, torch.bfloat16, seed)
    grads = run_backward(case, inputs, fwd, dy, dres)
    check_backward(case, backward_input(case, inputs, fwd.residual_out), inputs, dy, dres, grads)


def test_backward_subset_of_gradients(seed):
    # Any gradient may be NULL: the ones asked for are still right and the others untouched.
    case = GATED.replace(bias=True)
    inputs = make_norm_inputs(case, torch.float32, seed)
    fwd = run_forward(case, inputs)
    dy, dres = make_norm_cotangents(case, torch.float32, seed)
    s = fwd.residual_out
    full = check_backward(case, s, inputs, dy, dres, run_backward(case, inputs, fwd, dy, dres))
    for wanted in (("dweight",), ("dz", "dbias"), ("dx",)):
        grads = {n: poisoned_like(s if n == "dx" else inputs[n[1:]]) for n in wanted}
        NormCApi().backward(case, s, inputs, fwd.mean, fwd.rstd, dy, dres, grads)
        for name, g in grads.items():
            assert_close(name, g, *full[name])


def test_backward_needs(seed):
    # needs= names the gradients wanted; the others come back None.
    case = GATED.replace(bias=True)
    inputs = make_norm_inputs(case, torch.float32, seed)
    fwd = run_forward(case, inputs)
    dy, dres = make_norm_cotangents(case, torch.float32, seed)
    s = fwd.residual_out
    full = check_backward(case, s, inputs, dy, dres, run_backward(case, inputs, fwd, dy, dres))
    grads = run_backward(case, inputs, fwd, dy, dres, needs=(False, False, True, False, True))
    assert grads.dx is None and grads.dresidual is None and grads.dbias is None
    assert_close("dweight", grads.dweight, *full["dweight"])
    assert_close("dz", grads.dz, *full["dz"])


# ---------------------------------------------------------------------------------------------
# Determinism and extreme values.


@pytest.mark.parametrize("case", [GATED.replace(bias=True, lead=(300,)),
                                  LAYER.replace(lead=(257,), hidden=7)], ids=case_id)
def test_weight_gradients_bitwise_deterministic(case, seed):
    inputs = make_norm_inputs(case, torch.float32, seed)
    dy, dres = make_norm_cotangents(case, torch.float32, seed)
    fwd = run_forward(case, inputs)
    first = run_backward(case, inputs, fwd, dy, dres)
    for _ in range(3):
        again = run_backward(case, inputs, fwd, dy, dres)
        assert torch.equal(again.dweight, first.dweight)
        assert torch.equal(again.dbias, first.dbias)


EXTREME_ROWS = {
    "zeros": lambda x: x * 0.0,        # rstd = 1/sqrt(eps); y = bias
    "constant": lambda x: x * 0.0 + 3.0,  # LayerNorm variance 0
    # A common offset far above the spread: a one-pass variance E[x^2] - mean^2 in float32 loses
    # most of its digits to cancellation.
    "offset": lambda x: x + 300.0,
    "large": lambda x: x * 1e4,        # squares far past float16's range
}


@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize("pattern", list(EXTREME_ROWS))
def test_extreme_rows(pattern, kind, seed):
    case = LAYER.replace(kind=kind, lead=(4,), hidden=256)
    inputs = make_norm_inputs(case, torch.float32, seed)
    inputs["x"] = EXTREME_ROWS[pattern](inputs["x"])
    fwd = run_forward(case, inputs)
    check_forward(case, inputs, fwd)
    dy, _ = make_norm_cotangents(case, torch.float32, seed)
    check_backward(case, inputs["x"], inputs, dy, None, run_backward(case, inputs, fwd, dy, None))


def test_case_labels_are_distinct():
    labels = [case_id(c) for c in ROWS]
    assert len(set(labels)) == len(labels)
    assert NormCase().label() == "base"


def test_poisoned_forward_buffers_are_nan():
    # The harness's poisoned buffers really start NaN (so "all written" tests can fail).
    case = LAYER.replace(residual=True)
    out = poisoned_forward(case, make_norm_inputs(case, torch.float32, 0))
    assert all(torch.isnan(t).all() for t in out.values())
