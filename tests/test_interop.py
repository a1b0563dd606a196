"""Arrays from each framework in, the same framework's arrays out: NumPy, torch, mixtures of the
two, producers that speak only the legacy DLPack capsule or only the versioned one, read-only
and broadcast NumPy inputs, and JAX when it is installed."""
import numpy as np
import pytest
import torch

import libssm
from references import INPUT_NAMES, make_cotangents, make_inputs
from harness import to_numpy
from scan_harness import FULL, check_backward, check_forward, run_backward, run_forward

CASE = FULL


class LegacyProducer:
    """An array from a producer that predates DLPack 1.0: its __dlpack__ ignores max_version
    and returns a legacy "dltensor" capsule."""

    def __init__(self, t):
        self.t = t
        self.shape = tuple(t.shape)
        self.dtype = t.dtype
        self.calls = 0

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        self.calls += 1
        return torch.utils.dlpack.to_dlpack(self.t)

    def __dlpack_device__(self):
        return self.t.__dlpack_device__()


class VersionedProducer:
    """An array whose producer records how it was asked, and hands out torch's own capsule for
    that request (a versioned "dltensor_versioned" one when max_version >= (1, 0))."""

    def __init__(self, t):
        self.t = t
        self.shape = tuple(t.shape)
        self.dtype = t.dtype
        self.requests = []

    def __dlpack__(self, **kwargs):
        self.requests.append(kwargs)
        capsule = self.t.__dlpack__(**kwargs)
        assert "dltensor_versioned" in repr(capsule)
        return capsule

    def __dlpack_device__(self):
        return self.t.__dlpack_device__()


def wrap_all(inputs, producer, skip=()):
    return {k: v if v is None or k in skip else producer(v) for k, v in inputs.items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_numpy_in_numpy_out(dtype, seed):
    inputs = make_inputs(CASE, dtype, seed)
    np_inputs = {k: to_numpy(v) for k, v in inputs.items()}
    out, last_state = run_forward(CASE, np_inputs)
    assert type(out) is np.ndarray and out.dtype == np_inputs["u"].dtype
    assert type(last_state) is np.ndarray and last_state.dtype == np.float32
    check_forward(CASE, inputs, out, last_state)
    dout, dlast = make_cotangents(CASE, dtype, seed)
    grads = run_backward(CASE, np_inputs, to_numpy(dout), to_numpy(dlast))
    for name in INPUT_NAMES:
        assert type(getattr(grads, "d" + name)) is np.ndarray
        assert getattr(grads, "d" + name).dtype == np_inputs[name].dtype
    check_backward(CASE, inputs, dout, dlast, grads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_in_torch_out(dtype, seed):
    inputs = make_inputs(CASE, dtype, seed)
    out, last_state = run_forward(CASE, inputs)
    assert type(out) is torch.Tensor and out.dtype == dtype and out.device.type == "cpu"
    assert type(last_state) is torch.Tensor and last_state.dtype == torch.float32
    check_forward(CASE, inputs, out, last_state)
    dout, dlast = make_cotangents(CASE, dtype, seed)
    grads = run_backward(CASE, inputs, dout, dlast)
    assert all(type(g) is torch.Tensor for g in grads)
    check_backward(CASE, inputs, dout, dlast, grads)


def test_mixed_frameworks_follow_u(seed):
    # The result takes u's framework; the other arrays may come from anywhere.
    inputs = make_inputs(CASE, torch.float32, seed)
    with_numpy_rest = {k: to_numpy(v) if k != "u" else v for k, v in inputs.items()}
    out, last_state = run_forward(CASE, with_numpy_rest)
    assert type(out) is torch.Tensor and type(last_state) is torch.Tensor
    check_forward(CASE, inputs, out, last_state)
    with_torch_rest = {k: to_numpy(v) if k == "u" else v for k, v in inputs.items()}
    out, last_state = run_forward(CASE, with_torch_rest)
    assert type(out) is np.ndarray and type(last_state) is np.ndarray
    check_forward(CASE, inputs, out, last_state)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_legacy_capsule_producer(dtype, seed):
    inputs = make_inputs(CASE, dtype, seed)
    wrapped = wrap_all(inputs, LegacyProducer, skip=("u",))
    out, last_state = run_forward(CASE, wrapped)
    assert type(out) is torch.Tensor
    check_forward(CASE, inputs, out, last_state)
    assert all(w.calls >= 1 for k, w in wrapped.items() if k != "u" and w is not None)
    dout, dlast = make_cotangents(CASE, dtype, seed)
    grads = run_backward(CASE, wrapped, LegacyProducer(dout), LegacyProducer(dlast))
    check_backward(CASE, inputs, dout, dlast, grads)


def test_legacy_capsule_producer_everywhere(seed):
    # Every array, out= included, from the legacy producer: out is written through its capsule.
    inputs = make_inputs(CASE, torch.float32, seed)
    out = torch.full(inputs["u"].shape, float("nan"))
    wrapped_out = LegacyProducer(out)
    result, last_state = run_forward(CASE, wrap_all(inputs, LegacyProducer), out=wrapped_out)
    assert result is wrapped_out
    check_forward(CASE, inputs, out, torch.as_tensor(np.asarray(last_state)))


def test_versioned_capsule_requested(seed):
    # A DLPack 1.x consumer asks for max_version (1, x), and gets the versioned capsule.
    inputs = make_inputs(CASE, torch.float16, seed)
    wrapped = wrap_all(inputs, VersionedProducer, skip=("u",))
    out, last_state = run_forward(CASE, wrapped)
    check_forward(CASE, inputs, out, last_state)
    for name, w in wrapped.items():
        if name == "u" or w is None:
            continue
        assert w.requests, name
        for request in w.requests:
            assert tuple(request.get("max_version") or (0, 0)) >= (1, 0), (name, request)
            assert request.get("stream") is None, (name, request)  # a CPU array: no stream


def test_read_only_and_broadcast_numpy_inputs(seed):
    # Inputs are only read: read-only arrays and stride-0 broadcasts are accepted.
    inputs = make_inputs(CASE, torch.float32, seed)
    inputs["delta_bias"] = torch.full((CASE.dim,), 0.25)
    np_inputs = {k: to_numpy(v) for k, v in inputs.items()}
    for a in np_inputs.values():
        a.flags.writeable = False
    np_inputs["delta_bias"] = np.broadcast_to(np.float32(0.25), (CASE.dim,))
    check_forward(CASE, inputs, *run_forward(CASE, np_inputs))


def test_stream_argument_on_cpu_is_accepted(seed):
    # The CPU path runs synchronously and ignores the stream (torch inputs then take the DLPack
    # path, since an explicit stream is given).
    inputs = make_inputs(CASE, torch.float32, seed)
    check_forward(CASE, inputs, *run_forward(CASE, inputs, stream=0))


class CudaClaimingProducer(VersionedProducer):
    """An unknown producer's array on CUDA device 0 (only claimed: nothing may read it)."""

    def __dlpack_device__(self):
        return (2, 0)


@pytest.mark.parametrize("op", ["fwd", "bwd"])
def test_cuda_array_of_unknown_producer_needs_stream(op, seed):
    # libssm cannot ask an unknown producer (or JAX) for its current stream and never falls
    # back to stream 0: stream= is required, and the call fails before touching any array.
    inputs = wrap_all(make_inputs(CASE, torch.float32, seed), CudaClaimingProducer)
    with pytest.raises(libssm.InvalidArgumentError) as excinfo:
        if op == "fwd":
            run_forward(CASE, inputs)
        else:
            run_backward(CASE, inputs, inputs["u"], None)
    assert str(excinfo.value).startswith("stream:"), str(excinfo.value)
    assert all(not w.requests for w in inputs.values() if w is not None)


def test_jax_in_jax_out(seed):
    jax = pytest.importorskip("jax")
    jnp = pytest.importorskip("jax.numpy")
    inputs = make_inputs(CASE, torch.float32, seed)
    jax_inputs = {k: None if v is None else jnp.asarray(to_numpy(v)) for k, v in inputs.items()}
    cpu = jax.devices("cpu")[0]
    jax_inputs = {k: None if v is None else jax.device_put(v, cpu) for k, v in jax_inputs.items()}
    out, last_state = run_forward(CASE, jax_inputs)
    assert isinstance(out, jax.Array) and isinstance(last_state, jax.Array)
    check_forward(CASE, inputs, np.asarray(out), np.asarray(last_state))
    dout, dlast = make_cotangents(CASE, torch.float32, seed)
    grads = run_backward(CASE, jax_inputs, jnp.asarray(to_numpy(dout)),
                         jnp.asarray(to_numpy(dlast)))
    assert all(isinstance(g, jax.Array) for g in grads)
    check_backward(CASE, inputs, dout, dlast,
                   libssm.SelectiveScanGrads(*(np.asarray(g) for g in grads)))


def test_jax_out_is_refused():
    jnp = pytest.importorskip("jax.numpy")
    u = jnp.zeros((1, 2, 3), jnp.float32)
    with pytest.raises(libssm.InvalidArgumentError) as excinfo:
        libssm.selective_scan(u, u, jnp.zeros((2, 1), jnp.float32), jnp.zeros((1, 1, 3)),
                              jnp.zeros((1, 1, 3)), out=u)
    assert str(excinfo.value).startswith("out:")
