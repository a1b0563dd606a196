"""Selective scan (Mamba-1) on the GPU: libssm against mamba_ssm's selective_scan_fn (when it
imports) and a pure-PyTorch sequential reference, on the rows of PERFORMANCE.md.

For each row: forward and forward+backward time (median of CUDA-event timings after warm-up),
the ratio peer/libssm (> 1 means libssm is faster), and the peak memory allocated beyond the
inputs by the forward and by forward+backward (gradients included). Also the host overhead of
one eager libssm call. Prints a table last and writes the numbers to
benchmarks/results/selective_scan_<gpu>.json.

    python benchmarks/bench_selective_scan.py [--reps 50] [--rows all|quick] [--impls libssm,...]
"""
import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

import libssm
import libssm.torch as st

try:
    from mamba_ssm.ops.selective_scan_interface import selective_scan_fn as mamba_scan
except ImportError:  # the peer is optional: its columns read "-" without it
    mamba_scan = None

ROWS = [  # batch, dim, seqlen, dstate, dtype; the last two are the game-AI sizes
    (1, 2048, 512, 32, torch.bfloat16),
    (16, 2048, 512, 32, torch.float32),
    (16, 2048, 512, 32, torch.bfloat16),
    (16, 2048, 512, 16, torch.bfloat16),
    (8, 4096, 2048, 16, torch.bfloat16),
    (32, 512, 60, 16, torch.bfloat16),
    (32, 1024, 180, 16, torch.bfloat16),
]
# The sequential reference materialises (batch, dim, seqlen, dstate) tensors; past this many
# elements it takes minutes and gigabytes, so those rows skip it (as PERFORMANCE.md does).
REF_MAX_ELEMENTS = 2**31


def torch_reference(u, delta, A, B, C, D, z, delta_bias):
    """The scan as plain PyTorch ops, one step at a time (what users without a kernel run)."""
    dt = torch.nn.functional.softplus(delta.float() + delta_bias[None, :, None])
    dA = torch.exp(torch.einsum("bdl,dn->bdln", dt, A))
    dBu = torch.einsum("bdl,bnl,bdl->bdln", dt, B.float(), u.float())
    h = torch.zeros(u.shape[0], u.shape[1], A.shape[1], device=u.device)
    ys = []
    for t in range(u.shape[2]):
        h = dA[:, :, t] * h + dBu[:, :, t]
        ys.append(torch.einsum("bdn,bn->bd", h, C[:, :, t].float()))
    y = torch.stack(ys, dim=2) + D[None, :, None] * u.float()
    return (y * torch.nn.functional.silu(z.float())).to(u.dtype)


def make_inputs(batch, dim, seqlen, dstate, dtype, grad):
    g = torch.Generator(device="cuda").manual_seed(0)
    r = lambda *s, dt=dtype: torch.randn(*s, device="cuda", generator=g).to(dt)
    x = dict(
        u=r(batch, dim, seqlen), delta=(0.5 * r(batch, dim, seqlen, dt=torch.float32)).to(dtype),
        A=-torch.rand(dim, dstate, device="cuda", generator=g) - 0.5,
        B=r(batch, dstate, seqlen), C=r(batch, dstate, seqlen),
        D=r(dim, dt=torch.float32), z=r(batch, dim, seqlen),
        delta_bias=0.1 * r(dim, dt=torch.float32),
    )
    for t in x.values():
        t.requires_grad_(grad)
    return x


def call(impl, x):
    if impl == "libssm":
        return st.selective_scan(x["u"], x["delta"], x["A"], x["B"], x["C"], D=x["D"], z=x["z"],
                                 delta_bias=x["delta_bias"], delta_softplus=True)
    if impl == "mamba_ssm":
        return mamba_scan(x["u"], x["delta"], x["A"], x["B"], x["C"], D=x["D"], z=x["z"],
                          delta_bias=x["delta_bias"], delta_softplus=True)
    return torch_reference(x["u"], x["delta"], x["A"], x["B"], x["C"], x["D"], x["z"], x["delta_bias"])


def median_ms(fn, reps, warmup=5):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def measure(impl, row, reps):
    batch, dim, seqlen, dstate, dtype = row
    x = make_inputs(*row, grad=False)
    with torch.no_grad():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = call(impl, x)
        torch.cuda.synchronize()
        peak_mb = (torch.cuda.max_memory_allocated() - base) / 2**20
        del out
        fwd = median_ms(lambda: call(impl, x), reps)
    xg = make_inputs(*row, grad=True)
    dout = torch.randn(batch, dim, seqlen, device="cuda", dtype=dtype)

    def fwd_bwd():
        for t in xg.values():
            t.grad = None
        call(impl, xg).backward(dout)

    both = median_ms(fwd_bwd, reps)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fwd_bwd()
    torch.cuda.synchronize()
    both_peak_mb = (torch.cuda.max_memory_allocated() - base) / 2**20
    return dict(fwd_ms=fwd, fwd_bwd_ms=both, fwd_peak_extra_mb=peak_mb,
                fwd_bwd_peak_extra_mb=both_peak_mb)


def host_overhead_us(calls=20000):
    """Wall time per eager call on a tiny problem whose kernel is shorter than the host work."""
    x = make_inputs(1, 16, 8, 4, torch.float32, grad=False)
    for _ in range(100):
        call("libssm", x)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        call("libssm", x)
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / calls * 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--rows", choices=["all", "quick"], default="all")
    ap.add_argument("--impls", default="libssm,mamba_ssm,torch_ref",
                    help="comma-separated subset of libssm, mamba_ssm, torch_ref")
    args = ap.parse_args()
    rows = ROWS if args.rows == "all" else ROWS[2:4]
    impls = [i for i in args.impls.split(",") if i != "mamba_ssm" or mamba_scan]
    gpu = torch.cuda.get_device_name()
    results = []
    for row in rows:
        batch, dim, seqlen, dstate, dtype = row
        for impl in impls:
            if impl == "torch_ref" and batch * dim * seqlen * dstate > REF_MAX_ELEMENTS:
                continue
            r = measure(impl, row, args.reps if impl != "torch_ref" else 3)
            results.append(dict(impl=impl, batch=batch, dim=dim, seqlen=seqlen, dstate=dstate,
                                dtype=str(dtype).removeprefix("torch."), **r))
            print(results[-1], flush=True)
            torch.cuda.empty_cache()
    overhead = host_overhead_us()

    def find(impl, key, row):
        for r in results:
            if r["impl"] == impl and (r["batch"], r["dim"], r["seqlen"], r["dstate"], r["dtype"]) == row:
                return r[key]
        return None

    out = Path(__file__).parent / "results" / f"selective_scan_{gpu.replace(' ', '_')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(gpu=gpu, torch=torch.__version__, libssm=libssm.__version__,
                                   host=platform.node(), host_overhead_us=overhead,
                                   results=results), indent=1))
    fmt = lambda v, spec: "-" if v is None else format(v, spec)
    print(f"\nselective scan on {gpu} (ms, median of CUDA events; ratio = peer / libssm)")
    print("| batch, dim, seqlen, dstate | dtype | libssm fwd | mamba fwd | ratio | libssm fwd+bwd "
          "| mamba fwd+bwd | ratio | fwd peak MB libssm / mamba | fwd+bwd peak MB libssm / mamba "
          "| torch ref fwd |")
    print("|" + " --- |" * 11)
    for batch, dim, seqlen, dstate, dtype in rows:
        key = (batch, dim, seqlen, dstate, str(dtype).removeprefix("torch."))
        lf, mf = find("libssm", "fwd_ms", key), find("mamba_ssm", "fwd_ms", key)
        lb, mb = find("libssm", "fwd_bwd_ms", key), find("mamba_ssm", "fwd_bwd_ms", key)
        print(f"| {batch}, {dim}, {seqlen}, {dstate} | {key[4]} | {fmt(lf, '.3f')} | {fmt(mf, '.3f')} "
              f"| {fmt(mf and mf / lf, '.2f')} | {fmt(lb, '.3f')} | {fmt(mb, '.3f')} "
              f"| {fmt(mb and mb / lb, '.2f')} | {fmt(find('libssm', 'fwd_peak_extra_mb', key), '.1f')} "
              f"/ {fmt(find('mamba_ssm', 'fwd_peak_extra_mb', key), '.1f')} "
              f"| {fmt(find('libssm', 'fwd_bwd_peak_extra_mb', key), '.0f')} "
              f"/ {fmt(find('mamba_ssm', 'fwd_bwd_peak_extra_mb', key), '.0f')} "
              f"| {fmt(find('torch_ref', 'fwd_ms', key), '.2f')} |")
    print(f"\nhost overhead of one eager libssm.torch call: {overhead:.2f} us; results in {out}")


if __name__ == "__main__":
    main()
