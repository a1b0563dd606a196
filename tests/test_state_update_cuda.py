"""The selective-state decode step on a CUDA GPU (select with -m cuda; skipped without one): the
CPU suite's rows plus sizes on and beside every kernel path (16-byte state chunks with one or two
chunks a lane, partially idle lane groups, the element-by-element kernel for dstate 1, 2, 17,
for unaligned or dstate-strided states), realistic Mamba-1 and Mamba-2 decode sizes at batch 1
and 64, dtype mixes, against the float64 references and libssm's own CPU path. out starts
NaN-filled; untouched state slots must keep their bits; an index past batch_state gives NaN and
leaves the state alone; a state slot past 2^31 elements and more than 2^31 rows exercise 64-bit
indexing; the call runs on the caller's stream, gives the same bits every run, and replays in a
CUDA graph with new inputs."""
import pytest
import torch

import libssm
import libssm.torch as ssm_torch
from harness import DTYPE_IDS, DTYPES, capture_cuda_graph, poisoned_like
from references import (assert_close, assert_close_to, make_state_update_inputs,
                        state_update_numpy)
from state_update_harness import (FULL, MAMBA1, MAMBA1_FULL, MAMBA2_STEP, ROWS,
                                  StateUpdateCApi, case_id, check, references, run)

pytestmark = pytest.mark.cuda
dtypes = pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)

# Chosen against the launch plan (state_update_cuda.cu): a row's lanes are its 16-byte state
# chunks rounded up to a power of two, float32 taking two chunks a lane past dstate 128, and at
# least the rows of a tile (consecutive rows of a head: 8 for float32 states with A constant
# along dstate, 2 with two chunks a lane, else 4), blocks shrinking to one warp when few tiles
# fill the GPU. dstate 4 (float32: one chunk, the rest of a tile's lanes idle; 16-bit states:
# not a whole chunk, so element by element), 8 (two lanes' worth or one), 24 and 48 (lanes left
# idle), 132 (float32: 33 chunks, so 32 lanes of which one has a second chunk; 16-bit: element
# by element), 256 (the limit), 3 and 17 (element by element), headdim not a multiple of a
# tile's rows (3, 5, 9, 257), 32 heads a group.
KERNEL_ROWS = (
    FULL.replace(dstate=4),
    FULL.replace(dstate=8),
    FULL.replace(dstate=24, headdim=9),
    FULL.replace(dstate=48, indices="pad"),
    FULL.replace(dstate=132, headdim=3),
    FULL.replace(dstate=256, indices="perm"),
    MAMBA2_STEP.replace(dstate=256, headdim=3),
    FULL.replace(dstate=3),
    FULL.replace(dstate=17, indices="pad"),
    MAMBA1_FULL.replace(dstate=16, headdim=1000, batch=5),
    MAMBA1_FULL.replace(dstate=32, headdim=257, indices="pad", batch=7),
    FULL.replace(nheads=32, ngroups=1, headdim=64, dstate=64, batch=2),
    MAMBA2_STEP.replace(dstate=128, headdim=5, batch=3, indices="pad"),
)
# Decode as models run it: mamba_ssm's Mamba-1 (d_inner 2048, dstate 16) and Mamba-2 (24 heads
# of 64, dstate 128, stride-0 dt/dt_bias/A, ngroups 1 and 8) at batch 1 and 64.
MODEL_ROWS = (
    MAMBA1_FULL.replace(headdim=2048, dstate=16, batch=1),
    MAMBA1_FULL.replace(headdim=2048, dstate=16, batch=64),
    MAMBA2_STEP.replace(nheads=24, headdim=64, dstate=128, ngroups=1, batch=1),
    MAMBA2_STEP.replace(nheads=24, headdim=64, dstate=128, ngroups=8, batch=64),
    MAMBA2_STEP.replace(nheads=24, headdim=64, dstate=128, ngroups=1, batch=64,
                        indices="pad", index_dtype="int32"),
)
CUDA_ROWS = ROWS + KERNEL_ROWS + MODEL_ROWS


def gpu_and_cpu(case, inputs, **extra):
    """One call on the GPU (out NaN-poisoned, passed as out=) against the references, and
    against the library's CPU path on the same inputs. Returns the GPU out."""
    cpu_inputs = {k: None if v is None else v.cpu().clone() for k, v in inputs.items()}
    refs = references(case, inputs)
    before = inputs["state"].clone()
    out = poisoned_like(inputs["x"])
    assert run(case, inputs, out=out, **extra) is out
    torch.cuda.synchronize()
    check(case, inputs, before, out, refs)
    cpu_out = run(case, cpu_inputs)
    for name, got, want in (("out", out, cpu_out), ("state", inputs["state"],
                                                    cpu_inputs["state"])):
        ref64, plain = refs[name]
        assert_close_to(name + " vs CPU", got.cpu(), want, ref64, plain, got.dtype)
    return out


@pytest.mark.parametrize("case", CUDA_ROWS, ids=case_id)
@dtypes
def test_decode_step(case, dtype, seed):
    gpu_and_cpu(case, make_state_update_inputs(case, dtype, seed, device="cuda"))


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
@pytest.mark.parametrize("case", KERNEL_ROWS + MODEL_ROWS[1::2], ids=case_id)
def test_dtype_mixes(case, mix, seed):
    gpu_and_cpu(case, make_state_update_inputs(case, seed=seed, device="cuda", **MIXES[mix]))


def _offset_by(t, elements):
    """t's values in a view starting `elements` into a larger buffer: the same strides, the data
    pointer no longer 16-byte aligned."""
    flat = torch.empty(t.numel() + elements, dtype=t.dtype, device=t.device)
    view = flat[elements:].view(t.shape)
    view.copy_(t)
    return view


@pytest.mark.parametrize("which", ["state", "B", "C", "A", "all"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS.get)
def test_unaligned(which, dtype, seed):
    # A state 2 elements off 16 bytes takes the element-by-element kernel; B, C or A off by one
    # element are read element by element beside a chunked state.
    case = FULL.replace(dstate=32, indices="pad")
    inputs = make_state_update_inputs(case, dtype, seed, device="cuda")
    for name in (("state", "A", "B", "C") if which == "all" else (which,)):
        inputs[name] = _offset_by(inputs[name].contiguous(), 2 if name == "state" else 1)
    gpu_and_cpu(case, inputs)


@pytest.mark.parametrize("layout", ["dstate-strided", "transposed", "padded-rows"])
def test_strided_state(layout, seed):
    case = MAMBA2_STEP.replace(dstate=64, indices="pad", batch=5)
    inputs = make_state_update_inputs(case, torch.float32, seed, device="cuda")
    s = inputs["state"]
    if layout == "dstate-strided":
        big = torch.zeros(s.shape[:-1] + (2 * s.shape[-1],), device="cuda")
        inputs["state"] = big[..., ::2]
    elif layout == "transposed":
        inputs["state"] = s.transpose(1, 2).contiguous().transpose(1, 2)
    else:  # 16-byte aligned rows with a gap between them: still chunked
        big = torch.zeros(s.shape[:-1] + (s.shape[-1] + 4,), device="cuda")
        inputs["state"] = big[..., :s.shape[-1]]
    inputs["state"].copy_(s)
    gpu_and_cpu(case, inputs)


@pytest.mark.parametrize("case", [FULL.replace(indices="pad"), MAMBA1_FULL.replace(dstate=17),
                                  MAMBA2_STEP.replace(dstate=256, indices="perm")], ids=case_id)
@dtypes
def test_c_entry_point_poisoned_out(case, dtype, seed):
    inputs = make_state_update_inputs(case, dtype, seed, device="cuda")
    refs = references(case, inputs)
    before = inputs["state"].clone()
    out = poisoned_like(inputs["x"])
    StateUpdateCApi().update(case, inputs, out)
    torch.cuda.synchronize()
    check(case, inputs, before, out, refs)


@pytest.mark.parametrize("case", [FULL.replace(dstate=16), FULL.replace(dstate=17)],
                         ids=case_id)
def test_index_past_batch_state_gives_nan(case, seed):
    # The host cannot read the indices: the kernel leaves the state alone and flags the row.
    inputs = make_state_update_inputs(case.replace(indices="perm"), torch.float32, seed,
                                      device="cuda")
    idx = inputs["state_batch_indices"]
    idx[1] = inputs["state"].shape[0] + 5
    before = inputs["state"].clone()
    out = run(case, inputs)
    torch.cuda.synchronize()
    assert torch.isnan(out[1]).all() and torch.isfinite(out[0]).all()
    assert torch.isfinite(out[2]).all()
    untouched = [s for s in range(before.shape[0]) if s not in (int(idx[0]), int(idx[2]))]
    assert torch.equal(inputs["state"][untouched], before[untouched])


def test_same_bits_every_run(seed):
    case = MAMBA2_STEP.replace(nheads=8, headdim=64, dstate=128, batch=16, indices="pad")
    inputs = make_state_update_inputs(case, torch.bfloat16, seed, device="cuda",
                                      state_dtype=torch.float32)
    start = inputs["state"].clone()
    results = []
    for _ in range(3):
        inputs["state"].copy_(start)
        out = run(case, inputs)
        results.append((out.clone(), inputs["state"].clone()))
    for out, state in results[1:]:
        assert torch.equal(out, results[0][0]) and torch.equal(state, results[0][1])


def test_runs_on_the_current_stream(seed):
    # Inputs written on a side stream and used there at once: a launch on another stream would
    # race with the writes and, with the kernel queued behind a long one, read stale values.
    case = MAMBA2_STEP.replace(nheads=24, headdim=64, dstate=128, batch=8)
    inputs = make_state_update_inputs(case, torch.float32, seed, device="cuda")
    fresh = make_state_update_inputs(case, torch.float32, seed + 1, device="cuda")
    refs = references(case, {**fresh, "state": inputs["state"]})
    before = inputs["state"].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(20_000_000)
        inputs["x"].copy_(fresh["x"])
        out = ssm_torch.selective_state_update(
            inputs["state"], inputs["x"], *(fresh[n] for n in ("dt", "A", "B", "C", "D", "z",
                                                               "dt_bias")), True)
    side.synchronize()
    check(case, {**fresh, "state": inputs["state"]}, before, out, refs)


def test_cuda_graph_capture_and_replay(seed):
    # Two decode steps captured once; each replay after copying new values into the static
    # inputs must advance the state again (work outside the capture stream would replay as
    # nothing and leave the state where it was).
    case = MAMBA2_STEP.replace(nheads=8, headdim=64, dstate=128, batch=4, indices="pad")
    static = make_state_update_inputs(case, torch.bfloat16, seed, device="cuda",
                                      state_dtype=torch.float32)
    names = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias")
    start = static["state"].clone()

    def step():
        y = ssm_torch.selective_state_update(static["state"], *(static[n] for n in names),
                                             True, static["state_batch_indices"])
        return ssm_torch.selective_state_update(static["state"], y, *(static[n] for n in
                                                                      names[1:]),
                                                True, static["state_batch_indices"])

    graph, static_out = capture_cuda_graph(step)
    for replay in range(2):
        fresh = make_state_update_inputs(case, torch.bfloat16, seed + 1 + replay, device="cuda",
                                         state_dtype=torch.float32)
        for n in names:
            if static[n] is not None and fresh[n] is not None:
                # Broadcast operands (stride 0, as Mamba-2 passes dt, A and D) hold one element
                # along those axes: write through a view that has each element once.
                once = tuple(0 if st == 0 else slice(None) for st in static[n].stride())
                static[n][once].copy_(fresh[n][once])
        static["state"].copy_(start)
        static_out.fill_(float("nan"))
        graph.replay()
        eager = {k: None if v is None else v.clone() for k, v in static.items()}
        eager["state"] = start.clone()
        y = run(case, eager)
        want = run(case, {**eager, "x": y})
        torch.cuda.synchronize()
        torch.testing.assert_close(static_out, want, rtol=0, atol=0)
        torch.testing.assert_close(static["state"], eager["state"], rtol=0, atol=0)


def test_state_slot_past_2_to_the_31_elements(seed):
    # 2^27 + 8 slots of 16 bf16 values: the slot the index names starts 2^31 + 112 elements in.
    slots = (1 << 27) + 8
    case = MAMBA1.replace(batch=2, headdim=1, dstate=16, indices="perm")
    inputs = make_state_update_inputs(case, torch.bfloat16, seed, device="cuda")
    state = torch.zeros(slots, 1, 16, dtype=torch.bfloat16, device="cuda")
    state[-2:] = inputs["state"][:2]
    inputs["state"] = state
    inputs["state_batch_indices"] = torch.tensor([slots - 1, slots - 2], device="cuda")
    small = {**inputs, "state": state[-2:].clone(),
             "state_batch_indices": torch.tensor([1, 0], device="cuda")}
    refs = references(case, small)
    out = run(case, inputs)
    torch.cuda.synchronize()
    assert_close("out", out.cpu(), *refs["out"])
    assert_close("state", state[-2:].cpu(), *refs["state"])
    assert not state[:-2].any()


def test_more_than_2_to_the_31_rows(seed):
    # Mamba-1 with dim 2^31 + 64 and dstate 1 (the element-by-element kernel's 64-bit row
    # split); dt and A broadcast with stride 0 so only state, x and out take memory (12 GB).
    # Rows are independent, so the first and last thousand are checked against the reference.
    dim = (1 << 31) + 64
    g = torch.Generator(device="cuda").manual_seed(seed)
    state = torch.randn(1, dim, 1, generator=g, device="cuda", dtype=torch.float16)
    x = torch.randn(1, dim, generator=g, device="cuda", dtype=torch.float16)
    dt = torch.full((1, 1), 0.3, device="cuda").expand(1, dim)
    A = torch.full((1, 1), -0.7, device="cuda").expand(dim, 1)
    B = torch.full((1, 1), 0.5, device="cuda")
    C = torch.full((1, 1), 2.0, device="cuda")
    keep = {"head": slice(0, 1000), "tail": slice(dim - 1000, dim)}
    before = {k: (state[:, s].cpu(), x[:, s].cpu()) for k, s in keep.items()}
    out = libssm.selective_state_update(state, x, dt, A, B, C)
    torch.cuda.synchronize()
    for k, s in keep.items():
        s0, x0 = before[k]
        want_out, want_state = state_update_numpy(s0, x0, dt[:, s].cpu(), A[s].cpu(), B.cpu(),
                                                  C.cpu())
        torch.testing.assert_close(out[:, s].cpu().double(), torch.from_numpy(want_out),
                                   rtol=2e-3, atol=2e-3)
        torch.testing.assert_close(state[:, s].cpu().double(), torch.from_numpy(want_state),
                                   rtol=2e-3, atol=2e-3)


def test_cpu_inputs_are_refused_beside_cuda_state(seed):
    inputs = make_state_update_inputs(FULL, torch.float32, seed, device="cuda")
    inputs["x"] = inputs["x"].cpu()
    before = inputs["state"].clone()
    with pytest.raises(libssm.DeviceError, match="^x: is on cpu, but state is on cuda"):
        libssm.selective_state_update(inputs["state"], *(inputs[n] for n in (
            "x", "dt", "A", "B", "C")), out=poisoned_like(inputs["state"][:, :, :, 0]))
    assert torch.equal(inputs["state"], before)
