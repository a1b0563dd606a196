"""Measures the host time of one eager libssm.torch.selective_scan call, for benchmarks and
`check` to print: the smallest real problem (batch 1, a few channels and steps), so validation,
output allocation, the C call and, on CUDA, the kernel launch are all counted while the compute
itself is negligible."""

import time


def eager_overhead_us(device="cpu", calls=10000, repeats=5):
    """Best-of-`repeats` microseconds per call over `calls` calls, without gradients."""
    import torch

    from .torch import selective_scan

    batch, dim, seqlen, dstate = 1, 16, 8, 4
    u = torch.randn(batch, dim, seqlen, device=device)
    delta = torch.rand(batch, dim, seqlen, device=device)
    A = -torch.rand(dim, dstate, device=device)
    B = torch.randn(batch, dstate, seqlen, device=device)
    C = torch.randn(batch, dstate, seqlen, device=device)
    for _ in range(min(calls, 500)):
        selective_scan(u, delta, A, B, C)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            selective_scan(u, delta, A, B, C)
        best = min(best, time.perf_counter() - start)
    return best / calls * 1e6
