"""Odd-sized selective-scan calls for compute-sanitizer on a GPU machine (not a pytest module):

    compute-sanitizer --tool memcheck  python tests/sanitizer_cases.py
    compute-sanitizer --tool racecheck python tests/sanitizer_cases.py

Covers the narrow and wide forward kernels, the checkpoint replay and the backward, with
partial blocks, partial chunks, padded states, groups and fixed B/C. Numerics are the pytest
suites' job; this only has to drive every kernel path once."""
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


def main():
    torch.manual_seed(0)
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


if __name__ == "__main__":
    main()
