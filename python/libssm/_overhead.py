"""Host time per eager libssm.torch.selective_scan call, for benchmarks and `check` to print:
a small problem with batch 0, so validation, output allocation and the C call all run but no
compute does, and the figure is the host overhead alone (on CUDA nothing is launched)."""

import time


def eager_overhead_us(device="cpu", calls=10000, repeats=5, full=False):
    """Best-of-`repeats` microseconds per call over `calls` calls, without gradients.
    full: also pass D, z and delta_bias with delta_softplus (more tensors to describe)."""
    import torch

    from .torch import selective_scan

    dim, seqlen, dstate = 16, 8, 4
    u = torch.randn(0, dim, seqlen, device=device)
    delta = torch.rand(0, dim, seqlen, device=device)
    A = -torch.rand(dim, dstate, device=device)
    B = torch.randn(0, dstate, seqlen, device=device)
    C = torch.randn(0, dstate, seqlen, device=device)
    extra = {}
    if full:
        extra = dict(D=torch.randn(dim, device=device),
                     z=torch.randn(0, dim, seqlen, device=device),
                     delta_bias=torch.rand(dim, device=device), delta_softplus=True)
    for _ in range(min(calls, 500)):
        selective_scan(u, delta, A, B, C, **extra)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            selective_scan(u, delta, A, B, C, **extra)
        best = min(best, time.perf_counter() - start)
    if u.is_cuda:
        torch.cuda.synchronize(u.device)
    return best / calls * 1e6
