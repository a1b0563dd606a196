"""The causal conv1d on a CUDA GPU (select with -m cuda; skipped without one): the CPU suite's rows
plus sizes on and beside every kernel path (rows shorter than one 8-position slice, segments of 2
to 32 lanes, rows cut into many chunks, 16-byte vector loads and element loads, channel-last x,
packed sequences crossing chunk boundaries, widths 4 and 8 of each kernel family and of its fast
kernels), every dtype and dtype mix, x, out and dx in different layouts, against the float64
references and libssm's own CPU path. Outputs and gradient buffers start NaN-filled, so anything
left unwritten fails; dweight/dbias must be the same bits run to run; the decode step with indices
and padding rows; streams, CUDA graphs and offsets past 2^31."""
import pytest
import torch

import libssm
from conv1d_harness import (BASE, FULL, PACKED, ROWS, UPDATE_BASE, UPDATE_ROWS, Conv1dCApi,
                            as_torch, c_forward_backward, case_id, check_agree, check_backward,
                            check_forward, check_update, make_update_inputs, reference_backward,
                            reference_update, run_backward, run_forward, run_update, to_cpu,
                            update_id)
from harness import DTYPE_IDS, DTYPES, capture_cuda_graph, poisoned_like
from references import assert_close, make_conv1d_cotangents, make_conv1d_inputs

pytestmark = pytest.mark.cuda
dtypes = pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)

# Sizes chosen against the kernels' plans (conv1d_plan.h): seqlen 9, 17 and 33 give segments
# of 2, 4 and 8 lanes; 255/256/257 sit beside 32 full slices; 2048 moves by 16-byte vectors over
# whole-row units; 4097 has a partial last slice (element loads) and, at dim 3, rows cut into
# several units; 100000 on two channels cuts each row into many chunks whose edges the
# backward's recomputed dz must cross; packed sequences whose boundaries fall inside and across
# chunks; channel-last x with odd dims and many chunks; many short rows.
AWKWARD_ROWS = (
    FULL.replace(seqlen=9, dim=40),
    FULL.replace(seqlen=17, width=8, dim=40),
    FULL.replace(seqlen=33, width=3),
    FULL.replace(seqlen=255, dim=33, width=5),
    FULL.replace(seqlen=256, dim=33),
    FULL.replace(seqlen=257, dim=33, width=8),
    FULL.replace(seqlen=2048, batch=4, dim=64),
    FULL.replace(seqlen=2048, batch=4, dim=64, width=8, silu=False),
    FULL.replace(seqlen=4097, batch=2, dim=3),
    FULL.replace(seqlen=100000, batch=1, dim=2),
    FULL.replace(seqlen=100000, batch=1, dim=2, width=7),
    PACKED.replace(seqlen=20000, batch=2, dim=3, seq_idx=(9999, 1, 3, 9997),
                   initial_states=True),
    PACKED.replace(seqlen=20000, batch=2, dim=3, seq_idx=(9999, 1, 3, 9997),
                   initial_states=True, width=8),
    FULL.replace(seqlen=2048, batch=2, dim=128, layout="channel_last"),
    FULL.replace(seqlen=3001, batch=2, dim=5, layout="channel_last", width=6),
    PACKED.replace(seqlen=5000, batch=2, dim=67, seq_idx=(2500, 7, 2493),
                   layout="channel_last", initial_states=True),
    FULL.replace(seqlen=16, batch=1, dim=4096),
    FULL.replace(seqlen=3, batch=16, dim=512, layout="channel_last"),
    FULL.replace(seqlen=1, batch=16, dim=512),
)
# Rows the fast kernels take (Mamba's case: the width fills the kernel's 4 or 8 taps, SiLU, no
# states; seq rows of whole 16-byte slices, channel-last rows of whole channel groups): rows cut
# into several backward units, the last one partial; channel-last chunks with and without an
# interior between their first and last kTaps-1 positions, the last one partial.
FAST_ROWS = (
    BASE.replace(seqlen=2000, batch=2, dim=64),
    BASE.replace(seqlen=4096, batch=1, dim=16, width=8),
    BASE.replace(seqlen=3000, batch=2, dim=64, layout="channel_last"),
    BASE.replace(seqlen=5, batch=3, dim=8, layout="channel_last"),
    BASE.replace(seqlen=1001, batch=2, dim=34, width=8, layout="channel_last"),
)
CUDA_ROWS = ROWS + AWKWARD_ROWS + FAST_ROWS


def cpu_results(case, inputs, dout=None, dfinal=None):
    """The library's CPU path on the same (device-rounded) inputs."""
    cpu = to_cpu(inputs)
    fwd = run_forward(case, cpu)
    grads = None
    if dout is not None:
        grads = run_backward(case, cpu, dout.cpu(), None if dfinal is None else dfinal.cpu())
    return fwd, grads


def forward_on_gpu_and_cpu(case, inputs, **extra):
    """The forward through the generic API into a NaN-filled out=, against the references and
    against the library's CPU path on the same inputs. Returns the GPU result."""
    out = torch.full_like(inputs["x"], float("nan"))
    result = run_forward(case, inputs, out=out, **extra)
    got = result[0] if case.final_states else result
    assert got is out
    refs = check_forward(case, inputs, result)
    cpu, _ = cpu_results(case, inputs)
    names = ("out", "final_states") if case.final_states else ("out",)
    values = result if case.final_states else (result,)
    expected = cpu if case.final_states else (cpu,)
    check_agree(dict(zip(names, values)), dict(zip(names, expected)), refs)
    return result


def backward_on_gpu_and_cpu(case, inputs, dout, dfinal):
    """Forward and backward through the C entry points into NaN-filled buffers, then the
    backward through the generic API; both against the references and the CPU path."""
    result, grads = c_forward_backward(case, inputs, dout, dfinal)
    torch.cuda.synchronize()
    check_forward(case, inputs, result)
    refs = check_backward(case, inputs, grads, dout, dfinal)
    api = run_backward(case, inputs, dout, dfinal)
    check_backward(case, inputs, api, dout, dfinal, refs=refs)
    _, cpu = cpu_results(case, inputs, dout, dfinal)
    check_agree(grads._asdict(), cpu._asdict(), refs)
    return grads


@pytest.mark.parametrize("case", CUDA_ROWS, ids=case_id)
@dtypes
def test_forward(case, dtype, seed):
    forward_on_gpu_and_cpu(case, make_conv1d_inputs(case, dtype, seed, device="cuda"))


@pytest.mark.parametrize("case", CUDA_ROWS, ids=case_id)
@dtypes
def test_backward(case, dtype, seed):
    inputs = make_conv1d_inputs(case, dtype, seed, device="cuda")
    dout, dfinal = make_conv1d_cotangents(case, dtype, seed, device="cuda")
    backward_on_gpu_and_cpu(case, inputs, dout, dfinal)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("case", [FULL.replace(seqlen=2048, dim=16),
                                  PACKED.replace(initial_states=True, layout="channel_last",
                                                 dim=64)], ids=case_id)
def test_float32_parameters_beside_low_precision_x(case, dtype, seed):
    f32 = torch.float32
    inputs = make_conv1d_inputs(case, dtype, seed, device="cuda",
                                dtypes={"weight": f32, "bias": f32, "initial_states": f32})
    forward_on_gpu_and_cpu(case, inputs)
    dout, dfinal = make_conv1d_cotangents(case, dtype, seed, device="cuda")
    grads = backward_on_gpu_and_cpu(case, inputs, dout, dfinal)
    assert grads.dweight.dtype == f32 and grads.dinitial_states.dtype == f32


# ---------------------------------------------------------------------------------------------
# Layouts.


def shifted(t):
    """t's values one element into a larger buffer: no row is 16-byte aligned."""
    flat = torch.zeros(t.numel() + 1, dtype=t.dtype, device=t.device)
    view = flat[1:].view(t.shape)
    view.copy_(t)
    return view


def every_other(t):
    """t's values at every other position of a buffer twice as long (stride 2 along seqlen)."""
    wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)
    wide[..., ::2] = t
    return wide[..., ::2]


def channel_last(t):
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def padded_rows(t):
    """t's rows 8 elements apart beyond seqlen: rows stay 16-byte aligned, strides differ."""
    big = torch.zeros(*t.shape[:-1], t.shape[-1] + 8, dtype=t.dtype, device=t.device)
    view = big[..., :t.shape[-1]]
    view.copy_(t)
    return view


LAYOUTS = {"shifted": shifted, "every_other": every_other, "channel_last": channel_last,
           "padded_rows": padded_rows}


@pytest.mark.parametrize("case", [FULL.replace(seqlen=1024, dim=24),
                                  PACKED.replace(initial_states=True, seqlen=1000,
                                                 seq_idx=(400, 600), dim=9)], ids=case_id)
@pytest.mark.parametrize("x_layout", list(LAYOUTS))
@pytest.mark.parametrize("out_layout", ["same", "contiguous", "channel_last"])
@dtypes
def test_layouts(case, x_layout, out_layout, dtype, seed):
    # x, dout, out and dx each in its own layout; every combination gives the reference's
    # values (vector loads only where every operand allows them).
    inputs = make_conv1d_inputs(case, dtype, seed, device="cuda")
    dout, dfinal = make_conv1d_cotangents(case, dtype, seed, device="cuda")
    view = LAYOUTS[x_layout]
    vx = dict(inputs, x=view(inputs["x"]))
    shape = inputs["x"].shape
    make_out = {"same": lambda: view(torch.full(shape, float("nan"), dtype=dtype,
                                                device="cuda")),
                "contiguous": lambda: torch.full(shape, float("nan"), dtype=dtype,
                                                 device="cuda"),
                "channel_last": lambda: channel_last(torch.full(shape, float("nan"),
                                                                dtype=dtype, device="cuda"))}
    out = make_out[out_layout]()
    final = torch.full((case.batch, case.dim, case.width - 1), float("nan"), dtype=dtype,
                       device="cuda")
    api = Conv1dCApi()
    api.forward(case.silu, vx, out, final)
    grads = {"dx": make_out[out_layout](), "dweight": poisoned_like(inputs["weight"]),
             "dbias": poisoned_like(inputs["bias"]),
             "dinitial_states": None if inputs["initial_states"] is None
             else poisoned_like(inputs["initial_states"])}
    api.backward(case.silu, vx, view(dout), dfinal, grads)
    torch.cuda.synchronize()
    check_forward(case, inputs, (out, final))
    check_backward(case, inputs, libssm.Conv1dGrads(**grads), dout, dfinal)


def test_output_follows_channel_last_x(seed):
    case = FULL.replace(layout="channel_last", seqlen=300, dim=32)
    inputs = make_conv1d_inputs(case, torch.bfloat16, seed, device="cuda")
    out, _ = run_forward(case, inputs)
    dout, dfinal = make_conv1d_cotangents(case, torch.bfloat16, seed, device="cuda")
    grads = run_backward(case, inputs, dout, dfinal)
    assert out.stride(1) == 1 and grads.dx.stride(1) == 1


@pytest.mark.parametrize("case", [FULL.replace(seqlen=0), FULL.replace(batch=0),
                                  FULL.replace(dim=0)], ids=case_id)
def test_empty(case, seed):
    # No positions, batch rows or channels: nothing to compute, but the final states are the
    # initial states, their gradient is dfinal_states, and dweight/dbias (sums over nothing)
    # are written as zeros over their NaN poison.
    inputs = make_conv1d_inputs(case, torch.float32, seed, device="cuda")
    dout, dfinal = make_conv1d_cotangents(case, torch.float32, seed, device="cuda")
    (out, final), grads = c_forward_backward(case, inputs, dout, dfinal)
    torch.cuda.synchronize()
    assert out.shape == inputs["x"].shape
    assert torch.equal(final, inputs["initial_states"])
    assert torch.equal(grads.dinitial_states, dfinal)
    assert torch.equal(grads.dweight, torch.zeros_like(grads.dweight))
    assert torch.equal(grads.dbias, torch.zeros_like(grads.dbias))


# ---------------------------------------------------------------------------------------------
# Determinism.


@pytest.mark.parametrize("case, dtype", [
    (FULL.replace(batch=8, dim=256, seqlen=4096), torch.bfloat16),
    (FULL.replace(batch=3, dim=5, seqlen=100000, width=8), torch.float32),
    (PACKED.replace(batch=4, dim=96, seqlen=3000, seq_idx=(1000, 2000),
                    layout="channel_last"), torch.float16),
], ids=lambda v: case_id(v) if hasattr(v, "label") else DTYPE_IDS[v])
def test_weight_gradients_bitwise_deterministic(case, dtype, seed):
    # dweight and dbias are sums in a fixed order: the same inputs give the same bits every run.
    inputs = make_conv1d_inputs(case, dtype, seed, device="cuda",
                                dtypes={"weight": torch.float32, "bias": torch.float32})
    dout, dfinal = make_conv1d_cotangents(case, dtype, seed, device="cuda")
    first = run_backward(case, inputs, dout, dfinal)
    for _ in range(3):
        again = run_backward(case, inputs, dout, dfinal)
        assert torch.equal(again.dweight, first.dweight)
        assert torch.equal(again.dbias, first.dbias)
        assert torch.equal(again.dx, first.dx)
    torch.cuda.synchronize()
    refs = reference_backward(case, inputs, dout, dfinal)
    assert_close("dweight", first.dweight.cpu(), *refs["dweight"])


# ---------------------------------------------------------------------------------------------
# The decode step.


@pytest.mark.parametrize("case", UPDATE_ROWS + (UPDATE_BASE.replace(batch=64, dim=4096),
                                                UPDATE_BASE.replace(batch=64, dim=4096,
                                                                    indices="padding",
                                                                    circular=True,
                                                                    state_len=16)),
                         ids=update_id)
@dtypes
def test_update(case, dtype, seed):
    inputs = make_update_inputs(case, dtype, seed, device="cuda")
    expected = reference_update(case, inputs)
    out = run_update(case, inputs)
    torch.cuda.synchronize()
    check_update(case, inputs, out, inputs["conv_state"], expected)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS.get)
def test_update_dtype_mix(state_dtype, seed):
    case = UPDATE_BASE.replace(circular=True, state_len=5, seqlen=2, indices="perm")
    inputs = make_update_inputs(case, torch.float16, seed, device="cuda",
                                state_dtype=state_dtype, weight_dtype=torch.float32,
                                index_dtype=torch.int64)
    expected = reference_update(case, inputs)
    out = torch.full_like(inputs["x"], float("nan"))
    Conv1dCApi().update(case.silu, inputs, out)
    torch.cuda.synchronize()
    check_update(case, inputs, out, inputs["conv_state"], expected)


def test_update_index_past_state(seed):
    # The GPU cannot report an index the host never reads: that row's out is NaN and no state
    # is touched; the other rows are right.
    case = UPDATE_BASE.replace(indices="perm")
    inputs = make_update_inputs(case, torch.float32, seed, device="cuda")
    inputs["conv_state_indices"][1] = case.batch_state + 5
    before = inputs["conv_state"].clone()
    out = run_update(case, inputs)
    torch.cuda.synchronize()
    assert torch.isnan(out[1]).all()
    for b in (0, 2):
        s = int(inputs["conv_state_indices"][b])
        assert not torch.equal(inputs["conv_state"][s], before[s])
        assert torch.isfinite(out[b]).all()
    untouched = set(range(case.batch_state)) - {int(inputs["conv_state_indices"][b])
                                                for b in (0, 2)}
    for s in untouched:
        assert torch.equal(inputs["conv_state"][s], before[s])


# ---------------------------------------------------------------------------------------------
# Streams and graphs: make the wrong stream visibly wrong. A stream is kept busy with a long
# sleep, then the inputs are overwritten on it; work launched on any other stream would read
# the old values.

BUSY_CYCLES = 200_000_000  # ~0.1 s of GPU time


def test_runs_on_torch_current_stream(seed):
    case = FULL.replace(batch=4, dim=256, seqlen=1024)
    x = make_conv1d_inputs(case, torch.float32, seed, device="cuda")
    new = make_conv1d_inputs(case, torch.float32, seed + 1, device="cuda")
    dout, dfinal = make_conv1d_cotangents(case, torch.float32, seed, device="cuda")
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        torch.cuda._sleep(BUSY_CYCLES)
        for n in ("x", "weight", "bias", "initial_states"):
            x[n].copy_(new[n])
        result = run_forward(case, x)
        grads = run_backward(case, x, dout, dfinal)
    stream.synchronize()
    check_forward(case, new, result)
    check_backward(case, new, grads, dout, dfinal)


def test_cuda_graph_capture_python_api(seed):
    case = PACKED.replace(batch=2, dim=64, seqlen=500, seq_idx=(100, 400))
    static = make_conv1d_inputs(case, torch.float16, seed, device="cuda")
    out = torch.full_like(static["x"], float("nan"))
    graph, result = capture_cuda_graph(lambda: run_forward(case, static, out=out), warmup=1)
    for i in range(2):
        inputs = make_conv1d_inputs(case, torch.float16, seed + 1 + i, device="cuda")
        for n in ("x", "weight", "bias"):
            static[n].copy_(inputs[n])
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check_forward(case, inputs, result)


# ---------------------------------------------------------------------------------------------
# 64-bit offsets.


@pytest.mark.parametrize("layout", ["seq", "channel_last"])
def test_offsets_past_int32(layout):
    """batch * dim * seqlen > 2^31, so element offsets into x, out, dout and dx leave int32
    range. The last channels, whose offsets are the largest, are checked against the CPU path
    run on those channels alone."""
    batch, dim, seqlen, width = 2, 32768, 32800, 4
    assert batch * dim * seqlen > 2**31
    g = torch.Generator(device="cuda").manual_seed(7)
    x = torch.randn(batch, dim, seqlen, device="cuda", generator=g, dtype=torch.bfloat16)
    if layout == "channel_last":
        x = x.transpose(1, 2).contiguous().transpose(1, 2)
    weight = torch.randn(dim, width, device="cuda", generator=g)
    bias = torch.randn(dim, device="cuda", generator=g)
    out = libssm.causal_conv1d(x, weight, bias, activation="silu")
    dout = torch.randn_like(x)
    grads = libssm.causal_conv1d_bwd(x, weight, dout, bias, activation="silu",
                                     needs=(True, False, False, False))
    last = slice(dim - 3, dim)
    cpu = lambda t: t[:, last].cpu().contiguous()  # noqa: E731
    want = libssm.causal_conv1d(cpu(x), weight[last].cpu(), bias[last].cpu(), activation="silu")
    want_dx = libssm.causal_conv1d_bwd(cpu(x), weight[last].cpu(), cpu(dout), bias[last].cpu(),
                                       activation="silu", needs=(True, False, False, False)).dx

    def rel(got, ref):
        got, ref = as_torch(got).double(), ref.double()
        return ((got - ref).norm() / ref.norm()).item()

    assert rel(out[:, last], want) < 1e-2
    assert rel(grads.dx[:, last], want_dx) < 1e-2
