"""One Mamba layer's decode step on the GPU, per token: the conv step (causal_conv1d_update) then
the selective-state update, libssm against mamba_ssm's (its Triton selective_state_update with
causal-conv1d's causal_conv1d_update, the pair mamba_ssm's Mamba.step / Mamba2.step call) and
against the same step in plain torch ops (the conv as Mamba2.step's fallback when the kernels
are missing, the state update as mamba_ssm's selective_state_update_ref).
The projections around them (in_proj, x_proj, dt_proj, out_proj) are left out: they are the
same matmuls for every implementation.

Layouts, bf16 activations, weights as the layers keep them, a float32 SSM state:
- mamba1: d_inner 2048 and 4096, d_state 16. conv over x (batch, d_inner); state (batch,
  d_inner, 16); dt, z (batch, d_inner); B, C (batch, 16); A (d_inner, 16), D and dt_bias
  (d_inner,) float32.
- mamba2: nheads 64 and 128, headdim 64, d_state 128, ngroups 1 and 8. conv over xBC (batch,
  nheads*64 + 2*ngroups*128); x, B and C are views of its output; state (batch, nheads, 64,
  128); dt (batch, nheads) bf16 and dt_bias, A, D (nheads,) float32, each broadcast with
  stride 0 over headdim (A also over d_state), as Mamba2.step passes them; no z (the gate
  goes to the norm).
Both at batch 1 (launch-bound: the step is a few microseconds of GPU work) and 64.

Two timings per implementation, each the median of --reps windows after warm-up, divided by
the steps in a window (--inner, default 100):
- eager: the steps launched back to back from Python, CUDA events around the window: launch
  cost included, as an eager decode loop pays it;
- graph: the --inner steps captured once in a CUDA graph, one replay a window: the GPU time
  with launch gaps mostly gone, as a decode loop captured as a graph runs (mamba_ssm's
  generation captures its decode step so).
The conv and the state update are also timed alone, eager and replayed from a graph (the
second table: where a graph step's time goes at batch 1, where launches, not bytes, bound
it). "x mamba" is libssm's speed over mamba_ssm's (its time / libssm's; > 1: libssm faster).
TB/s: the minimal bytes of the step (each input read once, each output written once, the
states read and written, the conv output written once and read once) over the graph time; at
batch 64 the mamba2 state dominates (256 MiB read and written at 128 heads).

Before timing, one step of each implementation, from the same inputs and states, is checked
against a float64 evaluation of the step: out and both new states within ||err|| / ||ref|| <=
2e-2 (bf16 out), or the implementation is reported WRONG and not timed.

    python benchmarks/bench_decode.py [--reps 30] [--inner 100] [--impls libssm,mamba_ssm,torch]
                                      [--layouts mamba1,mamba2] [--batches 1,64]

mamba_ssm: the installed package if it imports; otherwise, when MAMBA_SSM_SRC names an unpacked
mamba_ssm source tree, its Triton selective_state_update.py is loaded from there without the
package's __init__ (which needs the compiled extensions); causal_conv1d_update comes from the
causal_conv1d package. Missing either, mamba_ssm's step reads "-" (the part it has is still
timed alone). Writes benchmarks/results/decode_<gpu>.json and prints the table last.
--dry-run runs tiny configurations on the CPU (no JSON; the graph columns then time eager
steps) only to exercise the code paths where no GPU is at hand.
"""
import argparse
import sys

import torch
import torch.nn.functional as F

import _common as cm

try:
    import libssm.torch as st
    LIBSSM_IMPORT_ERROR = None
except Exception as e:  # noqa: BLE001 - report why, and still measure the peers
    st = None
    LIBSSM_IMPORT_ERROR = cm.error_text(e)

IMPLS = ("libssm", "mamba_ssm", "torch")
WIDTH = 4
ACT_DTYPE = torch.bfloat16
STATE_DTYPE = torch.float32
TOL = 2e-2
CONFIGS = [
    dict(layout="mamba1", d_inner=2048, d_state=16),
    dict(layout="mamba1", d_inner=4096, d_state=16),
    dict(layout="mamba2", nheads=64, headdim=64, d_state=128, ngroups=1),
    dict(layout="mamba2", nheads=64, headdim=64, d_state=128, ngroups=8),
    dict(layout="mamba2", nheads=128, headdim=64, d_state=128, ngroups=1),
    dict(layout="mamba2", nheads=128, headdim=64, d_state=128, ngroups=8),
]
BATCHES = (1, 64)
DRY_CONFIGS = [dict(layout="mamba1", d_inner=64, d_state=4),
               dict(layout="mamba2", nheads=4, headdim=8, d_state=16, ngroups=2)]
DRY_BATCHES = (1, 3)


def config_name(cfg):
    if cfg["layout"] == "mamba1":
        return f"d_inner {cfg['d_inner']}, d_state {cfg['d_state']}"
    return (f"heads {cfg['nheads']}x{cfg['headdim']}, d_state {cfg['d_state']}, "
            f"groups {cfg['ngroups']}")


# ---------------------------------------------------------------------------------------------
# the step in torch ops (the "torch" implementation, and in float64 the reference)

def torch_conv_update(x, conv_state, weight, bias, activation):
    """causal_conv1d_update in torch ops, as Mamba2.step's fallback: shift the state, append x,
    dot the window with the weight, in the inputs' dtype."""
    conv_state.copy_(torch.roll(conv_state, shifts=-1, dims=-1))
    conv_state[:, :, -1] = x
    out = torch.sum(conv_state * weight, dim=-1) + bias
    return F.silu(out) if activation else out


def torch_state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False):
    """selective_state_update in torch ops (mamba_ssm's selective_state_update_ref), state
    updated in place; the arithmetic runs in the state's dtype or float32, whichever is wider."""
    mamba1 = state.dim() == 3
    if mamba1:  # one head of d_inner channels
        state, x, dt, z = (t if t is None else t.unsqueeze(1) for t in (state, x, dt, z))
        A, D, dt_bias = (t if t is None else t.unsqueeze(0) for t in (A, D, dt_bias))
        B, C = B.unsqueeze(1), C.unsqueeze(1)
    work = torch.promote_types(state.dtype, torch.float32)
    per_group = state.shape[1] // B.shape[1]
    B = B.to(work).repeat_interleave(per_group, dim=1)[:, :, None, :]
    C = C.to(work).repeat_interleave(per_group, dim=1)[:, :, None, :]
    dt = dt.to(work) + (dt_bias.to(work) if dt_bias is not None else 0)
    if dt_softplus:
        dt = F.softplus(dt)
    xw = x.to(work)
    new = state.to(work) * torch.exp(dt[..., None] * A.to(work)) + (dt * xw)[..., None] * B
    state.copy_(new)
    out = (new * C).sum(-1)
    if D is not None:
        out = out + D.to(work) * xw
    if z is not None:
        out = out * F.silu(z.to(work))
    out = out.to(x.dtype)
    return out.squeeze(1) if mamba1 else out


# ---------------------------------------------------------------------------------------------
# inputs and byte counts

class Inputs:
    """A layer's decode inputs: x_in (the conv's input for this token), conv_state, conv weight
    and bias, the SSM state, and the state update's other operands; split(conv_out) gives its
    (x, B, C)."""

    def __init__(self, cfg, batch, device):
        g = torch.Generator(device=device).manual_seed(batch)
        r = lambda *s, scale=1.0: scale * torch.randn(*s, device=device, generator=g)  # noqa
        self.cfg, self.batch = cfg, batch
        n = cfg["d_state"]
        if cfg["layout"] == "mamba1":
            d = conv_dim = cfg["d_inner"]
            self.state = r(batch, d, n, scale=0.5).to(STATE_DTYPE)
            self.dt = r(batch, d, scale=0.5).to(ACT_DTYPE)
            self.A = -torch.rand(d, n, device=device, generator=g) * n - 0.5
            self.B = r(batch, n).to(ACT_DTYPE)
            self.C = r(batch, n).to(ACT_DTYPE)
            self.D = r(d)
            self.z = r(batch, d).to(ACT_DTYPE)
            self.dt_bias = r(d, scale=0.5) - 3.0
        else:
            h, p, ng = cfg["nheads"], cfg["headdim"], cfg["ngroups"]
            conv_dim = h * p + 2 * ng * n
            self.state = r(batch, h, p, n, scale=0.5).to(STATE_DTYPE)
            self.dt = r(batch, h, scale=0.5).to(ACT_DTYPE)[:, :, None].expand(batch, h, p)
            self.A = (-torch.rand(h, device=device, generator=g) * 4 - 0.5)[:, None, None] \
                .expand(h, p, n)
            self.B = self.C = None
            self.D = r(h)[:, None].expand(h, p)
            self.z = None
            self.dt_bias = (r(h, scale=0.5) - 3.0)[:, None].expand(h, p)
        self.x_in = r(batch, conv_dim).to(ACT_DTYPE)
        self.conv_state = r(batch, conv_dim, WIDTH).to(ACT_DTYPE)
        self.conv_weight = r(conv_dim, WIDTH, scale=0.5).to(ACT_DTYPE)
        self.conv_bias = r(conv_dim, scale=0.5).to(ACT_DTYPE)

    def split(self, conv_out):
        """(x, B, C) for the state update from the conv's output (views of it for mamba2)."""
        cfg = self.cfg
        if cfg["layout"] == "mamba1":
            return conv_out, self.B, self.C
        h, p, n, ng = cfg["nheads"], cfg["headdim"], cfg["d_state"], cfg["ngroups"]
        x = conv_out[:, :h * p].view(self.batch, h, p)
        B = conv_out[:, h * p:h * p + ng * n].view(self.batch, ng, n)
        C = conv_out[:, h * p + ng * n:].view(self.batch, ng, n)
        return x, B, C

    def states(self):
        return self.conv_state, self.state

    def converted(self, dtype):
        """A copy with every tensor in dtype (and so with states of its own)."""
        new = object.__new__(Inputs)
        for k, v in vars(self).items():
            setattr(new, k, v.to(dtype) if isinstance(v, torch.Tensor) else v)
        return new


def unique_bytes(t):
    """Bytes of the distinct elements of t (axes of stride 0 counted once)."""
    if t is None:
        return 0
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride:
            n *= size
    return n * t.element_size()


def step_bytes(inp):
    """Minimal bytes of one step: conv (read x_in, weight, bias, conv_state; write conv_state,
    conv out) then the state update (read conv out's x, B, C once, dt, A, D, z, dt_bias, state;
    write state, out)."""
    conv_out = torch.empty_like(inp.x_in)
    x, B, C = inp.split(conv_out)
    conv = (unique_bytes(inp.x_in) + unique_bytes(inp.conv_weight) + unique_bytes(inp.conv_bias)
            + 2 * unique_bytes(inp.conv_state) + unique_bytes(conv_out))
    ssm = (sum(unique_bytes(t) for t in (x, B, C, inp.dt, inp.A, inp.D, inp.z, inp.dt_bias))
           + 2 * unique_bytes(inp.state) + unique_bytes(x))
    return conv + ssm


# ---------------------------------------------------------------------------------------------
# implementations

def load_impls(impls):
    """{impl: (conv_update or None, state_update or None)}, {impl: where they came from}."""
    fns, notes = {}, {}
    if "libssm" in impls:
        fns["libssm"] = (None, None) if st is None else (st.causal_conv1d_update,
                                                         st.selective_state_update)
        notes["libssm"] = LIBSSM_IMPORT_ERROR or "libssm.torch"
    if "mamba_ssm" in impls:
        ssu_mod, ssu_note = cm.import_mamba("ops.triton.selective_state_update")
        cc_mod, cc_note = cm.import_peer("causal_conv1d")
        fns["mamba_ssm"] = (cc_mod and cc_mod.causal_conv1d_update,
                            ssu_mod and ssu_mod.selective_state_update)
        notes["mamba_ssm"] = f"selective_state_update: {ssu_note}; causal_conv1d_update: {cc_note}"
    if "torch" in impls:
        fns["torch"] = (torch_conv_update, torch_state_update)
        notes["torch"] = "torch ops (this script's torch_conv_update, torch_state_update)"
    return fns, notes


def make_calls(conv_update, state_update, inp):
    """(conv(), state_update_alone(), step()) on inp, None where a part is missing; the state
    update alone reads a conv output made once, so the conv is not in its time."""
    def conv():
        return conv_update(inp.x_in, inp.conv_state, inp.conv_weight, inp.conv_bias, "silu")

    def ssm(conv_out):
        x, B, C = inp.split(conv_out)
        return state_update(inp.state, x, inp.dt, inp.A, B, C, inp.D, z=inp.z,
                            dt_bias=inp.dt_bias, dt_softplus=True)

    conv_out = torch.randn(inp.x_in.shape, device=inp.x_in.device).to(ACT_DTYPE)
    return (conv if conv_update else None,
            (lambda: ssm(conv_out)) if state_update else None,
            (lambda: ssm(conv())) if conv_update and state_update else None)


def reference_step(inp):
    """(out, conv_state, state) after one step, in float64, inp left as it was."""
    ref = inp.converted(torch.float64)
    x, B, C = ref.split(torch_conv_update(ref.x_in, ref.conv_state, ref.conv_weight,
                                          ref.conv_bias, "silu"))
    out = torch_state_update(ref.state, x, ref.dt, ref.A, B, C, ref.D, ref.z, ref.dt_bias,
                             dt_softplus=True)
    return out, ref.conv_state, ref.state


def measure(impl, fns, unavailable, cfg, batch, timer, args):
    r = dict(impl=impl, check=None, error=None, conv_us=None, ssm_us=None, step_us=None,
             graph_us=None, conv_graph_us=None, ssm_graph_us=None)
    conv_update, state_update = fns
    if conv_update is None and state_update is None:
        r["error"] = unavailable
        return r
    try:
        inp = Inputs(cfg, batch, timer.device)
        want = reference_step(inp)
        conv, ssm_alone, step = make_calls(conv_update, state_update, inp)
        if step is None:
            r["error"] = f"no full step ({unavailable}); the part present is timed alone"
        else:
            out = step()
            r["errors"] = {n: cm.rel_err(a, b) for n, a, b in
                           zip(("out", "conv_state", "state"), (out, *inp.states()), want)}
            r["check"] = cm.check_errors(r["errors"].items(), TOL)
            if r["check"] is not None:
                return r
        us = lambda ms: 1e3 * ms  # noqa: E731
        for name, fn in (("conv", conv), ("ssm", ssm_alone)):
            if fn:
                r[name + "_us"] = us(timer.median_ms(fn, args.reps, args.warmup,
                                                     inner=args.inner))
                r[name + "_graph_us"] = us(timer.graph_ms(fn, args.reps, args.warmup,
                                                          inner=args.inner))
        if step:
            r["step_us"] = us(timer.median_ms(step, args.reps, args.warmup, inner=args.inner))
            r["graph_us"] = us(timer.graph_ms(step, args.reps, args.warmup, inner=args.inner))
    except Exception as e:  # noqa: BLE001 - one implementation failing must not end the run
        r["error"] = cm.error_text(e)
    return r


# ---------------------------------------------------------------------------------------------

def print_table(results, configs, batches, gpu, args):
    def find(cfg, batch, impl):
        for r in results:
            if r["config"] == cfg and r["batch"] == batch and r["impl"] == impl:
                return r
        return {}

    def us(r, field):
        return "WRONG" if r.get("check") else cm.fmt(r.get(field), ".2f")

    print(f"\none Mamba layer's decode step (conv step + selective state update) on {gpu}: us a "
          f"token, median of {args.reps} windows of {args.inner} steps; eager = launched from "
          f"Python, graph = replayed from a CUDA graph; x mamba = mamba_ssm time / libssm time; "
          f"TB/s: minimal bytes over libssm's graph time")
    head = ["layout", "config", "batch", "MB", "libssm eager", "mamba eager", "torch eager",
            "libssm graph", "mamba graph", "torch graph", "eager x mamba", "graph x mamba",
            "libssm TB/s"]
    print("| " + " | ".join(head) + " |")
    print("|" + " --- |" * len(head))
    for cfg in configs:
        for batch in batches:
            lib, mam, tch = (find(cfg, batch, i) for i in IMPLS)
            ratio = {f: lib.get(f) and mam.get(f) and mam[f] / lib[f]
                     for f in ("step_us", "graph_us")}
            nbytes = lib.get("step_bytes") or mam.get("step_bytes") or tch.get("step_bytes")
            cells = [cfg["layout"], config_name(cfg), str(batch),
                     cm.fmt(nbytes and nbytes / 1e6, ".2f"),
                     us(lib, "step_us"), us(mam, "step_us"), us(tch, "step_us"),
                     us(lib, "graph_us"), us(mam, "graph_us"), us(tch, "graph_us"),
                     cm.fmt(ratio["step_us"], ".2f"), cm.fmt(ratio["graph_us"], ".2f"),
                     cm.fmt(lib.get("graph_us") and nbytes / lib["graph_us"] / 1e6, ".2f")]
            print("| " + " | ".join(cells) + " |")
    print("\nthe parts alone, us a token (conv = conv step, ssu = selective state update; "
          "eager / graph replay)")
    head = ["layout", "config", "batch"] + [f"{i} {part} {mode}" for i in IMPLS[:2]
                                            for part in ("conv", "ssu")
                                            for mode in ("eager", "graph")]
    print("| " + " | ".join(head) + " |")
    print("|" + " --- |" * len(head))
    for cfg in configs:
        for batch in batches:
            cells = [cfg["layout"], config_name(cfg), str(batch)]
            for impl in IMPLS[:2]:
                r = find(cfg, batch, impl)
                cells += [us(r, f) for f in ("conv_us", "conv_graph_us", "ssm_us",
                                             "ssm_graph_us")]
            print("| " + " | ".join(cells) + " |")
    for r in results:
        if r["check"] or r["error"]:
            what = f"WRONG ({r['check']})" if r["check"] else r["error"]
            print(f"  {r['impl']} {r['config']['layout']} {config_name(r['config'])} batch "
                  f"{r['batch']}: {what}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=30, help="timed windows per measurement (median)")
    ap.add_argument("--warmup", type=int, default=10, help="untimed steps before timing")
    ap.add_argument("--inner", type=int, default=100,
                    help="steps per timed window, and per captured graph")
    ap.add_argument("--impls", default=",".join(IMPLS),
                    help="comma-separated subset of " + ", ".join(IMPLS))
    ap.add_argument("--layouts", default="mamba1,mamba2")
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--dry-run", action="store_true",
                    help="tiny configurations on the CPU, no JSON: only exercises the code paths")
    args = ap.parse_args()
    impls = [i for i in args.impls.split(",") if i]
    for i in impls:
        if i not in IMPLS:
            ap.error(f"unknown implementation {i!r}")
    layouts = [s for s in args.layouts.split(",") if s]

    if args.dry_run:
        device = "cpu"
        args.reps, args.warmup, args.inner = min(args.reps, 2), 1, min(args.inner, 3)
        configs, batches = DRY_CONFIGS, DRY_BATCHES
    else:
        if not torch.cuda.is_available():
            sys.exit("no CUDA device (use --dry-run to exercise the script on the CPU)")
        device = "cuda"
        configs, batches = CONFIGS, [int(b) for b in args.batches.split(",") if b]
    configs = [c for c in configs if c["layout"] in layouts]
    fns, notes = load_impls(impls)
    for impl, note in notes.items():
        print(f"{impl}: {note}", flush=True)
    gpu = cm.gpu_name(device)
    timer = cm.Timer(device)

    results = []
    for cfg in configs:
        for batch in batches:
            nbytes = step_bytes(Inputs(cfg, batch, device))
            for impl in impls:
                r = measure(impl, fns[impl], notes[impl], cfg, batch, timer, args)
                r.update(config=cfg, batch=batch, step_bytes=nbytes)
                results.append(r)
                print({k: v for k, v in r.items() if v is not None}, flush=True)

    out = None
    if not args.dry_run:
        out = cm.results_path("decode", gpu)
        cm.write_json(out, dict(
            gpu=gpu, **cm.environment(), implementations=notes, reps=args.reps,
            warmup=args.warmup, inner=args.inner, activation_dtype="bf16", state_dtype="fp32",
            conv_width=WIDTH, results=results))
    print_table(results, configs, batches, gpu, args)
    print(f"\nresults in {out}" if out else "\ndry run: no JSON written")


if __name__ == "__main__":
    main()
