"""The model benchmark of the fused-kernel background document (seeds/004) on the GPU: a Mamba-1
language model of 8 layers, d_model 1024 (d_inner 2048, conv width 4), d_state 32, vocab
16384, seqlen 512, at batch 1, 2, 4, 8 and 16, run as:
- eager: the pure-PyTorch reference, libssm._mamba_reference.lm_forward, float32: torch
  projections and conv, and the selective scan as a Python loop over time on (batch, d_inner,
  seqlen, d_state) decays and inputs made up front (the 004 baseline);
- compile: torch.compile (inductor, default mode) of the same reference, one compiled layer
  (norm, mixer, residual add) shared by the 8 layers. The 512-step time loop unrolls into the
  graph (each step its own kernels), so compiling takes minutes, and the whole model as one
  graph would be 8 times larger. Graphs: one per grad mode and batch class (batch 1; the
  others share a batch-dynamic one, unless the conv's backend choice splits the range, as it
  does at 16 on the CPU); the count and each first call's seconds are in the JSON;
- amp_fp16: the eager reference under torch.autocast(float16);
- libssm_fp32, libssm_bf16: libssm.torch.MambaLMHeadModel in float32 / bfloat16 (A_log, D and
  the residual stream in float32 either way, as mamba_ssm keeps them);
- mamba_fp32, mamba_bf16: the official mamba_ssm.models.mixer_seq_simple.MambaLMHeadModel, same
  config (its fast path: causal-conv1d, the CUDA selective scan, the fused Triton add+RMSNorm),
  when the installed mamba_ssm imports.
Every model holds the same weights: one float32 state_dict drawn once (seed 0) and loaded into
each.

Measured per implementation and batch:
- fwd ms: input ids to logits under torch.no_grad(), median of CUDA-event timings after
  warm-up (--reps calls, fewer, down to 3, where they would take more than --budget-s);
  "x eager": eager's time over this one (the speed-up over eager);
- fwd peak MB: torch.cuda.max_memory_allocated after a reset, around one forward, with only
  this implementation's model on the GPU: its weights, the ids and the forward's peak;
- fwd+bwd ms and peak MB: a training step, forward with autograd, cross-entropy against random
  targets, torch.autograd.grad of the loss with respect to every parameter, in one window.
eager and amp_fp16 are slow (the time loop launches thousands of kernels, and its backward
zero-fills a (batch, d_inner, seqlen, d_state) gradient for each of the 512 steps of each
layer, ~20 s a call at batch 16): their fwd+bwd is measured only up to batch
--slow-bwd-max-batch.

Correctness before timing: each implementation's logits at every batch against the eager
float32 reference, ||err|| / ||ref|| <= 2e-3 in float32, 3e-2 in bf16 / fp16; and, up to batch
--grad-check-max-batch (4: libssm's scan takes its narrow kernels at batch 1-2 and its wide ones
from 4), every parameter's gradient, <= 2e-3 in float32, 1e-1 in bf16 (amp_fp16's gradients are
not checked: without a loss scaler, fp16 gradients underflow, and dt_proj.weight's was measured
18% off on a small model; that is autocast's numerics, not a kernel's). A failing
implementation is reported WRONG and not timed; the errors are in the table and the JSON.

Target (issue 4): libssm faster than mamba_ssm at every batch size with memory no higher,
checked dtype by dtype (libssm_fp32 against mamba_fp32, libssm_bf16 against mamba_bf16) on
the fwd and fwd+bwd times and peaks, and printed as met or not.

    python benchmarks/bench_mamba_model.py [--reps 20] [--batches 1,2,4,8,16]
                                           [--impls eager,compile,...] [--fwd-only compile]
                                           [--merge]

Implementations run in the order libssm, mamba_ssm, eager, amp_fp16, compile, and
benchmarks/results/mamba_model_<gpu>.json is rewritten after each batch of each, so a run cut
short keeps what it measured. --merge keeps the rows of an earlier JSON for the same GPU and
model that this run does not measure (say the compile row run alone, after the rest), and
tables and plots them all; --fwd-only compile skips the compile row's training graph, the
longest compile. When matplotlib imports, mamba_model_speedup_<gpu>.png (forward speed-up over
eager against batch) and mamba_model_memory_<gpu>.png (forward peak memory against batch) are
written beside it. --dry-run runs a 2-layer toy model on the CPU (no JSON; the plots are
drawn, not saved) only to exercise the code paths where no GPU is at hand.
"""
import argparse
import io
import json
import sys
import time

import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

import _common as cm

try:
    import libssm.torch as st
    from libssm import _mamba_reference as ref
    LIBSSM_IMPORT_ERROR = None
except Exception as e:  # noqa: BLE001 - report why, and still measure the peers
    st = ref = None
    LIBSSM_IMPORT_ERROR = cm.error_text(e)

IMPLS = ("eager", "compile", "amp_fp16", "libssm_fp32", "libssm_bf16", "mamba_fp32",
         "mamba_bf16")
# Run order: the target's rows first, compile last, so that a run cut short (the JSON is
# written after each implementation) has lost the least; --merge can add the rest later.
RUN_ORDER = ("libssm_fp32", "libssm_bf16", "mamba_fp32", "mamba_bf16", "eager", "amp_fp16",
             "compile")
SLOW = ("eager", "amp_fp16")
REFERENCE_ROWS = {  # the rows that evaluate the pure-PyTorch reference, for the JSON
    "eager": "libssm._mamba_reference.lm_forward, float32",
    "compile": "torch.compile of one layer of libssm._mamba_reference.lm_forward (norm, "
               "mamba_forward, residual add), shared by the layers",
    "amp_fp16": "libssm._mamba_reference.lm_forward under torch.autocast(float16)",
}
NO_GRAD_CHECK = ("eager", "amp_fp16")  # the reference itself; fp16 without a loss scaler
CONFIG = dict(n_layer=8, d_model=1024, d_state=32, vocab_size=16384, seqlen=512)
BATCHES = (1, 2, 4, 8, 16)
DRY_CONFIG = dict(n_layer=2, d_model=64, d_state=8, vocab_size=256, seqlen=16)
DRY_BATCHES = (1, 2)
# (logits, gradients) tolerances on ||err|| / ||ref|| against the float32 reference
TOLS = {"fp32": (2e-3, 2e-3), "half": (3e-2, 1e-1)}
TARGET_PAIRS = (("libssm_fp32", "mamba_fp32"), ("libssm_bf16", "mamba_bf16"))


# ---------------------------------------------------------------------------------------------
# models

def load_mamba():
    """(MambaLMHeadModel, MambaConfig) of the installed mamba_ssm, or None, and a note. Its
    model needs the compiled extensions, so no source tree stands in for it."""
    mod, note = cm.import_mamba("models.mixer_seq_simple", source_ok=False)
    if mod is None:
        return None, note
    return (mod.MambaLMHeadModel, mod.MambaConfig), note


def impl_dtype(impl):
    return torch.bfloat16 if impl.endswith("bf16") else torch.float32


def compiled_reference(model):
    """forward(ids) -> logits: lm_forward's loop, each layer (norm, mixer, residual add) through
    one torch.compile'd function that the layers share (so one graph serves all 8)."""
    def layer_step(layer, residual):
        normed = ref._norm(layer.norm, residual.to(layer.norm.weight.dtype))
        return residual + ref.mamba_forward(layer.mixer, normed).to(residual.dtype)

    compiled = torch.compile(layer_step)
    backbone = model.backbone

    def forward(ids):
        residual = backbone.embedding(ids)
        if backbone.residual_in_fp32:
            residual = residual.float()
        if residual.shape[0] > 1:
            # Batch symbolic from the first compile past batch 1 (which is always specialised),
            # so later batches can share its graph instead of batch 2 getting one of its own;
            # "maybe": the conv's backend choice may still guard on ranges of batch sizes.
            torch._dynamo.maybe_mark_dynamic(residual, 0)
        for layer in backbone.layers:
            residual = compiled(layer, residual)
        hidden = ref._norm(backbone.norm_f, residual.to(backbone.norm_f.weight.dtype))
        return F.linear(hidden, model.lm_head.weight)
    return forward


def build(impl, cfg, master, device, mamba):
    """(model on device holding master's weights, forward(ids) -> logits)."""
    dtype = impl_dtype(impl)
    if impl.startswith("mamba"):
        lm_cls, config_cls = mamba
        model = lm_cls(config_cls(d_model=cfg["d_model"], n_layer=cfg["n_layer"],
                                  vocab_size=cfg["vocab_size"],
                                  ssm_cfg={"d_state": cfg["d_state"]}),
                       device=device, dtype=dtype)
    else:
        if st is None:
            raise RuntimeError(f"libssm.torch does not import: {LIBSSM_IMPORT_ERROR}")
        model = st.MambaLMHeadModel(st.MambaConfig(d_model=cfg["d_model"], n_layer=cfg["n_layer"],
                                                   vocab_size=cfg["vocab_size"],
                                                   ssm_cfg={"d_state": cfg["d_state"]}),
                                    device=device, dtype=dtype)
    model.load_state_dict(master)
    if impl == "eager":
        return model, lambda ids: ref.lm_forward(model, ids)
    if impl == "amp_fp16":
        def forward(ids):
            with torch.autocast(torch.device(device).type, dtype=torch.float16):
                return ref.lm_forward(model, ids)
        return model, forward
    if impl == "compile":
        return model, compiled_reference(model)
    return model, lambda ids: model(ids).logits


def train_step(forward, ids, targets, params):
    logits = forward(ids)
    loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
    return torch.autograd.grad(loss, params)


def make_batch(cfg, batch, device):
    """(ids, targets), the same on every run (drawn on the CPU from a seed)."""
    g = torch.Generator().manual_seed(1000 + batch)
    ids, targets = torch.randint(0, cfg["vocab_size"], (2, batch, cfg["seqlen"]), generator=g)
    return ids.to(device), targets.to(device)


# ---------------------------------------------------------------------------------------------
# reference, measurement

def reference_outputs(cfg, batches, master, device, grad_max_batch, timer):
    """{batch: (logits, {name: grad} or None)} from the eager float32 reference, kept on the
    CPU so the GPU holds one model at a time while the others are measured."""
    model, forward = build("eager", cfg, master, device, None)
    names, params = zip(*model.named_parameters())
    out = {}
    for batch in batches:
        ids, targets = make_batch(cfg, batch, device)
        with torch.no_grad():
            logits = forward(ids).cpu()
        grads = None
        if batch <= grad_max_batch:
            grads = {n: g.cpu() for n, g in zip(names, train_step(forward, ids, targets, params))}
        out[batch] = (logits, grads)
        timer.sync()
        print(f"reference at batch {batch} computed", flush=True)
    del model, forward
    return out


def check(impl, forward, model, batch_data, reference, timer, grads_wanted):
    """(errors dict, None or what is wrong, wall seconds of the first forward, of the first
    training step or None); the first calls compile / autotune where an implementation does."""
    ids, targets = batch_data
    ref_logits, ref_grads = reference
    tol_logits, tol_grads = TOLS["fp32" if impl_dtype(impl) == torch.float32
                                 and impl != "amp_fp16" else "half"]
    t0 = time.perf_counter()
    with torch.no_grad():
        logits = forward(ids)
    timer.sync()
    first_fwd = time.perf_counter() - t0
    err = cm.rel_err(logits, ref_logits)
    del logits
    errors = {"logits": err}
    problem = cm.check_errors([("logits", err)], tol_logits)
    first_train = None
    if ref_grads is not None and grads_wanted:
        t0 = time.perf_counter()
        named = list(model.named_parameters())
        grads = train_step(forward, ids, targets, [p for _, p in named])
        timer.sync()
        first_train = time.perf_counter() - t0
        grad_errors = [(n, cm.rel_err(g, ref_grads[n]) if n in ref_grads
                        else "no such parameter in the reference")
                       for (n, _), g in zip(named, grads)]
        del grads
        worst = max(grad_errors, key=lambda e: float("inf") if isinstance(e[1], str) else e[1])
        errors["worst_grad"], errors["worst_grad_of"] = worst[1], worst[0]
        problem = problem or cm.check_errors([("gradient of " + n, e) for n, e in grad_errors],
                                             tol_grads)
    return errors, problem, first_fwd, first_train


def timed_ms(fn, timer, args):
    """(median ms, repetitions): the first warm-up call is timed on the host clock, and the
    repetitions are cut (down to 3) so the timed calls take about --budget-s at most; after a
    call of a second or more (the eager reference's), that first call is warm-up enough."""
    t0 = time.perf_counter()
    fn()
    timer.sync()
    once = time.perf_counter() - t0
    reps = max(3, min(args.reps, int(args.budget_s / max(once, 1e-6))))
    return timer.median_ms(fn, reps, args.warmup - 1 if once < 1.0 else 0), reps


def measure(impl, forward, model, batch, batch_data, reference, timer, args):
    r = dict(impl=impl, batch=batch, check=None, error=None, fwd_ms=None, fwd_peak_mb=None,
             fwd_bwd_ms=None, fwd_bwd_peak_mb=None)
    ids, targets = batch_data
    params = [p for p in model.parameters()]
    try:
        if impl == "eager":
            r["errors"] = "the reference itself"
        else:
            r["errors"], r["check"], r["first_fwd_s"], r["first_fwd_bwd_s"] = check(
                impl, forward, model, batch_data, reference, timer,
                grads_wanted=impl not in NO_GRAD_CHECK and impl not in args.fwd_only)
            if r["check"] is not None:
                return r

        def infer():
            with torch.no_grad():
                forward(ids)

        def step():
            train_step(forward, ids, targets, params)

        r["fwd_ms"], r["fwd_reps"] = timed_ms(infer, timer, args)
        r["fwd_peak_mb"] = timer.peak_mb(infer)
        if impl in SLOW and batch > args.slow_bwd_max_batch:
            r["fwd_bwd_skipped"] = f"slow implementation above batch {args.slow_bwd_max_batch}"
        elif impl in args.fwd_only:
            r["fwd_bwd_skipped"] = "--fwd-only"
        else:
            r["fwd_bwd_ms"], r["fwd_bwd_reps"] = timed_ms(step, timer, args)
            r["fwd_bwd_peak_mb"] = timer.peak_mb(step)
    except Exception as e:  # noqa: BLE001 - e.g. out of memory: that cell reads "-"
        r["error"] = cm.error_text(e)
    return r


# ---------------------------------------------------------------------------------------------
# report

def find(results, impl, batch):
    for r in results:
        if r["impl"] == impl and r["batch"] == batch:
            return r
    return {}


def error_summary(r):
    """"(logits 3e-07, grads 9e-07)" from a checked row's errors."""
    errors = r.get("errors") or {}
    parts = [f"{k} {errors[f]:.1e}" for k, f in (("logits", "logits"), ("grads", "worst_grad"))
             if isinstance(errors.get(f), float)]
    return f"({', '.join(parts)})" if parts else ""


def print_table(results, batches, gpu, args):
    print(f"\nMamba LM ({args.config_text}) on {gpu}: ms, median of {args.reps} calls (3 or more "
          f"for slow calls, see the JSON); x eager = eager time / this time; peak = "
          f"torch.cuda.max_memory_allocated with this model alone on the GPU; {', '.join(SLOW)} "
          f"fwd+bwd only up to batch {args.slow_bwd_max_batch}")
    head = ["batch", "implementation", "fwd ms", "fwd x eager", "fwd peak MB", "fwd+bwd ms",
            "fwd+bwd x eager", "fwd+bwd peak MB", "check"]
    print("| " + " | ".join(head) + " |")
    print("|" + " --- |" * len(head))
    for batch in batches:
        eager = find(results, "eager", batch)
        for impl in IMPLS:
            r = find(results, impl, batch)
            if not r:
                continue
            speed = {f: eager.get(f) and r.get(f) and eager[f] / r[f]
                     for f in ("fwd_ms", "fwd_bwd_ms")}
            state = ("WRONG: " + r["check"] if r.get("check") else "error" if r.get("error")
                     else "reference" if impl == "eager" else "ok " + error_summary(r))
            cells = [str(batch), impl, cm.fmt(r.get("fwd_ms"), ".2f"),
                     cm.fmt(speed["fwd_ms"], ".1f"), cm.fmt(r.get("fwd_peak_mb"), ".0f"),
                     cm.fmt(r.get("fwd_bwd_ms"), ".2f"), cm.fmt(speed["fwd_bwd_ms"], ".1f"),
                     cm.fmt(r.get("fwd_bwd_peak_mb"), ".0f"), state]
            print("| " + " | ".join(cells) + " |")
    errors = {}
    for r in results:
        if r.get("error"):
            errors.setdefault((r["impl"], r["error"]), []).append(str(r["batch"]))
    for (impl, error), which in errors.items():
        print(f"  {impl} batch {', '.join(which)}: {error}")


def target_verdict(results, batches):
    """(met: bool or None when not measurable, lines)."""
    lines, met = [], True
    for lib_impl, peer_impl in TARGET_PAIRS:
        for batch in batches:
            lib, peer = find(results, lib_impl, batch), find(results, peer_impl, batch)
            fields = ("fwd_ms", "fwd_bwd_ms", "fwd_peak_mb", "fwd_bwd_peak_mb")
            missing = [f for f in fields if lib.get(f) is None or peer.get(f) is None]
            if missing:
                why = (lib.get("error") or peer.get("error")
                       or (lib.get("check") and "libssm WRONG")
                       or (peer.get("check") and "peer WRONG") or "no " + ", ".join(missing))
                lines.append(f"  {lib_impl} vs {peer_impl}, batch {batch}: not measured ({why})")
                met = None if met is not False else met
                continue
            miss = [f"{f} {lib[f]:.2f} >= {peer[f]:.2f}" for f in ("fwd_ms", "fwd_bwd_ms")
                    if lib[f] >= peer[f]]
            miss += [f"{f} {lib[f]:.0f} > {peer[f]:.0f}" for f in fields[2:] if lib[f] > peer[f]]
            if miss:
                met = False
            lines.append(f"  {lib_impl} vs {peer_impl}, batch {batch}: fwd "
                         f"{peer['fwd_ms'] / lib['fwd_ms']:.2f}x, fwd+bwd "
                         f"{peer['fwd_bwd_ms'] / lib['fwd_bwd_ms']:.2f}x, peak MB fwd "
                         f"{lib['fwd_peak_mb']:.0f} / {peer['fwd_peak_mb']:.0f}, fwd+bwd "
                         f"{lib['fwd_bwd_peak_mb']:.0f} / {peer['fwd_bwd_peak_mb']:.0f}: "
                         + ("; ".join(miss) if miss else "ok"))
    return met, lines


def plot(results, batches, gpu, config_text, dry_run):
    """The two PNGs (speed-up and peak memory against batch), or why not; in a dry run they are
    drawn into memory only."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # noqa: BLE001 - plots are optional
        return [f"plots skipped: matplotlib does not import ({cm.error_text(e)})"]
    written = []
    for kind, ylabel in (("speedup", "forward speed-up over eager fp32"),
                         ("memory", "forward peak memory (MiB)")):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for impl in IMPLS:
            xs, ys = [], []
            for batch in batches:
                r, eager = find(results, impl, batch), find(results, "eager", batch)
                y = (eager.get("fwd_ms") and r.get("fwd_ms") and eager["fwd_ms"] / r["fwd_ms"]
                     if kind == "speedup" else r.get("fwd_peak_mb"))
                if y is not None:
                    xs.append(batch)
                    ys.append(y)
            if xs:
                ax.plot(xs, ys, marker="o", label=impl)
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(batches), [str(b) for b in batches])
        ax.set_yscale("log")
        ax.set_xlabel("batch")
        ax.set_ylabel(ylabel)
        ax.set_title(f"Mamba LM ({config_text}), {gpu}", fontsize=8)
        ax.grid(True, which="both", alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
        fig.tight_layout()
        if dry_run:
            fig.savefig(io.BytesIO(), format="png")
            written.append(f"{kind} plot drawn (dry run: not saved)")
        else:
            path = cm.results_path(f"mamba_model_{kind}", gpu).with_suffix(".png")
            path.parent.mkdir(parents=True, exist_ok=True)
            fig.savefig(path, dpi=120)
            written.append(f"{kind} plot: {path}")
        plt.close(fig)
    return written


# ---------------------------------------------------------------------------------------------

def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=20, help="timed calls per measurement (median)")
    ap.add_argument("--warmup", type=int, default=3,
                    help="untimed calls before timing (at least 1)")
    ap.add_argument("--budget-s", type=float, default=5.0,
                    help="fewer timed calls (down to 3) where --reps would take longer")
    ap.add_argument("--slow-bwd-max-batch", type=int, default=4,
                    help="largest batch at which the slow implementations' fwd+bwd is timed")
    ap.add_argument("--grad-check-max-batch", type=int, default=4,
                    help="largest batch at which gradients are checked (logits at every batch)")
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--impls", default=",".join(IMPLS),
                    help="comma-separated subset of " + ", ".join(IMPLS))
    ap.add_argument("--fwd-only", default="",
                    help="comma-separated implementations whose fwd+bwd (and gradient check) "
                         "is skipped, e.g. compile when its training graph compiles too long")
    ap.add_argument("--merge", action="store_true",
                    help="keep an earlier JSON's rows that this run does not measure")
    ap.add_argument("--dry-run", action="store_true",
                    help="a toy model on the CPU, no JSON: only exercises the code paths")
    args = ap.parse_args()
    impls = [i for i in args.impls.split(",") if i]
    args.fwd_only = [i for i in args.fwd_only.split(",") if i]
    for i in impls + args.fwd_only:
        if i not in IMPLS:
            ap.error(f"unknown implementation {i!r}")

    if args.dry_run:
        device, cfg, batches = "cpu", DRY_CONFIG, DRY_BATCHES
        args.reps, args.warmup = min(args.reps, 3), 1
    else:
        if not torch.cuda.is_available():
            sys.exit("no CUDA device (use --dry-run to exercise the script on the CPU)")
        device, cfg = "cuda", CONFIG
        batches = [int(b) for b in args.batches.split(",") if b]
    if st is None:
        sys.exit(f"libssm.torch does not import ({LIBSSM_IMPORT_ERROR}): the reference model "
                 f"and the weights come from it")
    args.config_text = ", ".join(f"{k} {v}" for k, v in cfg.items())
    gpu = cm.gpu_name(device)
    timer = cm.Timer(device)
    out = None if args.dry_run else cm.results_path("mamba_model", gpu)

    prior, notes = [], {}
    if args.merge and out is not None and out.exists():
        old = json.loads(out.read_text())
        if old.get("config") != cfg:
            sys.exit(f"--merge: {out} holds another model ({old.get('config')})")
        prior, notes = old["results"], old.get("implementations", {})
    mamba = None
    if any(i.startswith("mamba") for i in impls):
        mamba, notes["mamba_ssm"] = load_mamba()
        print(f"mamba_ssm: {notes['mamba_ssm']}", flush=True)
    # The float32 rows are checked at 2e-3 against a float32 reference, which cuDNN would
    # otherwise run its conv for in TF32 (~5e-4 an element). torch's matmuls are float32 already.
    torch.backends.cudnn.allow_tf32 = False
    # One compiled layer serves all layers; the limit is raised so that no recompile can
    # silently send a layer to eager.
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 64))

    torch.manual_seed(0)
    master = st.MambaLMHeadModel(st.MambaConfig(
        d_model=cfg["d_model"], n_layer=cfg["n_layer"], vocab_size=cfg["vocab_size"],
        ssm_cfg={"d_state": cfg["d_state"]})).state_dict()
    reference = reference_outputs(cfg, batches, master, device, args.grad_check_max_batch, timer)

    results = []

    def merged():
        done = {(r["impl"], r["batch"]) for r in results}
        return [r for r in prior if (r["impl"], r["batch"]) not in done] + results

    def save():
        if out is None:
            return
        rows = merged()
        cm.write_json(out, dict(
            gpu=gpu, **cm.environment(), config=cfg, batches=sorted({r["batch"] for r in rows}),
            earlier_rows=len(rows) - len(results), implementations=notes, reps=args.reps,
            budget_s=args.budget_s, warmup=args.warmup,
            slow_bwd_max_batch=args.slow_bwd_max_batch,
            grad_check_max_batch=args.grad_check_max_batch, tolerances=TOLS,
            tf32_matmul=torch.backends.cuda.matmul.allow_tf32,
            tf32_cudnn=torch.backends.cudnn.allow_tf32, results=rows))

    for impl in sorted(impls, key=RUN_ORDER.index):
        torch._dynamo.reset()
        graphs_before = counters["stats"]["unique_graphs"]
        try:
            if impl.startswith("mamba") and mamba is None:
                raise RuntimeError(notes["mamba_ssm"])
            model, forward = build(impl, cfg, master, device, mamba)
        except Exception as e:  # noqa: BLE001 - not available: its cells read "-"
            for batch in batches:
                results.append(dict(impl=impl, batch=batch, check=None, error=cm.error_text(e)))
                print(results[-1], flush=True)
        else:
            notes[impl] = REFERENCE_ROWS.get(impl, type(model).__module__ + "."
                                             + type(model).__name__)
            for batch in batches:
                r = measure(impl, forward, model, batch, make_batch(cfg, batch, device),
                            reference[batch], timer, args)
                results.append(r)
                print({k: v for k, v in r.items() if v is not None}, flush=True)
                save()
                if timer.cuda:
                    torch.cuda.empty_cache()
            if impl == "compile":  # one per grad mode and batch class: see the docstring
                notes["compile_graphs"] = counters["stats"]["unique_graphs"] - graphs_before
                print(f"compile: {notes['compile_graphs']} graphs", flush=True)
            del model, forward
        torch._dynamo.reset()  # frees compiled graphs
        if timer.cuda:
            torch.cuda.empty_cache()
        save()

    rows = merged()
    all_batches = sorted({r["batch"] for r in rows})
    print_table(rows, all_batches, gpu, args)
    met, lines = target_verdict(rows, all_batches)
    print("\ntarget: libssm faster than mamba_ssm at every batch size, peak memory no higher: "
          + {True: "MET", False: "NOT MET", None: "not measurable (rows missing)"}[met])
    print("\n".join(lines))
    for line in plot(rows, all_batches, gpu, args.config_text, args.dry_run):
        print(line)
    print(f"\nresults in {out}" if out else "\ndry run: no JSON written")


if __name__ == "__main__":
    main()
