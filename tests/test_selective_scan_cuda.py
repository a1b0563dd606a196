"""The selective scan on a CUDA GPU (select with -m cuda; skipped without one): the CPU suite's
rows plus awkward sizes (seqlen around 2048, odd dims, dstate 1, 17 and 256, groups 3) and a
larger case, in fp32/fp16/bf16, against the float64 references and against libssm's own CPU path.
Outputs and gradient buffers start NaN-filled, so anything left unwritten fails; inputs are
fresh per test; the stream rules (torch's current stream, stream=, CUDA graphs) are checked by
making the wrong stream give wrong answers."""
import pytest
import torch

import libssm
from references import INPUT_NAMES, make_cotangents, make_inputs
from harness import DTYPE_IDS, DTYPES, capture_cuda_graph, poisoned_like
from scan_harness import (FULL, ROWS, CApi, case_id, check_agree, check_backward, check_forward,
                          extreme_delta_and_z, mamba_layout, poisoned_grads, run_backward,
                          run_forward, strided_views, transposed_poison)

pytestmark = pytest.mark.cuda
dtypes = pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)

# Sizes chosen to sit on and beside the kernels' chunk and block boundaries: seqlen one past and
# one short of a multiple of every chunk length (8, 16, 32 steps) and of mamba_ssm's 2048 (2047,
# 2048, 2049, 4097), odd channel counts that leave partial blocks (7, 33), dstate that is 1, not
# a power of two (17) or the limit (256), and 3 groups of 11 channels.
AWKWARD_ROWS = (
    FULL.replace(seqlen=2047),
    FULL.replace(seqlen=2048),
    FULL.replace(seqlen=2049),
    FULL.replace(seqlen=4097, dim=3, batch=1),
    FULL.replace(dim=7),
    FULL.replace(dim=33, B_form="group", C_form="group", groups=3),
    FULL.replace(dstate=1, seqlen=300),
    FULL.replace(dstate=17, seqlen=300),
    FULL.replace(dstate=256, seqlen=300, dim=7),
    FULL.replace(dstate=256, seqlen=2049, dim=3, batch=1),
    FULL.replace(B_form="fixed", C_form="fixed", seqlen=2049),
    FULL.replace(B_form="fixed", C_form="group", groups=3, dim=33, seqlen=513),
    FULL.replace(B_form="group", C_form="fixed", groups=2, seqlen=1),
)
LARGE = FULL.replace(batch=2, dim=64, seqlen=2049, dstate=16)
# The forward has a narrow variant (more threads a channel) for grids under two blocks per SM;
# these rows have enough channels (8 x 2048) for the wide one on any GPU of up to 256 SMs, so
# both variants are checked whatever the small rows pick.
WIDE_GRID_ROWS = (
    FULL.replace(batch=8, dim=2048, seqlen=40, dstate=16),
    FULL.replace(batch=8, dim=2048, seqlen=19, dstate=32, B_form="group", C_form="group", groups=2),
)
CUDA_ROWS = ROWS + AWKWARD_ROWS


def to_cpu(inputs):
    return {k: None if v is None else v.cpu() for k, v in inputs.items()}


def forward_on_gpu_and_cpu(case, inputs):
    """Runs the forward on the GPU into a NaN-filled out=, checks it against the references and
    against the library's CPU path on the same inputs."""
    out = poisoned_like(inputs["u"])
    result, last_state = run_forward(case, inputs, out=out)
    assert result is out
    assert out.is_cuda and (last_state is None or last_state.device == out.device)
    cpu_inputs = to_cpu(inputs)
    gpu = {"out": out.cpu(), "last_state": None if last_state is None else last_state.cpu()}
    refs = check_forward(case, cpu_inputs, gpu["out"], gpu["last_state"])
    cpu_out, cpu_last = run_forward(case, cpu_inputs)
    check_agree(gpu, {"out": cpu_out, "last_state": cpu_last}, refs)


def backward_on_gpu_and_cpu(case, inputs, dout, dlast):
    """The backward through the C entry point into NaN-filled gradient buffers, and through the
    Python API; both against the references and against the library's CPU path."""
    grads = poisoned_grads(inputs)
    CApi().backward(case, inputs, dout, dlast, grads)
    poisoned = {k: v.cpu() for k, v in grads.items()}
    api = {k: None if v is None else v.cpu()
           for k, v in run_backward(case, inputs, dout, dlast)._asdict().items()}
    cpu_inputs = to_cpu(inputs)
    dout_cpu = dout.cpu()
    dlast_cpu = None if dlast is None else dlast.cpu()
    refs = check_backward(case, cpu_inputs, dout_cpu, dlast_cpu,
                          libssm.SelectiveScanGrads(**{n: poisoned.get(n) for n in
                                                       libssm.SelectiveScanGrads._fields}))
    check_backward(case, cpu_inputs, dout_cpu, dlast_cpu, libssm.SelectiveScanGrads(**api),
                   refs)
    cpu = run_backward(case, cpu_inputs, dout_cpu, dlast_cpu)._asdict()
    check_agree(poisoned, cpu, refs)


@pytest.mark.parametrize("case", CUDA_ROWS, ids=case_id)
@dtypes
def test_forward(case, dtype, seed):
    forward_on_gpu_and_cpu(case, make_inputs(case, dtype, seed, device="cuda"))


@pytest.mark.parametrize("case", CUDA_ROWS, ids=case_id)
@dtypes
def test_backward(case, dtype, seed):
    inputs = make_inputs(case, dtype, seed, device="cuda")
    dout, dlast = make_cotangents(case, dtype, seed, device="cuda")
    backward_on_gpu_and_cpu(case, inputs, dout, dlast)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS.get)
def test_large(dtype, seed):
    inputs = make_inputs(LARGE, dtype, seed, device="cuda")
    forward_on_gpu_and_cpu(LARGE, inputs)
    dout, dlast = make_cotangents(LARGE, dtype, seed, device="cuda")
    backward_on_gpu_and_cpu(LARGE, inputs, dout, dlast)


@pytest.mark.parametrize("case", WIDE_GRID_ROWS, ids=case_id)
@dtypes
def test_wide_grid(case, dtype, seed):
    inputs = make_inputs(case, dtype, seed, device="cuda")
    forward_on_gpu_and_cpu(case, inputs)
    dout, dlast = make_cotangents(case, dtype, seed, device="cuda")
    backward_on_gpu_and_cpu(case, inputs, dout, dlast)


def test_mixed_dtypes(seed):
    case = FULL.replace(seqlen=300)
    mixed = {"u": torch.float16, "delta": torch.bfloat16, "B": torch.float32,
             "C": torch.float16, "z": torch.bfloat16, "initial_state": torch.float16}
    inputs = make_inputs(case, torch.float32, seed, device="cuda", dtypes=mixed)
    forward_on_gpu_and_cpu(case, inputs)
    dout, dlast = make_cotangents(case, torch.bfloat16, seed, device="cuda")
    backward_on_gpu_and_cpu(case, inputs, dout, dlast)


@pytest.mark.parametrize("case", [FULL.replace(seqlen=2049),
                                  FULL.replace(B_form="group", C_form="group", groups=3),
                                  FULL.replace(B_form="fixed", C_form="fixed")], ids=case_id)
@dtypes
def test_strided_inputs(case, dtype, seed):
    inputs = make_inputs(case, dtype, seed, device="cuda")
    views = strided_views(inputs)
    assert not views["u"].is_contiguous() and views["delta"].storage_offset() == 3
    forward_on_gpu_and_cpu(case, views)
    dout, dlast = make_cotangents(case, dtype, seed, device="cuda")
    backward_on_gpu_and_cpu(case, views, dout.transpose(0, 2).contiguous().transpose(0, 2),
                            dlast)


@pytest.mark.parametrize("case", [FULL, FULL.replace(B_form="fixed", C_form="fixed")],
                         ids=case_id)
def test_strided_output_buffers(case, seed):
    inputs = make_inputs(case, torch.float32, seed, device="cuda")
    api = CApi()
    out = transposed_poison(inputs["u"].shape, torch.float32, "cuda")
    last_state = transposed_poison((case.batch, case.dim, case.dstate), torch.float32, "cuda")
    api.forward(case, inputs, out, last_state)
    cpu_inputs = to_cpu(inputs)
    check_forward(case, cpu_inputs, out.cpu(), last_state.cpu())
    dout, dlast = make_cotangents(case, torch.float32, seed, device="cuda")
    grads = {"d" + n: transposed_poison(x.shape, x.dtype, "cuda") for n, x in inputs.items()
             if x is not None}
    api.backward(case, inputs, dout, dlast, grads)
    check_backward(case, cpu_inputs, dout.cpu(), dlast.cpu(),
                   libssm.SelectiveScanGrads(**{k: v.cpu() for k, v in grads.items()}))


@pytest.mark.parametrize("explicit_stream", [False, True], ids=["direct", "dlpack"])
def test_backward_out_given(explicit_stream, seed):
    # Buffers for a subset of the gradients (one strided) are written on the GPU and returned
    # as given; the others are allocated there. stream= sends torch tensors down the DLPack
    # path instead of the direct one, so both are covered.
    case = FULL
    inputs = make_inputs(case, torch.float32, seed, device="cuda")
    dout, dlast = make_cotangents(case, torch.float32, seed, device="cuda")
    given = {"du": poisoned_like(inputs["u"]), "dA": poisoned_like(inputs["A"]),
             "dB": transposed_poison(inputs["B"].shape, torch.float32, "cuda")}
    extra = {"stream": torch.cuda.current_stream()} if explicit_stream else {}
    grads = run_backward(case, inputs, dout, dlast, out=given, **extra)
    torch.cuda.synchronize()
    for name, buffer in given.items():
        assert getattr(grads, name) is buffer, name
    assert all(g is None or g.is_cuda for g in grads)
    check_backward(case, to_cpu(inputs), dout.cpu(), dlast.cpu(),
                   libssm.SelectiveScanGrads(*(None if g is None else g.cpu() for g in grads)))


@pytest.mark.parametrize("case", [FULL.replace(batch=0),
                                  FULL.replace(batch=0, B_form="fixed", C_form="fixed")],
                         ids=case_id)
def test_batch_zero(case, seed):
    inputs = make_inputs(case, torch.float32, seed, device="cuda")
    out, last_state = run_forward(case, inputs)
    assert out.shape == (0, case.dim, case.seqlen) and out.is_cuda
    assert last_state.shape == (0, case.dim, case.dstate)
    dout, dlast = make_cotangents(case, torch.float32, seed, device="cuda")
    grads = poisoned_grads(inputs)
    CApi().backward(case, inputs, dout, dlast, grads)
    for name in ("dA", "dD", "ddelta_bias") + (("dB", "dC") if case.B_form == "fixed" else ()):
        assert torch.equal(grads[name].cpu(), torch.zeros(grads[name].shape)), name


def test_repeated_calls_agree_with_reference(seed):
    # The same op run several times on fresh inputs in a row (no state kept between calls).
    case = FULL.replace(seqlen=700)
    for i in range(3):
        forward_on_gpu_and_cpu(case, make_inputs(case, torch.float16, seed + i, device="cuda"))


# ---------------------------------------------------------------------------------------------
# Streams: make the wrong stream visibly wrong. A stream is kept busy with a long sleep, then
# the inputs are overwritten on it; work launched on any other stream would read the old values.

BUSY_CYCLES = 200_000_000  # ~0.1 s of GPU time


def _stream_case(seed):
    case = FULL.replace(seqlen=500)
    old = make_inputs(case, torch.float32, seed, device="cuda")
    new = make_inputs(case, torch.float32, seed + 1, device="cuda")
    torch.cuda.synchronize()
    return case, old, new


def test_runs_on_torch_current_stream(seed):
    case, x, new = _stream_case(seed)
    dout, dlast = make_cotangents(case, torch.float32, seed, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        torch.cuda._sleep(BUSY_CYCLES)
        for n in INPUT_NAMES:
            x[n].copy_(new[n])
        out, last_state = run_forward(case, x)
        grads = run_backward(case, x, dout, dlast)
    stream.synchronize()
    cpu_inputs = to_cpu(new)
    check_forward(case, cpu_inputs, out.cpu(), last_state.cpu())
    check_backward(case, cpu_inputs, dout.cpu(), dlast.cpu(),
                   libssm.SelectiveScanGrads(*(g.cpu() for g in grads)))


def test_runs_on_explicit_stream(seed):
    case, x, new = _stream_case(seed)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        torch.cuda._sleep(BUSY_CYCLES)
        for n in INPUT_NAMES:
            x[n].copy_(new[n])
    out = poisoned_like(x["u"])
    stream.wait_stream(torch.cuda.current_stream())  # out's NaN fill precedes the op
    _, last_state = run_forward(case, x, out=out, stream=stream)
    stream.synchronize()
    check_forward(case, to_cpu(new), out.cpu(), last_state.cpu())


def test_cuda_graph_capture_python_api(seed):
    # libssm.selective_scan with a static out= captured in a CUDA graph; replays after new
    # values are copied into the static inputs give the new results.
    case = FULL.replace(seqlen=300)
    first = make_inputs(case, torch.float16, seed, device="cuda")
    static = {k: v.clone() for k, v in first.items()}
    out = poisoned_like(static["u"])
    graph, (_, static_last) = capture_cuda_graph(lambda: run_forward(case, static, out=out),
                                                 warmup=1)
    for i in range(2):
        inputs = make_inputs(case, torch.float16, seed + 1 + i, device="cuda")
        for n in INPUT_NAMES:
            static[n].copy_(inputs[n])
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check_forward(case, to_cpu(inputs), out.cpu(), static_last.cpu())


# ---------------------------------------------------------------------------------------------
# Layouts real callers produce, and extreme values.


@dtypes
def test_mamba_layout(dtype, seed):
    case = FULL.replace(seqlen=1000)
    inputs = make_inputs(case, dtype, seed, device="cuda")
    views = mamba_layout(inputs, case)
    forward_on_gpu_and_cpu(case, views)
    dout, dlast = make_cotangents(case, dtype, seed, device="cuda")
    backward_on_gpu_and_cpu(case, views, dout, dlast)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS.get)
def test_extreme_delta_and_z(dtype, seed):
    case = FULL.replace(seqlen=300)
    inputs = extreme_delta_and_z(case, dtype, seed)
    inputs = {k: None if v is None else v.cuda() for k, v in inputs.items()}
    forward_on_gpu_and_cpu(case, inputs)
    dout, dlast = make_cotangents(case, dtype, seed, device="cuda")
    backward_on_gpu_and_cpu(case, inputs, dout, dlast)


def test_offsets_past_int32():
    """batch * dim * seqlen > 2^31, so element offsets into u, delta, out, du, ddelta and the
    backward's checkpoints leave int32 range (where mamba_ssm's kernels wrap around). The last
    channels, whose offsets are the largest, are checked against the CPU path run on those
    channels alone; dA sums over both batches of the same channels."""
    batch, dim, seqlen, dstate = 2, 40000, 27000, 4
    assert batch * dim * seqlen > 2**31
    g = torch.Generator(device="cuda").manual_seed(7)
    r = lambda *s, dt=torch.bfloat16: torch.randn(*s, device="cuda", generator=g).to(dt)
    u, delta = r(batch, dim, seqlen), r(batch, dim, seqlen)
    A = -torch.rand(dim, dstate, device="cuda", generator=g) - 0.5
    B, C = r(batch, dstate, seqlen), r(batch, dstate, seqlen)
    D, bias = r(dim, dt=torch.float32), r(dim, dt=torch.float32)
    out = libssm.selective_scan(u, delta, A, B, C, D, None, bias, delta_softplus=True)
    dout = r(batch, dim, seqlen)
    grads = libssm.selective_scan_bwd(u, delta, A, B, C, dout, D, None, bias, delta_softplus=True)

    last = slice(dim - 3, dim)
    cpu = lambda t: t.cpu().contiguous()
    args = (cpu(u[:, last]), cpu(delta[:, last]), cpu(A[last]), cpu(B), cpu(C), cpu(D[last]),
            None, cpu(bias[last]))
    want_out = libssm.selective_scan(*args, delta_softplus=True)
    want = libssm.selective_scan_bwd(*args[:5], cpu(dout[:, last]), *args[5:], delta_softplus=True)

    def rel(got, ref):
        got, ref = got.cpu().double(), ref.double()
        return ((got - ref).norm() / ref.norm()).item()

    assert rel(out[:, last], want_out) < 1e-2
    assert rel(grads.du[:, last], want.du) < 1e-2
    assert rel(grads.ddelta[:, last], want.ddelta) < 1e-2
    assert rel(grads.dA[last], want.dA) < 1e-4
