"""Fused RMSNorm / LayerNorm (+ residual add, + SiLU gate) on the GPU: libssm against torch eager,
torch.compile of the same expression, and mamba_ssm's Triton kernels (when they import).

Every figure is a bandwidth: the minimal bytes of the operation (each input read once, each
output written once) over the median CUDA-event time after warm-up, in TB/s (1e12 bytes/s).
The same run measures a device-to-device copy (a large torch copy_, read + written bytes) and
reports libssm as a % of it, and libssm's speed over each other implementation's (> 1: libssm
is faster). Targets (PERFORMANCE.md / the issue): forward >= 90% of copy and backward >= 80%
at hidden >= 4096, and never slower than torch.compile.

Rows:
- rms:   RMSNorm + residual add, prenorm (returns y and the residual stream), bf16 x and
         residual, fp32 weight; hidden 256 .. 65536; rows = min(32768, 2**27 // hidden), so each
         bf16 tensor is 256 MiB at hidden >= 4096 (--max-elements changes the 2**27).
- layer: LayerNorm + residual add, prenorm, bf16 x, fp32 residual stream (Mamba's
         residual_in_fp32 after the first block), fp32 weight and bias.
- gated: Mamba-2's gated RMSNorm y = rmsnorm(x * silu(z)) * weight (norm_before_gate=False),
         per group of group_size columns, bf16 x and z, fp32 weight, no residual.
- gated-after: the same with the gate after the norm, y = rmsnorm(x) * weight * silu(z)
         (norm_before_gate=True, RMSNormGated's default).
- rms-plain, layer-plain: the norm alone, as torch.nn.RMSNorm / LayerNorm call it: bf16 x, no
         residual, fp32 weight (and bias for LayerNorm).

Bytes counted:
- forward: read x, residual, z, weight, bias; write y, residual_out. The mean/rstd statistics
  are not counted (inference does not need them; they are <= 0.4% of the bytes here).
- backward: read s (the forward's residual_out, or x when there is no residual), dy,
  dresidual_out (prenorm), z, weight, rstd and mean (these are what a backward must read);
  write dx, dresidual (only when the residual dtype differs from x's: otherwise it is dx
  itself), dz, dweight, dbias. bias is not read: no gradient here depends on it.

Timing: each implementation's calls are queued one after another, each between its own pair
of CUDA events, with one host wait after the last; each figure is the smallest of --rounds
such medians (a host stall can only lengthen a window). Before each window a spin kernel of
--lead-ms (1 ms) is queued, so the GPU is still busy with it while the host issues the timed
call: the window holds the call's GPU work (its kernels and any gaps between them), not the
host's time to reach its first kernel. Without it (--lead-ms 0) the backward rows measured
the host: on one H100 machine an autograd backward took 150-330 us of host time, more than the
untimed forward queued before it, and the LayerNorm alone's backward read 60-73% of copy at
kernels timed directly at 82-91%. The host's own time a call (the median of the Python-side
time from the call to its return, the fewest of the rounds) is reported beside each speed.
Forward calls are made with autograd recording (inputs require grad), i.e. the
training forward that the backward below pairs with; --fwd-mode infer times it under
torch.no_grad() instead (one more torch.compile per row). The backward is timed alone and the
same way for every implementation: each repetition runs the forward untimed, then times
torch.autograd.grad of the outputs (dy, dresidual_out) with respect to every input. This is
each implementation's own backward as autograd runs it (libssm's registered backward,
mamba_ssm's autograd.Function, AOTAutograd's compiled backward, torch's eager autograd), with
no forward inside the timed window and no retain_graph (which would change what
torch.compile generates).

Before timing, each implementation's outputs and gradients are checked once per row against
torch eager (max error <= 2% of the reference's largest magnitude, finite, same dtypes), so a
wrong kernel cannot post a fast number: a failing implementation is reported, not timed.

    python benchmarks/bench_norm.py [--reps 20] [--rounds 3] [--rows all|quick]
                                    [--kind rms|layer|gated|gated-after|all]
                                    [--hidden 16384,32768]
                                    [--impls libssm,eager,compile,mamba] [--fwd-mode train|infer]

mamba_ssm: imported as the installed package if that works; otherwise, when MAMBA_SSM_SRC
names an unpacked mamba_ssm source tree (the sdist's root or its mamba_ssm/ folder), the two
Triton files are loaded from it by path without running the package's __init__ (which needs
the compiled CUDA extensions); otherwise its columns read "-". Needs triton (and einops for
the gated kernel). Its kernels stop at 64 KB per row, so hidden 65536 in bf16 reads "-".

Writes benchmarks/results/norm_<gpu>.json, rewritten after each row so that a run cut short keeps
what it measured, and prints a table last. --dry-run runs tiny rows on the CPU (no JSON) only to
exercise the code paths where no GPU is at hand.
"""
import argparse
import gc
import importlib.util
import os
import platform
import statistics
import sys
import time
import types
from pathlib import Path

import torch
import torch.nn.functional as F

import _common as cm

try:
    import libssm
    import libssm.torch as st
    LIBSSM_IMPORT_ERROR = None
except Exception as e:  # noqa: BLE001 - report why, and still measure the peers
    libssm = st = None
    LIBSSM_IMPORT_ERROR = f"{type(e).__name__}: {e}"

IMPLS = ("libssm", "eager", "compile", "mamba")
PEERS = ("eager", "compile", "mamba")
KINDS = ("rms", "layer", "gated", "gated-after", "rms-plain", "layer-plain")
RMS_HIDDEN = (256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
# kind, hidden, group_size (None: one group of hidden columns)
ALL_ROWS = ([("rms", h, None) for h in RMS_HIDDEN]
            + [("layer", 2048, None), ("layer", 8192, None)]
            # Mamba-2 with ngroups=1 (d_inner 4096 at d_model 2048) and ngroups=8 (d_inner 8192)
            + [("gated", 4096, None), ("gated", 8192, 1024)]
            + [("rms-plain", 8192, None), ("layer-plain", 8192, None),
               ("layer-plain", 16384, None)])
# PERFORMANCE.md's three RMSNorm rows, for a side-by-side look, and one of each other kind
QUICK_ROWS = [("rms", 1024, None), ("rms", 4096, None), ("rms", 8192, None),
              ("layer", 8192, None), ("gated", 8192, 1024)]
DRY_ROWS = [("rms", 256, None), ("layer", 512, None), ("gated", 512, 128),
            ("gated-after", 384, None), ("rms-plain", 256, None), ("layer-plain", 512, None)]
TOL = 2e-2  # bf16 outputs: the eager reference rounds x + residual to bf16 before the norm
COPY_BYTES = 2**29  # 512 MiB each way: far past any L2, so the copy runs at DRAM speed


# ---------------------------------------------------------------------------------------------
# mamba_ssm peer

def _load_by_path(pkg_dir, rel, name):
    spec = importlib.util.spec_from_file_location(name, pkg_dir / rel)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # triton's JIT reads the kernels' source back through the module
    spec.loader.exec_module(mod)
    return mod


def load_mamba():
    """-> (layer_norm module | None, layernorm_gated module | None, where they came from)."""
    errors = []
    try:
        from mamba_ssm.ops.triton import layer_norm, layernorm_gated
        return layer_norm, layernorm_gated, "installed mamba_ssm"
    except Exception as e:  # noqa: BLE001
        errors.append(f"installed: {type(e).__name__}: {e}")
    src = os.environ.get("MAMBA_SSM_SRC")
    if not src:
        return None, None, "; ".join(errors + ["MAMBA_SSM_SRC not set"])
    root = Path(src)
    pkg = root if (root / "ops/triton/layer_norm.py").is_file() else root / "mamba_ssm"
    # A failed import of an installed package leaves half-initialised modules behind; they
    # would shadow the source tree.
    for name in [n for n in sys.modules if n == "mamba_ssm" or n.startswith("mamba_ssm.")]:
        del sys.modules[name]
    # An empty package object stands in for mamba_ssm: layer_norm.py's
    # `from mamba_ssm.utils... import` then find the plain-Python files beside it, and
    # mamba_ssm/__init__.py (which imports the compiled selective-scan extension) never runs.
    stub = types.ModuleType("mamba_ssm")
    stub.__path__ = [str(pkg)]
    sys.modules["mamba_ssm"] = stub
    mods = []
    for rel in ("ops/triton/layer_norm.py", "ops/triton/layernorm_gated.py"):
        try:
            mods.append(_load_by_path(pkg, rel, "_bench_norm_peer_" + Path(rel).stem))
        except Exception as e:  # noqa: BLE001 - e.g. no triton, no einops: that column reads "-"
            mods.append(None)
            errors.append(f"{rel}: {type(e).__name__}: {e}")
    where = f"source tree {pkg}" + (f" (not loaded from it: {'; '.join(errors[1:])})"
                                     if len(errors) > 1 else "")
    return mods[0], mods[1], where


# ---------------------------------------------------------------------------------------------
# rows, inputs, byte counts

def make_row(kind, hidden, group_size, max_elements):
    rows = max(1, min(32768, max_elements // hidden))
    # norm: which normalisation (rms, layer or gated) the row's kind times
    row = dict(kind=kind, norm=kind.split("-")[0], hidden=hidden, rows=rows,
               group_size=group_size, x_dtype=torch.bfloat16, res_dtype=None, z=False,
               bias=False, prenorm=False, norm_before_gate=False, eps=1e-6)
    if kind == "rms":
        row.update(res_dtype=torch.bfloat16, prenorm=True)
    elif kind == "layer":
        row.update(res_dtype=torch.float32, prenorm=True, bias=True, eps=1e-5)
    elif kind == "layer-plain":
        row.update(bias=True, eps=1e-5)
    elif kind == "gated":  # as Mamba-2's RMSNormGated: no residual, gate applied before the norm
        row.update(z=True, eps=1e-5)
    elif kind == "gated-after":
        row.update(z=True, norm_before_gate=True, eps=1e-5)
    return row


def row_key(row):
    return (row["kind"], row["hidden"], row["rows"], row["group_size"])


def dname(dtype):
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]


def make_inputs(row, device):
    """Leaves that require grad (x, residual, z, weight, bias; None where the row has none),
    and the output gradients (dy, dresidual_out when prenorm)."""
    g = torch.Generator(device=device).manual_seed(0)
    n, h = row["rows"], row["hidden"]

    def r(*shape, dtype, scale=1.0, shift=0.0):
        t = torch.randn(*shape, device=device, generator=g, dtype=torch.float32)
        return (t * scale + shift).to(dtype).requires_grad_(True)

    x = r(n, h, dtype=row["x_dtype"])
    res = r(n, h, dtype=row["res_dtype"]) if row["res_dtype"] is not None else None
    z = r(n, h, dtype=row["x_dtype"]) if row["z"] else None
    w = r(h, dtype=torch.float32, scale=0.1, shift=1.0)
    b = r(h, dtype=torch.float32, scale=0.1) if row["bias"] else None
    grads = [torch.randn(n, h, device=device, generator=g).to(row["x_dtype"])]
    if row["prenorm"]:
        grads.append(torch.randn(n, h, device=device, generator=g).to(row["res_dtype"]))
    return (x, res, z, w, b), grads


def nbytes(row):
    """(forward bytes, backward bytes), as counted in the module docstring."""
    n, h = row["rows"], row["hidden"]
    ngroups = h // (row["group_size"] or h)
    ex = row["x_dtype"].itemsize
    er = row["res_dtype"].itemsize if row["res_dtype"] is not None else 0
    es = er or ex  # s: the residual stream when there is one, else x
    ez = ex if row["z"] else 0
    wb = 4 * h * (2 if row["bias"] else 1)  # fp32 weight (+ bias) or their gradients
    stats = 4 * n * ngroups * (2 if row["norm"] == "layer" else 1)
    fwd = n * h * (ex + er + ez + ex + (er if row["prenorm"] else 0)) + wb
    dres_in = er if row["res_dtype"] not in (None, row["x_dtype"]) else 0
    bwd = (n * h * (es + ex + (er if row["prenorm"] else 0) + ez)  # read s, dy, dres_out, z
           + 4 * h + stats                                        # read weight, rstd (, mean)
           + n * h * (ex + dres_in + ez) + wb)                    # write dx, dres, dz, dw (, db)
    return fwd, bwd


# ---------------------------------------------------------------------------------------------
# implementations: each maps the leaves (x, residual, z, weight, bias) to a tuple of outputs,
# (y, residual_out) when prenorm, else (y,)

def reference(x, residual, z, weight, bias, *, kind, eps, group_size, norm_before_gate,
              prenorm):
    """What a user writes: the residual add in the stream's dtype (bf16 + fp32 promotes), the
    norm in fp32 through torch's own rms_norm / layer_norm, the result cast back to x's dtype."""
    s = x + residual if residual is not None else x
    h = s.float()
    if z is not None and not norm_before_gate:
        h = h * F.silu(z.float())
    hidden = h.shape[-1]
    norm = F.layer_norm if kind == "layer" else F.rms_norm
    if group_size in (None, hidden):
        if kind == "layer":
            o = F.layer_norm(h, (hidden,), weight, bias, eps=eps)
        else:
            o = F.rms_norm(h, (hidden,), weight, eps=eps)
    else:  # each group normalised on its own, then the per-column affine
        hg = h.view(*h.shape[:-1], hidden // group_size, group_size)
        o = norm(hg, (group_size,), eps=eps).view(h.shape) * weight
        if bias is not None:
            o = o + bias
    if z is not None and norm_before_gate:
        o = o * F.silu(z.float())
    y = o.to(x.dtype)
    return (y, s) if prenorm else (y,)


def make_impl(impl, row, mamba_ln, mamba_gated):
    """-> callable(x, residual, z, weight, bias) -> outputs, or raise why it is unavailable."""
    kind, eps, gs, prenorm = row["norm"], row["eps"], row["group_size"], row["prenorm"]
    before = row["norm_before_gate"]
    if impl in ("eager", "compile"):
        def fn(x, residual, z, weight, bias):
            return reference(x, residual, z, weight, bias, kind=kind, eps=eps, group_size=gs,
                             norm_before_gate=before, prenorm=prenorm)
        if impl == "eager":
            return fn
        # One compiled graph per shape, as a model with fixed sizes gets. Resetting dynamo
        # between rows keeps the recompile limit from silently sending later rows to eager.
        torch._dynamo.reset()
        return torch.compile(fn, dynamic=False, fullgraph=True)
    if impl == "libssm":
        if st is None:
            raise RuntimeError(f"libssm.torch does not import: {LIBSSM_IMPORT_ERROR}")
        op = st.layer_norm if kind == "layer" else st.rms_norm

        def fn(x, residual, z, weight, bias):
            out = op(x, weight, bias, residual=residual, z=z, eps=eps, group_size=gs,
                     norm_before_gate=before, prenorm=prenorm)
            return tuple(out) if prenorm else (out,)
        return fn
    if impl == "mamba":
        if kind == "gated":
            if mamba_gated is None:
                raise RuntimeError("mamba_ssm layernorm_gated not importable")

            def fn(x, residual, z, weight, bias):
                return (mamba_gated.rmsnorm_fn(x, weight, bias, z=z, eps=eps, group_size=gs,
                                               norm_before_gate=before),)
            return fn
        if mamba_ln is None:
            raise RuntimeError("mamba_ssm layer_norm not importable")
        op = mamba_ln.layer_norm_fn if kind == "layer" else mamba_ln.rms_norm_fn

        def fn(x, residual, z, weight, bias):
            # the residual's dtype sets residual_out's (fp32 for the layer rows)
            out = op(x, weight, bias, residual=residual, eps=eps, prenorm=prenorm)
            return tuple(out) if prenorm else (out,)
        return fn
    raise ValueError(impl)


# ---------------------------------------------------------------------------------------------
# timing and checking

class Timer:
    def __init__(self, device, flush_l2, lead_ms):
        self.cuda = device == "cuda"
        # Writing a buffer larger than L2 before each timed call evicts the previous call's
        # data, so small rows are measured from DRAM (off by default, as PERFORMANCE.md ran).
        self.flush = (torch.empty(2**28, dtype=torch.uint8, device=device)
                      if flush_l2 and self.cuda else None)
        # A spin kernel of lead_ms queued before each window keeps the GPU busy while the host
        # prepares the call, so the window holds the call's GPU work alone (host time is
        # reported apart): on one H100 machine an autograd backward took up to ~330 us of host
        # time, more than the untimed forward before it, and the GPU idled inside the window.
        self.lead_cycles = self._cycles(lead_ms) if self.cuda and lead_ms > 0 else 0
        self.host_ms = None  # median host time of one call in the last median_ms

    @staticmethod
    def _cycles(ms):
        probe = 10**7
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(probe)  # first launch loads the kernel
        start.record()
        torch.cuda._sleep(probe)
        end.record()
        end.synchronize()
        return int(probe * ms / start.elapsed_time(end))

    def median_ms(self, fn, reps, warmup, setup=None):
        """Median over reps of fn's time; setup (untimed) runs before each call. On CUDA the
        calls are queued one after another, each behind the lead spin and between its own pair
        of events, and the host waits only after the last, so each window holds the call's GPU
        time; self.host_ms is then the median host time of a call."""
        # Python's cycle collector stays off while the calls are queued. With it on, two sweeps
        # of every kind in one process timed the norm alone's backward from 4096 columns at
        # 44-92% of copy on one H200, where runs of one kind a process gave 63-93; with it off,
        # 63-95 in one process.
        gc.collect()
        gc.disable()
        try:
            return self._median_ms(fn, reps, warmup, setup)
        finally:
            gc.enable()

    def _median_ms(self, fn, reps, warmup, setup):
        for _ in range(warmup):
            if setup:
                setup()
            fn()
        self.sync()
        host = []
        if not self.cuda:
            for _ in range(reps):
                if setup:
                    setup()
                t0 = time.perf_counter()
                fn()
                host.append((time.perf_counter() - t0) * 1e3)
            self.host_ms = statistics.median(host)
            return self.host_ms
        events = []
        for _ in range(reps):
            if setup:
                setup()
            if self.flush is not None:
                self.flush.zero_()
            if self.lead_cycles:
                torch.cuda._sleep(self.lead_cycles)
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            t0 = time.perf_counter()
            fn()
            host.append((time.perf_counter() - t0) * 1e3)
            end.record()
            events.append((start, end))
        self.sync()
        self.host_ms = statistics.median(host)
        return statistics.median(start.elapsed_time(end) for start, end in events)

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()


def copy_tbps(timer, device, nbytes_each, reps, rounds):
    src = torch.empty(nbytes_each, dtype=torch.uint8, device=device)
    src.fill_(1)
    dst = torch.empty_like(src)
    ms = min(timer.median_ms(lambda: dst.copy_(src), reps, warmup=3) for _ in range(rounds))
    return 2 * nbytes_each / ms / 1e9


def forward_backward(fn, leaves, grads):
    outs = fn(*leaves)
    need = [t for t in leaves if t is not None]
    return outs, torch.autograd.grad(outs, need, grads[:len(outs)])


def compare(got, want, names):
    """None if every tensor matches the reference closely enough, else what is wrong."""
    for name, a, b in zip(names, got, want):
        if a is None or b is None:
            if a is not b:
                return f"{name}: missing"
            continue
        if a.shape != b.shape or a.dtype != b.dtype:
            return f"{name}: {tuple(a.shape)} {a.dtype}, expected {tuple(b.shape)} {b.dtype}"
        a32, b32 = a.float(), b.float()
        if not bool(torch.isfinite(a32).all()):
            return f"{name}: not finite"
        err = (a32 - b32).abs().max().item()
        scale = max(b32.abs().max().item(), 1e-6)
        if err > TOL * scale:
            return f"{name}: max error {err:.3g} against a largest value of {scale:.3g}"
    return None


def timed(timer, fn, args, warmup, setup=None):
    """(fastest of args.rounds medians in ms, the fewest of their median host us a call)."""
    device_ms, host_us = [], []
    for _ in range(args.rounds):
        device_ms.append(timer.median_ms(fn, args.reps, warmup, setup=setup))
        host_us.append(timer.host_ms * 1e3)
    return min(device_ms), min(host_us)


def measure(impl, fn, row, leaves, grads, ref, names, timer, args):
    r = dict(impl=impl, check=None, error=None, fwd_ms=None, bwd_ms=None, fwd_host_us=None,
             bwd_host_us=None)
    try:
        # first call: compiles / autotunes where an implementation does that (not timed)
        outs, gr = forward_backward(fn, leaves, grads)
        timer.sync()
        got = list(outs) + list(gr)
        r["check"] = compare(got, ref, names)
        del outs, gr, got
        if r["check"] is not None:
            return r
        warmup = 1 if args.dry_run else 5
        if args.fwd_mode == "infer":
            def fwd():
                with torch.no_grad():
                    fn(*leaves)
        else:
            def fwd():
                fn(*leaves)
        r["fwd_ms"], r["fwd_host_us"] = timed(timer, fwd, args, warmup)
        need = [t for t in leaves if t is not None]
        state = {}

        def setup():
            state["outs"] = fn(*leaves)

        def bwd():
            outs = state.pop("outs")
            torch.autograd.grad(outs, need, grads[:len(outs)])
        r["bwd_ms"], r["bwd_host_us"] = timed(timer, bwd, args, warmup, setup)
    except Exception as e:  # noqa: BLE001 - one implementation failing must not end the run
        r["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
    return r


# ---------------------------------------------------------------------------------------------

def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=20, help="timed calls per measurement (median)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="measurements per figure, the fastest kept (host stalls only slow one)")
    ap.add_argument("--rows", choices=["all", "quick"], default="all")
    ap.add_argument("--kind", choices=list(KINDS) + ["all"],
                    default="all")
    ap.add_argument("--hidden", default="",
                    help="comma-separated hidden sizes: rows of the chosen kinds at these sizes, "
                         "one group each, in place of the standard rows (a sweep)")
    ap.add_argument("--impls", default=",".join(IMPLS),
                    help="comma-separated subset of " + ", ".join(IMPLS))
    ap.add_argument("--fwd-mode", choices=["train", "infer"], default="train",
                    help="time the forward with autograd recording (train) or under no_grad")
    ap.add_argument("--max-elements", type=int, default=2**27,
                    help="rows = min(32768, this // hidden); 2**28 gives PERFORMANCE.md's "
                         "32768 rows up to hidden 8192")
    ap.add_argument("--flush-l2", action="store_true",
                    help="evict L2 before each timed call (matters at small hidden)")
    ap.add_argument("--lead-ms", type=float, default=1.0,
                    help="GPU spin queued before each timed call, hiding the host's time to "
                         "issue it (0: none; the call's host time then counts where it "
                         "outlasts the GPU work queued before it)")
    ap.add_argument("--dry-run", action="store_true",
                    help="tiny rows on the CPU, no JSON: only exercises the code paths")
    args = ap.parse_args()
    impls = [i for i in args.impls.split(",") if i]
    for i in impls:
        if i not in IMPLS:
            ap.error(f"unknown implementation {i!r}")

    device = "cpu" if args.dry_run else "cuda"
    if args.dry_run:
        args.reps = min(args.reps, 2)
        specs, max_elements, copy_bytes = DRY_ROWS, 64 * 512, 2**22
    else:
        if not torch.cuda.is_available():
            sys.exit("no CUDA device (use --dry-run to exercise the script on the CPU)")
        specs = ALL_ROWS if args.rows == "all" else QUICK_ROWS
        max_elements, copy_bytes = args.max_elements, COPY_BYTES
    if args.hidden:
        kinds = KINDS if args.kind == "all" else (args.kind,)
        specs = [(k, int(h), None) for k in kinds for h in args.hidden.split(",")]
    specs = [s for s in specs if args.kind in ("all", s[0])]
    rows = [make_row(k, h, g, max_elements) for k, h, g in specs]

    mamba_ln = mamba_gated = None
    mamba_from = "not requested"
    if "mamba" in impls:
        mamba_ln, mamba_gated, mamba_from = load_mamba()
        print(f"mamba_ssm: {mamba_from}", flush=True)
    if "libssm" in impls and st is None:
        print(f"libssm.torch: {LIBSSM_IMPORT_ERROR}", flush=True)
    # Rows reset dynamo; the recompile limit is raised as well so that a shape it has already
    # seen can never send a row to eager silently (the name changed across torch versions).
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 64))

    gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu (dry run)"
    timer = Timer(device, args.flush_l2, args.lead_ms)
    copy = copy_tbps(timer, device, copy_bytes, max(args.reps, 10), args.rounds)
    print(f"device-to-device copy: {copy:.3f} TB/s (read + written bytes)", flush=True)

    # The JSON is rewritten after every row, so a run cut short (a call's time limit) keeps the
    # rows it measured.
    out = None if args.dry_run else cm.results_path("norm", gpu)
    meta = dict(
        gpu=gpu, torch=torch.__version__,
        triton=getattr(sys.modules.get("triton"), "__version__", None),
        libssm=getattr(libssm, "__version__", None), mamba_ssm=mamba_from,
        host=platform.node(), copy_tbps=copy, reps=args.reps, rounds=args.rounds,
        fwd_mode=args.fwd_mode, flush_l2=args.flush_l2, lead_ms=args.lead_ms,
        max_elements=max_elements,
        backward_timing="forward untimed, then torch.autograd.grad of all outputs timed")
    results = []
    for row in rows:
        fwd_bytes, bwd_bytes = nbytes(row)
        leaves, grads = make_inputs(row, device)
        names = (["y"] + (["residual_out"] if row["prenorm"] else [])
                 + [n for n, t in zip(("dx", "dresidual", "dz", "dweight", "dbias"), leaves)
                    if t is not None])
        ref_outs, ref_grads = forward_backward(make_impl("eager", row, None, None), leaves, grads)
        ref = [t.detach() for t in list(ref_outs) + list(ref_grads)]
        del ref_outs, ref_grads
        for impl in impls:
            try:
                fn = make_impl(impl, row, mamba_ln, mamba_gated)
            except Exception as e:  # noqa: BLE001 - not available: its columns read "-"
                r = dict(impl=impl, check=None, error=f"{type(e).__name__}: {e}"[:300],
                         fwd_ms=None, bwd_ms=None, fwd_host_us=None, bwd_host_us=None)
            else:
                r = measure(impl, fn, row, leaves, grads, ref, names, timer, args)
                del fn  # drops the compiled graph or autotuned state it holds
            r.update(kind=row["kind"], hidden=row["hidden"], rows=row["rows"],
                     group_size=row["group_size"], x_dtype=dname(row["x_dtype"]),
                     residual_dtype=dname(row["res_dtype"]) if row["res_dtype"] else None,
                     fwd_bytes=fwd_bytes, bwd_bytes=bwd_bytes,
                     fwd_tbps=r["fwd_ms"] and fwd_bytes / r["fwd_ms"] / 1e9,
                     bwd_tbps=r["bwd_ms"] and bwd_bytes / r["bwd_ms"] / 1e9)
            results.append(r)
            print({k: v for k, v in r.items() if v is not None}, flush=True)
            if device == "cuda":
                torch.cuda.empty_cache()
        del leaves, grads, ref
        if out is not None:
            cm.write_json(out, dict(meta, results=results))
        torch._dynamo.reset()  # frees the compiled graphs and their cached shapes
        if device == "cuda":
            torch.cuda.empty_cache()

    def find(impl, key, row):
        for r in results:
            if r["impl"] == impl and row_key(r) == row_key(row):
                return r[key]
        return None

    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731

    def cells(row, d):
        """TB/s of each implementation, libssm's % of copy, libssm's speed over each peer."""
        tb = {i: find(i, f"{d}_tbps", row) for i in IMPLS}
        flags = {i: find(i, "check", row) for i in IMPLS}
        lib = tb["libssm"]
        c = [("WRONG" if flags[i] else fmt(tb[i], ".2f")) for i in IMPLS]
        c.append(fmt(lib and 100 * lib / copy, ".0f"))
        c += [fmt(lib and tb[p] and lib / tb[p], ".2f") for p in PEERS]
        c.append(" / ".join(fmt(find(i, f"{d}_host_us", row), ".0f")
                            for i in ("libssm", "compile")))
        return c, lib, tb["compile"]

    def targets(row, fwd, bwd):
        if fwd[1] is None or bwd[1] is None:
            return "-"
        miss = []
        for d, (_, lib, comp), need in (("fwd", fwd, 90), ("bwd", bwd, 80)):
            if row["hidden"] >= 4096 and 100 * lib / copy < need:
                miss.append(f"{d} {100 * lib / copy:.0f}% < {need}%")
            if comp is None:
                miss.append(f"{d} compile not measured")
            elif lib < comp:
                miss.append(f"{d} < compile")
        return "; ".join(miss) or "ok"

    print(f"\nfused norm on {gpu}: TB/s of the minimal bytes (fastest of {args.rounds} medians "
          f"of {args.reps}); copy {copy:.3f} TB/s; 'x peer' = libssm speed / peer speed "
          f"(> 1: libssm faster); forward {args.fwd_mode} mode; backward timed alone")
    head = ["kind", "hidden", "rows", "x / residual"]
    for d in ("fwd", "bwd"):
        head += [f"{d} libssm", f"{d} eager", f"{d} compile", f"{d} mamba", f"{d} % copy",
                 f"{d} x eager", f"{d} x compile", f"{d} x mamba",
                 f"{d} host us libssm / compile"]
    head.append("targets")
    print("| " + " | ".join(head) + " |")
    print("|" + " --- |" * len(head))
    for row in rows:
        fwd, bwd = cells(row, "fwd"), cells(row, "bwd")
        kind = row["kind"] + (f" g{row['group_size']}" if row["group_size"] else "")
        gate = " (z " + dname(row["x_dtype"]) + ")" if row["z"] else ""
        dt = dname(row["x_dtype"]) + " / " + (dname(row["res_dtype"]) if row["res_dtype"]
                                             else "-" + gate)
        print("| " + " | ".join([kind, str(row["hidden"]), str(row["rows"]), dt]
                                + fwd[0] + bwd[0] + [targets(row, fwd, bwd)]) + " |")
    problems = [r for r in results if r["check"] or r["error"]]
    for r in problems:
        what = f"WRONG ({r['check']})" if r["check"] else r["error"]
        print(f"  {r['impl']} {r['kind']} hidden {r['hidden']}: {what}")
    print(f"\nresults in {out}" if out else "\ndry run: no JSON written")


if __name__ == "__main__":
    main()
