"""Odd-sized selective-scan and fused-norm calls for compute-sanitizer on a GPU machine (not a
pytest module):

    compute-sanitizer --tool memcheck  python tests/sanitizer_cases.py
    compute-sanitizer --tool racecheck python tests/sanitizer_cases.py

Scan: the narrow and wide forward kernels, the checkpoint replay and the backward, with partial
blocks, partial chunks, padded states, groups and fixed B/C. Norm: forward and backward (every
gradient) on each kernel path: rows shorter than one 8-column slice, partial slices, rows held
in registers and rows re-read (hidden past 16384, up to 65536), tiny groups, gate on either side,
LayerNorm, many rows (dweight/dbias partial sums) and unaligned row strides. Numerics are the
pytest suites' job; this only has to drive every kernel path once."""
import torch

import libssm

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


NORM_CASES = [  # rows, hidden, group_size, kind, x dtype, weight dtype, z, norm_before_gate, pad
    (7, 1, 0, "rms", torch.bfloat16, torch.float32, True, False, 0),
    (33, 7, 1, "layer", torch.float16, torch.float16, True, True, 0),
    (5, 4097, 241, "rms", torch.float32, torch.float32, True, False, 0),
    (3, 4097, 0, "layer", torch.bfloat16, torch.bfloat16, False, True, 1),
    (2, 16384, 0, "rms", torch.float16, torch.float32, False, True, 0),
    (2, 16385, 0, "layer", torch.float32, torch.float32, True, True, 0),
    (3, 20000, 0, "layer", torch.bfloat16, torch.float32, True, False, 3),
    (2, 65536, 0, "rms", torch.bfloat16, torch.float32, True, True, 0),
    (1, 65536, 8192, "layer", torch.float16, torch.float16, True, False, 0),
    (96, 2048, 8, "rms", torch.bfloat16, torch.float32, True, False, 0),
    (4096, 1024, 0, "rms", torch.bfloat16, torch.float32, False, True, 8),
    (1000, 768, 0, "layer", torch.float32, torch.float32, True, True, 5),
]


def run_norm_cases():
    for rows, hidden, group, kind, dtype, wdtype, gated, before, pad in NORM_CASES:
        def rows_of(dt=dtype):
            # pad > 0: rows sit hidden + pad apart, so neither rows nor vectors line up.
            return torch.randn(rows, hidden + pad, device="cuda", dtype=dt)[:, :hidden]
        x, residual, dy, dres = rows_of(), rows_of(torch.float32), rows_of(), rows_of()
        z = rows_of() if gated else None
        weight = torch.randn(hidden, device="cuda", dtype=wdtype)
        bias = torch.randn(hidden, device="cuda", dtype=wdtype) if kind == "layer" else None
        options = dict(kind=kind, eps=1e-5, group_size=group or None, norm_before_gate=before)
        fwd = libssm.norm_fwd(x, weight, bias, residual=residual, z=z, **options)
        grads = libssm.norm_bwd(fwd.residual_out, dy, fwd.mean, fwd.rstd, weight, bias, z=z,
                                dresidual_out=dres, residual_dtype=dtype, **options)
        torch.cuda.synchronize()
        outputs = [t for t in tuple(fwd) + tuple(grads) if t is not None]
        finite = all(bool(torch.isfinite(t).all()) for t in outputs)
        print(f"norm {(rows, hidden, group)} {kind} {str(dtype)[6:]}/{str(wdtype)[6:]} "
              f"gate={gated}/{before} pad={pad}: ran, finite={finite}", flush=True)


def main():
    torch.manual_seed(0)
    run_scan_cases()
    run_norm_cases()


if __name__ == "__main__":
    main()
