"""The fused norm on a CUDA GPU (select with -m cuda; skipped without one): the CPU suite's rows
plus sizes on and beside every kernel path (hidden 1, 7, 4097, 16384/16385, 20000 and 65536;
rows 0, 1 and thousands; many small groups), every dtype and dtype mix, strided and misaligned
rows, against the float64 references and libssm's own CPU path. Outputs and gradient buffers
start NaN-filled, so anything left unwritten fails; dweight/dbias must be the same bits run to
run; the stream rules are checked by making the wrong stream give wrong answers."""
import pytest
import torch

import libssm
import libssm.torch as ssm_torch
from harness import DTYPE_IDS, DTYPES, capture_cuda_graph, fresh_leaves, poisoned_like
from norm_harness import (BASE, GATED, LAYER, ROWS, NormCApi, backward_input, c_forward_backward,
                          case_id, check_agree, check_backward, check_forward, only_view_written,
                          reference_backward, reference_forward, row_strided, run_backward,
                          run_forward, run_norm, storage_copy, to_cpu)
from references import assert_close, make_norm_cotangents, make_norm_inputs

pytestmark = pytest.mark.cuda
dtypes = pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
half_dtypes = pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=DTYPE_IDS.get)
# The weight's (and the bias's) dtypes the lean kernels compile in: float32, or x's.
weight_dtypes = pytest.mark.parametrize("weight", ["float32", "x"])


def weighted_inputs(case, dtype, weight, seed):
    """make_norm_inputs on the GPU with the weight and bias in float32 (weight "float32") or in
    x's dtype (weight "x")."""
    wdtype = torch.float32 if weight == "float32" else dtype
    return make_norm_inputs(case, dtype, seed, device="cuda",
                            dtypes={"weight": wdtype, "bias": wdtype})

# Sizes chosen against the kernels' plan (norm_plan.h): segments of 8-column slices held in
# registers up to a per-thread count and re-read beyond it, so hidden 1 and 7 (less than one
# slice), 4097 (one column past a power of two: a partial slice, no vector loads), 16384 and
# 16385 (either side of the largest register-resident row), 20000 and 65536 (re-read slices;
# 65536 is the limit); group sizes that are tiny (1, 8) or not multiples of 8 (241); rows from
# 1 to 8192, the latter spreading dweight/dbias over many blocks' partial sums. On sm_90 the
# lean kernels share segments past 8192 columns among the CTAs of a cluster (norm_fast_bwd.cuh):
# 8200 (three 256-thread CTAs, the last one a slice), 24584 (seven, LayerNorm's two sums), 40000
# (five 512-thread CTAs, 300 rows so each cluster walks many), 65536 (eight), 16384 with no rows
# (zero dweight), and gated groups of 16384 and 12288 columns (a cluster per group). The forward
# without a gate holds segments past one CTA's stage in registers on clusters (norm_held.cuh):
# 24584 (two 16-bit CTAs, the second short; four float32 ones), 40000 (five float32 CTAs; 16-bit
# rows without a residual take the plain forward's clusters, three CTAs of 8 slices a thread)
# and 65536 (four; eight); an RMSNorm of 16-bit rows beside a residual there in one plain CTA of
# up to 1024 threads: 24584 (3073 slices, the last lanes idle); at 32768 without a residual the
# plain forward's two CTAs of 4 slices a thread, every lane full. Shorter rows without a gate
# take one plain held CTA too (HELD_ROWS), in each shape held_plan (norm_cuda.cu) picks.
CLUSTER_ROWS = (
    BASE.replace(hidden=24584, lead=(37,), residual=True, prenorm=True),
    BASE.replace(hidden=32768, lead=(4,), bias=True),
    BASE.replace(hidden=8200, lead=(9,), residual=True, prenorm=True),
    LAYER.replace(hidden=24584, lead=(37,), residual=True, prenorm=True),
    BASE.replace(hidden=40000, lead=(300,), zero_centered_weight=True),
    BASE.replace(hidden=65536, lead=(5,), residual=True),
    LAYER.replace(hidden=16384, lead=(0,)),
    GATED.replace(hidden=32768, group_size=16384, lead=(6,)),
    BASE.replace(hidden=24576, z=True, group_size=12288, lead=(5,)),
)
# The plain held CTAs within one stage: 2 slices a thread in 512 threads, every lane full (8192
# columns; float32 LayerNorm too); 2056 columns, 257 slices, so one lane holds a second slice
# (16-bit, 256 threads) or a third (a float32 RMSNorm takes 4 a thread in 128 threads); 264, 33
# slices in 32 float32 threads (16-bit ones take the lean forward's two slices a lane); without a
# residual, 4 slices a thread at 8192 and 1032 columns (float32: 4 for the RMSNorm at 8192, 2 for
# the LayerNorm at 1032); 12296 columns beside a residual, 4 slices a thread in 512 16-bit threads,
# the last ones idle; 6152, 769 slices, for a 16-bit RMSNorm staged, or held at 2 slices a thread
# in 512 threads where the device's DRAM passes 4 TB/s (the call is a prenorm one: the generic
# API writes residual_out), zero-centred staged everywhere, and 4 slices a thread in 256 float32
# threads. Past one stage, 16-bit RMSNorms beside a residual take 3 slices a thread up to 3072
# slices: 20488 columns (2561 slices in 1024 threads, 513 lanes holding a third) and 24576 (every
# lane full; float32 rows take clusters).
HELD_ROWS = (
    LAYER.replace(hidden=8192, lead=(9,), residual=True, prenorm=True),
    BASE.replace(hidden=2056, lead=(5,), residual=True),
    BASE.replace(hidden=264, lead=(40,), residual=True, prenorm=True),
    BASE.replace(hidden=8192, lead=(7,)),
    LAYER.replace(hidden=1032, lead=(11,)),
    BASE.replace(hidden=12296, lead=(3,), residual=True, prenorm=True),
    BASE.replace(hidden=6152, lead=(5,), residual=True),
    BASE.replace(hidden=6152, lead=(5,), residual=True, zero_centered_weight=True),
    BASE.replace(hidden=20488, lead=(7,), residual=True, prenorm=True),
    BASE.replace(hidden=24576, lead=(3,), residual=True, zero_centered_weight=True),
)
# The plain forward (norm_plain.cuh) takes 16-bit rows without a residual or a gate
# (test_plain_and_gated_ring_rows), in whole warps: 4 slices a thread below 512 slices, at 1024
# columns (one warp) and 1040 (130 slices in 64 threads, two lanes holding a third), and for an
# RMSNorm without a bias at 2056 (257 slices in 96 threads, three warps, 65 lanes holding a third)
# and at 4096 on enough rows that the blocks fetch rows 4 MB ahead into L2; a LayerNorm from 512
# slices takes 8: a zero-centred one at 4096 columns (64 threads), 5120 (640 slices in 96 threads,
# 64 lanes holding 7, the others 6), 6144 (768 in 96, every lane 8: three warps of equal counts),
# 8192 (every lane full), 8240 (1030 slices in 160 threads, 70 lanes holding 7: the moments of
# unequal counts) and 16384. Past 2048 slices the CTAs of a cluster share an RMSNorm's row: two CTAs
# of 1280 slices, 8 a thread in 160 threads (20480), three of 1537, the last 1535, in 224 threads
# (193 lanes holding 7, the others 6; 36872), three and four CTAs of 2048, 4 a thread in 512 threads
# (49152 zero-centred, 65536 with a bias), with enough rows that the blocks fetch rows ahead into L2
# and the last blocks do not (past 4096 slices, where the DRAM passes 4 TB/s, CTAs of up to 1024 as
# a LayerNorm's: five of 922, the last 921, six and eight full ones); a LayerNorm's: two CTAs of
# 1152 slices, 8 a thread in 160 threads (18432), of 1280 (20480), of 1537 and 1536 in 224 threads
# (24584), and past 4096 slices CTAs of up to 1024 in 128 threads: five of 922, the last 921 (36872
# columns), six of 854, the last 851 (40968), eight full ones (65536, on three rows). Where the
# DRAM passes 4 TB/s the ring forward takes a LayerNorm's rows past 2048 slices and an RMSNorm's
# past 4096 instead (ring_fwd_plan, norm_cuda.cu), in the clusters ring_fwd_cluster gives them.
PLAIN_ROWS = (
    LAYER.replace(hidden=1024, lead=(3,)),
    LAYER.replace(hidden=1040, lead=(13,)),
    LAYER.replace(hidden=4096, zero_centered_weight=True, lead=(6,)),
    BASE.replace(hidden=2056, lead=(5,)),
    BASE.replace(hidden=4096, lead=(600,)),
    LAYER.replace(hidden=5120, lead=(7,)),
    LAYER.replace(hidden=6144, lead=(5,)),
    LAYER.replace(hidden=8192, lead=(4,)),
    LAYER.replace(hidden=8240, lead=(5,)),
    LAYER.replace(hidden=16384, lead=(3,)),
    LAYER.replace(hidden=24584, lead=(37,)),
    LAYER.replace(hidden=36872, lead=(37,)),
    LAYER.replace(hidden=65536, lead=(3,)),
    BASE.replace(hidden=20480, lead=(5,)),
    LAYER.replace(hidden=20480, lead=(300,)),
    LAYER.replace(hidden=18432, lead=(300,)),
    LAYER.replace(hidden=40968, lead=(300,)),
    BASE.replace(hidden=36872, lead=(300,)),
    BASE.replace(hidden=49152, zero_centered_weight=True, lead=(250,)),
    BASE.replace(hidden=65536, bias=True, lead=(300,)),
)
# The ring backward (norm_ring.cuh) takes 16-bit rows without a residual or a gate from 513
# slices (test_ring_rows), enough rows that each CTA (or cluster) walks its ring of three stages
# several times. One CTA a row is whole warps, 4 slices a thread: up to 1024 slices several CTAs
# an SM, 513 in 160 threads (33 lanes holding 4 slices, the others 3; RMSNorm with a bias: the
# mean terms and dbias), a LayerNorm of 640 in 160 (every lane 4) and of 1024 in 256; past that
# one CTA an SM, a LayerNorm at 16384 columns (512 threads, every lane full), 1537 slices in 416
# (289 lanes holding 4; zero-centred RMSNorm) and 1025 in 288 (161 holding 4). Past 2048 slices
# the CTAs of a cluster share a row, also whole warps: with a LayerNorm or a dbias CTAs of at most
# 512 slices while eight of them suffice, else of 1024, a LayerNorm of seven CTAs of 439 slices
# (24584 columns, 128 threads) and of five of 845 (33800 columns, 224 threads: seven warps, their
# sums padded to eight), an RMSNorm with a bias of eight of 1024 (65536); without them CTAs of up
# to 2048, a zero-centred RMSNorm of three of 1707 (40960 columns, 448 threads).
RING_ROWS = (
    BASE.replace(hidden=4104, bias=True, lead=(1700,)),
    LAYER.replace(hidden=5120, lead=(1300,)),
    LAYER.replace(hidden=8192, lead=(900,)),
    LAYER.replace(hidden=16384, lead=(1000,)),
    BASE.replace(hidden=12296, zero_centered_weight=True, lead=(601,)),
    BASE.replace(hidden=8200, bias=True, lead=(300,)),
    LAYER.replace(hidden=24584, lead=(400,)),
    LAYER.replace(hidden=33800, lead=(250,)),
    BASE.replace(hidden=40960, zero_centered_weight=True, lead=(250,)),
    BASE.replace(hidden=65536, bias=True, lead=(170,)),
)
# The ring forward (norm_ring.cuh) takes an RMSNorm of 16-bit x gated by z in one group
# without a residual from 513 slices (test_plain_and_gated_ring_rows), on clusters of CTAs of up
# to 1024 slices, enough rows that every cluster walks its ring of three stages more than once:
# one CTA at 5128 columns (641 slices in 256 threads, 129 lanes holding a third; the gate after the
# norm), the gate first at 8200 columns (two CTAs of 513 and 512 slices) and at 65536 (eight, a
# zero-centred weight), the gate after the norm at 24584 with a bias (seven CTAs of 440 slices,
# the last 433).
GATED_RING_ROWS = (
    BASE.replace(hidden=5128, z=True, lead=(400,)),
    BASE.replace(hidden=8200, z=True, norm_before_gate=False, lead=(300,)),
    BASE.replace(hidden=24584, z=True, bias=True, lead=(250,)),
    BASE.replace(hidden=65536, z=True, norm_before_gate=False, zero_centered_weight=True,
                 lead=(150,)),
)
# The ring forward takes 16-bit x beside a residual (its stream in x's dtype or float32) in
# one group without a gate from 4097 slices, a LayerNorm beside a float32 stream from 1281
# (test_residual_ring_rows), enough rows that every cluster walks its ring more than once: a
# LayerNorm at 12296 columns (two CTAs of 769 and 768 slices in 512 threads beside a float32
# stream: unequal counts), at 24584 (eight CTAs of 385 slices, the last 378, in 256 threads: from
# three CTAs up to 4096 slices a float32 stream takes eight), returning the stream at 40968 (six
# CTAs of 854 slices, the last 851, beside a stream of x's dtype; eight of 641, the last 634,
# beside a float32 one, which takes eight again past 5120 slices), an RMSNorm with a bias at
# 49152 (six full ones; eight of 768 beside a float32 stream), a LayerNorm at 65536 (eight)
# returning the stream.
RESIDUAL_RING_ROWS = (
    LAYER.replace(hidden=12296, residual=True, lead=(400,)),
    LAYER.replace(hidden=24584, residual=True, lead=(300,)),
    LAYER.replace(hidden=40968, residual=True, prenorm=True, lead=(200,)),
    BASE.replace(hidden=49152, residual=True, bias=True, lead=(200,)),
    LAYER.replace(hidden=65536, residual=True, prenorm=True, lead=(150,)),
)
# The lean forward (segments of up to 32 slices: one slice a lane, two rows a lane at once, blocks
# of 128 threads, a grid row a group): an odd row count, so the last lanes' second row is past
# the end (257 rows of 256 columns, a warp a row); 25 slices in 32 lanes, 7 idle (200 columns);
# four groups of 8 lanes (256 columns, groups of 64); one lane a row, 256 rows a block (8 columns).
# Two slices a lane for 16-bit rows without a gate (up to 64 slices): every lane full (512
# columns, 37 rows), 49 slices, so 17 lanes hold a second (a LayerNorm at 392 columns), and two
# groups of 64 slices (1024 columns); float32 rows there take the held forward. The norm alone at
# two and four slices a lane (below the plain forward's 128 slices): 49 slices on an odd row
# count, 64 (every lane two), 97 (lane 0 holding four, the others three), 127 with a zero-centred
# weight (lane 31 holding three) and two groups of 80; x returned as the stream without a residual
# (the residual kernel at two slices). At three slices a lane, where that leaves fewer lanes idle
# (lean_fwd_slices, norm_cuda.cu): 48 slices (16 lanes a segment, each holding three), 41 (lanes
# 0-8 holding a third), 96 (32 lanes of three) and two groups of 65 (lane 0 holding a third).
FAST_ROWS = (
    BASE.replace(hidden=256, lead=(257,), residual=True, prenorm=True),
    LAYER.replace(hidden=200, lead=(33,)),
    GATED.replace(hidden=256, group_size=64, lead=(129,)),
    BASE.replace(hidden=8, lead=(1001,), bias=True),
    BASE.replace(hidden=512, lead=(37,), residual=True, prenorm=True),
    LAYER.replace(hidden=392, lead=(9,), residual=True),
    BASE.replace(hidden=1024, group_size=512, lead=(5,), residual=True, prenorm=True),
    BASE.replace(hidden=392, lead=(37,)),
    LAYER.replace(hidden=512, lead=(9,)),
    LAYER.replace(hidden=776, lead=(11,)),
    BASE.replace(hidden=1016, lead=(5,), zero_centered_weight=True),
    LAYER.replace(hidden=1280, group_size=640, lead=(7,)),
    BASE.replace(hidden=392, lead=(9,), prenorm=True),
    BASE.replace(hidden=384, lead=(37,)),
    LAYER.replace(hidden=328, lead=(21,)),
    LAYER.replace(hidden=768, lead=(9,)),
    BASE.replace(hidden=1040, group_size=520, lead=(5,)),
    # The prenorm RMSNorm kernel in whole warps, lanes 25-31 idle, on rows that leave its last
    # group of four short; beside a bias, a zero-centred weight or none the residual kernel
    # takes the same call.
    BASE.replace(hidden=200, lead=(45,), residual=True, prenorm=True),
    BASE.replace(hidden=256, lead=(45,), residual=True, prenorm=True, bias=True),
    BASE.replace(hidden=256, lead=(45,), residual=True, prenorm=True, zero_centered_weight=True),
    BASE.replace(hidden=256, lead=(45,), residual=True, prenorm=True, weight=False),
    # The prenorm RMSNorm at four slices a lane, one row a lane: 125 slices (lanes 29-31 holding
    # three), 65 (lane 0 holding a third, the others two) and two groups of 128 (every lane four).
    BASE.replace(hidden=1000, lead=(37,), residual=True, prenorm=True),
    BASE.replace(hidden=520, lead=(19,), residual=True, prenorm=True),
    BASE.replace(hidden=2048, group_size=1024, lead=(7,), residual=True, prenorm=True),
    # Rows past its prefetch distance (kPrenormAheadBytes, 1 MB of x: 524 rows of 1000 16-bit
    # columns, 256 of two groups of 1024), so its first rows fetch the last ones into L2.
    BASE.replace(hidden=1000, lead=(600,), residual=True, prenorm=True),
    BASE.replace(hidden=2048, group_size=1024, lead=(300,), residual=True, prenorm=True),
)
# The staged forward's gated segments up to 128 slices (staged_plan, norm_cuda.cu), in blocks of
# 128 threads: two slices a thread where that leaves no lane idle, 64 slices (a warp a segment, on
# a row count that leaves the last block short) and two groups of 128 (two warps), gated after
# the norm, LayerNorm beside a residual; four elsewhere, 40 slices (16 threads, 6 idle), 97
# (lane 0 holding a fourth) and 121 (lanes 25-31 holding three). On a device of more than 4 TB/s
# of DRAM (spread_gated_pairs) the 64-slice row takes the lean forward at two slices a lane, the
# plain gated rows of 121, 125 (a LayerNorm without a bias: lanes 29-31 holding three) and 128
# slices in one group the lean forward at four slices a lane (lanes 25-31 holding three at 121),
# and the others four slices a thread.
STAGED_GATED_ROWS = (
    BASE.replace(hidden=512, z=True, norm_before_gate=False, lead=(77,)),
    LAYER.replace(hidden=2048, group_size=1024, z=True, residual=True, lead=(9,)),
    BASE.replace(hidden=1024, z=True, lead=(13,)),
    GATED.replace(hidden=320, group_size=0, lead=(21,)),
    GATED.replace(hidden=776, group_size=0, lead=(11,)),
    GATED.replace(hidden=968, group_size=0, residual=False, prenorm=False, lead=(37,)),
    LAYER.replace(hidden=1000, bias=False, z=True, norm_before_gate=False, lead=(9,)),
)
# The lean forward's gated rows past 32 slices (lean_fwd_slices, norm_cuda.cu), the gate first:
# two slices a lane at 56 slices (lanes 24-31 holding one) on an odd row count beside a residual;
# three at 41 (16 lanes, 0-8 holding a third) and at 95 (lane 31 holding two); a LayerNorm in two
# groups of 72 beside a residual. The gate after the norm: two slices a lane at 56 beside a
# residual, three at 41 (a LayerNorm with a bias) and at 95 beside a residual.
LEAN_GATED_ROWS = (
    GATED.replace(hidden=448, group_size=0, lead=(37,)),
    GATED.replace(hidden=328, group_size=0, residual=False, prenorm=False, lead=(21,)),
    BASE.replace(hidden=760, z=True, norm_before_gate=False, lead=(9,)),
    LAYER.replace(hidden=1152, group_size=576, z=True, norm_before_gate=False, residual=True,
                  lead=(7,)),
    GATED.replace(hidden=448, group_size=0, norm_before_gate=True, lead=(13,)),
    LAYER.replace(hidden=328, z=True, lead=(21,)),
    BASE.replace(hidden=760, z=True, residual=True, lead=(9,)),
)
AWKWARD_ROWS = (CLUSTER_ROWS + HELD_ROWS + PLAIN_ROWS + RING_ROWS + GATED_RING_ROWS +
                RESIDUAL_RING_ROWS + FAST_ROWS + STAGED_GATED_ROWS + LEAN_GATED_ROWS) + (
    GATED.replace(hidden=1, group_size=0, lead=(5000,)),
    LAYER.replace(hidden=7, residual=True, z=True, lead=(1000,)),
    GATED.replace(hidden=4097, group_size=241, lead=(33,)),
    LAYER.replace(hidden=4097, residual=True, prenorm=True, z=True, lead=(33,)),
    BASE.replace(hidden=16384, bias=True, lead=(7,)),
    LAYER.replace(hidden=16385, lead=(5,), residual=True),
    GATED.replace(hidden=20000, group_size=0, lead=(3,)),
    LAYER.replace(hidden=20000, z=True, norm_before_gate=False, lead=(2,)),
    BASE.replace(hidden=65536, lead=(3,), residual=True, z=True),
    LAYER.replace(hidden=65536, lead=(1,), residual=True, z=True, norm_before_gate=False),
    GATED.replace(hidden=65536, group_size=8192, lead=(2,)),
    GATED.replace(hidden=2048, group_size=8, lead=(96,)),
    GATED.replace(hidden=4096, group_size=128, kind="layer", bias=True, lead=(64,)),
    GATED.replace(hidden=1024, lead=(8192,), bias=True),
    LAYER.replace(hidden=768, lead=(4, 1025), residual=True),
    GATED.replace(lead=(1,), hidden=8192, group_size=0),
)
CUDA_ROWS = ROWS + AWKWARD_ROWS


def forward_on_gpu_and_cpu(case, inputs, **extra):
    """The forward through the generic API into a NaN-filled out=, against the references and
    against the library's CPU path on the same inputs. Returns the GPU NormForward."""
    out = poisoned_like(inputs["x"])
    fwd = run_forward(case, inputs, out=out, **extra)
    assert fwd.y is out and all(t is None or t.is_cuda for t in fwd)
    cpu_inputs = to_cpu(inputs)
    gpu = libssm.NormForward(*(None if t is None else t.cpu() for t in fwd))
    refs = check_forward(case, cpu_inputs, gpu, residual_dtype=extra.get("residual_dtype"))
    cpu = run_forward(case, cpu_inputs, **extra)
    check_agree({k: v for k, v in gpu._asdict().items() if k in refs}, cpu._asdict(), refs)
    return fwd


def forward_on_gpu_checked(case, inputs, **extra):
    """The forward through the generic API on the GPU against the float64 references run on CPU
    copies of the inputs; unlike forward_on_gpu_and_cpu, no out= and no library CPU path."""
    fwd = run_forward(case, inputs, **extra)
    check_forward(case, to_cpu(inputs),
                  libssm.NormForward(*(None if t is None else t.cpu() for t in fwd)),
                  residual_dtype=extra.get("residual_dtype"))


def backward_on_gpu_and_cpu(case, inputs, dy, dres, residual_dtype=None):
    """Forward and backward through the C entry points into NaN-filled buffers (dresidual
    float32 too), then the backward through the generic API; both against the references and
    against the library's CPU path."""
    fwd, s, grads = c_forward_backward(case, inputs, dy, dres, residual_dtype=residual_dtype,
                                       dresidual_dtype=torch.float32)
    torch.cuda.synchronize()
    cpu_inputs, s_cpu = to_cpu(inputs), s.cpu()
    dy_cpu, dres_cpu = dy.cpu(), None if dres is None else dres.cpu()
    gpu = libssm.NormGrads(*(None if g is None else g.cpu() for g in grads))
    refs = check_backward(case, s_cpu, cpu_inputs, dy_cpu, dres_cpu, gpu,
                          dresidual_dtype=torch.float32)
    api = run_backward(case, inputs, fwd, dy, dres)
    check_backward(case, s_cpu, cpu_inputs, dy_cpu, dres_cpu,
                   libssm.NormGrads(*(None if g is None else g.cpu() for g in api)), refs=refs)
    cpu_fwd = libssm.NormForward(*(None if t is None else t.cpu() for t in fwd))
    cpu = run_backward(case, cpu_inputs, cpu_fwd, dy_cpu, dres_cpu, residual_dtype=torch.float32
                       if s.dtype != torch.float32 else None)
    expected = cpu._asdict()
    if expected["dresidual"] is None:
        expected["dresidual"] = expected["dx"]
    check_agree(gpu._asdict(), expected, refs)
    return gpu


@pytest.mark.parametrize("case", CUDA_ROWS, ids=case_id)
@dtypes
def test_forward(case, dtype, seed):
    forward_on_gpu_and_cpu(case, make_norm_inputs(case, dtype, seed, device="cuda"))


@pytest.mark.parametrize("case", CUDA_ROWS, ids=case_id)
@dtypes
def test_backward(case, dtype, seed):
    inputs = make_norm_inputs(case, dtype, seed, device="cuda")
    dy, dres = make_norm_cotangents(case, dtype, seed, device="cuda")
    backward_on_gpu_and_cpu(case, inputs, dy, dres)


# The norm alone in whole-warp segments (norm_fwd_alone_kernel, norm_fast.cuh: a weight of float32
# or x's dtype, a bias of the weight's dtype with a LayerNorm only). One slice a lane: 256 columns
# on an odd row count (the last warps' second row past the end), 200 (lanes 25-31 idle) with a
# zero-centred weight, two groups of 136 (17 slices), LayerNorms with and without a bias. Two
# slices a lane: 64 slices, and 49 (lanes 17-31 holding one). Three: 96 slices, and two groups of
# 65 (lane 0 alone holding a third). Four: 127 slices with a zero-centred weight (lane 31 holding
# three), 97 (lane 0 alone holding four), 128. From two slices every row count is odd, so the last
# warps' second row lies past the end (from three slices the blocks are one warp, lean_fwd_block).
# Then the calls it leaves to norm_fwd_fast_kernel: an RMSNorm with a bias, and no weight.
ALONE_WARP_ROWS = (
    BASE.replace(hidden=256, lead=(257,)),
    BASE.replace(hidden=200, lead=(37,), zero_centered_weight=True),
    BASE.replace(hidden=272, group_size=136, lead=(19,)),
    LAYER.replace(hidden=256, lead=(129,)),
    LAYER.replace(hidden=256, bias=False, lead=(33,)),
    LAYER.replace(hidden=272, group_size=136, lead=(11,)),
    BASE.replace(hidden=512, lead=(37,)),
    LAYER.replace(hidden=392, lead=(9,)),
    LAYER.replace(hidden=768, lead=(7,)),
    BASE.replace(hidden=1040, group_size=520, lead=(5,)),
    BASE.replace(hidden=1016, lead=(5,), zero_centered_weight=True),
    LAYER.replace(hidden=776, bias=False, lead=(11,)),
    LAYER.replace(hidden=1024, lead=(13,)),
    BASE.replace(hidden=256, lead=(45,), bias=True),
    BASE.replace(hidden=256, lead=(45,), weight=False),
)


@pytest.mark.parametrize("case", ALONE_WARP_ROWS, ids=case_id)
@half_dtypes
@weight_dtypes
def test_alone_whole_warp_rows(case, dtype, weight, seed):
    forward_on_gpu_and_cpu(case, weighted_inputs(case, dtype, weight, seed))
    # Rows of twice the width apart, through a view.
    strided = weighted_inputs(case.replace(lead=(5,)), dtype, weight, seed)
    wide = torch.zeros(5, 2 * case.hidden, dtype=dtype, device="cuda")
    wide[:, :case.hidden] = strided["x"]
    strided["x"] = wide[:, :case.hidden]
    forward_on_gpu_and_cpu(case.replace(lead=(5,)), strided)


# 16-bit x beside a float32 stream in whole-warp segments (norm_fwd_stream_kernel, in halves of
# 4 columns 128 apart; at one slice a lane with idle lanes norm_fwd_fast_kernel): one slice a
# lane (256 columns on an odd row count, blocks of two warps for LayerNorm; 200, lanes 25-31
# idle, with a zero-centred weight), two (49 slices: slice 1's second half past the row in lanes
# 2-31), three (two groups of 65), four (127 slices); 64 slices with no residual (residual_out is
# x widened), 96, 128; odd row counts, so the last block's second row lies past the end.
STREAM_WARP_ROWS = (
    LAYER.replace(hidden=256, residual=True, prenorm=True, lead=(257,)),
    BASE.replace(hidden=200, residual=True, prenorm=True, zero_centered_weight=True, lead=(37,)),
    LAYER.replace(hidden=392, residual=True, lead=(9,)),
    LAYER.replace(hidden=1040, group_size=520, residual=True, prenorm=True, lead=(5,)),
    BASE.replace(hidden=1016, residual=True, prenorm=True, lead=(7,)),
    BASE.replace(hidden=512, prenorm=True, lead=(21,)),
    LAYER.replace(hidden=768, residual=True, prenorm=True, lead=(11,)),
    LAYER.replace(hidden=1024, residual=True, lead=(13,)),
)


@pytest.mark.parametrize("case", STREAM_WARP_ROWS, ids=case_id)
@half_dtypes
@weight_dtypes
def test_float32_stream_whole_warp_rows(case, dtype, weight, seed):
    wdtype = torch.float32 if weight == "float32" else dtype
    dtypes = {"weight": wdtype, "bias": wdtype, "residual": torch.float32}
    inputs = make_norm_inputs(case, dtype, seed, device="cuda", dtypes=dtypes)
    forward_on_gpu_and_cpu(case, inputs, residual_dtype=torch.float32)
    # x and the residual in rows of twice the width apart, through views.
    strided = make_norm_inputs(case.replace(lead=(5,)), dtype, seed, device="cuda", dtypes=dtypes)
    for name in ("x", "residual"):
        if strided[name] is not None:
            wide = torch.zeros(5, 2 * case.hidden, dtype=strided[name].dtype, device="cuda")
            wide[:, :case.hidden] = strided[name]
            strided[name] = wide[:, :case.hidden]
    forward_on_gpu_and_cpu(case.replace(lead=(5,)), strided, residual_dtype=torch.float32)


def float32_stream_layer_norm(hidden, rows, seed):
    """A prenorm LayerNorm of bf16 rows beside a float32 residual stream (float32 weight and
    bias), the call norm_fwd_stream_kernel takes, and its inputs on the GPU."""
    case = LAYER.replace(hidden=hidden, residual=True, prenorm=True, lead=(rows,))
    dtypes = {"weight": torch.float32, "bias": torch.float32, "residual": torch.float32}
    return case, make_norm_inputs(case, torch.bfloat16, seed, device="cuda", dtypes=dtypes)


# Rows whose offsets pass 32 bits: norm_fwd_stream_kernel computes them in 64-bit arithmetic there
# (offsets_fit_32, norm_plan.h), 32-bit elsewhere. x's three rows lie 2**30 + 256 elements apart
# (a 4 GiB allocation, untouched but for them), the last one past INT32_MAX.
@pytest.mark.parametrize("hidden", [256, 1024])
def test_float32_stream_offsets_past_32_bits(hidden, seed):
    case, inputs = float32_stream_layer_norm(hidden, 3, seed)
    stride = 2**30 + 256
    wide = torch.empty(2 * stride + hidden, dtype=torch.bfloat16, device="cuda")
    x = wide.as_strided((3, hidden), (stride, 1))
    x.copy_(inputs["x"])
    inputs["x"] = x
    forward_on_gpu_and_cpu(case, inputs, residual_dtype=torch.float32)


# x's rows stored last to first and handed over with a negative row stride (DLPack allows it for
# inputs; torch cannot make one): norm_fwd_stream_kernel then computes its offsets in 64 bits
# (offsets_fit_32, norm_plan.h), whose 32-bit arithmetic would wrap them.
@pytest.mark.parametrize("hidden", [256, 1024])
def test_float32_stream_negative_row_stride(hidden, seed):
    case, inputs = float32_stream_layer_norm(hidden, 5, seed)
    x = inputs["x"]
    stored = x.flip(0).contiguous()  # row r of x is row rows - 1 - r here
    api = NormCApi()
    dl_x = api.dltensor(x, data=stored[-1].data_ptr())
    api.ffi.cast("DLTensor *", dl_x).strides[0] = -hidden
    y, residual_out = poisoned_like(x), poisoned_like(inputs["residual"])
    mean = torch.full((case.rows,), float("nan"), device="cuda")
    rstd = mean.clone()
    dl = {n: api.dltensor(inputs[n]) for n in ("residual", "weight", "bias")}
    api.check(api.lib.ssm_norm_fwd(api.params(case), dl_x, dl["residual"], dl["weight"],
                                   dl["bias"], 0, api.dltensor(y), api.dltensor(residual_out),
                                   api.dltensor(mean), api.dltensor(rstd), api.stream_of(x)))
    torch.cuda.synchronize()
    fwd = libssm.NormForward(y.cpu(), residual_out.cpu(), mean.cpu(), rstd.cpu())
    check_forward(case, to_cpu(inputs), fwd, residual_dtype=torch.float32)


# The plain gated call (plain_gated_call, norm_plan.h: no residual, a weight of float32 or x's
# dtype, no bias, not zero-centred) takes lean kernels with those options compiled out: one slice a
# lane (200 columns), two (456: 57 slices, lanes 25-31 holding one), three (328: 41 slices in 16
# lanes, a LayerNorm without a bias; 760: 95), with either gate order.
PLAIN_GATED_ROWS = tuple(
    case.replace(z=True, norm_before_gate=before)
    for case in (BASE.replace(hidden=200, lead=(37,)), BASE.replace(hidden=456, lead=(21,)),
                 LAYER.replace(hidden=328, bias=False, lead=(13,)),
                 BASE.replace(hidden=760, lead=(9,)))
    for before in (False, True))


@pytest.mark.parametrize("case", PLAIN_GATED_ROWS, ids=case_id)
@half_dtypes
@weight_dtypes
def test_plain_gated_rows(case, dtype, weight, seed):
    forward_on_gpu_and_cpu(case, weighted_inputs(case, dtype, weight, seed))


# Where x, z and y are about the L2's bytes (from 0.9 to 1.75 times them) the plain gated call
# loads x and z without allocating them in L1, elsewhere through L1; past twice the L2, at two
# slices a lane up to 48 slices and, where the DRAM is not past 4 TB/s, at three, it fetches them
# into L2 rows ahead with fewer CTAs an SM (lean_fwd_fetch, norm_cuda.cu). Rows of 1.25 L2s and
# just past two (the smaller tests take the rest), at one slice a lane (256 columns), at two up
# to and beyond 48 slices (384, 448; groups of 384 in 768) and at three (760).
@pytest.mark.parametrize("l2s", [1.25, 2])
@pytest.mark.parametrize("before", [False, True])
@pytest.mark.parametrize("hidden,group_size", [(256, 0), (384, 0), (448, 0), (768, 384), (760, 0)])
def test_plain_gated_by_l2_share(l2s, before, hidden, group_size, seed):
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    rows = int(l2s * l2) // (3 * 2 * hidden) + 101
    case = BASE.replace(hidden=hidden, group_size=group_size, z=True, norm_before_gate=before,
                        lead=(rows,))
    inputs = make_norm_inputs(case, torch.bfloat16, seed, device="cuda",
                              dtypes={"weight": torch.float32})
    forward_on_gpu_checked(case, inputs)


@pytest.mark.parametrize("case", PLAIN_ROWS + GATED_RING_ROWS, ids=case_id)
@half_dtypes
@pytest.mark.parametrize("weight", ["float32", "bfloat16"])
def test_plain_and_gated_ring_rows(case, dtype, weight, seed):
    # The plain forward reads the weight and bias in float32 or in x's dtype (a bfloat16 weight
    # beside float16 x takes the held forward instead); the ring forward reads them in any.
    wdtype = getattr(torch, weight)
    inputs = make_norm_inputs(case, dtype, seed, device="cuda",
                              dtypes={"weight": wdtype, "bias": wdtype})
    forward_on_gpu_and_cpu(case, inputs)


@pytest.mark.parametrize("case", RESIDUAL_RING_ROWS, ids=case_id)
@half_dtypes
@pytest.mark.parametrize("stream", ["x", "float32"])
def test_residual_ring_rows(case, dtype, stream, seed):
    # The stream in x's dtype, or a float32 residual and stream beside 16-bit x.
    extra, dtypes = {}, None
    if stream == "float32":
        extra, dtypes = {"residual_dtype": torch.float32}, {"residual": torch.float32}
    inputs = make_norm_inputs(case, dtype, seed, device="cuda", dtypes=dtypes)
    forward_on_gpu_and_cpu(case, inputs, **extra)


# The ring forward's LayerNorm merges its CTAs' moments (norm_ring.cuh), and so do the plain
# forward's clusters (norm_plain.cuh), on rows whose variance a float32 sum of squares around a
# poorly chosen centre would lose: one element in 8192 far from the others, which are equal (the
# first of every CTA's share beside a float32 stream, eight ring CTAs of 1024 slices; of the
# first CTA's without a residual, five plain ones of 922, or two of 1537, or, where the DRAM passes
# 4 TB/s, the ring forward's CTAs), or every element far from zero. At column 0 the far element is
# its thread's first and its warp's lane 0's.
@pytest.mark.parametrize("case", (LAYER.replace(hidden=36872, lead=(300,)),
                                  LAYER.replace(hidden=24584, lead=(300,)),
                                  LAYER.replace(hidden=65536, residual=True, lead=(150,))),
                         ids=case_id)
@half_dtypes
@pytest.mark.parametrize("rows", ["spikes", "offset"])
def test_ring_layer_norm_moments(case, dtype, rows, seed):
    extra, dtypes = {}, None
    if case.residual:
        extra, dtypes = {"residual_dtype": torch.float32}, {"residual": torch.float32}
    inputs = make_norm_inputs(case, dtype, seed, device="cuda", dtypes=dtypes)
    x = inputs["x"]
    if rows == "spikes":
        x.fill_(0.25)
        x[..., ::8192] = 100.0
        if case.residual:
            inputs["residual"].zero_()
    else:
        x.add_(120.0)
    forward_on_gpu_and_cpu(case, inputs, **extra)


# Past 4 TB/s of DRAM the ring backward takes an RMSNorm without a dbias gated, z staged after dy,
# 4 slices a thread (ring_cluster, norm_cuda.cu): one CTA up to 768 slices, then CTAs of up to 512
# while eight suffice, then of up to 1024 in two stages. The gate after the norm from 513 slices
# (4104 columns: 160 threads, 33 lanes holding 4 slices), at 7176 (two CTAs of 449 and 448
# slices), 24592 (seven of 440, the last 434, in 128 threads), 40968 (six of 854 in two stages,
# the last 851) and 65536 (eight full ones of 1024, a zero-centred weight); the gate first from
# 513 slices: 4104 columns, 6144 (768 slices, every lane of 192 full), 16392 (five CTAs of 410,
# the last 409), 32768 (eight full ones of 512) and 49160 (seven of 878 in two stages, the last
# 877). On other devices these rows take the lean backward.
GATED_RING_BWD_ROWS = (
    BASE.replace(hidden=4104, z=True, lead=(300,)),
    BASE.replace(hidden=7176, z=True, lead=(300,)),
    BASE.replace(hidden=24592, z=True, lead=(250,)),
    BASE.replace(hidden=40968, z=True, lead=(120,)),
    BASE.replace(hidden=65536, z=True, zero_centered_weight=True, lead=(150,)),
    BASE.replace(hidden=4104, z=True, norm_before_gate=False, lead=(300,)),
    BASE.replace(hidden=6144, z=True, norm_before_gate=False, lead=(300,)),
    BASE.replace(hidden=16392, z=True, norm_before_gate=False, lead=(200,)),
    BASE.replace(hidden=32768, z=True, norm_before_gate=False, zero_centered_weight=True,
                 lead=(150,)),
    BASE.replace(hidden=49160, z=True, norm_before_gate=False, lead=(100,)),
)


@pytest.mark.parametrize("case", RING_ROWS + GATED_RING_BWD_ROWS, ids=case_id)
@half_dtypes
@weight_dtypes
def test_ring_rows(case, dtype, weight, seed):
    # The ring backward reads the weight in any dtype: float32, or x's.
    inputs = weighted_inputs(case, dtype, weight, seed)
    dy, dres = make_norm_cotangents(case, dtype, seed, device="cuda")
    backward_on_gpu_and_cpu(case, inputs, dy, dres)


def check_grads_asked(case, inputs, fwd, dy, dres, grads, dresidual_dtype=None):
    """The NormGrads of a backward that was not asked for dbias (or dz) against the float64
    references: dx, dresidual when asked, dweight, and dz where z is given."""
    s = backward_input(case, inputs, fwd.residual_out).cpu()
    refs = reference_backward(case, s, inputs, dy, dres)
    assert grads.dbias is None
    assert_close("dx", grads.dx.cpu(), *refs["dx"])
    if dresidual_dtype is not None:
        assert grads.dresidual.dtype == dresidual_dtype
        assert_close("dresidual", grads.dresidual.cpu(), *refs["dx"])
    assert_close("dweight", grads.dweight.cpu(), *refs["dweight"])
    if inputs["z"] is not None:
        assert_close("dz", grads.dz.cpu(), *refs["dz"])


# A bias whose gradient is not asked for leaves the gated rows to the ring backward (no kFull),
# where the gate after's dz takes the bias (y = (xhat w + b) silu(z)): three CTAs of 342 slices,
# the last 341, at 8200 columns.
@half_dtypes
def test_gated_ring_backward_without_dbias(dtype, seed):
    case = BASE.replace(hidden=8200, z=True, bias=True, lead=(300,))
    inputs = make_norm_inputs(case, dtype, seed, device="cuda")
    dy, _ = make_norm_cotangents(case, dtype, seed, device="cuda")
    fwd = run_forward(case, inputs)
    grads = run_backward(case, inputs, fwd, dy, None, needs=(True, False, True, False, True))
    check_grads_asked(case, inputs, fwd, dy, None, grads)


# Past 4 TB/s of DRAM the ring backward takes an RMSNorm without a dbias beside a residual stream
# of x's dtype up to 1024 slices, one CTA of 2 slices a thread, dresidual_out fetched into L2 as
# beside a float32 one (ring_cluster): the prenorm RMSNorm at 4608 columns (576 slices in 288
# threads) and zero-centred at 8192 (every lane of 512 full), an RMSNorm beside a residual without
# the prenorm output (no dresidual_out) at 5128 (641 slices in 352 threads, lane 320 holding
# one); dresidual asked for in x's dtype beside dx.
@pytest.mark.parametrize("case", (
    BASE.replace(hidden=4608, residual=True, prenorm=True, lead=(300,)),
    BASE.replace(hidden=8192, residual=True, prenorm=True, zero_centered_weight=True,
                 lead=(200,)),
    BASE.replace(hidden=5128, residual=True, lead=(200,))), ids=case_id)
@half_dtypes
def test_stream16_ring_backward(case, dtype, seed):
    inputs = make_norm_inputs(case, dtype, seed, device="cuda")
    dy, dres = make_norm_cotangents(case, dtype, seed, device="cuda")
    fwd = run_forward(case, inputs)
    grads = run_backward(case, inputs, fwd, dy, dres, needs=(True, True, True, False, False))
    check_grads_asked(case, inputs, fwd, dy, dres, grads, dresidual_dtype=dtype)


# Beside a float32 residual stream (Mamba's residual_in_fp32) the torch adapter asks the
# backward for dx in x's dtype and dresidual in float32 (the generic API's dx follows s): the
# lean backward (one CTA) up to 512 slices (4096 columns) for a LayerNorm past 4 TB/s of DRAM,
# 1024 (8192) otherwise, past that the ring backward, 2 slices a thread: one CTA up to 1024 slices
# (a LayerNorm at 5128 columns: 641 slices in 352 threads, lane 320 holding one; at 8192 every
# lane of 512 full), then clusters of CTAs of up to 1024 slices: 8200 columns (two CTAs of 513
# and 512 slices), 16384 (two full ones), 24584 without prenorm (no dresidual_out; four CTAs of
# 769 slices, the last 766; a bias and a zero-centred weight) and 65536 (eight), enough rows that
# every CTA walks its ring of three stages more than once.
STREAM_ROWS = (
    LAYER.replace(hidden=4096, residual=True, prenorm=True, lead=(64,)),
    LAYER.replace(hidden=5128, residual=True, prenorm=True, lead=(500,)),
    LAYER.replace(hidden=8192, residual=True, prenorm=True, lead=(400,)),
    LAYER.replace(hidden=8200, residual=True, prenorm=True, lead=(300,)),
    LAYER.replace(hidden=16384, residual=True, prenorm=True, lead=(400,)),
    BASE.replace(hidden=24584, residual=True, bias=True, zero_centered_weight=True, lead=(250,)),
    BASE.replace(hidden=65536, residual=True, prenorm=True, lead=(150,)),
)


@pytest.mark.parametrize("case", STREAM_ROWS, ids=case_id)
@half_dtypes
def test_float32_stream_backward(case, dtype, seed):
    inputs = make_norm_inputs(case, dtype, seed, device="cuda",
                              dtypes={"residual": torch.float32, "weight": torch.float32,
                                      "bias": torch.float32})
    x = fresh_leaves(inputs)
    fn = ssm_torch.layer_norm if case.kind == "layer" else ssm_torch.rms_norm
    result = fn(x["x"], x["weight"], x["bias"], x["residual"], eps=case.eps,
                zero_centered_weight=case.zero_centered_weight, prenorm=case.prenorm,
                residual_dtype=torch.float32)
    dy, dres = make_norm_cotangents(case, dtype, seed, device="cuda",
                                    dresidual_dtype=torch.float32)
    if case.prenorm:
        torch.autograd.backward(list(result), [dy, dres])
    else:
        result.backward(dy)
        dres = None
    # The s the backward saw: x + residual rounded once to float32, as the forward made it.
    s = inputs["x"].float() + inputs["residual"]
    refs = reference_backward(case, s, inputs, dy, dres)
    assert x["x"].grad.dtype == dtype and x["residual"].grad.dtype == torch.float32
    assert_close("x.grad", x["x"].grad, *refs["dx"])
    assert_close("residual.grad", x["residual"].grad, *refs["dx"])
    for name in ("weight", "bias"):
        if inputs[name] is not None:
            assert_close(name + ".grad", x[name].grad, *refs["d" + name])


@pytest.mark.parametrize("case", [BASE, GATED, LAYER.replace(residual=True, prenorm=True)],
                         ids=case_id)
@dtypes
def test_rms_norm_and_layer_norm(case, dtype, seed):
    inputs = make_norm_inputs(case, dtype, seed, device="cuda")
    result = run_norm(case, inputs)
    y, residual_out = result if case.prenorm else (result, None)
    refs = reference_forward(case, to_cpu(inputs))
    assert_close("y", y.cpu(), *refs["y"])
    if case.prenorm:
        assert_close("residual_out", residual_out.cpu(), *refs["residual_out"])


# Dtype mixes a model runs: weights kept in float32 beside half-precision activations, the
# residual stream in float32 beside bf16 x (arriving in either dtype), weights in the input
# dtype, and a y of its own dtype through the C entry point.
MIXES = {
    "bf16-x-fp32-weight": dict(dtype=torch.bfloat16, dtypes={"weight": torch.float32,
                                                             "bias": torch.float32}),
    "fp16-x-fp32-weight": dict(dtype=torch.float16, dtypes={"weight": torch.float32,
                                                            "bias": torch.float32}),
    "fp32-x-bf16-weight": dict(dtype=torch.float32, dtypes={"weight": torch.bfloat16,
                                                            "bias": torch.bfloat16}),
    "bf16-x-fp32-residual-stream": dict(dtype=torch.bfloat16,
                                        dtypes={"residual": torch.float32},
                                        residual_dtype=torch.float32),
    "fp16-x-fp32-residual-stream": dict(dtype=torch.float16,
                                        dtypes={"residual": torch.float32},
                                        residual_dtype=torch.float32),
    "bf16-x-bf16-residual-fp32-stream": dict(dtype=torch.bfloat16,
                                             residual_dtype=torch.float32),
    "fp16-x-fp16-residual-bf16-stream": dict(dtype=torch.float16,
                                             residual_dtype=torch.bfloat16),
    "fp16-z-beside-bf16-x": dict(dtype=torch.bfloat16, dtypes={"z": torch.float16}),
}


def _beside_residual(case, hidden, rows, **changes):
    return case.replace(hidden=hidden, residual=True, lead=(rows,), **changes)


# Beside a float32 stream the lean backward keeps one slice a thread up to 512 slices
# (bwd_one_slice, norm_plan.h): the rows up to 1000 columns, one slice a segment (8 columns, 128
# rows a CTA), two groups of 128 slices, and one segment a CTA from 129 slices (2048 columns in
# 256 threads, 385 slices in 512 with the last 127 threads idle, and 512 in 512); LayerNorm
# with dresidual_out fetches rows ahead into L2 at 385 and 161 slices (stream_ahead,
# norm_fast_bwd.cuh), where the rows outnumber two strides of its grid. The lean forward takes three
# slices a lane there at 41 slices (16 lanes a segment) and 65 (lane 0 holding a third).
@pytest.mark.parametrize("case", [GATED.replace(bias=True),
                                  _beside_residual(BASE, 8, 300, prenorm=True),
                                  _beside_residual(LAYER, 2048, 7, group_size=1024),
                                  _beside_residual(BASE, 200, 45, prenorm=True),
                                  _beside_residual(BASE, 512, 21, prenorm=True),
                                  _beside_residual(BASE, 1000, 11, prenorm=True),
                                  _beside_residual(LAYER, 392, 11, prenorm=True),
                                  _beside_residual(LAYER, 776, 13),
                                  _beside_residual(LAYER, 328, 19, prenorm=True),
                                  _beside_residual(BASE, 520, 9),
                                  _beside_residual(LAYER, 2048, 33, prenorm=True),
                                  _beside_residual(LAYER, 3080, 13),
                                  _beside_residual(LAYER, 3080, 400, prenorm=True),
                                  _beside_residual(LAYER, 1288, 600, prenorm=True),
                                  _beside_residual(BASE, 4096, 9, prenorm=True),
                                  _beside_residual(LAYER, 8192, 5, prenorm=True),
                                  _beside_residual(LAYER, 4097, 9, z=True),
                                  _beside_residual(BASE, 20000, 3, bias=True)], ids=case_id)
@pytest.mark.parametrize("mix", list(MIXES))
def test_dtype_mixes(mix, case, seed):
    m = MIXES[mix]
    inputs = make_norm_inputs(case, m["dtype"], seed, device="cuda", dtypes=m.get("dtypes"))
    residual_dtype = m.get("residual_dtype")
    extra = {} if residual_dtype is None else {"residual_dtype": residual_dtype}
    forward_on_gpu_and_cpu(case, inputs, **extra)
    dy, dres = make_norm_cotangents(case, m["dtype"], seed, device="cuda",
                                    dresidual_dtype=residual_dtype)
    backward_on_gpu_and_cpu(case, inputs, dy, dres, residual_dtype=residual_dtype)


def test_c_every_dtype_independent(seed):
    case = GATED.replace(bias=True, hidden=1000, group_size=200)
    dtypes = {"x": torch.bfloat16, "residual": torch.float32, "z": torch.float16,
              "weight": torch.bfloat16, "bias": torch.float32}
    inputs = make_norm_inputs(case, torch.float32, seed, device="cuda", dtypes=dtypes)
    dy, dres = make_norm_cotangents(case, torch.float16, seed, device="cuda",
                                    dresidual_dtype=torch.bfloat16)
    fwd, s, grads = c_forward_backward(case, inputs, dy, dres, y_dtype=torch.float32,
                                       residual_dtype=torch.float16,
                                       dresidual_dtype=torch.float32)
    torch.cuda.synchronize()
    cpu = to_cpu(inputs)
    refs = reference_forward(case, cpu)
    for name in ("y", "residual_out", "rstd"):
        assert_close(name, getattr(fwd, name).cpu(), *refs[name])
    check_backward(case, s.cpu(), cpu, dy.cpu(), dres.cpu(),
                   libssm.NormGrads(*(None if g is None else g.cpu() for g in grads)),
                   dresidual_dtype=torch.float32)


# ---------------------------------------------------------------------------------------------
# Layouts.


@pytest.mark.parametrize("case", [GATED, LAYER.replace(residual=True, z=True, lead=(2, 3, 4)),
                                  BASE.replace(hidden=4096, residual=True, lead=(17,)),
                                  LAYER.replace(hidden=2048, lead=(17,)),
                                  BASE.replace(hidden=20000, z=True, lead=(3,)),
                                  LAYER.replace(hidden=8200, lead=(40,))], ids=case_id)
@pytest.mark.parametrize("pad, offset", [(8, 8), (5, 3), (1, 1)],
                         ids=["aligned", "odd", "one"])
@dtypes
def test_strided_rows(case, pad, offset, dtype, seed):
    # Rows of every row-shaped input and output sit apart in larger buffers. "aligned" keeps
    # 16-byte alignment for every dtype; the others break it (the kernels must notice and not
    # use vector loads). Outputs are written through the same strides, gaps left alone.
    inputs = make_norm_inputs(case, dtype, seed, device="cuda")
    views = dict(inputs, **{n: row_strided(inputs[n], pad, offset)
                            for n in ("x", "residual", "z") if inputs[n] is not None})
    api = NormCApi()
    x = inputs["x"]
    y = row_strided(poisoned_like(x), pad, offset)
    residual_out = row_strided(poisoned_like(x), pad, offset) if case.residual else None
    before = {"y": storage_copy(y)}
    stats = torch.full((case.rows,) if case.ngroups == 1 else (case.rows, case.ngroups),
                       float("nan"), device="cuda")
    mean = stats.clone() if case.kind == "layer" else None
    api.forward(case, views, y, residual_out, mean, stats)
    torch.cuda.synchronize()
    assert only_view_written(y, before["y"])
    fwd = libssm.NormForward(y.cpu(), None if residual_out is None else residual_out.cpu(),
                             None if mean is None else mean.cpu(), stats.cpu())
    check_forward(case, to_cpu(inputs), fwd)
    dy, dres = make_norm_cotangents(case, dtype, seed, device="cuda")
    s = residual_out if case.residual else views["x"]
    grads = {"dx": row_strided(poisoned_like(s), pad, offset),
             "dweight": poisoned_like(inputs["weight"]),
             "dz": None if inputs["z"] is None else row_strided(poisoned_like(x), pad, offset)}
    api.backward(case, s, views, mean, stats, row_strided(dy, pad, offset),
                 None if dres is None else row_strided(dres, pad, offset), grads)
    torch.cuda.synchronize()
    got = libssm.NormGrads(grads["dx"].cpu(), None, grads["dweight"].cpu(), None,
                           None if grads["dz"] is None else grads["dz"].cpu())
    refs = reference_backward(case, s.cpu(), to_cpu(inputs), dy.cpu(),
                              None if dres is None else dres.cpu())
    for name, g in got._asdict().items():
        if g is not None:
            assert_close(name, g, *refs[name])


@pytest.mark.parametrize("case", [GATED.replace(lead=(0,), bias=True),
                                  LAYER.replace(lead=(0, 3), residual=True, z=True,
                                                hidden=4097)], ids=case_id)
def test_rows_zero(case, seed):
    inputs = make_norm_inputs(case, torch.float32, seed, device="cuda")
    fwd = run_forward(case, inputs)
    assert fwd.y.shape == inputs["x"].shape and fwd.y.is_cuda
    dy, dres = make_norm_cotangents(case, torch.float32, seed, device="cuda")
    _, _, grads = c_forward_backward(case, inputs, dy, dres)
    torch.cuda.synchronize()
    for name in ("dweight", "dbias"):
        g = getattr(grads, name)
        assert torch.equal(g.cpu(), torch.zeros(g.shape)), name


# ---------------------------------------------------------------------------------------------
# Determinism.


@pytest.mark.parametrize("case, dtype", [
    (GATED.replace(bias=True, hidden=1024, lead=(8192,)), torch.bfloat16),
    (LAYER.replace(hidden=4097, lead=(3000,), residual=True, z=True), torch.float32),
    (BASE.replace(hidden=20000, lead=(600,), bias=True), torch.float16),
    (LAYER.replace(hidden=32768, lead=(700,), residual=True), torch.bfloat16),
    (LAYER.replace(hidden=16384, lead=(700,)), torch.bfloat16),
    (GATED.replace(hidden=7, group_size=1, lead=(50000,), bias=True), torch.float32),
], ids=lambda v: case_id(v) if hasattr(v, "label") else DTYPE_IDS[v])
def test_weight_gradients_bitwise_deterministic(case, dtype, seed):
    # dweight and dbias are sums over rows in a fixed order: the same inputs give the same bits
    # on every run, with float32 weights beside low-precision x (the partial sums' dtype).
    inputs = make_norm_inputs(case, dtype, seed, device="cuda",
                              dtypes={"weight": torch.float32, "bias": torch.float32})
    dy, dres = make_norm_cotangents(case, dtype, seed, device="cuda")
    fwd = run_forward(case, inputs)
    first = run_backward(case, inputs, fwd, dy, dres)
    for _ in range(3):
        again = run_backward(case, inputs, fwd, dy, dres)
        assert torch.equal(again.dweight, first.dweight)
        if case.bias:
            assert torch.equal(again.dbias, first.dbias)
        assert torch.equal(again.dx, first.dx)
    torch.cuda.synchronize()
    refs = reference_backward(case, backward_input(case, to_cpu(inputs),
                                                   None if fwd.residual_out is None
                                                   else fwd.residual_out.cpu()),
                              to_cpu(inputs), dy.cpu(), None if dres is None else dres.cpu())
    assert_close("dweight", first.dweight.cpu(), *refs["dweight"])


# ---------------------------------------------------------------------------------------------
# Streams: make the wrong stream visibly wrong. A stream is kept busy with a long sleep, then
# the inputs are overwritten on it; work launched on any other stream would read the old values.

BUSY_CYCLES = 200_000_000  # ~0.1 s of GPU time


def _stream_case(seed):
    case = GATED.replace(bias=True, hidden=4096, group_size=1024, lead=(256,))
    old = make_norm_inputs(case, torch.float32, seed, device="cuda")
    new = make_norm_inputs(case, torch.float32, seed + 1, device="cuda")
    torch.cuda.synchronize()
    return case, old, new


def _overwrite(x, new):
    for n, t in new.items():
        if t is not None:
            x[n].copy_(t)


def test_runs_on_torch_current_stream(seed):
    case, x, new = _stream_case(seed)
    dy, dres = make_norm_cotangents(case, torch.float32, seed, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        torch.cuda._sleep(BUSY_CYCLES)
        _overwrite(x, new)
        fwd = run_forward(case, x)
        grads = run_backward(case, x, fwd, dy, dres)
    stream.synchronize()
    cpu = to_cpu(new)
    check_forward(case, cpu, libssm.NormForward(*(None if t is None else t.cpu() for t in fwd)))
    check_backward(case, fwd.residual_out.cpu(), cpu, dy.cpu(), dres.cpu(),
                   libssm.NormGrads(*(None if g is None else g.cpu() for g in grads)))


def test_runs_on_explicit_stream(seed):
    case, x, new = _stream_case(seed)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        torch.cuda._sleep(BUSY_CYCLES)
        _overwrite(x, new)
    out = poisoned_like(x["x"])
    stream.wait_stream(torch.cuda.current_stream())  # out's NaN fill precedes the op
    fwd = run_forward(case, x, out=out, stream=stream)
    stream.synchronize()
    check_forward(case, to_cpu(new), libssm.NormForward(*(None if t is None else t.cpu()
                                                          for t in fwd)))


def test_cuda_graph_capture_python_api(seed):
    # libssm.norm_fwd with a static out= captured in a CUDA graph; replays after new values are
    # copied into the static inputs give the new results.
    case = GATED.replace(bias=True, hidden=2048, group_size=512, lead=(64,))
    static = {k: None if v is None else v.clone()
              for k, v in make_norm_inputs(case, torch.float16, seed, device="cuda").items()}
    out = poisoned_like(static["x"])
    graph, fwd = capture_cuda_graph(lambda: run_forward(case, static, out=out), warmup=1)
    for i in range(2):
        inputs = make_norm_inputs(case, torch.float16, seed + 1 + i, device="cuda")
        _overwrite(static, inputs)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check_forward(case, to_cpu(inputs),
                      libssm.NormForward(*(None if t is None else t.cpu() for t in fwd)))


# ---------------------------------------------------------------------------------------------
# Extreme values and 64-bit offsets.

EXTREME_ROWS = {
    "zeros": lambda x: x * 0.0,
    "constant": lambda x: x * 0.0 + 3.0,
    # A common offset far above the spread: a one-pass variance E[x^2] - mean^2 in float32 loses
    # most of its digits to cancellation.
    "offset": lambda x: x + 300.0,
    "large": lambda x: x * 1e4,
}


# bfloat16 rows of 4096 and 16384 columns take the plain forward's one-round moments
# (segment_moments) and, at 16384, the ring backward.
@pytest.mark.parametrize("hidden, dtype", [(256, torch.float32), (20000, torch.float32),
                                           (4096, torch.bfloat16), (16384, torch.bfloat16)],
                         ids=["256", "20000", "4096-bf16", "16384-bf16"])
@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize("pattern", list(EXTREME_ROWS))
def test_extreme_rows(pattern, kind, hidden, dtype, seed):
    case = LAYER.replace(kind=kind, lead=(4,), hidden=hidden)
    inputs = make_norm_inputs(case, dtype, seed, device="cuda")
    inputs["x"] = EXTREME_ROWS[pattern](inputs["x"])
    fwd = run_forward(case, inputs)
    cpu = to_cpu(inputs)
    check_forward(case, cpu, libssm.NormForward(*(None if t is None else t.cpu() for t in fwd)))
    dy, _ = make_norm_cotangents(case, dtype, seed, device="cuda")
    grads = run_backward(case, inputs, fwd, dy, None)
    check_backward(case, cpu["x"], cpu, dy.cpu(), None,
                   libssm.NormGrads(*(None if g is None else g.cpu() for g in grads)))


# Where x and y together outgrow the L2, the norm alone's forwards fetch x into L2 4 MB of rows
# ahead of their own (kAloneAheadBytes, kPlainAheadBytes, norm_plan.h), so the last rows' fetches
# would fall past the end and must be skipped; the lean one loads x without allocating it in L1
# past the L2, or on a device whose DRAM passes 4 TB/s from 0.9 to 2.5 L2s (lean_fwd_fetch,
# norm_cuda.cu). Rows of 0.95 L2s, just past one and of three, at two slices a lane and two rows
# (512 columns), at three slices and one row (520), and in the plain forward's CTAs (1032 columns,
# 129 slices; 1536).
@pytest.mark.parametrize("l2s", [0.95, 1, 3])
@pytest.mark.parametrize("kind,hidden", [("rms", 512), ("layer", 520), ("rms", 1032),
                                         ("layer", 1536)])
def test_norm_alone_by_l2_share(l2s, kind, hidden, seed):
    rows = int(l2s * torch.cuda.get_device_properties(0).L2_cache_size) // (2 * 2 * hidden) + 1001
    case = (LAYER if kind == "layer" else BASE).replace(hidden=hidden, lead=(rows,))
    inputs = make_norm_inputs(case, torch.bfloat16, seed, device="cuda")
    forward_on_gpu_checked(case, inputs)


def prenorm_at_l2_share(l2s, hidden, dtype, seed, more_rows):
    """The prenorm RMSNorm (float32 weight) on rows whose x, residual, y and residual_out take `l2s`
    times the device's L2, and `more_rows` more, against the float64 references."""
    rows = int(l2s * torch.cuda.get_device_properties(0).L2_cache_size) // (4 * 2 * hidden)
    case = BASE.replace(hidden=hidden, residual=True, prenorm=True, lead=(rows + more_rows,))
    inputs = make_norm_inputs(case, dtype, seed, device="cuda", dtypes={"weight": torch.float32})
    forward_on_gpu_checked(case, inputs)


# Past the L2 (x, residual, y and residual_out together) on a device whose DRAM passes 4 TB/s, the
# prenorm RMSNorm fetches x and the residual 2 MB ahead (up to 48 slices) or holds fewer CTAs an SM
# as well (past 64), and between the two takes the plan of other devices past three L2s. On that
# device it loads them without allocating them in L1 from 0.78 L2s to 1.75 (up to 32 slices, which
# past that hold fewer CTAs an SM) or 2.25 (lean_fwd_fetch, norm_cuda.cu). Rows of 0.9 L2s, just
# past one and of 2.5: at one slice a lane (256 columns), at two with lanes idle (328: 41 slices),
# at 48 slices (384) and the first after (392), at the last before the cap (512) and the first with
# it (520: three slices, lane 0 holding a third), and at four slices with lanes idle (1000: 125).
@pytest.mark.parametrize("l2s", [0.9, 1, 2.5])
@pytest.mark.parametrize("hidden", [256, 328, 384, 392, 512, 520, 1000])
@half_dtypes
def test_prenorm_by_l2_share(l2s, hidden, dtype, seed):
    prenorm_at_l2_share(l2s, hidden, dtype, seed, 1001)


# The held forward of the prenorm RMSNorm (16-bit rows of 1025-8192 columns, 2 slices a thread) on
# a device whose DRAM passes 4 TB/s stores y and residual_out without L1 allocation up to 2.5 L2s
# (x, residual, y and residual_out together), and past 0.9 loads x and the residual so too and
# fetches into L2 the rows 1 MB of x ahead, whose last fetches would fall past the end and must be
# skipped; past 2.5 all three past 512 slices where at most 60% of the threads hold a slice
# (held_fwd_fetch, norm_cuda.cu). Up to 2.5 L2s its CTAs are whole warps, past that a power of
# two. Wider rows, 3 or 4 slices a thread, store without L1 and fetch 1 MB ahead past 2.5 L2s.
# Rows of 0.6, 1.2 and 3 L2s, at 1032 columns (129 slices: 65 threads busy of 96, or of 128, the
# second slice idle in all lanes but one), 4096, 4104 (513 slices, 257 threads busy of 288, or of
# 512: the first row the staged forward takes elsewhere), 8192, 12296 (4 slices a thread, 1537 in
# 512 threads) and 20488 (3 a thread, 2561 in 1024 threads).
@pytest.mark.parametrize("l2s", [0.6, 1.2, 3])
@pytest.mark.parametrize("hidden", [1032, 4096, 4104, 8192, 12296, 20488])
@half_dtypes
def test_held_prenorm_by_l2_share(l2s, hidden, dtype, seed):
    prenorm_at_l2_share(l2s, hidden, dtype, seed, 7)


# The held forward of 16-bit rows beside a float32 stream, on the same device, loads x and the
# residual and stores y without L1 allocation from 0.8 to 1.5 L2s of their bytes (held_fwd_fetch).
# Rows of 0.6 and 1.2 L2s at 2048 and 4096 columns.
@pytest.mark.parametrize("l2s", [0.6, 1.2])
@pytest.mark.parametrize("hidden", [2048, 4096])
def test_held_stream_by_l2_share(l2s, hidden, seed):
    rows = int(l2s * torch.cuda.get_device_properties(0).L2_cache_size) // (12 * hidden) + 7
    case, inputs = float32_stream_layer_norm(hidden, rows, seed)
    forward_on_gpu_checked(case, inputs, residual_dtype=torch.float32)


def test_offsets_past_int32():
    """rows * hidden > 2^31, so element offsets into x, y, residual_out, dy and dx leave int32
    range. The last rows, whose offsets are the largest, are checked against the CPU path run
    on those rows alone."""
    rows, hidden = 32800, 65536
    assert rows * hidden > 2**31
    g = torch.Generator(device="cuda").manual_seed(7)
    r = lambda *s: torch.randn(*s, device="cuda", generator=g).to(torch.bfloat16)  # noqa: E731
    x, residual, dy = r(rows, hidden), r(rows, hidden), r(rows, hidden)
    weight = torch.randn(hidden, device="cuda", generator=g)
    fwd = libssm.norm_fwd(x, weight, kind="rms", residual=residual, eps=1e-6)
    grads = libssm.norm_bwd(fwd.residual_out, dy, None, fwd.rstd, weight, kind="rms", eps=1e-6,
                            needs=(True, False, False, False, False))
    last = slice(rows - 3, rows)
    cpu = lambda t: t[last].cpu().contiguous()  # noqa: E731
    want = libssm.norm_fwd(cpu(x), weight.cpu(), kind="rms", residual=cpu(residual), eps=1e-6)
    want_dx = libssm.norm_bwd(want.residual_out, cpu(dy), None, want.rstd, weight.cpu(),
                              kind="rms", eps=1e-6, needs=(True, False, False, False, False)).dx

    def rel(got, ref):
        got, ref = got.cpu().double(), ref.double()
        return ((got - ref).norm() / ref.norm()).item()

    assert torch.equal(fwd.residual_out[last].cpu(), want.residual_out)
    assert rel(fwd.y[last], want.y) < 1e-2
    assert rel(fwd.rstd[last], want.rstd) < 1e-5
    assert rel(grads.dx[last], want_dx) < 1e-2
