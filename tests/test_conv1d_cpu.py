"""The causal conv1d on the CPU (libssm.causal_conv1d / causal_conv1d_bwd / causal_conv1d_update;
torch and NumPy arrays) against the float64 references: every option alone from Mamba's base
case (widths 2..8, bias, SiLU, initial and final states, packed sequences, channel-last x),
awkward sizes (seqlen 0, 1 and 2, one channel, no batch), every dtype and float32 weights beside
half-precision x, gradients of every input including initial_states and through final_states,
NaN-poisoned outputs through the C entry points, bit-identical dweight/dbias from run to run, and
the decode step with and without a circular buffer, with continuous-batching indices and padding
rows, against the reference and against the whole-sequence forward."""
import numpy as np
import pytest
import torch

import libssm
from conv1d_harness import (BASE, FULL, PACKED, ROWS, UPDATE_BASE, UPDATE_ROWS, Conv1dCApi,
                            UpdateCase, c_forward_backward, case_id, check_backward,
                            check_forward, check_update, make_update_inputs, poisoned_forward,
                            reference_backward, reference_update, run_backward, run_forward,
                            run_update, update_id)
from harness import DTYPE_IDS, DTYPES, to_numpy
from references import (Conv1dCase, assert_close, conv1d_numpy, conv1d_torch,
                        conv1d_update_numpy, make_conv1d_cotangents, make_conv1d_inputs)

dtypes = pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
rows = pytest.mark.parametrize("case", ROWS, ids=case_id)


# ---------------------------------------------------------------------------------------------
# The references themselves.


def test_reference_by_hand():
    # Width 3 on one row of four, worked out on paper: initial states [1, 2], weight [1, 10, 100],
    # bias 0.5; with packed sequences [0, 0, 1, 1] the taps reading sequence 0 from sequence 1's
    # outputs (and initial states, which belong to sequence 0) drop out.
    x = np.array([[[3.0, 4.0, 5.0, 6.0]]])
    init = np.array([[[1.0, 2.0]]])
    w = np.array([[1.0, 10.0, 100.0]])
    out, final = conv1d_numpy(x, w, np.array([0.5]), init)
    np.testing.assert_allclose(out[0, 0], [0.5 + 1 + 20 + 300, 0.5 + 2 + 30 + 400,
                                           0.5 + 3 + 40 + 500, 0.5 + 4 + 50 + 600])
    np.testing.assert_allclose(final[0, 0], [5.0, 6.0])
    seq = np.array([[0, 0, 1, 1]], dtype=np.int32)
    out, final = conv1d_numpy(x, w, None, init, seq)
    np.testing.assert_allclose(out[0, 0], [1 + 20 + 300, 2 + 30 + 400, 500, 50 + 600])
    np.testing.assert_allclose(final[0, 0], [5.0, 6.0])
    out, final = conv1d_numpy(x[..., :1], w, None, init, seq[:, :1], silu=True)
    z = 1 + 20 + 300
    np.testing.assert_allclose(out[0, 0], [z / (1 + np.exp(-z))])
    np.testing.assert_allclose(final[0, 0], [2.0, 3.0])  # seqlen < width-1: initial state kept


def test_final_states_of_packed_rows_by_hand():
    # The final states continue the last sequence: inputs of an earlier one read as 0.
    x = np.array([[[1.0, 2.0, 3.0, 4.0]]])
    w = np.ones((1, 4))
    _, final = conv1d_numpy(x, w, seq_idx=np.array([[0, 0, 0, 1]], dtype=np.int32))
    np.testing.assert_allclose(final[0, 0], [0.0, 0.0, 4.0])


@rows
def test_numpy_and_torch_references_agree(case):
    inputs = make_conv1d_inputs(case, torch.float64, 11)
    args = (inputs["x"], inputs["weight"], inputs["bias"], inputs["initial_states"],
            inputs["seq_idx"], case.silu)
    out, final = conv1d_numpy(*args)
    out_t, final_t = conv1d_torch(*args)
    np.testing.assert_allclose(out_t.numpy(), out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(final_t.numpy(), final, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("case", [FULL.replace(batch=1, dim=2, seqlen=9),
                                  PACKED.replace(batch=2, dim=2, seqlen=9, seq_idx=(3, 2, 4),
                                                 initial_states=True, width=3)], ids=case_id)
def test_reference_gradients_match_finite_differences(case):
    # The gradients every backward test trusts, checked once against finite differences.
    inputs = make_conv1d_inputs(case, torch.float64, 5)
    names = [n for n in ("x", "weight", "bias", "initial_states") if inputs[n] is not None]
    leaves = [inputs[n].clone().requires_grad_() for n in names]

    def f(*xs):
        kw = dict(zip(names, xs))
        return conv1d_torch(kw["x"], kw["weight"], kw.get("bias"), kw.get("initial_states"),
                            inputs["seq_idx"], case.silu)

    assert torch.autograd.gradcheck(f, leaves)


def test_update_reference_by_hand():
    # Width 3, state of 4 as a circular buffer at cache_seqlens 5: the window is entries
    # (5 - 2) % 4 = 3 and 0, the token goes to entry 5 % 4 = 1.
    state = np.array([[[10.0, 11.0, 12.0, 13.0]]])
    w = np.array([[1.0, 2.0, 3.0]])
    out, new = conv1d_update_numpy(np.array([[7.0]]), state, w, cache_seqlens=np.array([5]))
    np.testing.assert_allclose(out, [[13.0 + 2 * 10.0 + 3 * 7.0]])
    np.testing.assert_allclose(new[0, 0], [10.0, 7.0, 12.0, 13.0])
    out, new = conv1d_update_numpy(np.array([[7.0]]), state, w)
    np.testing.assert_allclose(out, [[12.0 + 2 * 13.0 + 3 * 7.0]])
    np.testing.assert_allclose(new[0, 0], [11.0, 12.0, 13.0, 7.0])


# ---------------------------------------------------------------------------------------------
# Forward and backward through the generic API, torch CPU tensors.


@rows
@dtypes
def test_forward(case, dtype, seed):
    inputs = make_conv1d_inputs(case, dtype, seed)
    check_forward(case, inputs, run_forward(case, inputs))


@rows
@dtypes
def test_backward(case, dtype, seed):
    inputs = make_conv1d_inputs(case, dtype, seed)
    dout, dfinal = make_conv1d_cotangents(case, dtype, seed)
    check_backward(case, inputs, run_backward(case, inputs, dout, dfinal), dout, dfinal)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("case", [FULL, PACKED.replace(initial_states=True, width=6)],
                         ids=case_id)
def test_float32_parameters_beside_low_precision_x(case, dtype, seed):
    # weight, bias and initial_states float32 (a model kept in fp32) while x is not; their
    # gradients come back float32, final_states in x's dtype.
    f32 = torch.float32
    inputs = make_conv1d_inputs(case, dtype, seed, dtypes={"weight": f32, "bias": f32,
                                                           "initial_states": f32})
    check_forward(case, inputs, run_forward(case, inputs))
    dout, dfinal = make_conv1d_cotangents(case, dtype, seed)
    grads = run_backward(case, inputs, dout, dfinal)
    assert grads.dweight.dtype == f32 and grads.dinitial_states.dtype == f32
    check_backward(case, inputs, grads, dout, dfinal)


def test_swish_is_silu(seed):
    inputs = make_conv1d_inputs(BASE, torch.float32, seed)
    args = (inputs["x"], inputs["weight"], inputs["bias"])
    assert torch.equal(libssm.causal_conv1d(*args, activation="swish"),
                       libssm.causal_conv1d(*args, activation="silu"))


@pytest.mark.parametrize("case", [BASE, FULL.replace(layout="channel_last"), PACKED],
                         ids=case_id)
def test_layouts_agree(case, seed):
    # The same values in the (batch, dim, seqlen) layout, channel-last, and as a strided view
    # (every other position of a larger buffer) give the same bits; out and dx come back in x's
    # layout.
    inputs = make_conv1d_inputs(case, torch.float32, seed)
    x = inputs["x"]
    dout, dfinal = make_conv1d_cotangents(case, torch.float32, seed)
    wide = torch.zeros(case.batch, case.dim, 2 * case.seqlen)
    wide[..., ::2] = x
    variants = {"seq": x.contiguous(), "channel_last": x.transpose(1, 2).contiguous()
                .transpose(1, 2), "strided": wide[..., ::2]}
    results = {}
    for name, xv in variants.items():
        v = dict(inputs, x=xv)
        result = run_forward(case, v)
        out = result[0] if case.final_states else result
        grads = run_backward(case, v, dout, dfinal)
        if name == "channel_last":
            assert out.stride(1) == 1 and grads.dx.stride(1) == 1
        results[name] = (result, grads)
    first = results["seq"]
    for name, (result, grads) in results.items():
        outs = result if case.final_states else (result,)
        for a, b in zip(outs, first[0] if case.final_states else (first[0],)):
            assert torch.equal(a, b), name
        for a, b in zip(grads, first[1]):
            assert (a is None and b is None) or torch.equal(a, b), name


@pytest.mark.parametrize("case", [FULL, PACKED.replace(layout="channel_last")], ids=case_id)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=DTYPE_IDS.get)
def test_numpy_forward_backward(case, dtype, seed):
    inputs = make_conv1d_inputs(case, dtype, seed)
    np_inputs = {k: to_numpy(v) for k, v in inputs.items()}
    result = run_forward(case, np_inputs)
    outs = result if case.final_states else (result,)
    assert all(isinstance(a, np.ndarray) for a in outs)
    if case.layout == "channel_last":
        assert outs[0].strides[1] == outs[0].itemsize
    check_forward(case, inputs, result)
    dout, dfinal = make_conv1d_cotangents(case, dtype, seed)
    grads = run_backward(case, np_inputs, to_numpy(dout), to_numpy(dfinal))
    assert all(g is None or isinstance(g, np.ndarray) for g in grads)
    check_backward(case, inputs, grads, dout, dfinal)


@pytest.mark.parametrize("framework", ["torch", "numpy"])
def test_out_given(framework, seed):
    # out= is written and returned as given, whatever its strides.
    case = FULL
    inputs = make_conv1d_inputs(case, torch.float32, seed)
    out = torch.full((case.batch, case.seqlen, case.dim), float("nan")).transpose(1, 2)
    if framework == "numpy":
        inputs_fw = {k: to_numpy(v) for k, v in inputs.items()}
        out = to_numpy(out)
    else:
        inputs_fw = inputs
    result = run_forward(case, inputs_fw, out=out)
    assert result[0] is out
    check_forward(case, inputs, (torch.as_tensor(out), result[1]))


@pytest.mark.parametrize("case", [BASE, FULL, PACKED.replace(initial_states=True, width=8),
                                  FULL.replace(layout="channel_last", seqlen=1),
                                  FULL.replace(seqlen=2, width=6), FULL.replace(dim=1)],
                         ids=case_id)
@dtypes
def test_poisoned_outputs_all_written(case, dtype, seed):
    inputs = make_conv1d_inputs(case, dtype, seed)
    dout, dfinal = make_conv1d_cotangents(case, dtype, seed)
    result, grads = c_forward_backward(case, inputs, dout, dfinal)
    check_forward(case, inputs, result)
    check_backward(case, inputs, grads, dout, dfinal)


def test_seqlen_zero(seed):
    # No positions: out is empty, final_states are the initial states, their gradient is
    # dfinal_states, and dweight and dbias, sums over nothing, are written as zeros.
    case = FULL.replace(seqlen=0)
    inputs = make_conv1d_inputs(case, torch.float32, seed)
    dout, dfinal = make_conv1d_cotangents(case, torch.float32, seed)
    (out, final), grads = c_forward_backward(case, inputs, dout, dfinal)
    assert out.shape == (case.batch, case.dim, 0)
    assert torch.equal(final, inputs["initial_states"])
    assert torch.equal(grads.dinitial_states, dfinal)
    assert torch.equal(grads.dweight, torch.zeros_like(grads.dweight))
    assert torch.equal(grads.dbias, torch.zeros_like(grads.dbias))


def test_backward_needs(seed):
    # needs= names the gradients wanted; the others come back None and are not computed.
    case = FULL
    inputs = make_conv1d_inputs(case, torch.float32, seed)
    dout, dfinal = make_conv1d_cotangents(case, torch.float32, seed)
    refs = reference_backward(case, inputs, dout, dfinal)
    for needs in ((False, True, False, False), (True, False, False, True),
                  (False, False, True, False)):
        grads = run_backward(case, inputs, dout, dfinal, needs=needs)
        for wanted, name in zip(needs, grads._fields):
            g = getattr(grads, name)
            if wanted:
                assert_close(name, g, *refs[name])
            else:
                assert g is None, name


def test_c_backward_subset_of_gradients(seed):
    # Through the C entry point any gradient may be NULL: the ones asked for are still right.
    case = PACKED.replace(initial_states=True)
    inputs = make_conv1d_inputs(case, torch.float32, seed)
    dout, dfinal = make_conv1d_cotangents(case, torch.float32, seed)
    refs = reference_backward(case, inputs, dout, dfinal)
    for wanted in (("dweight",), ("dx", "dbias"), ("dinitial_states",)):
        grads = {n: torch.full_like(inputs["x" if n == "dx" else n[1:]], float("nan"))
                 for n in wanted}
        Conv1dCApi().backward(case.silu, inputs, dout, dfinal, grads)
        for name, g in grads.items():
            assert_close(name, g, *refs[name])


@pytest.mark.parametrize("case", [FULL.replace(batch=8, dim=16, seqlen=300),
                                  PACKED.replace(batch=5, layout="channel_last")], ids=case_id)
def test_weight_gradients_bitwise_deterministic(case, seed):
    inputs = make_conv1d_inputs(case, torch.float32, seed)
    dout, dfinal = make_conv1d_cotangents(case, torch.float32, seed)
    first = run_backward(case, inputs, dout, dfinal)
    for _ in range(3):
        again = run_backward(case, inputs, dout, dfinal)
        assert torch.equal(again.dweight, first.dweight)
        assert torch.equal(again.dbias, first.dbias)


def test_packed_rows_do_not_leak(seed):
    # A packed row equals its sequences run one at a time (each with zero initial states), and
    # the final states equal the last sequence's.
    case = PACKED.replace(batch=1)
    inputs = make_conv1d_inputs(case, torch.float32, seed)
    out, final = run_forward(case, inputs)
    start = 0
    for length in case.seq_idx:
        piece = dict(inputs, x=inputs["x"][..., start:start + length], seq_idx=None)
        o, f = run_forward(case, piece)
        assert torch.allclose(out[..., start:start + length], o, rtol=1e-6, atol=1e-6)
        start += length
    assert torch.equal(final, f)


# ---------------------------------------------------------------------------------------------
# The decode step.


@pytest.mark.parametrize("case", UPDATE_ROWS, ids=update_id)
@dtypes
def test_update(case, dtype, seed):
    inputs = make_update_inputs(case, dtype, seed)
    expected = reference_update(case, inputs)
    out = run_update(case, inputs)
    check_update(case, inputs, out, inputs["conv_state"], expected)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("case", [UPDATE_BASE, UPDATE_BASE.replace(circular=True, state_len=5,
                                                                   indices="padding")],
                         ids=update_id)
def test_update_state_and_weight_dtypes(case, state_dtype, seed):
    # A conv_state of its own dtype (float32 beside fp16 x, or bf16) and float32 weights; int64
    # indices and cache lengths.
    inputs = make_update_inputs(case, torch.float16, seed, state_dtype=state_dtype,
                                weight_dtype=torch.float32, index_dtype=torch.int64)
    expected = reference_update(case, inputs)
    out = run_update(case, inputs)
    check_update(case, inputs, out, inputs["conv_state"], expected)


@pytest.mark.parametrize("case", [UPDATE_BASE, UPDATE_BASE.replace(seqlen=3, circular=True,
                                                                   state_len=7, indices="perm")],
                         ids=update_id)
def test_update_numpy_and_c(case, seed):
    # NumPy arrays through the generic layer, and the C entry point into a poisoned out.
    inputs = make_update_inputs(case, torch.float32, seed)
    expected = reference_update(case, inputs)
    np_inputs = {k: to_numpy(v) for k, v in inputs.items()}
    out = run_update(case, np_inputs)
    assert isinstance(out, np.ndarray)
    check_update(case, inputs, out, np_inputs["conv_state"], expected)
    inputs = make_update_inputs(case, torch.float32, seed)
    out = torch.full_like(inputs["x"], float("nan"))
    Conv1dCApi().update(case.silu, inputs, out)
    check_update(case, inputs, out, inputs["conv_state"], expected)


@pytest.mark.parametrize("width", [2, 4, 8])
@pytest.mark.parametrize("circular", [False, True], ids=["shift", "circular"])
def test_update_steps_match_the_forward(width, circular, seed):
    # Prefill with the whole-sequence forward (its final states become the conv state), then
    # decode token by token, in groups of three tokens and token by token again: every output
    # equals the forward over the whole sequence.
    case = Conv1dCase(batch=2, dim=5, seqlen=20, width=width, final_states=True)
    inputs = make_conv1d_inputs(case, torch.float32, seed)
    x = inputs["x"]
    full = libssm.causal_conv1d(x, inputs["weight"], inputs["bias"], activation="silu")
    prefix = 6
    _, final = libssm.causal_conv1d(x[..., :prefix], inputs["weight"], inputs["bias"],
                                    activation="silu", return_final_states=True)
    state_len = width - 1 + (3 if circular else 0)
    state = torch.zeros(case.batch, case.dim, state_len)
    state[..., state_len - (width - 1):] = final
    cache = torch.full((case.batch,), state_len, dtype=torch.int32) if circular else None
    t, outs = prefix, []
    for n in (1, 3, 1, 1, 3, 2, 3):
        step = x[..., t:t + n] if n > 1 else x[..., t]
        out = libssm.causal_conv1d_update(step, state, inputs["weight"], inputs["bias"],
                                          activation="silu", cache_seqlens=cache)
        outs.append(out if n > 1 else out[..., None])
        if circular:
            cache = cache + n
        t += n
    assert t == case.seqlen
    torch.testing.assert_close(torch.cat(outs, dim=-1), full[..., prefix:], rtol=1e-5,
                               atol=1e-5)


def test_update_padding_rows_left_alone(seed):
    # Padding rows: out zero (written over a poisoned buffer), their states and the unused
    # state rows exactly as they were.
    case = UPDATE_BASE.replace(batch=4, indices="padding")
    inputs = make_update_inputs(case, torch.float32, seed)
    before = inputs["conv_state"].clone()
    out = torch.full_like(inputs["x"], float("nan"))
    Conv1dCApi().update(case.silu, inputs, out)
    indices = inputs["conv_state_indices"]
    used = set(int(i) for i in indices if i >= 0)
    for b, s in enumerate(indices.tolist()):
        if s < 0:
            assert torch.equal(out[b], torch.zeros_like(out[b]))
    for s in range(case.batch_state):
        if s not in used:
            assert torch.equal(inputs["conv_state"][s], before[s]), s


def test_update_strided_state(seed):
    # conv_state as a view with gaps (a slice of a larger cache along state_len and dim) is
    # read and written through its strides; the gaps are untouched.
    case = UPDATE_BASE.replace(state_len=5, circular=True)
    inputs = make_update_inputs(case, torch.float32, seed)
    big = torch.full((case.batch, 2 * case.dim, case.state_len + 3), 7.0)
    view = big[:, ::2, 1:1 + case.state_len]
    view.copy_(inputs["conv_state"])
    expected = reference_update(case, inputs)
    out = run_update(case, dict(inputs, conv_state=view))
    check_update(case, inputs, out, view, expected)
    mask = torch.ones_like(big, dtype=torch.bool)
    mask[:, ::2, 1:1 + case.state_len] = False
    assert (big[mask] == 7.0).all()


def test_case_labels_are_distinct():
    for rows_ in (ROWS, UPDATE_ROWS):
        labels = [r.label() for r in rows_]
        assert len(set(labels)) == len(labels)
    assert Conv1dCase().label() == "base" and UpdateCase().label() == "base"


def test_poisoned_forward_buffers_are_nan():
    out, final = poisoned_forward(FULL, make_conv1d_inputs(FULL, torch.float32, 0))
    assert torch.isnan(out).all() and torch.isnan(final).all()

