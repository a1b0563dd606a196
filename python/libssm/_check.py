"""`python -m libssm check`: says which library is loaded, then checks every op on every device
against a reference (CPU: libssm's CPU path against a float64 NumPy evaluation of the formula;
each CUDA device: libssm on the GPU against libssm's CPU path, in float32 and bfloat16), one
line per check and a summary; the exit status is nonzero on any failure. The ops are the
selective scan, the fused norm and the causal conv1d."""

import sys

import numpy as np

from . import _conv1d_reference, _norm_reference, _reference
from . import _state_update_reference

# Max |result - reference| / max |reference| allowed, per (compared against, dtype, op).
TOLERANCE = {
    ("float64 reference", "float32", "fwd"): 1e-5,
    ("float64 reference", "float32", "bwd"): 1e-4,
    ("cpu", "float32", "fwd"): 1e-4,
    ("cpu", "float32", "bwd"): 1e-3,
    ("cpu", "bfloat16", "fwd"): 1e-2,   # bf16 outputs carry 2^-9 relative rounding
    ("cpu", "bfloat16", "bwd"): 2e-2,
    ("float64 reference", "float32", "step"): 1e-5,  # the decode step
    ("cpu", "float32", "step"): 1e-4,
    ("cpu", "bfloat16", "step"): 1e-2,
}

# Each case varies the options the kernels specialise on.
CASES = {
    "plain": dict(B="variable", C="variable"),
    "full": dict(B="grouped", C="variable", D=True, z=True, delta_bias=True, softplus=True,
                 initial_state=True, last_state=True),
    "fixed": dict(B="fixed", C="fixed", D=True, softplus=True, last_state=True),
}
CPU_SIZES = dict(batch=2, dim=4, seqlen=6, dstate=3)
CUDA_SIZES = dict(batch=2, dim=48, seqlen=333, dstate=16)  # seqlen a multiple of no chunk size
ACTIVATIONS = ("u", "delta", "B", "C", "z", "initial_state")  # the inputs that take the dtype


def make_inputs(case, batch, dim, seqlen, dstate, seed):
    """float32 NumPy inputs for one case, and the upstream gradients for the backward."""
    rng = np.random.default_rng(seed)
    opts = CASES[case]

    def normal(*shape, scale=1.0):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    def bc(form):
        if form == "fixed":
            return normal(dim, dstate)
        if form == "grouped":
            return normal(batch, 2, dstate, seqlen)
        return normal(batch, dstate, seqlen)

    softplus = bool(opts.get("softplus"))
    x = {
        "u": normal(batch, dim, seqlen),
        "delta": (normal(batch, dim, seqlen, scale=0.5) if softplus else
                  rng.uniform(0.01, 0.3, (batch, dim, seqlen)).astype(np.float32)),
        "A": -rng.uniform(0.5, 2.0, (dim, dstate)).astype(np.float32),
        "B": bc(opts["B"]), "C": bc(opts["C"]),
        "D": normal(dim) if opts.get("D") else None,
        "z": normal(batch, dim, seqlen) if opts.get("z") else None,
        "delta_bias": (rng.uniform(-1.0, 0.0, dim).astype(np.float32)
                       if opts.get("delta_bias") else None),
        "initial_state": normal(batch, dim, dstate) if opts.get("initial_state") else None,
    }
    dout = normal(batch, dim, seqlen)
    dlast = normal(batch, dim, dstate) if opts.get("last_state") else None
    return x, softplus, bool(opts.get("last_state")), dout, dlast


def relative_error(result, reference):
    result = np.asarray(result, dtype=np.float64)
    reference = np.asarray(reference, dtype=np.float64)
    if result.shape != reference.shape:
        return float("inf")
    scale = np.abs(reference).max() if reference.size else 0.0
    return float(np.abs(result - reference).max() / (scale or 1.0)) if reference.size else 0.0


def run_op(libssm, x, softplus, last_state, dout, dlast):
    """(forward outputs, backward gradients) by name, from whatever arrays x holds."""
    fwd = libssm.selective_scan(x["u"], x["delta"], x["A"], x["B"], x["C"], x["D"], x["z"],
                                x["delta_bias"], delta_softplus=softplus,
                                initial_state=x["initial_state"],
                                return_last_state=last_state)
    outputs = {"out": fwd[0], "last_state": fwd[1]} if last_state else {"out": fwd}
    grads = libssm.selective_scan_bwd(x["u"], x["delta"], x["A"], x["B"], x["C"], dout, x["D"],
                                      x["z"], x["delta_bias"], delta_softplus=softplus,
                                      initial_state=x["initial_state"], dlast_state=dlast)
    grads = {"d" + name: g for name, g in zip(_reference.INPUT_NAMES, grads) if g is not None}
    return outputs, grads


# Fused norm: each case varies what the kernels specialise on (kind, residual, gate and its
# placement, groups, zero-centred weight).
NORM_CASES = {
    "rms": dict(kind="rms", eps=1e-6, residual=True, weight=True),
    "layer": dict(kind="layer", eps=1e-5, residual=True, weight=True, bias=True, z=True,
                  norm_before_gate=False),
    "group": dict(kind="rms", eps=1e-5, weight=True, z=True, group_size=True,
                  zero_centered_weight=True),
}
NORM_CPU_SIZES = dict(rows=(2, 3), hidden=8, group=4)
NORM_CUDA_SIZES = dict(rows=(3, 77), hidden=1000, group=250)  # hidden a multiple of no vector
NORM_ACTIVATIONS = ("x", "residual", "z")  # the inputs that take the dtype


def make_norm_inputs(case, rows, hidden, group, seed):
    """(float32 NumPy inputs, options, dy, dresidual_out) for one norm case."""
    rng = np.random.default_rng(seed)
    opts = NORM_CASES[case]
    shape = tuple(rows) + (hidden,)

    def normal(*shape, scale=1.0, offset=0.0):
        return (offset + rng.standard_normal(shape) * scale).astype(np.float32)

    x = {
        "x": normal(*shape, offset=0.5),
        "residual": normal(*shape) if opts.get("residual") else None,
        "weight": normal(hidden, scale=0.2, offset=1.0) if opts.get("weight") else None,
        "bias": normal(hidden, scale=0.2) if opts.get("bias") else None,
        "z": normal(*shape) if opts.get("z") else None,
    }
    options = dict(kind=opts["kind"], eps=opts["eps"],
                   group_size=group if opts.get("group_size") else None,
                   norm_before_gate=opts.get("norm_before_gate", True),
                   zero_centered_weight=bool(opts.get("zero_centered_weight")))
    if options["zero_centered_weight"]:
        x["weight"] = x["weight"] - 1.0
    dro = normal(*shape) if opts.get("residual") else None
    return x, options, normal(*shape), dro


def run_norm(libssm, x, opts, dy, dro):
    """(forward outputs, backward gradients) by name, from whatever arrays x holds. dx is the
    gradient of both x and residual."""
    fwd = libssm.norm_fwd(x["x"], x["weight"], x["bias"], residual=x["residual"], z=x["z"],
                          want_residual_out=True, **opts)
    outputs = {"y": fwd.y, "residual_out": fwd.residual_out, "rstd": fwd.rstd}
    if fwd.mean is not None:
        outputs["mean"] = fwd.mean
    s = fwd.residual_out if x["residual"] is not None else x["x"]
    grads = libssm.norm_bwd(s, dy, fwd.mean, fwd.rstd, x["weight"], x["bias"], z=x["z"],
                            dresidual_out=dro, **opts)
    return outputs, {k: v for k, v in grads._asdict().items() if v is not None}


def _norm_reference_results(x, opts, dy, dro):
    y, s, mean, rstd = _norm_reference.forward(x, opts)
    ngroups = rstd.shape[1]
    fwd = {"y": y, "residual_out": s, "rstd": rstd if ngroups > 1 else rstd[:, 0]}
    if mean is not None:
        fwd["mean"] = mean if ngroups > 1 else mean[:, 0]
    grads = _norm_reference.gradients(x, opts, dy, dro)
    bwd = {"dx": grads["x"]}
    for name in ("weight", "bias", "z"):
        if grads[name] is not None:
            bwd["d" + name] = grads[name]
    return fwd, bwd


class Report:
    def __init__(self, stream):
        self.stream = stream
        self.passed = self.failed = self.skipped = 0

    def say(self, text=""):
        print(text, file=self.stream, flush=True)

    def skip(self, where, why):
        self.skipped += 1
        self.say("SKIP  %-8s %s" % (where, why))

    def compare(self, where, op, dtype, case, against, results, references,
                family="selective_scan"):
        """One check line: the worst of several named results against their references."""
        tol = TOLERANCE[(against, dtype, op)]
        worst, worst_name, problems = -1.0, "", []
        for name, ref in references.items():
            got = results.get(name)
            if got is None:
                problems.append("%s missing" % name)
                continue
            err = relative_error(got, ref)
            if not err <= worst:
                worst, worst_name = err, name
        worst = max(worst, 0.0)
        ok = not problems and worst <= tol
        self.passed += ok
        self.failed += not ok
        detail = "; ".join(problems) if problems else "worst %s" % worst_name
        self.say("%s  %-8s %s_%s %-8s %-5s vs %-17s max rel err %.1e (tol %.0e, %s)"
                 % ("PASS" if ok else "FAIL", where, family, op, dtype, case, against, worst,
                    tol, detail))

    def compare_calls(self, where, dtype, case, against, run, reference,
                      family="selective_scan"):
        """Runs fwd+bwd through `run` and compares with `reference`; a libssm error fails."""
        import libssm
        try:
            results = run()
        except libssm.Error as e:
            for op in ("fwd", "bwd"):
                self.failed += 1
                self.say("FAIL  %-8s %s_%s %-8s %-5s %s: %s"
                         % (where, family, op, dtype, case, type(e).__name__, e))
            return
        for op, got, ref in zip(("fwd", "bwd"), results, reference):
            self.compare(where, op, dtype, case, against, got, ref, family)


# Selective-state decode step: Mamba-1 with every optional operand, Mamba-2 with groups and
# state_batch_indices holding a padding row. The state is float32; on CUDA the other operands
# take the checked dtype.
STATE_UPDATE_CASES = {
    "mamba1": dict(mamba2=False, D=True, z=True, dt_bias=True, softplus=True),
    "mamba2": dict(mamba2=True, ngroups=2, D=True, dt_bias=True, softplus=True, indices=True),
}
STATE_UPDATE_CPU_SIZES = dict(batch=3, nheads=4, headdim=3, dstate=5)
STATE_UPDATE_CUDA_SIZES = dict(batch=5, nheads=8, headdim=64, dstate=128)


def make_state_update_inputs(case, batch, nheads, headdim, dstate, seed):
    """(float32 NumPy inputs, dt_softplus) for one decode-step case; state_batch_indices, when
    the case has them, are int64 with row 0 a padding row."""
    rng = np.random.default_rng(seed)
    opts = STATE_UPDATE_CASES[case]
    m2 = opts["mamba2"]
    ngroups = opts.get("ngroups", 1)
    if not m2:
        nheads = ngroups = 1
    rows = (batch, nheads, headdim) if m2 else (batch, headdim)
    channel = rows[1:]

    def normal(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    def uniform(low, high, *shape):
        return rng.uniform(low, high, shape).astype(np.float32)

    slots = batch + 2
    x = {
        "state": normal(slots, *channel, dstate),
        "x": normal(*rows), "dt": uniform(0.0, 0.5, *rows),
        "A": uniform(-2.0, -0.1, *channel, dstate),
        "B": normal(*((batch, ngroups, dstate) if m2 else (batch, dstate))),
        "C": normal(*((batch, ngroups, dstate) if m2 else (batch, dstate))),
        "D": normal(*channel) if opts.get("D") else None,
        "z": normal(*rows) if opts.get("z") else None,
        "dt_bias": uniform(-0.25, 0.25, *channel) if opts.get("dt_bias") else None,
        "state_batch_indices": None,
    }
    if opts.get("indices"):
        idx = rng.permutation(slots)[:batch].astype(np.int64)
        idx[0] = -1
        x["state_batch_indices"] = idx
    return x, bool(opts.get("softplus"))


def run_state_update(libssm, x, softplus):
    """{"out", "state"} after one step; x["state"] is updated in place and returned."""
    out = libssm.selective_state_update(x["state"], x["x"], x["dt"], x["A"], x["B"], x["C"],
                                        x["D"], x["z"], x["dt_bias"], dt_softplus=softplus,
                                        state_batch_indices=x["state_batch_indices"])
    return {"out": out, "state": x["state"]}


def _compare_state_update(report, where, dtype, case, against, run, reference):
    import libssm
    try:
        results = run()
    except libssm.Error as e:
        report.failed += 1
        report.say("FAIL  %-8s state_update_step %-8s %-5s %s: %s"
                   % (where, dtype, case, type(e).__name__, e))
        return
    report.compare(where, "step", dtype, case, against, results, reference, "state_update")


def check_state_update_cpu(report, libssm):
    for seed, case in enumerate(STATE_UPDATE_CASES):
        x, softplus = make_state_update_inputs(case, seed=seed, **STATE_UPDATE_CPU_SIZES)
        out, state = _state_update_reference.step(x, softplus)
        _compare_state_update(report, "cpu", "float32", case, "float64 reference",
                              lambda: run_state_update(libssm, dict(x, state=x["state"].copy()),
                                                       softplus),
                              {"out": out, "state": state})


def check_state_update_cuda(report, libssm, where, dtype, to_device, to_host):
    for seed, case in enumerate(STATE_UPDATE_CASES):
        x, softplus = make_state_update_inputs(case, seed=100 + seed, **STATE_UPDATE_CUDA_SIZES)
        kinds = {"state": "float32", "state_batch_indices": "int64"}
        dev = {k: None if v is None else to_device(v, kinds.get(k, dtype)) for k, v in x.items()}
        # The CPU path sees exactly the values the GPU sees (already rounded to dtype), in host
        # arrays of its own (to_host may return a view), since it updates the state in place.
        host = {k: None if v is None else np.array(to_host(v)) for k, v in dev.items()}
        host["state_batch_indices"] = x["state_batch_indices"]
        reference = run_state_update(libssm, host, softplus)

        def run():
            return {k: to_host(v) for k, v in run_state_update(libssm, dev, softplus).items()}
        _compare_state_update(report, where, dtype, case, "cpu", run, reference)


# Causal conv1d: the options the kernels branch on (packed sequences, initial and final
# states) and both layouts of x, which take different kernels on CUDA.
CONV1D_CASES = {
    "plain": dict(width=4, bias=True, silu=True),
    "states": dict(width=3, bias=True, initial_states=True, final_states=True, seq_idx=True),
    "chanlast": dict(width=6, silu=True, final_states=True, channel_last=True),
}
CONV1D_CPU_SIZES = dict(batch=2, dim=3, seqlen=7)
CONV1D_CUDA_SIZES = dict(batch=2, dim=48, seqlen=333)  # seqlen a multiple of no vector


def make_conv1d_inputs(case, batch, dim, seqlen, seed):
    """(float32 NumPy inputs, silu, return_final_states, dout, dfinal_states) for one conv1d
    case; x and dout channel-last when the case says so."""
    rng = np.random.default_rng(seed)
    opts = CONV1D_CASES[case]
    width = opts["width"]

    def normal(*shape, scale=1.0):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    def layout(a):
        return np.ascontiguousarray(a.transpose(0, 2, 1)).transpose(0, 2, 1) \
            if opts.get("channel_last") else a

    seq_idx = None
    if opts.get("seq_idx"):
        seq_idx = np.sort(rng.integers(0, 3, (batch, seqlen)), axis=1).astype(np.int32)
    x = {
        "x": layout(normal(batch, dim, seqlen)),
        "weight": normal(dim, width, scale=width ** -0.5),
        "bias": normal(dim) if opts.get("bias") else None,
        "initial_states": normal(batch, dim, width - 1) if opts.get("initial_states") else None,
        "seq_idx": seq_idx,
    }
    final = bool(opts.get("final_states"))
    dfinal = normal(batch, dim, width - 1) if final else None
    return x, bool(opts.get("silu")), final, layout(normal(batch, dim, seqlen)), dfinal


def run_conv1d(libssm, x, silu, final, dout, dfinal):
    """(forward outputs, backward gradients) by name, from whatever arrays x holds."""
    activation = "silu" if silu else None
    fwd = libssm.causal_conv1d(x["x"], x["weight"], x["bias"], activation=activation,
                               initial_states=x["initial_states"], return_final_states=final,
                               seq_idx=x["seq_idx"])
    outputs = {"out": fwd[0], "final_states": fwd[1]} if final else {"out": fwd}
    grads = libssm.causal_conv1d_bwd(x["x"], x["weight"], dout, x["bias"], activation=activation,
                                     initial_states=x["initial_states"], seq_idx=x["seq_idx"],
                                     dfinal_states=dfinal)
    return outputs, {k: v for k, v in grads._asdict().items() if v is not None}


def _conv1d_reference_results(x, silu, final, dout, dfinal):
    out, final_states = _conv1d_reference.forward(x, silu)
    fwd = {"out": out, "final_states": final_states} if final else {"out": out}
    grads = _conv1d_reference.gradients(x, silu, dout, dfinal)
    return fwd, {"d" + k: v for k, v in grads.items() if v is not None}


def check_conv1d_cpu(report, libssm):
    for seed, case in enumerate(CONV1D_CASES):
        x, silu, final, dout, dfinal = make_conv1d_inputs(case, seed=seed, **CONV1D_CPU_SIZES)
        report.compare_calls("cpu", "float32", case, "float64 reference",
                             lambda: run_conv1d(libssm, x, silu, final, dout, dfinal),
                             _conv1d_reference_results(x, silu, final, dout, dfinal),
                             family="conv1d")


def check_conv1d_cuda(report, libssm, where, dtype, to_device, to_host):
    """The GPU against libssm's CPU path on the same (rounded) values: x, dout and the states
    in dtype, weight and bias float32."""
    kinds = {"weight": "float32", "bias": "float32", "seq_idx": "int32"}
    for seed, case in enumerate(CONV1D_CASES):
        x, silu, final, dout, dfinal = make_conv1d_inputs(case, seed=100 + seed,
                                                          **CONV1D_CUDA_SIZES)
        try:
            dev = {k: None if v is None else to_device(v, kinds.get(k, dtype))
                   for k, v in x.items()}
            dev_dout = to_device(dout, dtype)
            dev_dfinal = None if dfinal is None else to_device(dfinal, "float32")
        except (ImportError, TypeError, ValueError) as e:
            report.skip(where, "%s conv1d %s: cannot make these arrays (%s)" % (dtype, case, e))
            continue
        host = {k: None if v is None else to_host(v) for k, v in dev.items()}
        host["seq_idx"] = x["seq_idx"]
        reference = run_conv1d(libssm, host, silu, final, to_host(dev_dout),
                               None if dev_dfinal is None else to_host(dev_dfinal))

        def run():
            fwd, bwd = run_conv1d(libssm, dev, silu, final, dev_dout, dev_dfinal)
            return ({k: to_host(v) for k, v in fwd.items()},
                    {k: to_host(v) for k, v in bwd.items()})
        report.compare_calls(where, dtype, case, "cpu", run, reference, family="conv1d")


def check_cpu(report, libssm):
    for seed, case in enumerate(CASES):
        x, softplus, last_state, dout, dlast = make_inputs(case, seed=seed, **CPU_SIZES)
        out, last = _reference.forward(x, softplus)
        ref_fwd = {"out": out, "last_state": last} if last_state else {"out": out}
        ref_bwd = {"d" + k: v for k, v in _reference.gradients(x, softplus, dout, dlast).items()
                   if v is not None}
        report.compare_calls("cpu", "float32", case, "float64 reference",
                             lambda: run_op(libssm, x, softplus, last_state, dout, dlast),
                             (ref_fwd, ref_bwd))
    for seed, case in enumerate(NORM_CASES):
        x, opts, dy, dro = make_norm_inputs(case, seed=seed, **NORM_CPU_SIZES)
        report.compare_calls("cpu", "float32", case, "float64 reference",
                             lambda: run_norm(libssm, x, opts, dy, dro),
                             _norm_reference_results(x, opts, dy, dro), family="norm")
    check_conv1d_cpu(report, libssm)
    check_state_update_cpu(report, libssm)


def _torch_backend(device):
    import torch
    if not torch.cuda.is_available() or device >= torch.cuda.device_count():
        return None

    def to_device(a, dtype):
        return torch.from_numpy(a).to("cuda:%d" % device, getattr(torch, dtype))

    def to_host(t):
        torch.cuda.synchronize(device)
        return t.float().cpu().numpy()
    return "torch", to_device, to_host


def _cupy_backend(device):
    import cupy
    if device >= cupy.cuda.runtime.getDeviceCount():
        return None

    def to_device(a, dtype):
        if dtype == "bfloat16":
            import ml_dtypes
            a = a.astype(ml_dtypes.bfloat16)
        with cupy.cuda.Device(device):
            return cupy.asarray(a)

    def to_host(c):
        with cupy.cuda.Device(device):
            cupy.cuda.get_current_stream().synchronize()
        return cupy.asnumpy(c).astype(np.float32)
    return "cupy", to_device, to_host


def _backend(device):
    for make in (_torch_backend, _cupy_backend):
        try:
            backend = make(device)
        except ImportError:
            continue
        if backend is not None:
            return backend
    return None


def check_cuda_device(report, libssm, device):
    where = "cuda:%d" % device
    backend = _backend(device)
    if backend is None:
        report.skip(where, "neither torch nor cupy can reach this device; CUDA checks need one "
                           "of them to make device arrays")
        return
    name, to_device, to_host = backend
    report.say("%s: device arrays made with %s" % (where, name))
    for dtype in ("float32", "bfloat16"):
        for seed, case in enumerate(CASES):
            x, softplus, last_state, dout, dlast = make_inputs(case, seed=100 + seed,
                                                               **CUDA_SIZES)
            try:
                dev = {k: None if v is None else
                       to_device(v, dtype if k in ACTIVATIONS else "float32")
                       for k, v in x.items()}
                dev_dout = to_device(dout, dtype)
                dev_dlast = None if dlast is None else to_device(dlast, dtype)
            except (ImportError, TypeError, ValueError) as e:
                report.skip(where, "%s %s: %s cannot make these arrays (%s)"
                            % (dtype, case, name, e))
                continue
            # The CPU path sees exactly the values the GPU sees (already rounded to dtype).
            host = {k: None if v is None else to_host(v) for k, v in dev.items()}
            host_dlast = None if dev_dlast is None else to_host(dev_dlast)
            reference = run_op(libssm, host, softplus, last_state, to_host(dev_dout), host_dlast)

            def run():
                fwd, bwd = run_op(libssm, dev, softplus, last_state, dev_dout, dev_dlast)
                return ({k: to_host(v) for k, v in fwd.items()},
                        {k: to_host(v) for k, v in bwd.items()})
            report.compare_calls(where, dtype, case, "cpu", run, reference)
        for seed, case in enumerate(NORM_CASES):
            x, opts, dy, dro = make_norm_inputs(case, seed=100 + seed, **NORM_CUDA_SIZES)
            try:
                dev = {k: None if v is None else
                       to_device(v, dtype if k in NORM_ACTIVATIONS else "float32")
                       for k, v in x.items()}
                dev_dy = to_device(dy, dtype)
                dev_dro = None if dro is None else to_device(dro, dtype)
            except (ImportError, TypeError, ValueError) as e:
                report.skip(where, "%s norm %s: %s cannot make these arrays (%s)"
                            % (dtype, case, name, e))
                continue
            # The CPU path sees exactly the values the GPU sees (already rounded to dtype),
            # in float32; the outputs then differ only by the GPU's arithmetic and rounding.
            host = {k: None if v is None else to_host(v) for k, v in dev.items()}
            reference = run_norm(libssm, host, opts, to_host(dev_dy),
                                 None if dev_dro is None else to_host(dev_dro))

            def run_norm_device():
                fwd, bwd = run_norm(libssm, dev, opts, dev_dy, dev_dro)
                return ({k: to_host(v) for k, v in fwd.items()},
                        {k: to_host(v) for k, v in bwd.items()})
            report.compare_calls(where, dtype, case, "cpu", run_norm_device, reference,
                                 family="norm")
        check_conv1d_cuda(report, libssm, where, dtype, to_device, to_host)
        check_state_update_cuda(report, libssm, where, dtype, to_device, to_host)


def report_overhead(report, cuda_devices):
    """Information, not a check: the host time of an eager libssm.torch call."""
    try:
        import torch
    except ImportError:
        report.say("host overhead: torch is not importable; not measured")
        return
    from . import _overhead
    devices = ["cpu"] + (["cuda"] if cuda_devices and torch.cuda.is_available() else [])
    for device in devices:
        us = _overhead.eager_overhead_us(device, calls=2000)
        report.say("host overhead per eager libssm.torch.selective_scan call (%s): %.1f us"
                   % (device, us))


def main(stream=sys.stdout):
    report = Report(stream)
    try:
        import libssm
        from . import _library
        library = _library.load()
    except ImportError as e:
        report.say("library:      not loaded (%s)" % e)
        return 1
    report.say("library:      %s" % library.path)
    report.say("version:      %s" % library.version)
    report.say("ABI version:  %d" % library.abi)
    report.say("headers:      %s" % library.header_dir)
    count = library.cuda_device_count()
    report.say("CUDA devices: %d" % count)
    for device in range(count):
        report.say("  cuda:%d  %s" % (device, library.cuda_device_name(device)))
    report.say()
    check_cpu(report, libssm)
    for device in range(count):
        check_cuda_device(report, libssm, device)
    if count == 0:
        report.say("(no CUDA device: CUDA checks not run)")
    report.say()
    report_overhead(report, count)
    report.say()
    report.say("summary: %d passed, %d failed, %d skipped"
               % (report.passed, report.failed, report.skipped))
    return 1 if report.failed else 0
