"""Causal depthwise conv1d on the GPU: libssm against causal-conv1d (Tri Dao's CUDA kernels,
`causal_conv1d_fn` and `causal_conv1d_update`, when the package imports), bf16 x, weight and
bias, width 4, SiLU.

Measured per row, each the median of CUDA-event timings after warm-up:
- fwd: the forward under torch.no_grad() (inference).
- fwd+bwd: the forward with autograd recording, then torch.autograd.grad of the output with
  respect to x, weight and bias, in one timed window (a training step's conv).
- update: one decode step, causal_conv1d_update of one new token against a conv state
  (batch, dim, 4) as Mamba keeps it, updated in place; timed --inner steps to a window, launch
  gaps included, as a decode loop runs them back to back.
Every time comes with a bandwidth, the minimal bytes over the time in TB/s (1e12 bytes/s):
- fwd: read x, weight, bias; write out (4 bytes an element of x).
- fwd+bwd: the forward's bytes, then read x, dout, weight, bias (the backward recomputes the
  pre-activation for SiLU's derivative); write dx, dweight, dbias (10 bytes an element).
- update: read x, weight, bias and conv_state; write conv_state and out.
"x cc" is libssm's speed over causal-conv1d's (its time / libssm's; > 1: libssm faster). A
device-to-device copy measured in the same run gives the ceiling.

Targets (PERFORMANCE.md, issue 4), marked in the table's last column, which lists the targets a
row misses ("ok": none missed; "-": not measurable, e.g. no peer):
- large rows (>= 2**25 elements, so x alone is past the 60 MB L2): libssm >= 1.2x
  causal-conv1d and >= 3.3 TB/s, for fwd and for fwd+bwd (PERFORMANCE.md quotes the peer's
  TB/s for the forward only: the fwd+bwd TB/s is the stricter reading);
- update rows: libssm >= 1.2x causal-conv1d.
Smaller rows are reported without a target ("small").

Rows (batch, dim, seqlen, layout), from small to large: one sequence; PERFORMANCE.md's two
rows (32, 1024, 180) and (8, 4096, 2048); then (16, 1536, 2048), (8, 4096, 4096) and
(4, 2048, 16384), 2**25.6 to 2**27 elements. Layout "bdl" is x (batch, dim, seqlen) with seqlen
contiguous; "cl" is channel-last, x (batch, seqlen, dim) contiguous and transposed, the layout
causal-conv1d supports for width <= 4 (Mamba-2 feeds its conv so). Update rows: batch 1 and 64,
dim 4096.

Before timing, each implementation's out, dx, dweight and dbias (update: out and the new
conv_state) are checked against torch in float32 on the same inputs (F.conv1d with groups=dim):
||err|| / ||ref|| <= 1e-2 and finite, or the implementation is reported WRONG and not timed.

    python benchmarks/bench_conv1d.py [--reps 30] [--inner 100] [--rows all|quick]
                                      [--impls libssm,causal_conv1d]

Writes benchmarks/results/conv1d_<gpu>.json and prints the table last. --dry-run runs tiny
rows on the CPU (no JSON, no peer) only to exercise the code paths where no GPU is at hand.
"""
import argparse
import math
import sys

import torch
import torch.nn.functional as F

import _common as cm

try:
    import libssm.torch as st
    LIBSSM_IMPORT_ERROR = None
except Exception as e:  # noqa: BLE001 - report why, and still measure the peer
    st = None
    LIBSSM_IMPORT_ERROR = cm.error_text(e)

IMPLS = ("libssm", "causal_conv1d")
WIDTH = 4
DTYPE = torch.bfloat16
LARGE_ELEMENTS = 2**25
TARGET_RATIO = 1.2
TARGET_TBPS = 3.3
TOL = 1e-2  # bf16 outputs rounded once: ~1e-3 expected
COPY_BYTES = 2**29  # 512 MiB each way: far past the L2

CONV_ROWS = [  # batch, dim, seqlen, layout
    (1, 2048, 512, "bdl"),
    (32, 1024, 180, "bdl"),
    (16, 1536, 2048, "bdl"),
    (8, 4096, 2048, "bdl"),
    (8, 4096, 4096, "bdl"),
    (4, 2048, 16384, "bdl"),
    (16, 1536, 2048, "cl"),
    (8, 4096, 2048, "cl"),
    (8, 4096, 4096, "cl"),
    (4, 2048, 16384, "cl"),
]
UPDATE_ROWS = [(1, 4096), (64, 4096)]  # batch, dim
QUICK_CONV_ROWS = [(8, 4096, 2048, "bdl"), (8, 4096, 4096, "bdl"), (8, 4096, 4096, "cl")]
DRY_CONV_ROWS = [(2, 64, 40, "bdl"), (2, 64, 40, "cl")]
DRY_UPDATE_ROWS = [(1, 64), (4, 64)]


def load_impls(impls):
    """{impl: (causal_conv1d_fn, causal_conv1d_update) or None}, {impl: where / why not}."""
    fns, notes = {}, {}
    if "libssm" in impls:
        fns["libssm"] = None if st is None else (st.causal_conv1d_fn, st.causal_conv1d_update)
        notes["libssm"] = LIBSSM_IMPORT_ERROR or "libssm.torch"
    if "causal_conv1d" in impls:
        mod, notes["causal_conv1d"] = cm.import_peer("causal_conv1d")
        fns["causal_conv1d"] = None if mod is None else (mod.causal_conv1d_fn,
                                                         mod.causal_conv1d_update)
    return fns, notes


# ---------------------------------------------------------------------------------------------
# inputs, references, byte counts

def make_conv_inputs(batch, dim, seqlen, layout, device):
    """[x, weight, bias] (requiring grad) and dout, which is laid out as x (and so as out, whose
    gradient autograd would pass in)."""
    g = torch.Generator(device=device).manual_seed(0)
    r = lambda *s: torch.randn(*s, device=device, generator=g)  # noqa: E731

    def activation(scale=1.0):
        if layout == "cl":
            return (scale * r(batch, seqlen, dim)).to(DTYPE).transpose(1, 2)
        return (scale * r(batch, dim, seqlen)).to(DTYPE)

    x = activation()
    weight = (0.5 * r(dim, WIDTH)).to(DTYPE)
    bias = (0.5 * r(dim)).to(DTYPE)
    return [t.requires_grad_(True) for t in (x, weight, bias)], activation()


def conv_reference(x, weight, bias, dout):
    """(out, dx, dweight, dbias) in float32, from upcast copies of the inputs."""
    x32, w32, b32 = (t.detach().float().requires_grad_(True) for t in (x, weight, bias))
    out = F.conv1d(x32, w32[:, None, :], b32, padding=WIDTH - 1, groups=x.shape[1])
    out = F.silu(out[..., :x.shape[2]])
    grads = torch.autograd.grad(out, (x32, w32, b32), dout.float())
    return [out.detach(), *grads]


def make_update_inputs(batch, dim, device):
    g = torch.Generator(device=device).manual_seed(1)
    r = lambda *s: torch.randn(*s, device=device, generator=g).to(DTYPE)  # noqa: E731
    return dict(x=r(batch, dim), conv_state=r(batch, dim, WIDTH), weight=r(dim, WIDTH),
                bias=r(dim))


def update_reference(inp):
    """(out, new conv_state) in float32: the state shifted left by one, x appended, and the
    width-4 window dotted with the weight."""
    window = torch.cat([inp["conv_state"][:, :, 1:], inp["x"][:, :, None]], dim=2).float()
    out = F.silu((window * inp["weight"].float()).sum(-1) + inp["bias"].float())
    return out, window


def conv_bytes(batch, dim, seqlen):
    n, e = batch * dim * seqlen, DTYPE.itemsize
    params = (dim * WIDTH + dim) * e
    fwd = 2 * n * e + params
    return fwd, fwd + 3 * n * e + 2 * params


def update_bytes(batch, dim):
    e = DTYPE.itemsize
    return (2 * batch * dim + 2 * batch * dim * WIDTH + dim * WIDTH + dim) * e


# ---------------------------------------------------------------------------------------------
# measurements

def measure_conv(impl, fns, unavailable, row, timer, args):
    """Result dict; fns: the implementation's (fn, update), None when unavailable says why."""
    r = dict(impl=impl, check=None, error=None, fwd_ms=None, fwd_bwd_ms=None)
    if fns is None:
        r["error"] = unavailable
        return r
    conv = fns[0]
    try:
        (x, weight, bias), dout = make_conv_inputs(*row, timer.device)
        ref = conv_reference(x, weight, bias, dout)

        def run():
            return conv(x, weight, bias, activation="silu")

        out = run()
        got = [out, *torch.autograd.grad(out, (x, weight, bias), dout)]
        r["errors"] = {n: cm.rel_err(a, b) for n, a, b in
                       zip(("out", "dx", "dweight", "dbias"), got, ref)}
        r["check"] = cm.check_errors(r["errors"].items(), TOL)
        del out, got, ref
        if r["check"] is not None:
            return r

        def fwd():
            with torch.no_grad():
                run()

        def fwd_bwd():
            torch.autograd.grad(run(), (x, weight, bias), dout)

        r["fwd_ms"] = timer.median_ms(fwd, args.reps, args.warmup)
        r["fwd_bwd_ms"] = timer.median_ms(fwd_bwd, args.reps, args.warmup)
    except Exception as e:  # noqa: BLE001 - one implementation failing must not end the run
        r["error"] = cm.error_text(e)
    return r


def measure_update(impl, fns, unavailable, row, timer, args):
    r = dict(impl=impl, check=None, error=None, update_ms=None)
    if fns is None:
        r["error"] = unavailable
        return r
    update = fns[1]
    try:
        inp = make_update_inputs(*row, timer.device)
        ref_out, ref_state = update_reference(inp)

        def step():
            return update(inp["x"], inp["conv_state"], inp["weight"], inp["bias"], "silu")

        out = step()
        r["errors"] = dict(out=cm.rel_err(out, ref_out),
                           conv_state=cm.rel_err(inp["conv_state"], ref_state))
        r["check"] = cm.check_errors(r["errors"].items(), TOL)
        if r["check"] is None:
            r["update_ms"] = timer.median_ms(step, args.reps, args.warmup, inner=args.inner)
    except Exception as e:  # noqa: BLE001
        r["error"] = cm.error_text(e)
    return r


# ---------------------------------------------------------------------------------------------
# table

def conv_targets(large, lib, cc):
    """The targets a row misses, as text; lib and cc: that implementation's result dicts."""
    if not large:
        return "small"
    miss = []
    for field, name in (("fwd", "fwd"), ("fwd_bwd", "fwd+bwd")):
        lms, cms, ltb = lib.get(field + "_ms"), cc.get(field + "_ms"), lib.get(field + "_tbps")
        if lms is None:
            return "-"
        if ltb < TARGET_TBPS:
            miss.append(f"{name} {ltb:.2f} < {TARGET_TBPS} TB/s")
        if cms is None:
            miss.append(f"{name} no peer")
        elif cms / lms < TARGET_RATIO:
            miss.append(f"{name} {cms / lms:.2f}x < {TARGET_RATIO}x")
    return "; ".join(miss) or "ok"


def print_tables(results, conv_rows, update_rows, gpu, copy, args):
    def find(kind, key, impl):
        for r in results:
            if r["kind"] == kind and r["key"] == list(key) and r["impl"] == impl:
                return r
        return {}

    def ms(r, field, scale=1.0, spec=".3f"):
        return "WRONG" if r.get("check") else cm.fmt(r.get(field) and scale * r[field], spec)

    print(f"\ncausal conv1d on {gpu}, bf16, width {WIDTH}, SiLU, bias (ms: median of "
          f"{args.reps}; TB/s of the minimal bytes; copy {copy:.2f} TB/s; x cc = causal-conv1d "
          f"time / libssm time; targets at >= 2^{math.log2(args.large_elements):.0f} elements: "
          f">= {TARGET_RATIO}x and >= "
          f"{TARGET_TBPS} TB/s)")
    head = ["batch, dim, seqlen", "layout", "elements"]
    for d in ("fwd", "fwd+bwd"):
        head += [f"{d} ms libssm", f"{d} ms cc", f"{d} TB/s libssm", f"{d} TB/s cc",
                 f"{d} x cc"]
    head.append("targets")
    print("| " + " | ".join(head) + " |")
    print("|" + " --- |" * len(head))
    for row in conv_rows:
        batch, dim, seqlen, layout = row
        n = batch * dim * seqlen
        lib, cc = find("conv", row, "libssm"), find("conv", row, "causal_conv1d")
        cells = [f"{batch}, {dim}, {seqlen}", layout, f"2^{math.log2(n):.1f}"]
        for field in ("fwd", "fwd_bwd"):
            lms, cms = lib.get(field + "_ms"), cc.get(field + "_ms")
            cells += [ms(lib, field + "_ms"), ms(cc, field + "_ms"),
                      cm.fmt(lib.get(field + "_tbps"), ".2f"),
                      cm.fmt(cc.get(field + "_tbps"), ".2f"),
                      cm.fmt(lms and cms and cms / lms, ".2f")]
        cells.append(conv_targets(n >= args.large_elements, lib, cc))
        print("| " + " | ".join(cells) + " |")

    print(f"\ncausal_conv1d_update, one token, conv_state (batch, dim, {WIDTH}), on {gpu} (us a "
          f"step: median of {args.reps} windows of {args.inner} steps; GB/s of the minimal "
          f"bytes; target >= {TARGET_RATIO}x)")
    print("| batch, dim | us libssm | us cc | GB/s libssm | GB/s cc | x cc | targets |")
    print("|" + " --- |" * 7)
    for row in update_rows:
        lib, cc = find("update", row, "libssm"), find("update", row, "causal_conv1d")
        lms, cms = lib.get("update_ms"), cc.get("update_ms")
        ratio = lms and cms and cms / lms
        target = "-" if ratio is None else ("ok" if ratio >= TARGET_RATIO
                                            else f"{ratio:.2f}x < {TARGET_RATIO}x")
        cells = [f"{row[0]}, {row[1]}", ms(lib, "update_ms", 1e3, ".2f"),
                 ms(cc, "update_ms", 1e3, ".2f"), ms(lib, "update_tbps", 1e3, ".0f"),
                 ms(cc, "update_tbps", 1e3, ".0f"), cm.fmt(ratio, ".2f"), target]
        print("| " + " | ".join(cells) + " |")
    for r in results:
        if r["check"] or r["error"]:
            what = f"WRONG ({r['check']})" if r["check"] else r["error"]
            print(f"  {r['impl']} {r['kind']} {tuple(r['key'])}: {what}")


# ---------------------------------------------------------------------------------------------

def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=30, help="timed windows per measurement (median)")
    ap.add_argument("--warmup", type=int, default=5, help="untimed calls before timing")
    ap.add_argument("--inner", type=int, default=100, help="update steps per timed window")
    ap.add_argument("--rows", choices=["all", "quick"], default="all")
    ap.add_argument("--impls", default=",".join(IMPLS),
                    help="comma-separated subset of " + ", ".join(IMPLS))
    ap.add_argument("--dry-run", action="store_true",
                    help="tiny rows on the CPU, no JSON: only exercises the code paths")
    args = ap.parse_args()
    impls = [i for i in args.impls.split(",") if i]
    for i in impls:
        if i not in IMPLS:
            ap.error(f"unknown implementation {i!r}")

    if args.dry_run:
        device = "cpu"
        args.reps, args.warmup, args.inner = min(args.reps, 2), 1, min(args.inner, 3)
        # so that the tiny rows also go through the target checks
        args.large_elements = 2**12
        conv_rows, update_rows, copy_bytes = DRY_CONV_ROWS, DRY_UPDATE_ROWS, 2**22
    else:
        if not torch.cuda.is_available():
            sys.exit("no CUDA device (use --dry-run to exercise the script on the CPU)")
        device = "cuda"
        conv_rows = CONV_ROWS if args.rows == "all" else QUICK_CONV_ROWS
        update_rows, copy_bytes = UPDATE_ROWS, COPY_BYTES
        args.large_elements = LARGE_ELEMENTS
    fns, notes = load_impls(impls)
    for impl, note in notes.items():
        print(f"{impl}: {note}", flush=True)

    gpu = cm.gpu_name(device)
    timer = cm.Timer(device)
    copy = cm.copy_tbps(timer, copy_bytes, max(args.reps, 10))
    print(f"device-to-device copy: {copy:.3f} TB/s (read + written bytes)", flush=True)

    results = []
    for row in conv_rows:
        fwd_bytes, fwd_bwd_bytes = conv_bytes(*row[:3])
        for impl in impls:
            r = measure_conv(impl, fns[impl], notes[impl], row, timer, args)
            r.update(kind="conv", key=list(row), fwd_bytes=fwd_bytes, fwd_bwd_bytes=fwd_bwd_bytes,
                     fwd_tbps=r["fwd_ms"] and fwd_bytes / r["fwd_ms"] / 1e9,
                     fwd_bwd_tbps=r["fwd_bwd_ms"] and fwd_bwd_bytes / r["fwd_bwd_ms"] / 1e9)
            results.append(r)
            print({k: v for k, v in r.items() if v is not None}, flush=True)
            if timer.cuda:
                torch.cuda.empty_cache()
    for row in update_rows:
        nbytes = update_bytes(*row)
        for impl in impls:
            r = measure_update(impl, fns[impl], notes[impl], row, timer, args)
            r.update(kind="update", key=list(row), update_bytes=nbytes,
                     update_tbps=r["update_ms"] and nbytes / r["update_ms"] / 1e9)
            results.append(r)
            print({k: v for k, v in r.items() if v is not None}, flush=True)

    out = None
    if not args.dry_run:
        out = cm.results_path("conv1d", gpu)
        cm.write_json(out, dict(
            gpu=gpu, **cm.environment(), peers=notes, copy_tbps=copy, reps=args.reps,
            warmup=args.warmup, inner=args.inner, dtype="bf16", width=WIDTH, activation="silu",
            targets=dict(large_elements=args.large_elements, ratio=TARGET_RATIO, tbps=TARGET_TBPS),
            results=results))
    print_tables(results, conv_rows, update_rows, gpu, copy, args)
    print(f"\nresults in {out}" if out else "\ndry run: no JSON written")


if __name__ == "__main__":
    main()
