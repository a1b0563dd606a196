"""pytest setup for libssm's suites: the `cuda` marker (tests that need a GPU and a libssm built
with CUDA; skipped, with the reason, when either is missing) and shared fixtures (seeds, the
external tools some tests need, and a clean torch.compile state)."""
import os
import shutil
import sys

import pytest

# Test modules import the references by name, whatever pytest's import mode.
_TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)

from references import seed_for  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "cuda: needs a CUDA GPU seen by torch and a libssm built with CUDA "
                   "(select with -m cuda; skipped otherwise)")


def _cuda_unavailable_reason():
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    import libssm
    if libssm.cuda_device_count() == 0:
        return "libssm sees no CUDA device (built without CUDA, or no driver)"
    return None


def pytest_collection_modifyitems(config, items):
    cuda_items = [item for item in items if "cuda" in item.keywords]
    if not cuda_items:
        return
    reason = _cuda_unavailable_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in cuda_items:
        item.add_marker(skip)


@pytest.fixture
def seed(request):
    """A fixed seed per test id: reruns see the same inputs, different tests different ones."""
    return seed_for(request.node.nodeid)


@pytest.fixture
def require_tools():
    """require_tools("cmake", "cc"): skips the test when a tool is not on PATH, except under CI
    (CI=true), where a missing tool fails it: CI must not pass with these tests silently
    skipped."""
    def require(*tools):
        missing = [t for t in tools if shutil.which(t) is None]
        if not missing:
            return
        reason = "needs %s (not found on PATH)" % ", ".join(missing)
        if os.environ.get("CI", "").lower() in ("true", "1"):
            pytest.fail(reason + "; CI=true, so this is a failure, not a skip")
        pytest.skip(reason)
    return require


@pytest.fixture
def fresh_compile():
    """No compiled artifact from an earlier run: torch's on-disk caches do not key on the
    custom ops' Python autograd formulas, so a cached backward could hide a change to one."""
    import torch  # only the torch suites ask for this; the others run without torch

    torch._dynamo.reset()
    with torch._inductor.config.patch(force_disable_caches=True):
        yield
    torch._dynamo.reset()
