"""The selective-state decode step on the CPU (libssm.selective_state_update; torch and NumPy
arrays) against the float64 references: both layouts, ngroups, Mamba-2's stride-0 operands,
dstate 1 to 256 and odd sizes, each optional operand on its own, every dtype and state/operand
dtype mixes, state_batch_indices with padding and permutations, strided operands and a state
that is a view into a larger cache (written in place, nothing else touched), NaN-poisoned out
through the C entry point, and L decode steps against the full selective scan."""
import math

import numpy as np
import pytest
import torch

import libssm
from harness import DTYPE_IDS, DTYPES, poisoned_like
from references import (StateUpdateCase, make_state_update_inputs, state_update_numpy,
                        state_update_torch)
from state_update_harness import (BASE, FULL, MAMBA1, MAMBA1_FULL, MAMBA2_STEP, ROWS,
                                  StateUpdateCApi, case_id, check, references, run,
                                  run_and_check, to_cpu)

dtypes = pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)


# ---------------------------------------------------------------------------------------------
# The references themselves.


def test_reference_by_hand():
    # Mamba-1, one row of two states, worked out on paper: dt' = 0.5 + 0.25, decay exp(A dt'),
    # drive B dt' x = B * 1.5, y = C . new + D x, out = y * silu(1).
    state = np.array([[[1.0, -1.0]]])
    x, dt, dt_bias = np.array([[2.0]]), np.array([[0.5]]), np.array([0.25])
    A, B, C = np.array([[-1.0, -2.0]]), np.array([[1.0, 3.0]]), np.array([[2.0, -1.0]])
    D, z = np.array([0.5]), np.array([[1.0]])
    new = [math.exp(-0.75) + 1.5, -math.exp(-1.5) + 4.5]
    y = 2.0 * new[0] - new[1] + 1.0
    out, got = state_update_numpy(state, x, dt, A, B, C, D, z, dt_bias)
    np.testing.assert_allclose(got[0, 0], new, rtol=1e-14)
    np.testing.assert_allclose(out, [[y / (1.0 + math.exp(-1.0))]], rtol=1e-14)
    # softplus: dt' = log(1 + e^0.75); a padding row leaves everything as it was.
    sp = math.log1p(math.exp(0.75))
    out, got = state_update_numpy(state, x, dt, A, B, C, dt_bias=dt_bias, dt_softplus=True)
    np.testing.assert_allclose(got[0, 0, 0], math.exp(-sp) + 2.0 * sp, rtol=1e-14)
    out, got = state_update_numpy(state, x, dt, A, B, C, state_batch_indices=np.array([-1]))
    assert out[0, 0] == 0.0 and np.array_equal(got, state)


def test_reference_groups_by_hand():
    # Mamba-2 with 4 heads in 2 groups: heads 0, 1 read group 0 of B and C, heads 2, 3 group 1.
    h, n = 4, 3
    state = np.zeros((1, h, 1, n))
    x, dt = np.ones((1, h, 1)), np.ones((1, h, 1))
    A = np.zeros((h, 1, n))
    B = np.array([[[1.0, 2.0, 3.0], [10.0, 20.0, 30.0]]])
    out, got = state_update_numpy(state, x, dt, A, B, np.ones((1, 2, n)))
    np.testing.assert_array_equal(got[0, :, 0], B[0][[0, 0, 1, 1]])
    np.testing.assert_array_equal(out[0, :, 0], [6.0, 6.0, 60.0, 60.0])


@pytest.mark.parametrize("case", ROWS, ids=case_id)
def test_numpy_and_torch_references_agree(case):
    inputs = make_state_update_inputs(case, torch.float64, 11)
    want_out, want_state = state_update_numpy(**inputs, **case.options())
    out, state = state_update_torch(**inputs, **case.options())
    np.testing.assert_allclose(out.numpy(), want_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(state.numpy(), want_state, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# Through the generic API, torch CPU tensors.


@pytest.mark.parametrize("case", ROWS, ids=case_id)
@dtypes
def test_decode_step(case, dtype, seed):
    run_and_check(case, make_state_update_inputs(case, dtype, seed))


# State dtype beside operand dtype, as models run them: a float32 state beside bf16/fp16
# activations (mamba_ssm's default), a bf16 state, and float32 A/D/dt_bias beside bf16 rest.
MIXES = {
    "fp32-state-bf16-rest": dict(dtype=torch.bfloat16, state_dtype=torch.float32),
    "fp32-state-fp16-rest": dict(dtype=torch.float16, state_dtype=torch.float32),
    "bf16-state-fp32-rest": dict(dtype=torch.float32, state_dtype=torch.bfloat16),
    "fp16-state-bf16-rest": dict(dtype=torch.bfloat16, state_dtype=torch.float16),
    "bf16-fp32-params": dict(dtype=torch.bfloat16, dtypes={"A": torch.float32,
                                                           "D": torch.float32,
                                                           "dt_bias": torch.float32}),
}


@pytest.mark.parametrize("mix", MIXES, ids=str)
@pytest.mark.parametrize("case", [FULL, MAMBA1_FULL, MAMBA2_STEP.replace(indices="pad"),
                                  FULL.replace(dstate=256)], ids=case_id)
def test_dtype_mixes(case, mix, seed):
    run_and_check(case, make_state_update_inputs(case, seed=seed, **MIXES[mix]))


def test_numpy_arrays(seed):
    # NumPy in, NumPy out; the state array is updated in place.
    for case in (FULL.replace(indices="pad"), MAMBA1_FULL):
        inputs = make_state_update_inputs(case, torch.float32, seed)
        refs = references(case, inputs)
        before = inputs["state"].clone()
        arrays = {k: None if v is None else v.numpy() for k, v in inputs.items()}
        out = run(case, arrays)
        assert isinstance(out, np.ndarray) and out.dtype == np.float32
        check(case, {**inputs, "state": torch.from_numpy(arrays["state"])}, before, out, refs)


@dtypes
def test_out_given(dtype, seed):
    # out= is written (a strided view included) and returned as it is.
    case = FULL.replace(indices="pad")
    inputs = make_state_update_inputs(case, dtype, seed)
    refs = references(case, inputs)
    before = inputs["state"].clone()
    big = torch.full((case.batch, case.nheads, 2 * case.headdim + 1), float("nan"), dtype=dtype)
    out = big[..., 1::2]
    assert run(case, inputs, out=out) is out
    check(case, inputs, before, out, refs)
    assert torch.isnan(big[..., ::2]).all(), "out= wrote outside its view"


def _strided_like(t, pad=3):
    """t's values in a view whose every axis has a stride of its own (the last one 2, rows
    padded), so no operand is contiguous."""
    big = torch.zeros(t.shape[:-1] + (2 * t.shape[-1] + pad,), dtype=t.dtype)
    view = big[..., pad::2][..., :t.shape[-1]]
    view.copy_(t)
    return view


@pytest.mark.parametrize("case", [FULL.replace(indices="pad"), MAMBA1_FULL,
                                  MAMBA2_STEP.replace(dstate=32)], ids=case_id)
@pytest.mark.parametrize("which", ["operands", "state", "transposed"])
def test_strided(case, which, seed):
    inputs = make_state_update_inputs(case, torch.float32, seed)
    if which == "operands":
        for name in ("x", "dt", "A", "B", "C", "D", "z", "dt_bias"):
            if inputs[name] is not None and inputs[name].stride()[-1] != 0:
                inputs[name] = _strided_like(inputs[name])
    elif which == "state":
        inputs["state"] = _strided_like(inputs["state"])
    else:  # dstate-major state, batch-major B and C transposed in memory
        inputs["state"] = inputs["state"].transpose(0, -1).contiguous().transpose(0, -1)
        for name in ("B", "C"):
            inputs[name] = inputs[name].transpose(0, -1).contiguous().transpose(0, -1)
    run_and_check(case, inputs)


@dtypes
def test_state_is_a_view_of_a_cache(dtype, seed):
    # The state of one layer inside a (layers, batch, nheads, headdim, dstate) cache: only the
    # slots the rows name change, nothing of the other layers.
    case = MAMBA2_STEP.replace(indices="pad", batch=5)
    inputs = make_state_update_inputs(case, dtype, seed)
    cache = torch.randn((3,) + tuple(inputs["state"].shape), dtype=torch.float64).to(dtype)
    cache[1] = inputs["state"]
    inputs["state"] = cache[1]
    whole = cache.clone()
    refs = references(case, inputs)
    before = inputs["state"].clone()
    pointer = inputs["state"].data_ptr()
    out = run(case, inputs)
    assert inputs["state"].data_ptr() == pointer
    check(case, inputs, before, out, refs)
    assert torch.equal(cache[0], whole[0]) and torch.equal(cache[2], whole[2])


@pytest.mark.parametrize("case", [FULL.replace(indices="pad"), MAMBA1_FULL.replace(dstate=3),
                                  MAMBA2_STEP.replace(indices="perm", index_dtype="int32")],
                         ids=case_id)
@dtypes
def test_c_entry_point_poisoned_out(case, dtype, seed):
    inputs = make_state_update_inputs(case, dtype, seed)
    refs = references(case, inputs)
    before = inputs["state"].clone()
    out = poisoned_like(inputs["x"])
    StateUpdateCApi().update(case, inputs, out)
    check(case, inputs, before, out, refs)


def test_repeated_steps_reach_a_fixed_point(seed):
    # With constant inputs, state -> state * a + b converges to b / (1 - a): many steps through
    # the library land on the closed form (the decay is applied, not just the drive).
    case = MAMBA1.replace(dstate=4, headdim=3, batch=2)
    inputs = make_state_update_inputs(case, torch.float32, seed)
    # decay exp(A dt) at most exp(-0.15): 300 steps leave 1e-20 of the starting state.
    inputs["A"] = inputs["A"].clamp(max=-0.5)
    inputs["dt"] = 0.3 + inputs["dt"]
    a = torch.exp(inputs["A"].double() * inputs["dt"].double()[..., None])
    b = inputs["B"].double()[:, None, :] * (inputs["dt"] * inputs["x"]).double()[..., None]
    for _ in range(300):
        run(case, inputs)
    want = b / (1.0 - a)
    torch.testing.assert_close(inputs["state"].double(), want, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Decoding L tokens one at a time is the selective scan over those L tokens.


def _scan_operands(case, steps, seed):
    """Per-step inputs (a list of dicts for the decode step) and the same values as the
    selective scan's (batch, channels, seqlen) operands. Mamba-2 heads map to scan channels
    h * headdim + p, its groups to the scan's grouped B and C."""
    m2 = case.layout == "mamba2"
    b, h, p, n = case.batch, case.nheads, case.headdim, case.dstate
    per_step = [make_state_update_inputs(case, torch.float32, seed + t) for t in range(steps)]
    first = per_step[0]
    for step in per_step[1:]:  # the layer's parameters do not change from token to token
        for name in ("A", "D", "dt_bias"):
            step[name] = first[name]
    dim = h * p if m2 else p

    def seq(name):
        return torch.stack([s[name].reshape(b, dim) for s in per_step], dim=-1)

    def bc(name):  # (b, ngroups, n, L) for Mamba-2, (b, n, L) for Mamba-1
        return torch.stack([s[name] for s in per_step], dim=-1)

    scan = {"u": seq("x"), "delta": seq("dt"), "z": seq("z") if case.z else None,
            "A": first["A"].reshape(dim, n).contiguous(), "B": bc("B"), "C": bc("C"),
            "D": None if first["D"] is None else first["D"].reshape(dim).contiguous(),
            "delta_bias": (None if first["dt_bias"] is None
                           else first["dt_bias"].reshape(dim).contiguous()),
            "initial_state": first["state"].reshape(b, dim, n).clone()}
    return per_step, scan


@pytest.mark.parametrize("case", [MAMBA1_FULL, MAMBA1.replace(dstate=5),
                                  FULL.replace(ngroups=2), FULL.replace(ngroups=1, dstate=8)],
                         ids=case_id)
def test_decode_steps_equal_the_selective_scan(case, seed):
    steps = 13
    per_step, scan = _scan_operands(case, steps, seed)
    want, last = libssm.selective_scan(scan["u"], scan["delta"], scan["A"], scan["B"], scan["C"],
                                       scan["D"], scan["z"], scan["delta_bias"],
                                       delta_softplus=case.softplus,
                                       initial_state=scan["initial_state"],
                                       return_last_state=True)
    state = per_step[0]["state"].clone()
    outs = []
    for step in per_step:
        step["state"] = state
        outs.append(run(case, step).reshape(case.batch, -1))
    got = torch.stack(outs, dim=-1)
    scale = want.abs().max().item()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * scale)
    torch.testing.assert_close(state.reshape(last.shape), last, rtol=1e-5,
                               atol=1e-5 * last.abs().max().item())


def test_empty_batch_writes_nothing():
    case = FULL.replace(batch=0)
    inputs = make_state_update_inputs(case, torch.float32, 1)
    before = inputs["state"].clone()
    out = run(case, inputs)
    assert out.shape == (0, case.nheads, case.headdim)
    assert torch.equal(inputs["state"], before)


def test_base_cases_are_what_they_say():
    # The rows the suites share start from these: Mamba-2 with grouped B/C, Mamba-1 with one
    # head, and the stride-0 operands of mamba_ssm's Mamba-2 step.
    assert BASE.layout == "mamba2" and BASE.ngroups > 1 and BASE.nheads % BASE.ngroups == 0
    assert MAMBA1 == StateUpdateCase(layout="mamba1", nheads=1, ngroups=1, headdim=7)
    inputs = make_state_update_inputs(MAMBA2_STEP, torch.float32, 0)
    assert inputs["dt"].stride()[-1] == 0 and inputs["dt_bias"].stride()[-1] == 0
    assert inputs["A"].stride()[-2:] == (0, 0)
    assert to_cpu(inputs)["state"].shape == (MAMBA2_STEP.batch_state, 4, 5, 16)
