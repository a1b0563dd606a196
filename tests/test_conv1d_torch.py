"""libssm.torch's causal conv1d: causal_conv1d_fn with causal-conv1d's signature and return
convention, gradients of x, weight, bias and initial_states through torch autograd (a loss on
final_states too) against float64 autograd of the reference, causal_conv1d_update mutating its
state, the registered ops under torch.library.opcheck, torch.compile(fullgraph=True) against
eager with no graph break, and, on CUDA, the same plus capture in a CUDA graph."""
import pytest
import torch

import libssm
import libssm.torch as ssm_torch
from conv1d_harness import (BASE, FULL, PACKED, UPDATE_BASE, case_id, make_update_inputs,
                            reference_backward, reference_forward, reference_update, to_cpu)
from harness import (DTYPE_IDS, DTYPES, capture_cuda_graph, check_compiled_matches_eager,
                     fresh_leaves)
from references import (assert_close, conv1d_update_numpy, make_conv1d_cotangents,
                        make_conv1d_inputs)

GRAD_ROWS = [
    BASE,
    BASE.replace(bias=False, silu=False),
    FULL,
    FULL.replace(width=2),
    FULL.replace(width=8),
    PACKED,
    PACKED.replace(initial_states=True),
    FULL.replace(layout="channel_last"),
    FULL.replace(seqlen=2),
]
FLOAT_INPUTS = ("x", "weight", "bias", "initial_states")


def leaves(inputs, requires_grad=True):
    """Fresh leaf tensors of the float inputs (seq_idx kept as it is)."""
    return fresh_leaves(inputs, requires_grad, FLOAT_INPUTS)


def call(case, x, **extra):
    return ssm_torch.causal_conv1d_fn(x["x"], x["weight"], x["bias"], x["seq_idx"],
                                      x["initial_states"], case.final_states,
                                      activation="silu" if case.silu else None, **extra)


def check_grads(case, inputs, x, dout, dfinal, names=FLOAT_INPUTS):
    refs = reference_backward(case, to_cpu(inputs), dout, dfinal)
    for name in FLOAT_INPUTS:
        grad = None if x[name] is None else x[name].grad
        if inputs[name] is None or name not in names:
            assert grad is None, f"{name}.grad set"
            continue
        assert grad is not None and grad.dtype == inputs[name].dtype, (name, grad)
        assert_close(name + ".grad", grad.cpu(), *refs["d" + name])


@pytest.mark.parametrize("case", GRAD_ROWS, ids=case_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
def test_gradients_of_every_input(case, dtype, seed):
    inputs = make_conv1d_inputs(case, dtype, seed)
    x = leaves(inputs)
    result = call(case, x)
    out, final = result if case.final_states else (result, None)
    refs = reference_forward(case, inputs)
    assert isinstance(out, torch.Tensor) and out.dtype == dtype
    assert_close("out", out.detach(), *refs["out"])
    dout, dfinal = make_conv1d_cotangents(case, dtype, seed)
    if case.final_states:
        assert_close("final_states", final.detach(), *refs["final_states"], dtype=dtype)
        torch.autograd.backward([out, final], [dout, dfinal.to(dtype)])
        dfinal = dfinal.to(dtype)
    else:
        out.backward(dout)
    check_grads(case, inputs, x, dout, dfinal)


def test_loss_on_final_states_only(seed):
    # Only the final states feed the loss: x.grad is dfinal_states at the last width-1
    # positions and zero elsewhere, weight and bias get zero gradients.
    case = FULL.replace(silu=False)
    inputs = make_conv1d_inputs(case, torch.float32, seed)
    x = leaves(inputs)
    _, final = call(case, x)
    dfinal = torch.randn(final.shape)
    final.backward(dfinal)
    want = torch.zeros_like(inputs["x"])
    want[..., -(case.width - 1):] = dfinal
    assert torch.equal(x["x"].grad, want)
    for name in ("weight", "bias", "initial_states"):
        grad = x[name].grad
        assert grad is None or torch.equal(grad, torch.zeros_like(grad)), name


def test_some_inputs_require_grad(seed):
    case = FULL
    inputs = make_conv1d_inputs(case, torch.float32, seed)
    x = leaves(inputs, requires_grad={"weight", "initial_states"})
    out, final = call(case, x)
    dout, dfinal = make_conv1d_cotangents(case, torch.float32, seed)
    torch.autograd.backward([out, final], [dout, dfinal])
    check_grads(case, inputs, x, dout, dfinal, names=("weight", "initial_states"))


def test_return_convention(seed):
    # As causal-conv1d: a tensor, or (out, final_states) with return_final_states;
    # final_states_out is written when given.
    inputs = make_conv1d_inputs(FULL, torch.float32, seed)
    args = (inputs["x"], inputs["weight"], inputs["bias"])
    out = ssm_torch.causal_conv1d_fn(*args, activation="swish")
    assert isinstance(out, torch.Tensor)
    assert torch.equal(out, ssm_torch.causal_conv1d_fn(*args, activation="silu"))
    out2, final = ssm_torch.causal_conv1d_fn(*args, return_final_states=True, activation="silu")
    assert torch.equal(out2, out)
    buf = torch.full_like(final, float("nan"))
    for requires_grad in (False, True):
        buf.fill_(float("nan"))
        x = inputs["x"].clone().requires_grad_(requires_grad)
        _, got = ssm_torch.causal_conv1d_fn(x, *args[1:], None, None, True, buf, "silu")
        assert torch.equal(buf, final) and torch.equal(got.detach(), final)


def test_no_grad_and_parameters(seed):
    case = FULL
    inputs = make_conv1d_inputs(case, torch.float32, seed)
    x = dict(inputs, weight=torch.nn.Parameter(inputs["weight"].clone()))
    out, _ = call(case, x)
    out.sum().backward()
    assert x["weight"].grad is not None
    with torch.no_grad():
        out, _ = call(case, x)
    assert out.grad_fn is None and not out.requires_grad
    assert_close("out", out, *reference_forward(case, inputs)["out"])


@pytest.mark.parametrize("case", [UPDATE_BASE, UPDATE_BASE.replace(seqlen=3, circular=True,
                                                                   state_len=5,
                                                                   indices="padding")],
                         ids=lambda c: c.label())
def test_update_mutates_state(case, seed):
    inputs = make_update_inputs(case, torch.float32, seed)
    expected = reference_update(case, inputs)
    out = ssm_torch.causal_conv1d_update(inputs["x"], inputs["conv_state"], inputs["weight"],
                                         inputs["bias"], "silu" if case.silu else None,
                                         inputs["cache_seqlens"], inputs["conv_state_indices"])
    assert_close("out", out, expected[0], expected[1])
    assert torch.equal(inputs["conv_state"], expected[2])


# ---------------------------------------------------------------------------------------------
# The registered ops.

OPCHECK_ROWS = [FULL, PACKED.replace(initial_states=True, width=3),
                BASE.replace(layout="channel_last", bias=False)]


def op_forward_args(case, inputs):
    return (inputs["x"], inputs["weight"], inputs["bias"], inputs["seq_idx"],
            inputs["initial_states"], case.final_states, case.silu)


@pytest.mark.parametrize("case", OPCHECK_ROWS, ids=case_id)
def test_opcheck_forward(case, seed):
    x = leaves(make_conv1d_inputs(case, torch.float32, seed))
    torch.library.opcheck(torch.ops.libssm.causal_conv1d_fwd.default, op_forward_args(case, x))


@pytest.mark.parametrize("case", OPCHECK_ROWS, ids=case_id)
def test_opcheck_backward(case, seed):
    inputs = make_conv1d_inputs(case, torch.float32, seed)
    dout, dfinal = make_conv1d_cotangents(case, torch.float32, seed)
    needs = [True, True, inputs["bias"] is not None, inputs["initial_states"] is not None]
    args = (inputs["x"], inputs["weight"], inputs["bias"], inputs["seq_idx"],
            inputs["initial_states"], dout, dfinal, case.silu, needs)
    torch.library.opcheck(torch.ops.libssm.causal_conv1d_bwd.default, args)
    grads = torch.ops.libssm.causal_conv1d_bwd(*args)
    refs = reference_backward(case, inputs, dout, dfinal)
    for name, g in zip(("dx", "dweight", "dbias", "dinitial_states"), grads):
        if name in refs:
            assert_close(name, g, *refs[name])
        else:
            assert g.numel() == 0, name


def test_opcheck_update(seed):
    case = UPDATE_BASE.replace(seqlen=2, circular=True, state_len=5, indices="padding")
    inputs = make_update_inputs(case, torch.float32, seed)
    args = (inputs["x"], inputs["conv_state"], inputs["weight"], inputs["bias"],
            inputs["cache_seqlens"], inputs["conv_state_indices"], True)
    torch.library.opcheck(torch.ops.libssm.causal_conv1d_update.default, args)


# ---------------------------------------------------------------------------------------------
# torch.compile.


def conv_block(x, weight, bias, initial_states, seq_idx):
    """A small model step around the op, so the compiled graph holds more than the op."""
    out, final = ssm_torch.causal_conv1d_fn(x * 2.0, weight, bias, seq_idx, initial_states,
                                            return_final_states=True, activation="silu")
    return torch.tanh(out) + 1.0, final * 0.5


def block_args(x):
    return (x["x"], x["weight"], x["bias"], x["initial_states"], x["seq_idx"])


def compile_and_compare(device, seed, backend="inductor"):
    case = PACKED.replace(initial_states=True)
    inputs = make_conv1d_inputs(case, torch.float32, seed, device=device)
    check_compiled_matches_eager(conv_block, inputs, block_args,
                                 make_conv1d_cotangents(case, torch.float32, seed, device=device),
                                 FLOAT_INPUTS, backend, (1e-5, 1e-5), (1e-4, 1e-5),
                                 names=FLOAT_INPUTS)


def test_compile_fullgraph_matches_eager(seed, fresh_compile):
    compile_and_compare("cpu", seed)


def test_compile_has_no_graph_break(seed, fresh_compile):
    inputs = make_conv1d_inputs(PACKED.replace(initial_states=True), torch.float32, seed)
    explanation = torch._dynamo.explain(conv_block)(*block_args(inputs))
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


def test_compile_dynamic_shapes(seed, fresh_compile):
    compiled_fn = torch.compile(conv_block, fullgraph=True, dynamic=True, backend="aot_eager")
    for seqlen in (17, 40):
        case = FULL.replace(seqlen=seqlen)
        inputs = make_conv1d_inputs(case, torch.float32, seed + seqlen)
        got = compiled_fn(*block_args(inputs))
        want = conv_block(*block_args(inputs))
        assert got[0].shape == (case.batch, case.dim, seqlen)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)


def test_compile_decode_step(seed, fresh_compile):
    # A decode step under torch.compile mutates the state exactly as in eager mode.
    case = UPDATE_BASE.replace(circular=True, state_len=5, indices="padding")
    inputs = make_update_inputs(case, torch.float32, seed)
    expected = reference_update(case, inputs)

    def step(x, state, weight, bias, cache_seqlens, indices):
        return ssm_torch.causal_conv1d_update(x * 1.0, state, weight, bias, "silu",
                                              cache_seqlens, indices) + 0.0

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    out = compiled(inputs["x"], inputs["conv_state"], inputs["weight"], inputs["bias"],
                   inputs["cache_seqlens"], inputs["conv_state_indices"])
    assert_close("out", out, expected[0], expected[1])
    assert torch.equal(inputs["conv_state"], expected[2])


def test_compile_generic_api_fullgraph(seed, fresh_compile):
    # libssm.causal_conv1d / causal_conv1d_bwd / causal_conv1d_update on tensors inside
    # torch.compile trace as the registered ops and return what they return in eager mode.
    case = FULL
    inputs = make_conv1d_inputs(case, torch.float32, seed)
    dout, dfinal = make_conv1d_cotangents(case, torch.float32, seed)
    upd = make_update_inputs(UPDATE_BASE, torch.float32, seed)

    def step(x, weight, bias, initial_states, state):
        out, final = libssm.causal_conv1d(x, weight, bias, activation="silu",
                                          initial_states=initial_states,
                                          return_final_states=True)
        grads = libssm.causal_conv1d_bwd(x, weight, dout, bias, activation="silu",
                                         initial_states=initial_states, dfinal_states=dfinal)
        y = libssm.causal_conv1d_update(upd["x"], state, upd["weight"], upd["bias"])
        return (out, final) + tuple(grads) + (y,)

    def run(fn):
        state = upd["conv_state"].clone()
        result = fn(inputs["x"], inputs["weight"], inputs["bias"], inputs["initial_states"],
                    state)
        return result, state

    eager, eager_state = run(step)
    compiled, compiled_state = run(torch.compile(step, fullgraph=True, backend="aot_eager"))
    for e, c in zip(eager, compiled):
        torch.testing.assert_close(c, e, rtol=1e-6, atol=1e-6)
    assert torch.equal(compiled_state, eager_state)
    _, want_state = conv1d_update_numpy(upd["x"], upd["conv_state"], upd["weight"], upd["bias"])
    assert torch.equal(eager_state, torch.from_numpy(want_state).float())


# ---------------------------------------------------------------------------------------------
# CUDA.


@pytest.mark.cuda
@pytest.mark.parametrize("case", [FULL.replace(batch=4, dim=64, seqlen=1000),
                                  PACKED.replace(initial_states=True,
                                                 layout="channel_last")], ids=case_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
def test_cuda_gradients_of_every_input(case, dtype, seed):
    inputs = make_conv1d_inputs(case, dtype, seed, device="cuda")
    x = leaves(inputs)
    out, final = call(case, x)
    dout, dfinal = make_conv1d_cotangents(case, dtype, seed, device="cuda")
    torch.autograd.backward([out, final], [dout, dfinal.to(dtype)])
    cpu = to_cpu(inputs)
    refs = reference_forward(case, cpu)
    assert_close("out", out.detach().cpu(), *refs["out"])
    check_grads(case, cpu, x, dout.cpu(), dfinal.to(dtype).cpu())


@pytest.mark.cuda
def test_cuda_compile_fullgraph_matches_eager(seed, fresh_compile):
    compile_and_compare("cuda", seed)


@pytest.mark.cuda
def test_cuda_graph_capture_and_replay(seed):
    # Forward, backward and a decode step captured once; replays after copying new values into
    # the static inputs give the new results.
    case = FULL.replace(batch=2, dim=64, seqlen=256)
    first = make_conv1d_inputs(case, torch.float32, seed, device="cuda")
    second = make_conv1d_inputs(case, torch.float32, seed + 1, device="cuda")
    static = leaves(first)
    dout, dfinal = make_conv1d_cotangents(case, torch.float32, seed, device="cuda")
    upd = make_update_inputs(UPDATE_BASE.replace(dim=64), torch.float32, seed, device="cuda")
    state0 = upd["conv_state"].clone()

    def step():
        out, final = call(case, static)
        grads = torch.autograd.grad([out, final], [static[n] for n in FLOAT_INPUTS],
                                    [dout, dfinal])
        y = ssm_torch.causal_conv1d_update(upd["x"], upd["conv_state"], upd["weight"],
                                           upd["bias"], "silu")
        return out, final, grads, y

    graph, (s_out, s_final, s_grads, s_y) = capture_cuda_graph(step)
    for inputs in (second, first):
        with torch.no_grad():
            for n in FLOAT_INPUTS:
                static[n].copy_(inputs[n])
            s_out.fill_(float("nan"))
            upd["conv_state"].copy_(state0)
        graph.replay()
        torch.cuda.synchronize()
        cpu = to_cpu(inputs)
        refs = reference_forward(case, cpu)
        assert_close("out", s_out.cpu(), *refs["out"])
        back = reference_backward(case, cpu, dout.cpu(), dfinal.cpu())
        for n, g in zip(FLOAT_INPUTS, s_grads):
            assert_close(n + ".grad", g.cpu(), *back["d" + n])
        want_y, want_state = conv1d_update_numpy(upd["x"].cpu(), state0.cpu(),
                                                 upd["weight"].cpu(), upd["bias"].cpu(), True)
        torch.testing.assert_close(s_y.cpu().double(), torch.from_numpy(want_y), rtol=1e-5,
                                   atol=1e-5)
        assert torch.equal(upd["conv_state"].cpu(), torch.from_numpy(want_state).float())
