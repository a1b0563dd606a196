"""`python -m libssm check`: says which library is loaded, then checks every op on every device
against a reference (CPU: libssm's CPU path against a float64 NumPy evaluation of the formula;
each CUDA device: libssm on the GPU against libssm's CPU path, in float32 and bfloat16), one
line per check and a summary; the exit status is nonzero on any failure. The ops are the
selective scan and the fused norm."""

import sys

import numpy as np

from . import _norm_reference, _reference

# Max |result - reference| / max |reference| allowed, per (compared against, dtype, op).
TOLERANCE = {
    ("float64 reference", "float32", "fwd"): 1e-5,
    ("float64 reference", "float32", "bwd"): 1e-4,
    ("cpu", "float32", "fwd"): 1e-4,
    ("cpu", "float32", "bwd"): 1e-3,
    ("cpu", "bfloat16", "fwd"): 1e-2,   # bf16 outputs carry 2^-9 relative rounding
    ("cpu", "bfloat16", "bwd"): 2e-2,
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
