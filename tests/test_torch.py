"""libssm.torch: gradients of every input through torch autograd against float64 autograd of the
reference (initial_state and a loss on last_state included), the registered custom ops under
torch.library.opcheck, torch.compile(fullgraph=True) against eager with no graph break, and, on
CUDA, capture in a CUDA graph replayed on new input values."""
import pytest
import torch

import libssm
import libssm.torch as ssm_torch
from references import (INPUT_NAMES, assert_close, make_cotangents, make_inputs,
                        reference_outputs)
from harness import (DTYPE_IDS, DTYPES, capture_cuda_graph, check_compiled_matches_eager,
                     fresh_leaves)
from scan_harness import FULL, case_id, check_backward, check_forward

GRAD_ROWS = [FULL, FULL.replace(B_form="group", C_form="group", groups=3),
             FULL.replace(B_form="fixed", C_form="var"), FULL.replace(seqlen=1)]


def call(case, x, return_last_state=None):
    return ssm_torch.selective_scan(
        x["u"], x["delta"], x["A"], x["B"], x["C"], x["D"], x["z"], x["delta_bias"],
        delta_softplus=case.softplus, initial_state=x["initial_state"],
        return_last_state=case.last_state if return_last_state is None else return_last_state)


def grads_of(x):
    return libssm.SelectiveScanGrads(*(None if x[n] is None else x[n].grad for n in INPUT_NAMES))


@pytest.mark.parametrize("case", GRAD_ROWS, ids=case_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
def test_gradients_of_every_input(case, dtype, seed):
    inputs = make_inputs(case, dtype, seed)
    x = fresh_leaves(inputs)
    out, last_state = call(case, x)
    check_forward(case, inputs, out.detach(), last_state.detach())
    dout, dlast = make_cotangents(case, dtype, seed)
    torch.autograd.backward([out, last_state], [dout, dlast])
    check_backward(case, inputs, dout, dlast, grads_of(x))


def test_loss_on_last_state_only(seed):
    case = FULL
    inputs = make_inputs(case, torch.float32, seed)
    x = fresh_leaves(inputs)
    _, last_state = call(case, x)
    _, dlast = make_cotangents(case, torch.float32, seed)
    (last_state * dlast).sum().backward()
    check_backward(case, inputs, torch.zeros_like(inputs["u"]), dlast, grads_of(x))


def test_loss_on_out_only_with_last_state_returned(seed):
    case = FULL
    inputs = make_inputs(case, torch.bfloat16, seed)
    x = fresh_leaves(inputs)
    out, _ = call(case, x)
    dout, _ = make_cotangents(case, torch.bfloat16, seed)
    out.backward(dout)
    check_backward(case, inputs, dout, None, grads_of(x))


def test_some_inputs_require_grad(seed):
    # Only the inputs that ask for a gradient get one, and those are right.
    case = FULL
    inputs = make_inputs(case, torch.float32, seed)
    x = fresh_leaves(inputs, requires_grad={"B", "D", "initial_state"})
    out, last_state = call(case, x)
    dout, dlast = make_cotangents(case, torch.float32, seed)
    torch.autograd.backward([out, last_state], [dout, dlast])
    ref = reference_outputs(inputs, True, dout, dlast)
    plain = reference_outputs(inputs, True, dout, dlast, precision=torch.float32)
    for name in INPUT_NAMES:
        grad = None if x[name] is None else x[name].grad
        if name in ("B", "D", "initial_state"):
            assert_close("d" + name, grad, ref["d" + name], plain["d" + name])
        else:
            assert grad is None, name


def test_parameters_and_no_grad(seed):
    # nn.Parameter inputs train; under no_grad the result carries no graph.
    case = FULL
    inputs = make_inputs(case, torch.float32, seed)
    x = dict(inputs)
    x["A"] = torch.nn.Parameter(inputs["A"].clone())
    x["D"] = torch.nn.Parameter(inputs["D"].clone())
    out, _ = call(case, x)
    out.sum().backward()
    assert x["A"].grad is not None and x["D"].grad is not None
    with torch.no_grad():
        out, last_state = call(case, x)
    assert out.grad_fn is None and not out.requires_grad
    check_forward(case, inputs, out, last_state)


def test_no_options_and_no_last_state(seed):
    case = FULL.replace(D=False, z=False, delta_bias=False, softplus=False, initial_state=False,
                        last_state=False)
    inputs = make_inputs(case, torch.float32, seed)
    x = fresh_leaves(inputs)
    out = call(case, x)
    assert isinstance(out, torch.Tensor)
    dout, _ = make_cotangents(case, torch.float32, seed)
    out.backward(dout)
    check_backward(case, inputs, dout, None, grads_of(x))


def test_mamba_positional_call_ports(seed):
    # mamba_ssm's selective_scan_fn(u, delta, A, B, C, D, z, delta_bias, delta_softplus) call
    # binds the same way; return_last_state and initial_state are keyword-only, so a positional
    # return_last_state (which selective_scan_fn allows) fails rather than becoming initial_state.
    case = FULL.replace(initial_state=False, last_state=False)
    x = make_inputs(case, torch.float32, seed)
    args = (x["u"], x["delta"], x["A"], x["B"], x["C"], x["D"], x["z"], x["delta_bias"])
    torch.testing.assert_close(ssm_torch.selective_scan(*args, True),
                               ssm_torch.selective_scan(*args, delta_softplus=True))
    with pytest.raises(TypeError):
        ssm_torch.selective_scan(*args, True, True)


# ---------------------------------------------------------------------------------------------
# The registered ops.


def op_args(case, inputs):
    return (inputs["u"], inputs["delta"], inputs["A"], inputs["B"], inputs["C"], inputs["D"],
            inputs["z"], inputs["delta_bias"], inputs["initial_state"], case.softplus,
            case.last_state)


OPCHECK_ROWS = [FULL.replace(seqlen=9),
                FULL.replace(seqlen=9, D=False, z=False, delta_bias=False, initial_state=False,
                             last_state=False, B_form="fixed", C_form="group", groups=2)]


@pytest.mark.parametrize("case", OPCHECK_ROWS, ids=case_id)
def test_opcheck_forward(case, seed):
    x = fresh_leaves(make_inputs(case, torch.float32, seed))
    torch.library.opcheck(torch.ops.libssm.selective_scan_fwd.default, op_args(case, x))


@pytest.mark.parametrize("case", OPCHECK_ROWS, ids=case_id)
def test_opcheck_backward(case, seed):
    inputs = make_inputs(case, torch.float32, seed)
    dout, dlast = make_cotangents(case, torch.float32, seed)
    mask = [inputs[n] is not None for n in INPUT_NAMES]
    args = (inputs["u"], inputs["delta"], inputs["A"], inputs["B"], inputs["C"], dout,
            inputs["D"], inputs["z"], inputs["delta_bias"], inputs["initial_state"], dlast,
            case.softplus, mask)
    torch.library.opcheck(torch.ops.libssm.selective_scan_bwd.default, args)
    grads = torch.ops.libssm.selective_scan_bwd(*args)
    check_backward(case, inputs, dout, dlast, libssm.SelectiveScanGrads(
        *(g if inputs[n] is not None else None for g, n in zip(grads, INPUT_NAMES))))


# ---------------------------------------------------------------------------------------------
# torch.compile.


def scan_block(u, delta, A, B, C, D, z, delta_bias, initial_state):
    """A small model step around the op, so the compiled graph holds more than the op."""
    out, last_state = ssm_torch.selective_scan(u * 2.0, delta, A, B, C, D, z, delta_bias,
                                               delta_softplus=True, initial_state=initial_state,
                                               return_last_state=True)
    return torch.tanh(out) + 1.0, last_state * 0.5


def compile_and_compare(device, seed, backend="inductor"):
    inputs = make_inputs(FULL, torch.float32, seed, device=device)
    check_compiled_matches_eager(scan_block, inputs, lambda x: [x[n] for n in INPUT_NAMES],
                                 make_cotangents(FULL, torch.float32, seed, device=device),
                                 INPUT_NAMES, backend, (1e-6, 1e-6), (1e-5, 1e-5))


def test_compile_fullgraph_matches_eager(seed, fresh_compile):
    compile_and_compare("cpu", seed)


def test_compile_has_no_graph_break(seed, fresh_compile):
    inputs = make_inputs(FULL, torch.float32, seed)
    explanation = torch._dynamo.explain(scan_block)(*(inputs[n] for n in INPUT_NAMES))
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


def test_compile_dynamic_shapes(seed, fresh_compile):
    # One compiled graph serves other sizes: the fake implementation follows symbolic shapes.
    compiled_fn = torch.compile(scan_block, fullgraph=True, dynamic=True, backend="aot_eager")
    for seqlen in (7, 12):
        case = FULL.replace(seqlen=seqlen)
        inputs = make_inputs(case, torch.float32, seed + seqlen)
        got = compiled_fn(*(inputs[n] for n in INPUT_NAMES))
        want = scan_block(*(inputs[n] for n in INPUT_NAMES))
        assert got[0].shape == (case.batch, case.dim, seqlen)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)


def test_compile_generic_api_fullgraph(seed, fresh_compile):
    # libssm.selective_scan / selective_scan_bwd on tensors inside torch.compile trace as the
    # registered ops: fullgraph=True fails on any graph break. out= buffers are honoured.
    inputs = make_inputs(FULL, torch.float32, seed)
    dout, dlast = make_cotangents(FULL, torch.float32, seed)
    x = [inputs[n] for n in INPUT_NAMES]

    def step(u, delta, A, B, C, D, z, delta_bias, initial_state, out, dB):
        y, last = libssm.selective_scan(u, delta, A, B, C, D, z, delta_bias, delta_softplus=True,
                                        initial_state=initial_state, return_last_state=True,
                                        out=out)
        grads = libssm.selective_scan_bwd(u, delta, A, B, C, dout, D, z, delta_bias,
                                          delta_softplus=True, initial_state=initial_state,
                                          dlast_state=dlast, out={"dB": dB})
        return y, last, grads

    def run(fn):
        out, dB = torch.full_like(x[0], float("nan")), torch.full_like(x[3], float("nan"))
        y, last, grads = fn(*x, out, dB)
        torch.testing.assert_close(out, y)
        torch.testing.assert_close(dB, grads.dB)
        return (y, last) + tuple(grads)

    eager = run(step)
    compiled = run(torch.compile(step, fullgraph=True, backend="aot_eager"))
    for e, c in zip(eager, compiled):
        torch.testing.assert_close(c, e, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# CUDA.


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
def test_cuda_gradients_of_every_input(dtype, seed):
    case = FULL.replace(seqlen=300, dim=33, dstate=17)
    inputs = make_inputs(case, dtype, seed, device="cuda")
    x = fresh_leaves(inputs)
    out, last_state = call(case, x)
    dout, dlast = make_cotangents(case, dtype, seed, device="cuda")
    torch.autograd.backward([out, last_state], [dout, dlast])
    cpu = {k: None if v is None else v.cpu() for k, v in inputs.items()}
    check_forward(case, cpu, out.detach().cpu(), last_state.detach().cpu())
    check_backward(case, cpu, dout.cpu(), dlast.cpu(),
                   libssm.SelectiveScanGrads(*(None if g is None else g.cpu()
                                               for g in grads_of(x))))


@pytest.mark.cuda
def test_cuda_compile_fullgraph_matches_eager(seed, fresh_compile):
    compile_and_compare("cuda", seed)


@pytest.mark.cuda
def test_cuda_graph_capture_and_replay(seed):
    # Forward and backward captured once; replay after copying new values into the static
    # inputs must give the new results (a launch outside the capture stream would replay as
    # nothing and leave the first results in place).
    case = FULL.replace(seqlen=200)
    first = make_inputs(case, torch.float32, seed, device="cuda")
    second = make_inputs(case, torch.float32, seed + 1, device="cuda")
    static = fresh_leaves(first)
    names = list(INPUT_NAMES)
    dout, dlast = make_cotangents(case, torch.float32, seed, device="cuda")

    def step():
        out, last_state = call(case, static)
        grads = torch.autograd.grad([out, last_state], [static[n] for n in names],
                                    [dout, dlast])
        return out, last_state, grads

    graph, (static_out, static_last, static_grads) = capture_cuda_graph(step)

    for inputs in (second, first):
        with torch.no_grad():
            for n in names:
                static[n].copy_(inputs[n])
            static_out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        cpu = {k: v.cpu() for k, v in inputs.items()}
        check_forward(case, cpu, static_out.cpu(), static_last.cpu())
        check_backward(case, cpu, dout.cpu(), dlast.cpu(),
                       libssm.SelectiveScanGrads(*(g.cpu() for g in static_grads)))
