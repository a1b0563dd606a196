"""Odd-sized calls of every kernel family for compute-sanitizer on a GPU machine (not a
pytest module):

    compute-sanitizer --tool memcheck  python tests/sanitizer_cases.py
    compute-sanitizer --tool racecheck python tests/sanitizer_cases.py

Scan: the narrow and wide forward kernels, the checkpoint replay and the backward, with partial
blocks, partial chunks, padded states, groups and fixed B/C. Norm: forward and backward (every
gradient) on each kernel path: rows shorter than one 8-column slice, partial slices, rows held
in registers and rows re-read (hidden past 16384, up to 65536), tiny groups, gate on either side,
LayerNorm, many rows (dweight/dbias partial sums), unaligned row strides, and the lean kernels
with and without thread-block clusters. Selective-state decode step: both layouts, every state
dtype, grouped and tied operands, indices with padding rows, unaligned states
(STATE_UPDATE_CASES). Causal conv1d: each kernel family and path, forward, backward and the
decode step (CONV1D_CASES). Numerics are the pytest suites' job; this only has to drive every
kernel path once."""
import torch

import libssm
import libssm.torch as ssm_torch

CASES = [  # batch, dim, seqlen, dstate, dtype, B/C form
    (2, 33, 77, 17, torch.float32, "variable"),
    (1, 7, 1, 1, torch.bfloat16, "variable"),
    (2, 33, 45, 7, torch.float16, "grouped"),
    (1, 5, 19, 256, torch.float32, "fixed"),
    (1, 9, 23, 64, torch.bfloat16, "variable"),
    (8, 1024, 21, 16, torch.bfloat16, "variable"),  # enough channels for the wide forward
]


def bc(form, batch, dim, dstate, seqlen, dtype):
    if form == "fixed":
        return torch.randn(dim, dstate, device="cuda", dtype=dtype)
    if form == "grouped":
        return torch.randn(batch, 3, dstate, seqlen, device="cuda", dtype=dtype)
    return torch.randn(batch, dstate, seqlen, device="cuda", dtype=dtype)


def run_scan_cases():
    for batch, dim, seqlen, dstate, dtype, form in CASES:
        r = lambda *s, dt=dtype: torch.randn(*s, device="cuda", dtype=dt)
        u, delta, z = r(batch, dim, seqlen), r(batch, dim, seqlen), r(batch, dim, seqlen)
        A = -torch.rand(dim, dstate, device="cuda")
        B, C = (bc(form, batch, dim, dstate, seqlen, dtype) for _ in range(2))
        D, bias = r(dim, dt=torch.float32), r(dim, dt=torch.float32)
        h0 = r(batch, dim, dstate, dt=torch.float32)
        out, last = libssm.selective_scan(u, delta, A, B, C, D, z, bias, delta_softplus=True,
                                          initial_state=h0, return_last_state=True)
        grads = libssm.selective_scan_bwd(u, delta, A, B, C, torch.randn_like(out), D, z, bias,
                                          delta_softplus=True, initial_state=h0,
                                          dlast_state=torch.randn_like(last))
        torch.cuda.synchronize()
        finite = all(bool(torch.isfinite(g).all()) for g in grads if g is not None)
        print(f"{(batch, dim, seqlen, dstate)} {str(dtype)[6:]} {form}: ran, finite={finite}",
              flush=True)


# rows, hidden, group_size, kind, x dtype, weight dtype, z, norm_before_gate, pad, residual dtype
# (None: no residual).
# Aligned rows of one dtype, or 16-bit x beside a float32 residual stream without a gate, take the
# lean kernels: the forward one slice a thread up to 256 columns (two up to 512 for 16-bit rows
# beside a residual of their dtype, four up to 1024 for the prenorm RMSNorm of those); beyond,
# without a gate, held in registers in one plain CTA where held_plan (norm_cuda.cu) says so (the
# block marked below, and 8200 bf16: 4 slices a thread in 512 threads), staged otherwise (16384 half
# beside a float32 stream, 6152 bf16); once a CTA's stage would pass 110 KB, held in registers
# without a gate, in one plain CTA for an RMSNorm of 16-bit rows beside a stream of their dtype
# (24584 and 32768 below) and on clusters otherwise (24584 half: 2 CTAs, 40000 float32: 5, 65536
# bf16: 4, 32768 bf16 beside a float32 stream: 2) and staged on clusters with one (40000 bf16: 8,
# 14336 float32: 7); the backward on clusters past 8192 16-bit columns, or without a residual
# through a ring of shared-memory stages (one CTA a row up to 16384 columns, a cluster past that).
# Padded rows and other mixes take the general kernels.
NORM_CASES = [
    (7, 1, 0, "rms", torch.bfloat16, torch.float32, True, False, 0, torch.float32),
    (33, 7, 1, "layer", torch.float16, torch.float16, True, True, 0, torch.float32),
    (5, 4097, 241, "rms", torch.float32, torch.float32, True, False, 0, torch.float32),
    (3, 4097, 0, "layer", torch.bfloat16, torch.bfloat16, False, True, 1, torch.float32),
    (2, 16384, 0, "rms", torch.float16, torch.float32, False, True, 0, torch.float32),
    (2, 16385, 0, "layer", torch.float32, torch.float32, True, True, 0, torch.float32),
    (3, 20000, 0, "layer", torch.bfloat16, torch.float32, True, False, 3, torch.float32),
    (2, 65536, 0, "rms", torch.bfloat16, torch.float32, True, True, 0, torch.float32),
    (1, 65536, 8192, "layer", torch.float16, torch.float16, True, False, 0, torch.float32),
    (96, 2048, 8, "rms", torch.bfloat16, torch.float32, True, False, 0, torch.float32),
    (4096, 1024, 0, "rms", torch.bfloat16, torch.float32, False, True, 8, torch.float32),
    (1000, 768, 0, "layer", torch.float32, torch.float32, True, True, 5, torch.float32),
    (9, 4096, 0, "layer", torch.bfloat16, torch.float32, False, True, 0, torch.bfloat16),
    (5, 8200, 0, "rms", torch.bfloat16, torch.float32, False, True, 0, torch.bfloat16),
    (37, 24584, 0, "layer", torch.float16, torch.float16, False, True, 0, torch.float16),
    (300, 40000, 0, "rms", torch.float32, torch.float32, False, True, 0, torch.float32),
    (3, 65536, 0, "layer", torch.bfloat16, torch.bfloat16, False, True, 0, torch.bfloat16),
    (5, 32768, 0, "rms", torch.bfloat16, torch.float32, False, True, 0, torch.float32),
    # The held forward in one plain 1024-thread CTA: the last lanes idle, then every lane full.
    (5, 24584, 0, "rms", torch.bfloat16, torch.float32, False, True, 0, torch.bfloat16),
    (3, 32768, 0, "rms", torch.float16, torch.float16, False, True, 0, torch.float16),
    # The held forward in one plain CTA within a stage: 2 slices a thread, a 512-thread CTA
    # beside a float32 stream and a float32 LayerNorm, every lane full; 257 slices, one lane
    # holding a second (16-bit) or a third (float32 RMSNorm, 4 a thread in 128 threads); 4
    # slices a thread without a residual, and in 512 16-bit threads at 1537 slices; 65 slices
    # in 64 threads (the LayerNorm at 520 columns below).
    (9, 8192, 0, "layer", torch.bfloat16, torch.float32, False, True, 0, torch.float32),
    (3, 8192, 0, "layer", torch.float32, torch.float32, False, True, 0, torch.float32),
    (5, 2056, 0, "rms", torch.float16, torch.float32, False, True, 0, torch.float16),
    (7, 2056, 0, "rms", torch.float32, torch.float32, False, True, 0, torch.float32),
    (7, 8192, 0, "rms", torch.bfloat16, torch.float32, False, True, 0, None),
    (5, 8192, 0, "rms", torch.float32, torch.float32, False, True, 0, None),
    # The ring backward in whole warps, several CTAs an SM walking their rings: 641 slices in
    # 192 threads (65 lanes holding 4 slices, the others 3).
    (800, 5128, 0, "layer", torch.float16, torch.float16, False, True, 0, None),
    (3, 12296, 0, "layer", torch.bfloat16, torch.bfloat16, False, True, 0, torch.bfloat16),
    (33, 520, 0, "layer", torch.bfloat16, torch.float32, False, True, 0, torch.bfloat16),
    # Past 4 TB/s of DRAM the ring kernels of an RMSNorm without a bias: gated (the forward and
    # the backward in one CTA of 641 slices; the backward's gate after in a cluster of seven CTAs
    # at 24584, the gate first in one CTA of 768 slices and in a cluster of five at 16392, both in
    # two-stage clusters of six CTAs of 854 slices at 40968), the
    # backward beside a stream of x's dtype (one CTA of 576 slices in 288 threads) and the norm
    # alone's forward past 4096 slices (36872 columns).
    (400, 5128, 0, "rms", torch.bfloat16, torch.float32, True, True, 0, None),
    (60, 24584, 0, "rms", torch.float16, torch.float16, True, True, 0, None),
    (300, 6144, 0, "rms", torch.bfloat16, torch.float32, True, False, 0, None),
    (40, 16392, 0, "rms", torch.bfloat16, torch.bfloat16, True, False, 0, None),
    (9, 40968, 0, "rms", torch.bfloat16, torch.float32, True, False, 0, None),
    (7, 40968, 0, "rms", torch.float16, torch.float16, True, True, 0, None),
    (300, 4608, 0, "rms", torch.bfloat16, torch.float32, False, True, 0, torch.bfloat16),
    (40, 36872, 0, "rms", torch.bfloat16, torch.float32, False, True, 0, None),
    # The lean forward at two and four slices a lane: the norm alone at 49 slices on an odd row
    # count and at 97 on rows 8 columns apart; a LayerNorm beside a float32 stream at 125.
    (37, 392, 0, "rms", torch.bfloat16, torch.float32, False, True, 0, None),
    (11, 776, 0, "layer", torch.float16, torch.float16, False, True, 8, None),
    (9, 1000, 0, "layer", torch.bfloat16, torch.float32, False, True, 0, torch.float32),
    # Gated rows with the gate first there: two slices a lane at 56 slices, three at 41 beside a
    # residual of x's dtype (16 lanes, 0-8 holding a third) and at 95 (lane 31 holding two).
    (37, 448, 0, "rms", torch.bfloat16, torch.float32, True, False, 0, None),
    (21, 328, 0, "layer", torch.float16, torch.float16, True, False, 0, torch.float16),
    (9, 760, 0, "rms", torch.bfloat16, torch.bfloat16, True, False, 0, None),
    # The same with the gate after the norm: two slices a lane at 56, three at 95; without a
    # residual or a bias (the plain gated call's kernels) at one slice a lane and at three (41).
    (13, 448, 0, "rms", torch.bfloat16, torch.float32, True, True, 0, torch.bfloat16),
    (9, 760, 0, "layer", torch.float16, torch.float16, True, True, 0, None),
    (15, 200, 0, "rms", torch.float16, torch.float32, True, True, 0, None),
    (11, 328, 0, "rms", torch.bfloat16, torch.bfloat16, True, True, 0, None),
    # The plain gated call at four slices a lane past 4 TB/s of DRAM, its weight fetched before x
    # and z: the gate first at 113 slices (lanes 17-31 holding three), the gate after at 128.
    (13, 904, 0, "rms", torch.bfloat16, torch.float32, True, False, 0, None),
    (9, 1024, 0, "rms", torch.float16, torch.float16, True, True, 0, None),
    # The plain gated call past twice the L2 (x, z and y beyond twice 60 MB) fetches x and z
    # ahead into L2 at two slices a lane (40 slices), and at three (95) holds fewer CTAs an SM
    # where the DRAM is not past 4 TB/s.
    (65001, 320, 0, "rms", torch.bfloat16, torch.float32, True, False, 0, None),
    (27001, 760, 0, "rms", torch.bfloat16, torch.float32, True, True, 0, None),
    # The prenorm RMSNorm past the L2 (x, residual, y and residual_out beyond 60 MB), which past
    # 4 TB/s of DRAM fetches x and the residual 2 MB ahead where it loads them without
    # allocating them in L1 (up to 48 slices) or holds fewer CTAs an SM (past 64): one slice a
    # lane, two at 41 slices (lanes 9-31 holding one) and at 57 (between the two: 1 MB ahead,
    # allocated), three at 65 (lane 0 holding a third) and four at 125 (lanes 29-31 holding
    # three).
    (31001, 256, 0, "rms", torch.bfloat16, torch.float32, False, False, 0, torch.bfloat16),
    (24001, 328, 0, "rms", torch.float16, torch.float16, False, False, 0, torch.float16),
    (17501, 456, 0, "rms", torch.float16, torch.float32, False, False, 0, torch.float16),
    (15601, 520, 0, "rms", torch.bfloat16, torch.bfloat16, False, False, 0, torch.bfloat16),
    (8101, 1000, 0, "rms", torch.bfloat16, torch.float32, False, False, 0, torch.bfloat16),
    # The prenorm RMSNorm forward: 25 slices in a warp with a float32 weight, the last group of
    # four rows short; two slices a lane; four (125 slices, lanes 29-31 holding three; 65, lane 0
    # holding a third; two groups of 128); float32 rows; and the same call beside a float32
    # stream, which the residual kernel takes.
    (45, 200, 0, "rms", torch.bfloat16, torch.float32, False, True, 0, torch.bfloat16),
    (21, 512, 0, "rms", torch.float16, torch.float16, False, True, 0, torch.float16),
    (37, 1000, 0, "rms", torch.bfloat16, torch.float32, False, True, 0, torch.bfloat16),
    (19, 520, 0, "rms", torch.bfloat16, torch.bfloat16, False, True, 0, torch.bfloat16),
    (7, 2048, 1024, "rms", torch.float16, torch.float16, False, True, 0, torch.float16),
    (13, 256, 0, "rms", torch.float32, torch.float32, False, True, 0, torch.float32),
    (19, 256, 0, "rms", torch.bfloat16, torch.float32, False, True, 0, torch.float32),
    # The prenorm RMSNorm on rows past its prefetch distance (524 rows of 1000 bf16 columns; 256
    # of two fp16 groups of 1024 on rows 2056 apart), its first rows fetching the last into L2.
    (600, 1000, 0, "rms", torch.bfloat16, torch.float32, False, True, 0, torch.bfloat16),
    (300, 2048, 1024, "rms", torch.float16, torch.float16, False, True, 8, torch.float16),
    # The plain forward (16-bit rows without a residual), in whole warps: 4 slices a thread, one
    # warp a row, 129 slices in 64 threads (one lane holding a third), an RMSNorm in 512 threads
    # every lane full (and in 128 on rows that fetch rows ahead); a LayerNorm's 8 slices a thread,
    # 1030 slices in 160 threads (five warps, 70 lanes holding 7), 768 in 96 (three warps, every
    # lane 8). Past 2048 slices, clusters: an RMSNorm of two CTAs of 1281 and 1280 in 192 threads, 8
    # slices a thread, and of three of 1537 and 1535 in 224 on rows that fetch rows ahead into L2; a
    # LayerNorm's of 1537 and 1536 in 224, and of 1280 in 160 on rows that fetch rows ahead.
    (4, 1024, 0, "layer", torch.bfloat16, torch.bfloat16, False, True, 0, None),
    (5, 1032, 0, "layer", torch.bfloat16, torch.float32, False, True, 0, None),
    (5, 6144, 0, "layer", torch.bfloat16, torch.float32, False, True, 0, None),
    (3, 16384, 0, "rms", torch.float16, torch.float16, False, True, 0, None),
    (600, 4096, 0, "rms", torch.bfloat16, torch.float32, False, True, 0, None),
    (5, 8240, 0, "layer", torch.bfloat16, torch.float32, False, True, 0, None),
    (37, 24584, 0, "layer", torch.bfloat16, torch.float32, False, True, 0, None),
    (7, 20488, 0, "rms", torch.float16, torch.float16, False, True, 0, None),
    (60, 36872, 0, "rms", torch.bfloat16, torch.float32, False, True, 0, None),
    (300, 20480, 0, "layer", torch.float16, torch.float32, False, True, 0, None),
    # Past 4096 slices a LayerNorm's CTAs of up to 1024: five of 922, the last 921, and six of
    # 854, the last 851, in 128 threads, on rows that fetch rows ahead into L2.
    (37, 36872, 0, "layer", torch.bfloat16, torch.float32, False, True, 0, None),
    (200, 40968, 0, "layer", torch.bfloat16, torch.float32, False, True, 0, None),
    # The ring backward (16-bit rows without a residual, from 1025 slices): a LayerNorm at 1537
    # slices (the last lanes' fourth slice idle), an RMSNorm at 1025, and past 2048 slices on
    # clusters a LayerNorm of seven CTAs of 439 slices in 128 threads (and of six of 854 in 224,
    # seven warps, the 40968 columns above), enough rows that every CTA walks its ring of stages
    # more than once.
    (600, 12296, 0, "layer", torch.bfloat16, torch.float32, False, True, 0, None),
    (301, 8200, 0, "rms", torch.float16, torch.float16, False, True, 0, None),
    (300, 24584, 0, "layer", torch.float16, torch.float32, False, True, 0, None),
    # The ring forward: an RMSNorm of 16-bit rows gated in one group from 513 slices, the
    # gate first on two CTAs of 513 and 512 slices, after the norm on seven of 440, the last 433;
    # a LayerNorm beside a residual from 4097 slices (its stream float32 on eight CTAs of 641
    # slices, the last 634, past 5120 slices; bf16 on six of 854, the last 851), and beside a
    # float32 stream from 1281 on two of 769 and 768 and on eight of 385, the last 378 (from
    # three CTAs up to 4096 slices); enough rows that every cluster walks its ring of stages more
    # than once.
    (300, 8200, 0, "rms", torch.bfloat16, torch.float32, True, False, 0, None),
    (250, 24584, 0, "rms", torch.float16, torch.float16, True, True, 0, None),
    (200, 40968, 0, "layer", torch.bfloat16, torch.float32, False, True, 0, torch.float32),
    (200, 40968, 0, "layer", torch.bfloat16, torch.float32, False, True, 0, torch.bfloat16),
    (300, 12296, 0, "layer", torch.bfloat16, torch.float32, False, True, 0, torch.float32),
    (300, 24584, 0, "layer", torch.float16, torch.float32, False, True, 0, torch.float32),
    # An RMSNorm of 16-bit rows beside their dtype, 769 slices: the staged forward without a gate,
    # or past 4 TB/s of DRAM the held one at 2 slices a thread in 512 threads.
    (5, 6152, 0, "rms", torch.bfloat16, torch.float32, False, True, 0, torch.bfloat16),
    # The lean forward: two rows a lane, the second past the end (33 rows), 25 slices in 32
    # lanes; 7 rows of one warp each; float32 rows with a gate in groups of 8 lanes.
    (33, 200, 0, "layer", torch.bfloat16, torch.bfloat16, False, True, 0, torch.float32),
    (7, 256, 0, "rms", torch.float16, torch.float32, False, True, 0, None),
    (5, 256, 64, "rms", torch.float32, torch.float32, True, False, 0, torch.float32),
    # Two slices a lane beside a residual of x's dtype: 49 slices (17 lanes holding a second), an
    # odd row count, two rows a lane (a LayerNorm) and one (the prenorm kernel's RMSNorm); two
    # groups of 64 slices.
    (37, 392, 0, "layer", torch.bfloat16, torch.bfloat16, False, True, 0, torch.bfloat16),
    (37, 392, 0, "rms", torch.bfloat16, torch.float32, False, False, 0, torch.bfloat16),
    (9, 1024, 512, "rms", torch.float16, torch.float32, False, True, 0, torch.float16),
    # The staged forward with a gate on groups of 33 slices (16 threads a segment).
    (9, 2112, 264, "rms", torch.bfloat16, torch.float32, True, False, 0, torch.bfloat16),
    # The staged forward with a gate: one CTA a segment, a cluster of 8, one of 7 (float32).
    (5, 4104, 0, "rms", torch.bfloat16, torch.float32, True, False, 0, torch.bfloat16),
    (3, 40000, 0, "layer", torch.bfloat16, torch.float32, True, True, 0, torch.bfloat16),
    (7, 14336, 0, "layer", torch.float32, torch.float32, True, False, 0, torch.float32),
    # The staged forward's gated segments up to 128 slices, two slices a thread (64 slices on a
    # row count that leaves the last block short; 128 slices; groups of 128) and four (97
    # slices). Past 4 TB/s of DRAM (spread_gated_pairs) 64 slices take the lean forward, 128 in
    # one group (and 121: lanes 25-31 holding three) the lean forward at four slices a lane, and
    # 128 in groups four slices a thread.
    (77, 512, 0, "rms", torch.bfloat16, torch.float32, True, False, 0, None),
    (21, 512, 0, "rms", torch.float16, torch.float16, True, True, 0, None),
    (13, 1024, 0, "rms", torch.bfloat16, torch.float32, True, False, 0, None),
    (9, 2048, 1024, "layer", torch.float16, torch.float16, True, True, 0, torch.float16),
    (5, 8192, 1024, "rms", torch.bfloat16, torch.float32, True, False, 0, None),
    (11, 776, 0, "rms", torch.bfloat16, torch.bfloat16, True, True, 0, torch.bfloat16),
    (37, 968, 0, "rms", torch.float16, torch.float16, True, False, 0, None),
    # The lean forward's three slices a lane for the norm alone: 41 slices in 16 lanes, lanes 9-15
    # idle for the third; two groups of 65 in 32 lanes, lane 0 alone holding a third.
    (37, 328, 0, "layer", torch.bfloat16, torch.float32, False, False, 0, None),
    (21, 1040, 520, "rms", torch.float16, torch.float32, False, False, 0, None),
    # The norm alone in whole-warp segments (norm_fwd_alone_kernel): at one slice a lane 32 slices
    # on an odd row count, 25 (lanes 25-31 idle) with a weight of x's dtype, two groups of 17, and
    # rows past the L2 (x fetched ahead and not allocated in L1); at two 49 slices (lanes 17-31
    # holding one), at three two groups of 65, at four 97 (lane 0 alone holding four) and 128.
    (257, 256, 0, "rms", torch.bfloat16, torch.float32, False, False, 0, None),
    (37, 200, 0, "layer", torch.float16, torch.float16, False, False, 0, None),
    (19, 272, 136, "layer", torch.bfloat16, torch.float32, False, False, 0, None),
    (131073, 256, 0, "rms", torch.float16, torch.float32, False, False, 0, None),
    (37, 392, 0, "layer", torch.bfloat16, torch.float32, False, False, 0, None),
    (11, 1040, 520, "rms", torch.float16, torch.float16, False, False, 0, None),
    (9, 776, 0, "layer", torch.bfloat16, torch.bfloat16, False, False, 0, None),
    (13, 1024, 0, "layer", torch.bfloat16, torch.float32, False, False, 0, None),
]


def run_norm_cases():
    for rows, hidden, group, kind, dtype, wdtype, gated, before, pad, rdtype in NORM_CASES:
        def rows_of(dt=dtype):
            # pad > 0: rows sit hidden + pad apart, so neither rows nor vectors line up.
            return torch.randn(rows, hidden + pad, device="cuda", dtype=dt)[:, :hidden]
        x, dy, dres = rows_of(), rows_of(), rows_of()
        residual = None if rdtype is None else rows_of(rdtype)
        z = rows_of() if gated else None
        weight = torch.randn(hidden, device="cuda", dtype=wdtype)
        bias = torch.randn(hidden, device="cuda", dtype=wdtype) if kind == "layer" else None
        options = dict(kind=kind, eps=1e-5, group_size=group or None, norm_before_gate=before)
        fwd = libssm.norm_fwd(x, weight, bias, residual=residual, z=z, **options)
        s = x if residual is None else fwd.residual_out
        grads = libssm.norm_bwd(s, dy, fwd.mean, fwd.rstd, weight, bias, z=z,
                                dresidual_out=None if residual is None else dres,
                                residual_dtype=dtype, **options)
        torch.cuda.synchronize()
        outputs = [t for t in tuple(fwd) + tuple(grads) if t is not None]
        finite = all(bool(torch.isfinite(t).all()) for t in outputs)
        print(f"norm {(rows, hidden, group)} {kind} {str(dtype)[6:]}/{str(wdtype)[6:]} "
              f"gate={gated}/{before} pad={pad}: ran, finite={finite}", flush=True)
    run_norm_stream_cases()


# rows, hidden, kind, x dtype, prenorm[, with a bias: True if left out]: the float32 residual stream
# (Mamba's residual_in_fp32) through the torch adapter, whose backward writes dx in x's dtype and
# dresidual in float32 (the generic API's dx follows s): the lean backward at 4096 columns, the ring
# backward past that (a LayerNorm's from 4104 past 4 TB/s of DRAM), one CTA up to 8192 columns (641
# slices in 352 threads, the last lanes idle; 1024 in 512), clusters past it (two CTAs of 513 and
# 512 slices; four without dresidual_out), with enough rows that every CTA walks its ring of stages
# more than once.
NORM_STREAM_CASES = [
    (33, 4096, "layer", torch.bfloat16, True),
    (500, 5128, "layer", torch.bfloat16, True),
    (200, 8192, "layer", torch.float16, True),
    # The lean backward's one slice a thread (up to 512 slices): 49 slices in 64 threads, two
    # rows a CTA; 128 in 128; one slice a segment, 128 rows a CTA.
    (37, 392, "layer", torch.bfloat16, True),
    (9, 1024, "rms", torch.float16, False),
    (300, 8, "layer", torch.bfloat16, True),
    # Past 128 slices, one segment a CTA: 257 slices in 512 threads, 385 in 512, 512 in 512.
    (7, 2056, "layer", torch.bfloat16, True),
    (13, 3080, "layer", torch.bfloat16, False),
    (9, 4096, "rms", torch.float16, True),
    # LayerNorm fetching rows ahead into L2 there (stream_ahead, norm_fast_bwd.cuh), with more rows
    # than two strides of its grid so that the prefetches run: 385 slices in 512 threads, one
    # CTA an SM; 161 in 256.
    (400, 3080, "layer", torch.bfloat16, True),
    (600, 1288, "layer", torch.float16, True),
    # The lean forward beside the stream at 41 slices (two a lane in norm_fwd_stream_kernel) and
    # 65 (three).
    (19, 328, "layer", torch.bfloat16, True),
    (9, 520, "rms", torch.float16, False),
    (300, 8200, "layer", torch.float16, True),
    (250, 24584, "rms", torch.bfloat16, False),
    # The lean forward in blocks of one warp (lean_fwd_block): 64 slices at two a lane, the last
    # block's second row past the end; 96 at three (1024 at four is above).
    (21, 512, "layer", torch.bfloat16, True),
    (11, 768, "rms", torch.bfloat16, True),
    # norm_fwd_stream_kernel (a bias only with LayerNorm): one slice a lane in blocks of two
    # warps, three rows a lane, the last block short; RMSNorm without a bias at one slice and at four with the last slice's halves past
    # the row in some lanes (127 slices).
    (257, 256, "layer", torch.bfloat16, True),
    (257, 256, "rms", torch.bfloat16, True, False),
    (13, 1016, "rms", torch.float16, True, False),
]


def run_norm_stream_cases():
    for rows, hidden, kind, dtype, prenorm, *rest in NORM_STREAM_CASES:
        with_bias = rest[0] if rest else True
        x = torch.randn(rows, hidden, device="cuda", dtype=dtype, requires_grad=True)
        residual = torch.randn(rows, hidden, device="cuda", requires_grad=True)
        weight = torch.randn(hidden, device="cuda", requires_grad=True)
        bias = torch.randn(hidden, device="cuda", requires_grad=True) if with_bias else None
        fn = ssm_torch.layer_norm if kind == "layer" else ssm_torch.rms_norm
        out = fn(x, weight, bias, residual, prenorm=prenorm, residual_dtype=torch.float32)
        outputs = list(out) if prenorm else [out]
        torch.autograd.backward(outputs, [torch.randn_like(t) for t in outputs])
        torch.cuda.synchronize()
        tensors = outputs + [t.grad for t in (x, residual, weight, bias) if t is not None]
        finite = all(bool(torch.isfinite(t).all()) for t in tensors)
        print(f"norm stream {(rows, hidden)} {kind} {str(dtype)[6:]} prenorm={prenorm}: ran, "
              f"finite={finite}", flush=True)


# Selective-state decode step: every kernel variant (float32 states with one and two 16-byte
# chunks a lane, fp16 and bf16 states, the element-by-element kernel for dstate 1 and 17 and for
# an unaligned state), lane groups left partly idle, Mamba-2's stride-0 operands, and indices with
# a padding row and a slot past batch_state (whose out is NaN by design).
STATE_UPDATE_CASES = [  # layout, batch, nheads, headdim, dstate, ngroups, state, rest, tie,
    # indices, unaligned state
    ("mamba1", 3, 1, 37, 16, 1, torch.float32, torch.bfloat16, False, None, False),
    ("mamba1", 4, 1, 33, 48, 1, torch.float32, torch.float32, False, torch.int32, False),
    ("mamba2", 3, 6, 5, 132, 3, torch.float32, torch.float16, False, torch.int64, False),
    ("mamba2", 2, 4, 3, 256, 2, torch.float32, torch.bfloat16, True, None, False),
    ("mamba2", 5, 8, 7, 8, 4, torch.float16, torch.float16, True, torch.int64, False),
    ("mamba2", 3, 24, 64, 128, 1, torch.bfloat16, torch.bfloat16, True, torch.int32, False),
    ("mamba2", 2, 4, 9, 256, 1, torch.bfloat16, torch.float32, False, None, False),
    ("mamba2", 3, 4, 5, 1, 2, torch.float32, torch.float32, False, torch.int64, False),
    ("mamba2", 2, 2, 3, 17, 1, torch.bfloat16, torch.bfloat16, True, None, False),
    ("mamba2", 4, 4, 5, 32, 2, torch.float32, torch.bfloat16, False, torch.int64, True),
]


def run_state_update_cases():
    for (layout, batch, nheads, headdim, dstate, ngroups, state_dtype, dtype, tie, index_dtype,
         unaligned) in STATE_UPDATE_CASES:
        m2 = layout == "mamba2"
        r = lambda *s, dt=dtype: torch.randn(*s, device="cuda", dtype=dt)
        rows = (batch, nheads, headdim) if m2 else (batch, headdim)
        slots = batch + 2
        state_shape = (slots, nheads, headdim, dstate) if m2 else (slots, headdim, dstate)
        state = r(*state_shape, dt=state_dtype)
        if unaligned:  # two elements into a larger buffer: no 16-byte chunks
            state = torch.empty(state.numel() + 2, device="cuda",
                                dtype=state_dtype)[2:].view(state_shape).copy_(state)
        x, z = r(*rows), r(*rows)
        if tie:  # Mamba-2's step: one dt, dt_bias, D and A value a head
            dt = torch.rand(batch, nheads, 1, device="cuda", dtype=dtype).expand(rows)
            bias, D = r(nheads, 1).expand(nheads, headdim), r(nheads, 1).expand(nheads, headdim)
            A = -torch.rand(nheads, 1, 1, device="cuda").expand(nheads, headdim, dstate)
        else:
            dt = torch.rand(*rows, device="cuda", dtype=dtype)
            bias, D = r(*rows[1:]), r(*rows[1:])
            A = -torch.rand(*(rows[1:] + (dstate,)), device="cuda")
        bc = (batch, ngroups, dstate) if m2 else (batch, dstate)
        B, C = r(*bc), r(*bc)
        idx = None
        if index_dtype is not None:
            idx = torch.randperm(slots, device="cuda")[:batch].to(index_dtype)
            idx[0], idx[-1] = -1, slots + 3  # a padding row, and one past batch_state
        out = libssm.selective_state_update(state, x, dt, A, B, C, D, z, bias, dt_softplus=True,
                                            state_batch_indices=idx)
        torch.cuda.synchronize()
        checked = out if idx is None else out[:-1]
        finite = bool(torch.isfinite(checked).all()) and bool(torch.isfinite(state).all())
        print(f"state update {layout} {(batch, nheads, headdim, dstate, ngroups)} "
              f"{str(state_dtype)[6:]}/{str(dtype)[6:]} tie={tie} indices={index_dtype} "
              f"unaligned={unaligned}: ran, finite={finite}", flush=True)


# Causal conv1d: the seq kernels (segments of 1 to 32 lanes, vector and element loads, rows cut
# into chunks, packed sequences across chunk edges) and the chan kernels (channel-last and
# strided x, odd dims), widths 4 and 8 of each, every output and gradient, seqlen 0 and the
# decode step with a circular buffer, padding rows and an index past batch_state (NaN by design).
CONV1D_CASES = [  # batch, dim, seqlen, width, dtype, layout, seq_idx, initial/final states
    (2, 5, 1, 4, torch.bfloat16, "seq", False, True),
    (3, 7, 13, 2, torch.float16, "seq", True, True),
    (2, 33, 257, 8, torch.float32, "seq", True, True),
    (2, 64, 2048, 4, torch.bfloat16, "seq", False, True),
    (1, 3, 40001, 6, torch.bfloat16, "seq", True, True),
    (2, 9, 301, 4, torch.float16, "unaligned", False, True),
    (2, 67, 999, 4, torch.bfloat16, "channel_last", True, True),
    (1, 5, 300, 8, torch.float32, "channel_last", False, False),
    (2, 6, 77, 5, torch.bfloat16, "strided", True, True),
    (2, 4, 0, 4, torch.float32, "seq", False, True),
    # The fast kernels (full width, no states; seq rows of whole slices, channel-last rows of
    # whole channel groups); 2000 leaves the backward's last unit partial.
    (2, 64, 2000, 4, torch.bfloat16, "seq", False, False),
    (1, 16, 512, 8, torch.float16, "seq", False, False),
    (2, 64, 1000, 4, torch.bfloat16, "channel_last", False, False),
    (1, 34, 301, 8, torch.float32, "channel_last", False, False),
]


def conv1d_x(batch, dim, seqlen, dtype, layout):
    r = torch.randn(batch, dim, seqlen, device="cuda", dtype=dtype)
    if layout == "channel_last":
        return r.transpose(1, 2).contiguous().transpose(1, 2)
    if layout == "strided":
        wide = torch.zeros(batch, dim, 2 * seqlen, device="cuda", dtype=dtype)
        wide[..., ::2] = r
        return wide[..., ::2]
    if layout == "unaligned":
        flat = torch.zeros(r.numel() + 1, device="cuda", dtype=dtype)
        return flat[1:].view(r.shape).copy_(r)
    return r


def run_conv1d_cases():
    for batch, dim, seqlen, width, dtype, layout, packed, states in CONV1D_CASES:
        x, dout = (conv1d_x(batch, dim, seqlen, dtype, layout) for _ in range(2))
        weight = torch.randn(dim, width, device="cuda")
        bias = torch.randn(dim, device="cuda", dtype=dtype)
        init = torch.randn(batch, dim, width - 1, device="cuda") if states else None
        seq_idx = None
        if packed and seqlen:
            cut = torch.randint(0, 3, (batch, seqlen), device="cuda").cumsum(-1) // 2
            seq_idx = cut.to(torch.int32)
        result = libssm.causal_conv1d(x, weight, bias, activation="silu", initial_states=init,
                                      return_final_states=states, seq_idx=seq_idx)
        dfinal = torch.randn_like(result[1]) if states else None
        grads = libssm.causal_conv1d_bwd(x, weight, dout, bias, activation="silu",
                                         initial_states=init, seq_idx=seq_idx,
                                         dfinal_states=dfinal)
        torch.cuda.synchronize()
        outputs = (tuple(result) if states else (result,)) + tuple(grads)
        finite = all(bool(torch.isfinite(t).all()) for t in outputs if t is not None)
        print(f"conv1d {(batch, dim, seqlen, width)} {str(dtype)[6:]} {layout} packed={packed} "
              f"states={states}: ran, finite={finite}", flush=True)
    for batch, dim, width, state_len, seqlen, circular in [(3, 7, 4, 3, None, False),
                                                          (5, 33, 8, 12, 3, True),
                                                          (4, 64, 2, 1, 2, False)]:
        x_shape = (batch, dim) if seqlen is None else (batch, dim, seqlen)
        x = torch.randn(*x_shape, device="cuda", dtype=torch.bfloat16)
        state = torch.randn(batch + 2, dim, state_len, device="cuda")
        idx = torch.randperm(batch + 2, device="cuda")[:batch].to(torch.int32)
        idx[0], idx[-1] = -1, batch + 5  # a padding row, and one past batch_state
        cache = torch.randint(0, 50, (batch,), device="cuda") if circular else None
        out = libssm.causal_conv1d_update(x, state, torch.randn(dim, width, device="cuda"),
                                          activation="silu", cache_seqlens=cache,
                                          conv_state_indices=idx)
        torch.cuda.synchronize()
        finite = bool(torch.isfinite(out[:-1]).all()) and bool(torch.isfinite(state).all())
        print(f"conv1d update {(batch, dim, width, state_len, seqlen)} circular={circular}: "
              f"ran, finite={finite}", flush=True)


def main():
    torch.manual_seed(0)
    run_scan_cases()
    run_norm_cases()
    run_state_update_cases()
    run_conv1d_cases()


if __name__ == "__main__":
    main()
