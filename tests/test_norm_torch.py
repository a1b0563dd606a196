"""libssm.torch's fused norms: gradients of x, weight, bias, residual and z through torch autograd
(a loss on residual_out too, with prenorm) against float64 autograd of the reference, eps=None,
the RMSNorm / LayerNorm modules against torch.nn's (outputs, gradients, state_dict both ways),
the registered ops under torch.library.opcheck, torch.compile(fullgraph=True) against eager with
no graph break, and, on CUDA, capture in a CUDA graph replayed on new input values."""
import pytest
import torch

import libssm
import libssm.torch as ssm_torch
from harness import (DTYPE_IDS, DTYPES, capture_cuda_graph, check_compiled_matches_eager,
                     fresh_leaves)
from norm_harness import BASE, GATED, LAYER, case_id, reference_backward, reference_forward, to_cpu
from references import (NORM_INPUT_NAMES, assert_close, make_norm_cotangents, make_norm_inputs,
                        norm_numpy)

GRAD_ROWS = [
    BASE,
    BASE.replace(bias=True, zero_centered_weight=True),
    BASE.replace(weight=False),
    BASE.replace(z=True),
    LAYER,
    LAYER.replace(weight=False, bias=False),
    LAYER.replace(residual=True, prenorm=True, z=True, norm_before_gate=False),
    GATED,
    GATED.replace(norm_before_gate=True, hidden=7, group_size=1),
    GATED.replace(residual=False, prenorm=False),
    BASE.replace(residual=True),
]


def call(case, x, **extra):
    fn = ssm_torch.layer_norm if case.kind == "layer" else ssm_torch.rms_norm
    return fn(x["x"], x["weight"], x["bias"], x["residual"], x["z"], eps=case.eps,
              group_size=case.group_size or None, norm_before_gate=case.norm_before_gate,
              zero_centered_weight=case.zero_centered_weight, prenorm=case.prenorm, **extra)


def check_grads(case, inputs, x, dy, dres, names=NORM_INPUT_NAMES):
    """x[name].grad for each name against the reference (dx for x and residual alike), in its
    input's dtype; None for inputs not named or absent."""
    s = inputs["x"].double() + (0 if inputs["residual"] is None else inputs["residual"].double())
    refs = reference_backward(case, s, inputs, dy, dres)
    for name in NORM_INPUT_NAMES:
        grad = None if x[name] is None else x[name].grad
        if inputs[name] is None or name not in names:
            assert grad is None, f"{name}.grad set"
            continue
        assert grad is not None and grad.dtype == inputs[name].dtype, (name, grad)
        key = "dx" if name in ("x", "residual") else "d" + name
        assert_close(name + ".grad", grad.cpu(), *refs[key])


@pytest.mark.parametrize("case", GRAD_ROWS, ids=case_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
def test_gradients_of_every_input(case, dtype, seed):
    inputs = make_norm_inputs(case, dtype, seed)
    x = fresh_leaves(inputs)
    result = call(case, x)
    y, residual_out = result if case.prenorm else (result, None)
    refs = reference_forward(case, inputs)
    assert y.dtype == dtype
    assert_close("y", y.detach(), *refs["y"])
    dy, dres = make_norm_cotangents(case, dtype, seed)
    if case.prenorm:
        assert_close("residual_out", residual_out.detach(), *refs["residual_out"])
        torch.autograd.backward([y, residual_out], [dy, dres])
    else:
        y.backward(dy)
        dres = None
    check_grads(case, inputs, x, dy, dres)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=DTYPE_IDS.get)
def test_float32_residual_stream(dtype, seed):
    # residual_in_fp32: float32 residual and stream beside low-precision x; x.grad comes back in
    # x's dtype and residual.grad in float32, both dL/ds.
    case = GATED.replace(bias=True)
    inputs = make_norm_inputs(case, dtype, seed, dtypes={"residual": torch.float32,
                                                         "weight": torch.float32,
                                                         "bias": torch.float32})
    x = fresh_leaves(inputs)
    y, residual_out = call(case, x, residual_dtype=torch.float32)
    assert residual_out.dtype == torch.float32 and y.dtype == dtype
    dy, dres = make_norm_cotangents(case, dtype, seed, dresidual_dtype=torch.float32)
    torch.autograd.backward([y, residual_out], [dy, dres])
    check_grads(case, inputs, x, dy, dres)


def test_loss_on_residual_out_only(seed):
    # Only the residual stream feeds the loss: dL/dx = dL/dresidual = dresidual_out exactly, and
    # weight, bias and z receive zero gradients (or none).
    case = GATED.replace(bias=True)
    inputs = make_norm_inputs(case, torch.float32, seed)
    x = fresh_leaves(inputs)
    _, residual_out = call(case, x)
    _, dres = make_norm_cotangents(case, torch.float32, seed)
    residual_out.backward(dres)
    assert torch.equal(x["x"].grad, dres) and torch.equal(x["residual"].grad, dres)
    for name in ("weight", "bias", "z"):
        grad = x[name].grad
        assert grad is None or torch.equal(grad, torch.zeros_like(grad)), name


def test_some_inputs_require_grad(seed):
    case = GATED.replace(bias=True)
    inputs = make_norm_inputs(case, torch.float32, seed)
    x = fresh_leaves(inputs, requires_grad={"weight", "z"})
    y, residual_out = call(case, x)
    dy, _ = make_norm_cotangents(case, torch.float32, seed)
    y.backward(dy)
    check_grads(case, inputs, x, dy, None, names=("weight", "z"))


def test_no_grad_and_parameters(seed):
    case = LAYER
    inputs = make_norm_inputs(case, torch.float32, seed)
    x = dict(inputs, weight=torch.nn.Parameter(inputs["weight"].clone()))
    call(case, x).sum().backward()
    assert x["weight"].grad is not None
    with torch.no_grad():
        y = call(case, x)
    assert y.grad_fn is None and not y.requires_grad
    assert_close("y", y, *reference_forward(case, inputs)["y"])


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_eps_none_is_dtype_eps(kind, dtype, seed):
    # eps=None means torch.finfo(x.dtype).eps, as torch.nn.RMSNorm: visible on rows whose mean
    # square is comparable to it.
    g = torch.Generator().manual_seed(seed)
    fn = ssm_torch.layer_norm if kind == "layer" else ssm_torch.rms_norm
    finfo_eps = torch.finfo(dtype).eps
    x = (finfo_eps ** 0.5 * torch.randn(4, 32, generator=g, dtype=torch.float64)).to(dtype)
    weight = torch.ones(32, dtype=dtype)
    y = fn(x, weight, eps=None)
    want = norm_numpy(x, weight, kind=kind, eps=finfo_eps)["y"]
    other = norm_numpy(x, weight, kind=kind, eps=finfo_eps * 4)["y"]
    got = y.double().numpy()
    tolerance = 4 * finfo_eps * abs(want).max()
    assert abs(got - want).max() <= tolerance
    assert abs(other - want).max() > 10 * tolerance


# ---------------------------------------------------------------------------------------------
# Modules against torch.nn's.

MODULE_ROWS = [
    ("rms", dict(), (32,)),
    ("rms", dict(eps=1e-5), (4, 8)),
    ("rms", dict(eps=None), (32,)),
    ("rms", dict(elementwise_affine=False), (32,)),
    ("layer", dict(), (32,)),
    ("layer", dict(bias=False), (32,)),
    ("layer", dict(elementwise_affine=False), (2, 3, 5)),
    ("layer", dict(eps=1e-3), (4, 8)),
]


def module_pair(kind, kwargs, shape, dtype=torch.float32):
    """(torch.nn module, libssm module) with the same trained-looking parameters."""
    ours = (ssm_torch.RMSNorm if kind == "rms" else ssm_torch.LayerNorm)(shape, dtype=dtype,
                                                                        **kwargs)
    theirs = (torch.nn.RMSNorm if kind == "rms" else torch.nn.LayerNorm)(shape, dtype=dtype,
                                                                        **kwargs)
    g = torch.Generator().manual_seed(17)
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
    ours.load_state_dict(theirs.state_dict())
    return theirs, ours


@pytest.mark.parametrize("kind, kwargs, shape", MODULE_ROWS,
                         ids=["%s-%s-%s" % (k, ",".join(f"{a}={b}" for a, b in kw.items())
                                            or "default", "x".join(map(str, s)))
                              for k, kw, s in MODULE_ROWS])
def test_module_matches_torch_nn(kind, kwargs, shape, seed):
    theirs, ours = module_pair(kind, kwargs, shape)
    assert isinstance(ours, type(theirs)) and ours.eps == theirs.eps
    assert list(dict(ours.named_parameters())) == list(dict(theirs.named_parameters()))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((3, 5) + shape, generator=g, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    y, y_ref = ours(x), theirs(x_ref)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    dy = torch.randn(y.shape, generator=g)
    y.backward(dy)
    y_ref.backward(dy)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-4, atol=1e-5)
    for (name, p), p_ref in zip(ours.named_parameters(), theirs.parameters()):
        torch.testing.assert_close(p.grad, p_ref.grad, rtol=1e-4, atol=1e-4, msg=name)


@pytest.mark.parametrize("kind, kwargs", [("rms", {}), ("layer", {}), ("layer", {"bias": False}),
                                          ("rms", {"elementwise_affine": False})],
                         ids=["rms", "layer", "layer-no-bias", "rms-no-affine"])
def test_module_state_dict_round_trip(kind, kwargs):
    # A state_dict saved by either loads into the other (strict), with the same keys, and the
    # parameters arrive unchanged.
    theirs, ours = module_pair(kind, kwargs, (16,))
    assert list(ours.state_dict()) == list(theirs.state_dict())
    fresh_theirs = type(theirs)((16,), **kwargs)
    fresh_theirs.load_state_dict(ours.state_dict(), strict=True)
    fresh_ours = type(ours)((16,), **kwargs)
    fresh_ours.load_state_dict(theirs.state_dict(), strict=True)
    for a, b, c in zip(theirs.state_dict().values(), fresh_theirs.state_dict().values(),
                       fresh_ours.state_dict().values()):
        assert torch.equal(a, b) and torch.equal(a, c)


@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_module_residual_and_prenorm(kind, seed):
    # forward(x, residual, prenorm=True) is the module's norm of x + residual, plus that sum.
    theirs, ours = module_pair(kind, {}, (24,))
    g = torch.Generator().manual_seed(seed)
    x, residual = torch.randn(6, 24, generator=g), torch.randn(6, 24, generator=g)
    y, residual_out = ours(x, residual, prenorm=True, residual_dtype=torch.float32)
    torch.testing.assert_close(residual_out, x + residual, rtol=0, atol=0)
    torch.testing.assert_close(y, theirs(x + residual), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours(x, residual), y)


def test_module_wrong_shape_is_named():
    with pytest.raises(libssm.ShapeError) as excinfo:
        ssm_torch.RMSNorm(16)(torch.randn(3, 15))
    assert str(excinfo.value).startswith("x:")


# ---------------------------------------------------------------------------------------------
# The registered ops.

OPCHECK_ROWS = [GATED.replace(bias=True, lead=(3,)),
                LAYER.replace(lead=(2, 3), residual=True, prenorm=True, z=True),
                BASE.replace(lead=(4,), weight=False, hidden=8)]


def op_forward_args(case, inputs, residual_dtype=None):
    return (inputs["x"], inputs["weight"], inputs["bias"], inputs["residual"], inputs["z"],
            case.kind, case.eps, case.group_size, case.norm_before_gate,
            case.zero_centered_weight, residual_dtype, case.prenorm)


@pytest.mark.parametrize("case", OPCHECK_ROWS, ids=case_id)
def test_opcheck_forward(case, seed):
    x = fresh_leaves(make_norm_inputs(case, torch.float32, seed))
    torch.library.opcheck(torch.ops.libssm.norm_fwd.default, op_forward_args(case, x))


@pytest.mark.parametrize("case", OPCHECK_ROWS, ids=case_id)
def test_opcheck_backward(case, seed):
    inputs = make_norm_inputs(case, torch.float32, seed)
    y, residual_out, mean, rstd = torch.ops.libssm.norm_fwd(*op_forward_args(case, inputs))
    s = residual_out if case.residual else inputs["x"]
    dy, dres = make_norm_cotangents(case, torch.float32, seed)
    needs = [inputs[n] is not None for n in ("weight", "bias", "z")]
    args = (s, dy, mean if case.kind == "layer" else None, rstd, inputs["weight"],
            inputs["bias"], inputs["z"], dres, case.kind, case.eps, case.group_size,
            case.norm_before_gate, case.zero_centered_weight, torch.float32, torch.float16,
            needs)
    torch.library.opcheck(torch.ops.libssm.norm_bwd.default, args)
    dx, dresidual, dweight, dbias, dz = torch.ops.libssm.norm_bwd(*args)
    refs = reference_backward(case, s, inputs, dy, dres)
    assert_close("dx", dx, *refs["dx"])
    assert dresidual.dtype == torch.float16
    assert_close("dresidual", dresidual, *refs["dx"])
    for name, g in (("weight", dweight), ("bias", dbias), ("z", dz)):
        if inputs[name] is None:
            assert g.numel() == 0, name
        else:
            assert_close("d" + name, g, *refs["d" + name])


# ---------------------------------------------------------------------------------------------
# torch.compile.


def norm_block(x, weight, bias, residual, z):
    """A small model step around the op, so the compiled graph holds more than the op: a
    gated RMSNorm with residual (prenorm) feeding a LayerNorm."""
    y, residual_out = ssm_torch.rms_norm(x * 2.0, weight, None, residual, z, group_size=16,
                                         norm_before_gate=False, prenorm=True)
    return ssm_torch.layer_norm(torch.tanh(y), weight, bias) + 1.0, residual_out * 0.5


def compile_and_compare(device, seed, backend="inductor"):
    case = GATED.replace(bias=True)
    inputs = make_norm_inputs(case, torch.float32, seed, device=device)
    check_compiled_matches_eager(norm_block, inputs, lambda x: [x[n] for n in NORM_INPUT_NAMES],
                                 make_norm_cotangents(case, torch.float32, seed, device=device),
                                 NORM_INPUT_NAMES, backend, (1e-5, 1e-5), (1e-4, 1e-5))


def test_compile_fullgraph_matches_eager(seed, fresh_compile):
    compile_and_compare("cpu", seed)


def test_compile_has_no_graph_break(seed, fresh_compile):
    inputs = make_norm_inputs(GATED.replace(bias=True), torch.float32, seed)
    explanation = torch._dynamo.explain(norm_block)(*(inputs[n] for n in NORM_INPUT_NAMES))
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


def test_compile_dynamic_shapes(seed, fresh_compile):
    # One compiled graph serves other row counts: the fake implementations follow symbolic
    # shapes.
    compiled_fn = torch.compile(norm_block, fullgraph=True, dynamic=True, backend="aot_eager")
    for rows in (5, 9):
        case = GATED.replace(bias=True, lead=(rows,))
        inputs = make_norm_inputs(case, torch.float32, seed + rows)
        got = compiled_fn(*(inputs[n] for n in NORM_INPUT_NAMES))
        want = norm_block(*(inputs[n] for n in NORM_INPUT_NAMES))
        assert got[0].shape == (rows, case.hidden)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)


def test_compile_generic_api_fullgraph(seed, fresh_compile):
    # libssm.norm_fwd / norm_bwd on tensors inside torch.compile trace as the registered ops
    # (fullgraph=True fails on any graph break) and return what they return in eager mode, out=
    # and a residual_out of its own dtype included.
    case = LAYER.replace(residual=True, z=True)
    inputs = make_norm_inputs(case, torch.float32, seed)
    dy, dres = make_norm_cotangents(case, torch.float32, seed)

    def step(x, weight, bias, residual, z, out):
        fwd = libssm.norm_fwd(x, weight, bias, kind="layer", residual=residual, z=z, eps=1e-5,
                              residual_dtype=torch.float16, out=out)
        grads = libssm.norm_bwd(fwd.residual_out, dy, fwd.mean, fwd.rstd, weight, bias,
                                kind="layer", z=z, dresidual_out=dres, eps=1e-5,
                                residual_dtype=torch.bfloat16)
        return tuple(fwd) + tuple(grads)

    def run(fn):
        out = torch.full_like(inputs["x"], float("nan"))
        result = fn(*(inputs[n] for n in NORM_INPUT_NAMES), out)
        torch.testing.assert_close(out, result[0])
        return result

    eager = run(step)
    compiled = run(torch.compile(step, fullgraph=True, backend="aot_eager"))
    assert [e is None for e in eager] == [c is None for c in compiled]
    assert eager[1].dtype == torch.float16 and eager[5].dtype == torch.bfloat16
    for e, c in zip(eager, compiled):
        if e is not None:
            assert c.dtype == e.dtype
            torch.testing.assert_close(c, e, rtol=1e-6, atol=1e-6)


def test_compile_module(seed, fresh_compile):
    _, ours = module_pair("rms", {}, (32,))
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(seed))
    compiled = torch.compile(ours, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x), ours(x), rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# CUDA.


@pytest.mark.cuda
@pytest.mark.parametrize("case", [GATED.replace(bias=True, lead=(64,), hidden=4096,
                                                group_size=1024),
                                  LAYER.replace(lead=(33,), hidden=4097, residual=True, z=True,
                                                prenorm=True)], ids=case_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
def test_cuda_gradients_of_every_input(case, dtype, seed):
    inputs = make_norm_inputs(case, dtype, seed, device="cuda")
    x = fresh_leaves(inputs)
    y, residual_out = call(case, x)
    dy, dres = make_norm_cotangents(case, dtype, seed, device="cuda")
    torch.autograd.backward([y, residual_out], [dy, dres])
    cpu = to_cpu(inputs)
    refs = reference_forward(case, cpu)
    assert_close("y", y.detach().cpu(), *refs["y"])
    assert_close("residual_out", residual_out.detach().cpu(), *refs["residual_out"])
    check_grads(case, cpu, x, dy.cpu(), dres.cpu())


@pytest.mark.cuda
def test_cuda_module_matches_torch_nn(seed):
    theirs, ours = module_pair("layer", {}, (1024,))
    theirs, ours = theirs.cuda(), ours.cuda()
    x = torch.randn(8, 1024, device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
    torch.testing.assert_close(ours(x), theirs(x), rtol=1e-5, atol=1e-5)


@pytest.mark.cuda
def test_cuda_compile_fullgraph_matches_eager(seed, fresh_compile):
    compile_and_compare("cuda", seed)


@pytest.mark.cuda
def test_cuda_graph_capture_and_replay(seed):
    # Forward and backward captured once; replay after copying new values into the static
    # inputs must give the new results (work launched outside the capture stream would replay
    # as nothing and leave the first results in place).
    case = GATED.replace(bias=True, lead=(40,), hidden=1024, group_size=256)
    first = make_norm_inputs(case, torch.float32, seed, device="cuda")
    second = make_norm_inputs(case, torch.float32, seed + 1, device="cuda")
    static = fresh_leaves(first)
    names = list(NORM_INPUT_NAMES)
    dy, dres = make_norm_cotangents(case, torch.float32, seed, device="cuda")

    def step():
        y, residual_out = call(case, static)
        grads = torch.autograd.grad([y, residual_out], [static[n] for n in names], [dy, dres])
        return y, residual_out, grads

    graph, (static_y, static_res, static_grads) = capture_cuda_graph(step)

    for inputs in (second, first):
        with torch.no_grad():
            for n in names:
                static[n].copy_(inputs[n])
            static_y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        cpu = to_cpu(inputs)
        fwd = libssm.NormForward(static_y.cpu(), static_res.cpu(), None, None)
        refs = reference_forward(case, cpu)
        assert_close("y", fwd.y, *refs["y"])
        assert_close("residual_out", fwd.residual_out, *refs["residual_out"])
        back = reference_backward(case, cpu["x"].double() + cpu["residual"].double(), cpu,
                                  dy.cpu(), dres.cpu())
        for n, g in zip(names, static_grads):
            key = "dx" if n in ("x", "residual") else "d" + n
            assert_close(n + ".grad", g.cpu(), *back[key])

