"""What bench_conv1d.py, bench_decode.py and bench_mamba_model.py share: the timer (median of
CUDA-event timings after warm-up, or of a host clock in a --dry-run on the CPU), CUDA-graph
replay timing, peak memory, the device copy bandwidth, relative errors, importing the optional
peers (mamba_ssm, causal-conv1d), and the results JSON. bench_norm.py and
bench_selective_scan.py predate this module and keep their own copies of the timer."""

import importlib
import json
import os
import platform
import statistics
import sys
import time
import types
from pathlib import Path

import torch

RESULTS_DIR = Path(__file__).parent / "results"


class Timer:
    """Times callables on one device after warm-up: each timed window is bracketed by CUDA
    events (a host clock on the CPU), and the median over the windows is returned."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def _window_ms(self, fn, inner):
        if self.cuda:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(inner):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        return (time.perf_counter() - t0) * 1e3

    def median_ms(self, fn, reps, warmup, setup=None, inner=1):
        """Median over reps windows of one call's time in ms: a window calls fn inner times back
        to back (so launch gaps between calls count, as in a decode loop) and its time is
        divided by inner. setup, untimed, runs before each window and each warm-up call."""
        for _ in range(warmup):
            if setup:
                setup()
            fn()
        self.sync()
        times = []
        for _ in range(reps):
            if setup:
                setup()
            times.append(self._window_ms(fn, inner) / inner)
        return statistics.median(times)

    def graph_ms(self, fn, reps, warmup, inner=1):
        """Median time in ms of one call of fn replayed from a CUDA graph that holds inner
        calls back to back (what a decode loop captured as a graph runs). fn must leave its
        buffers where they were (in-place state updates, no host synchronisation). On the CPU
        (dry runs) there is no graph: fn is timed as median_ms does."""
        if not self.cuda:
            return self.median_ms(fn, reps, warmup, inner=inner)
        # torch.cuda.graphs asks for the warm-up on a side stream, so that lazy initialisation
        # (cuBLAS handles, Triton's first launch) is not captured.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(max(warmup, 1)):
                fn()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(inner):
                fn()
        ms = self.median_ms(graph.replay, reps, warmup)
        del graph
        return ms / inner

    def peak_mb(self, fn):
        """torch.cuda.max_memory_allocated in MiB while fn runs (after a reset, so it counts
        everything already allocated plus fn's peak on top), or None on the CPU."""
        if not self.cuda:
            fn()
            return None
        self.sync()
        torch.cuda.reset_peak_memory_stats(self.device)
        fn()
        self.sync()
        return torch.cuda.max_memory_allocated(self.device) / 2**20


def copy_tbps(timer, nbytes, reps):
    """Device-to-device copy of nbytes each way, in TB/s of bytes read + written: the ceiling
    that the bandwidths of the same run are read against."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=timer.device)
    src.fill_(1)
    dst = torch.empty_like(src)
    ms = timer.median_ms(lambda: dst.copy_(src), reps, warmup=3)
    return 2 * nbytes / ms / 1e9


def rel_err(got, want):
    """||got - want|| / ||want|| in float64, inf when got is not finite; a string saying what is
    wrong when the shapes differ."""
    if got.shape != want.shape:
        return f"shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    g, w = got.detach().double(), want.detach().to(got.device).double()
    if not bool(torch.isfinite(g).all()):
        return float("inf")
    return ((g - w).norm() / w.norm().clamp_min(1e-30)).item()


def check_errors(named_errors, tol):
    """None when every error is a number <= tol, else the first failure as text."""
    for name, err in named_errors:
        if isinstance(err, str):
            return f"{name}: {err}"
        if not err <= tol:
            return f"{name}: relative error {err:.3g} > {tol:g}"
    return None


def error_text(e):
    """One line for a result's 'error' field."""
    first = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {first}"[:300]


def fmt(v, spec):
    return "-" if v is None else format(v, spec)


def gpu_name(device):
    return torch.cuda.get_device_name(device) if torch.device(device).type == "cuda" \
        else "cpu (dry run)"


def environment():
    """Versions and host, for the JSON."""
    try:
        import libssm
        lib = libssm.__version__
    except Exception as e:  # noqa: BLE001 - the JSON still says which torch ran
        lib = error_text(e)
    return dict(torch=torch.__version__, cuda=torch.version.cuda,
                triton=getattr(sys.modules.get("triton"), "__version__", None), libssm=lib,
                python=platform.python_version(), host=platform.node())


def import_peer(name):
    """(module or None, a sentence saying which version was imported, or why none was)."""
    try:
        mod = importlib.import_module(name)
    except Exception as e:  # noqa: BLE001 - a missing peer leaves its columns "-"
        return None, f"{name} not importable: {error_text(e)}"
    return mod, f"{name} {getattr(mod, '__version__', '(no __version__)')}"


def _drop_mamba_modules():
    # A failed import leaves half-initialised mamba_ssm modules behind; they would shadow the
    # source tree's files.
    for name in [n for n in sys.modules if n == "mamba_ssm" or n.startswith("mamba_ssm.")]:
        del sys.modules[name]


def import_mamba(rel, source_ok=True):
    """(module mamba_ssm.<rel> or None, where it came from or why not). The installed package is
    tried first. When that fails and source_ok, MAMBA_SSM_SRC may name an unpacked mamba_ssm
    source tree (the sdist's root or its mamba_ssm/ folder): an empty package object then
    stands in for mamba_ssm, so that plain-Python files (the Triton kernels) import from the
    tree while mamba_ssm/__init__.py, which needs the compiled CUDA extensions, never runs."""
    name = "mamba_ssm." + rel
    try:
        return importlib.import_module(name), "installed mamba_ssm " + getattr(
            sys.modules.get("mamba_ssm"), "__version__", "")
    except Exception as e:  # noqa: BLE001
        installed_error = f"installed mamba_ssm: {error_text(e)}"
    if not source_ok:
        return None, installed_error
    src = os.environ.get("MAMBA_SSM_SRC")
    if not src:
        return None, installed_error + "; MAMBA_SSM_SRC not set"
    root = Path(src)
    pkg = root if (root / "ops").is_dir() else root / "mamba_ssm"
    _drop_mamba_modules()
    stub = types.ModuleType("mamba_ssm")
    stub.__path__ = [str(pkg)]
    sys.modules["mamba_ssm"] = stub
    try:
        return importlib.import_module(name), f"source tree {pkg} ({installed_error})"
    except Exception as e:  # noqa: BLE001 - e.g. no triton or einops: the column reads "-"
        _drop_mamba_modules()
        return None, f"{installed_error}; source tree {pkg}: {error_text(e)}"


def results_path(name, gpu):
    return RESULTS_DIR / f"{name}_{gpu.replace(' ', '_')}.json"


def write_json(path, payload):
    """Written to a temporary file first, so an interrupted run never leaves half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=1))
    os.replace(tmp, path)
