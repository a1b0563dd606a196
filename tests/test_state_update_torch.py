"""libssm.torch.selective_state_update, called as mamba_ssm's selective_state_update is: out and
the state updated in place against the float64 references, the registered op
libssm::selective_state_update under torch.library.opcheck, torch.compile(fullgraph=True) against
eager with no graph break (the state's mutation reaching the caller's tensor, consecutive steps
in order, dynamic batch), the generic API under compile, and inference mode and parameters that
require grad (inference only: no gradient flows). On CUDA, compile against eager."""
import pytest
import torch

import libssm
import libssm.torch as ssm_torch
from harness import DTYPE_IDS, DTYPES
from references import make_state_update_inputs
from state_update_harness import (FULL, MAMBA1, MAMBA1_FULL, MAMBA2_STEP, case_id, check,
                                  references)

dtypes = pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)

TORCH_ROWS = [
    FULL,
    FULL.replace(indices="pad", index_dtype="int32"),
    MAMBA1,
    MAMBA1_FULL.replace(indices="perm"),
    MAMBA2_STEP,
    MAMBA2_STEP.replace(dstate=128, indices="pad"),
    FULL.replace(dstate=1),
]


def mamba_call(case, x):
    """Positional, in mamba_ssm's argument order."""
    return ssm_torch.selective_state_update(x["state"], x["x"], x["dt"], x["A"], x["B"], x["C"],
                                            x["D"], x["z"], x["dt_bias"], case.softplus,
                                            x["state_batch_indices"])


def op_args(case, x):
    return (x["state"], x["x"], x["dt"], x["A"], x["B"], x["C"], x["D"], x["z"], x["dt_bias"],
            case.softplus, x["state_batch_indices"])


@pytest.mark.parametrize("case", TORCH_ROWS, ids=case_id)
@dtypes
def test_matches_reference(case, dtype, seed):
    inputs = make_state_update_inputs(case, dtype, seed)
    refs = references(case, inputs)
    before = inputs["state"].clone()
    out = mamba_call(case, inputs)
    assert out.dtype == dtype and out.is_contiguous()
    check(case, inputs, before, out, refs)


def test_keywords_as_mamba_ssm_names_them(seed):
    case = MAMBA1_FULL.replace(indices="pad", batch=4)
    x = make_state_update_inputs(case, torch.float32, seed)
    refs = references(case, x)
    before = x["state"].clone()
    out = ssm_torch.selective_state_update(
        x["state"], x["x"], x["dt"], x["A"], x["B"], x["C"], D=x["D"], z=x["z"],
        dt_bias=x["dt_bias"], dt_softplus=True, state_batch_indices=x["state_batch_indices"])
    check(case, x, before, out, refs)


OPCHECK_ROWS = [FULL, MAMBA1_FULL, MAMBA2_STEP.replace(indices="pad"),
                FULL.replace(indices="perm", index_dtype="int32")]


@pytest.mark.parametrize("case", OPCHECK_ROWS, ids=case_id)
def test_opcheck(case, seed):
    inputs = make_state_update_inputs(case, torch.float32, seed)
    torch.library.opcheck(torch.ops.libssm.selective_state_update.default,
                          op_args(case, inputs))
    # The op itself, through the dispatcher: out and the state mutated in place.
    refs = references(case, inputs)
    before = inputs["state"].clone()
    out = torch.ops.libssm.selective_state_update(*op_args(case, inputs))
    check(case, inputs, before, out, refs)


# ---------------------------------------------------------------------------------------------
# torch.compile.


def decode_two_steps(state, x, dt, A, B, C, D, z, dt_bias, idx):
    """Two decode steps around other work: the second reads the state the first wrote, so the
    compiled graph must keep the mutation and the order."""
    y1 = ssm_torch.selective_state_update(state, x * 2.0, dt, A, B, C, D, z, dt_bias, True, idx)
    y2 = ssm_torch.selective_state_update(state, torch.tanh(y1), dt * 0.5, A, B, C, D, z,
                                          dt_bias, True, idx)
    return y1 + 1.0, y2 * 2.0


def compile_and_compare(case, device, seed, backend, dynamic=None, batches=None):
    compiled_fn = torch.compile(decode_two_steps, fullgraph=True, backend=backend,
                                dynamic=dynamic)
    for batch in batches or (case.batch,):
        inputs = make_state_update_inputs(case.replace(batch=batch), torch.float32, seed,
                                          device=device)
        names = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "state_batch_indices")
        eager_state, compiled_state = inputs["state"].clone(), inputs["state"].clone()
        eager = decode_two_steps(eager_state, *(inputs[n] for n in names))
        compiled = compiled_fn(compiled_state, *(inputs[n] for n in names))
        for e, c in zip(eager, compiled):
            torch.testing.assert_close(c, e, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(compiled_state, eager_state, rtol=1e-5, atol=1e-5)
        assert not torch.equal(compiled_state, inputs["state"]), "state not updated in place"


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("case", [FULL.replace(indices="pad"), MAMBA1_FULL, MAMBA2_STEP],
                         ids=case_id)
def test_compile_fullgraph_matches_eager(case, backend, seed, fresh_compile):
    compile_and_compare(case, "cpu", seed, backend)


def test_compile_dynamic_batch(seed, fresh_compile):
    compile_and_compare(FULL.replace(indices="pad"), "cpu", seed, "aot_eager", dynamic=True,
                        batches=(3, 5, 2))


def test_compile_has_no_graph_break(seed, fresh_compile):
    case = MAMBA2_STEP.replace(indices="pad")
    x = make_state_update_inputs(case, torch.float32, seed)
    args = (x["state"], x["x"], x["dt"], x["A"], x["B"], x["C"], x["D"], x["z"], x["dt_bias"],
            x["state_batch_indices"])
    explanation = torch._dynamo.explain(decode_two_steps)(*args)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


def test_compile_generic_api_fullgraph(seed, fresh_compile):
    # libssm.selective_state_update on tensors inside torch.compile traces as the registered op;
    # out= is filled and the state mutated as in eager mode.
    case = FULL.replace(indices="pad")
    inputs = make_state_update_inputs(case, torch.float32, seed)

    def step(state, out, x, dt, A, B, C, D, z, dt_bias, idx):
        libssm.selective_state_update(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus=True,
                                      state_batch_indices=idx, out=out)
        return out * 3.0

    names = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "state_batch_indices")
    results = []
    for fn in (step, torch.compile(step, fullgraph=True, backend="aot_eager")):
        state = inputs["state"].clone()
        out = torch.full(inputs["x"].shape, float("nan"))
        tripled = fn(state, out, *(inputs[n] for n in names))
        results.append((state, out, tripled))
    for e, c in zip(*results):
        torch.testing.assert_close(c, e, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# Inference only.


def test_inference_mode(seed):
    case = MAMBA1_FULL.replace(indices="pad", batch=4)
    with torch.inference_mode():
        inputs = make_state_update_inputs(case, torch.float32, seed)
        refs = references(case, inputs)
        before = inputs["state"].clone()
        out = mamba_call(case, inputs)
    check(case, inputs, before, out, refs)


def test_parameters_that_require_grad(seed):
    # A Mamba layer's step passes its parameters (D, dt_bias, -exp(A_log)) straight in: the call
    # works in eager mode with grad enabled, and its result carries no gradient.
    case = MAMBA1_FULL
    inputs = make_state_update_inputs(case, torch.float32, seed)
    refs = references(case, inputs)
    before = inputs["state"].clone()
    params = {n: torch.nn.Parameter(inputs[n].clone()) for n in ("D", "dt_bias")}
    A_log = torch.nn.Parameter(torch.log(-inputs["A"]))
    x = dict(inputs, A=-torch.exp(A_log), **params)
    out = mamba_call(case, x)
    assert not out.requires_grad
    check(case, inputs, before, out.detach(), refs)


@pytest.mark.cuda
def test_cuda_compile_fullgraph_matches_eager(seed, fresh_compile):
    compile_and_compare(MAMBA2_STEP.replace(indices="pad", batch=6), "cuda", seed, "inductor")
