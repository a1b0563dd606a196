"""Bad input to the selective-state decode step: each row breaks one argument and expects the
libssm exception for it, a message that starts with the argument's name and says what was
expected, and every array of the call (the state and the NaN-poisoned out= included) left
exactly as it was. Rows run through the generic layer with torch and with NumPy arrays, and the
torch adapter with mamba_ssm's signature; the params struct is checked through the C entry
point."""
import numpy as np
import pytest
import torch

import libssm
import libssm.torch as ssm_torch
from harness import as_framework, check_error, snapshot
from references import make_state_update_inputs
from state_update_harness import FULL, MAMBA1_FULL, StateUpdateCApi

NAN = float("nan")
CASE = FULL  # Mamba-2: batch 3, nheads 4, headdim 5, dstate 16, ngroups 2
BATCH, NHEADS, HEADDIM, DSTATE = CASE.batch, CASE.nheads, CASE.headdim, CASE.dstate


def valid_inputs(case=CASE):
    x = make_state_update_inputs(case, torch.float32, 4321)
    x["out"] = torch.full(x["x"].shape, NAN)
    x["dt_softplus"] = case.softplus
    return x


def _set(name, value):
    def mutate(x):
        x[name] = value(x) if callable(value) else value
    return mutate


def _indices(values, dtype=torch.int64):
    return _set("state_batch_indices", torch.tensor(values, dtype=dtype))


def _state_overlaps_x(x):
    # x is a slice of the state's own memory.
    x["x"] = x["state"].reshape(-1)[:BATCH * NHEADS * HEADDIM].reshape(BATCH, NHEADS, HEADDIM)


def _state_broadcast(x):
    x["state"] = torch.randn(1, NHEADS, HEADDIM, DSTATE).expand(BATCH, -1, -1, -1)


# (id, argument the message must name, mutation, exception, fragments the message must hold)
ROWS = [
    ("state-ndim-2", "state", _set("state", torch.randn(BATCH, DSTATE)), libssm.ShapeError,
     ["(batch_state, dim, dstate)", "(batch_state, nheads, headdim, dstate)", "(3, 16)"]),
    ("state-ndim-5", "state", _set("state", torch.randn(BATCH, 1, NHEADS, HEADDIM, DSTATE)),
     libssm.ShapeError, ["(3, 1, 4, 5, 16)"]),
    ("state-dstate-257", "state", _set("state", torch.randn(BATCH, NHEADS, HEADDIM, 257)),
     libssm.UnsupportedError, ["257", "256"]),
    ("state-dstate-0", "state", _set("state", torch.randn(BATCH, NHEADS, HEADDIM, 0)),
     libssm.ShapeError, ["dstate", "at least 1"]),
    ("state-float64", "state", _set("state", lambda x: x["state"].double()), libssm.DTypeError,
     ["float64"]),
    ("state-int32", "state", _set("state", lambda x: x["state"].int()), libssm.DTypeError,
     ["int32", "float32, float16 or bfloat16"]),
    ("state-too-few-slots", "state", _set("state", torch.randn(BATCH - 1, NHEADS, HEADDIM,
                                                               DSTATE)),
     libssm.ShapeError, ["batch_state", "2", "3", "state_batch_indices"]),
    ("state-overlaps-x", "state", _state_overlaps_x, libssm.LayoutError, ["overlaps input x"]),
    ("state-stride-0", "state", _state_broadcast, libssm.LayoutError, ["stride 0"]),
    ("x-headdim", "x", _set("x", torch.randn(BATCH, NHEADS, HEADDIM + 1)), libssm.ShapeError,
     ["(batch, nheads, headdim)", "(batch, 4, 5)", "(3, 4, 6)"]),
    ("x-mamba1-form", "x", _set("x", torch.randn(BATCH, NHEADS * HEADDIM)), libssm.ShapeError,
     ["(batch, nheads, headdim)"]),
    ("x-int64", "x", _set("x", lambda x: x["x"].long()), libssm.DTypeError, ["int64"]),
    ("dt-batch", "dt", _set("dt", torch.rand(BATCH + 1, NHEADS, HEADDIM)), libssm.ShapeError,
     ["(3, 4, 5)", "(4, 4, 5)"]),
    ("dt-float64", "dt", _set("dt", lambda x: x["dt"].double()), libssm.DTypeError,
     ["float64"]),
    ("A-shape", "A", _set("A", -torch.rand(NHEADS, DSTATE)), libssm.ShapeError,
     ["(nheads, headdim, dstate)", "(4, 5, 16)", "(4, 16)"]),
    ("B-groups-not-dividing", "B", _set("B", torch.randn(BATCH, 3, DSTATE)), libssm.ShapeError,
     ["ngroups", "3", "does not divide nheads 4"]),
    ("B-dstate", "B", _set("B", torch.randn(BATCH, 2, DSTATE + 1)), libssm.ShapeError,
     ["(batch, ngroups, dstate)", "(3, 2, 17)"]),
    ("C-groups-differ-from-B", "C", _set("C", torch.randn(BATCH, 1, DSTATE)),
     libssm.ShapeError, ["(3, 2, 16)", "(3, 1, 16)"]),
    ("C-float64", "C", _set("C", lambda x: x["C"].double()), libssm.DTypeError, ["float64"]),
    ("D-shape", "D", _set("D", torch.randn(NHEADS)), libssm.ShapeError,
     ["(nheads, headdim)", "(4, 5)", "(4,)"]),
    ("z-shape", "z", _set("z", torch.randn(BATCH, NHEADS, HEADDIM, 1)), libssm.ShapeError,
     ["(3, 4, 5)"]),
    ("dt_bias-shape", "dt_bias", _set("dt_bias", torch.randn(NHEADS, HEADDIM + 1)),
     libssm.ShapeError, ["(4, 5)", "(4, 6)"]),
    ("dt_bias-int32", "dt_bias", _set("dt_bias", lambda x: x["dt_bias"].int()),
     libssm.DTypeError, ["int32"]),
    ("indices-float", "state_batch_indices", _indices([0.0, 1.0, 2.0], torch.float32),
     libssm.DTypeError, ["int32 or int64", "float32"]),
    ("indices-int16", "state_batch_indices", _indices([0, 1, 2], torch.int16),
     libssm.DTypeError, ["int32 or int64", "int16"]),
    ("indices-length", "state_batch_indices", _indices([0, 1]), libssm.ShapeError,
     ["(batch,)", "(3,)", "(2,)"]),
    ("indices-out-of-range", "state_batch_indices", _indices([0, 3, 1]),
     libssm.InvalidArgumentError, ["entry 1", "3", "3 state slots"]),
    ("indices-int32-out-of-range", "state_batch_indices", _indices([7, -1, 1], torch.int32),
     libssm.InvalidArgumentError, ["entry 0", "7"]),
    ("indices-repeated", "state_batch_indices", _indices([2, -1, 2]),
     libssm.InvalidArgumentError, ["entries 0 and 2", "slot 2"]),
    ("out-shape", "out", _set("out", torch.full((BATCH, NHEADS, HEADDIM + 1), NAN)),
     libssm.ShapeError, ["(3, 4, 5)", "(3, 4, 6)"]),
    ("out-int32", "out", _set("out", torch.zeros(BATCH, NHEADS, HEADDIM, dtype=torch.int32)),
     libssm.DTypeError, ["int32"]),
    ("out-is-x", "out", _set("out", lambda x: x["x"]), libssm.LayoutError, ["input x"]),
    ("out-overlaps-state", "out",
     _set("out", lambda x: x["state"].reshape(-1)[:BATCH * NHEADS * HEADDIM]
          .reshape(BATCH, NHEADS, HEADDIM)), libssm.LayoutError, ["state"]),
    ("x-not-an-array", "x", _set("x", lambda x: x["x"].tolist()), libssm.InvalidArgumentError,
     ["__dlpack__"]),
    ("A-not-an-array", "A", _set("A", lambda x: x["A"].tolist()), libssm.InvalidArgumentError,
     ["__dlpack__"]),
]

MAMBA1_ROWS = [
    ("mamba1-x-3d", "x", _set("x", torch.randn(3, 1, 7)), libssm.ShapeError,
     ["(batch, dim)", "(3, 1, 7)"]),
    ("mamba1-A-dim", "A", _set("A", -torch.rand(8, 16)), libssm.ShapeError,
     ["(dim, dstate)", "(7, 16)", "(8, 16)"]),
    ("mamba1-B-grouped", "B", _set("B", torch.randn(3, 1, 16)), libssm.ShapeError,
     ["(batch, dstate)", "(3, 16)"]),
    ("mamba1-D-2d", "D", _set("D", torch.randn(1, 7)), libssm.ShapeError, ["(dim,)", "(7,)"]),
]


def call(x):
    return libssm.selective_state_update(
        x["state"], x["x"], x["dt"], x["A"], x["B"], x["C"], x["D"], x["z"], x["dt_bias"],
        dt_softplus=x["dt_softplus"], state_batch_indices=x["state_batch_indices"],
        out=x["out"])


def _expect(row, x, run):
    _, argument, _, exc, fragments = row
    before = snapshot(x)
    with pytest.raises(exc) as excinfo:
        run(x)
    check_error(excinfo, exc, argument, fragments)
    assert snapshot(x) == before, "a failed call changed its arguments"


@pytest.mark.parametrize("framework", ["torch", "numpy"])
@pytest.mark.parametrize("row", ROWS + MAMBA1_ROWS, ids=[r[0] for r in ROWS + MAMBA1_ROWS])
def test_bad_input(row, framework):
    x = valid_inputs(MAMBA1_FULL if row[0].startswith("mamba1") else CASE)
    row[2](x)
    _expect(row, as_framework(x, framework), call)


# mamba_ssm's signature takes tensors and no out=: the other rows apply to the torch adapter.
ADAPTER_ROWS = [r for r in ROWS + MAMBA1_ROWS if r[1] != "out" and "not-an-array" not in r[0]]


@pytest.mark.parametrize("row", ADAPTER_ROWS, ids=[r[0] for r in ADAPTER_ROWS])
def test_bad_input_torch_adapter(row):
    x = valid_inputs(MAMBA1_FULL if row[0].startswith("mamba1") else CASE)
    row[2](x)
    _expect(row, x, lambda x: ssm_torch.selective_state_update(
        x["state"], x["x"], x["dt"], x["A"], x["B"], x["C"], x["D"], x["z"], x["dt_bias"],
        x["dt_softplus"], x["state_batch_indices"]))


@pytest.mark.parametrize("framework", ["torch", "numpy"])
def test_valid_inputs_pass(framework):
    # The rows above fail because of their one change: the unchanged inputs are accepted, and
    # the NaN-filled out= is then written.
    for case in (CASE, MAMBA1_FULL):
        x = as_framework(valid_inputs(case), framework)
        out = call(x)
        assert out is x["out"] and not np.isnan(np.asarray(out)).any()


def test_read_only_state():
    x = as_framework(valid_inputs(), "numpy")
    x["state"].flags.writeable = False
    before = snapshot(x)
    with pytest.raises(libssm.InvalidArgumentError, match="^state: .*read-only"):
        call(x)
    assert snapshot(x) == before


@pytest.mark.parametrize("struct_size", [0, 8])
def test_params_struct_size(struct_size):
    x = valid_inputs()
    api = StateUpdateCApi()
    before = snapshot(x)
    with pytest.raises(libssm.InvalidArgumentError) as excinfo:
        api.update(CASE, x, x["out"], params=api.params(True, struct_size=struct_size))
    check_error(excinfo, libssm.InvalidArgumentError, "params",
                ["struct_size is %d" % struct_size, "sizeof(ssm_selective_state_update_params)"])
    assert snapshot(x) == before


def test_null_params_and_tensors():
    x = valid_inputs()
    api = StateUpdateCApi()
    dl = {n: api.dltensor(x[n]) for n in ("state", "x", "dt", "A", "B", "C", "out")}
    params = api.params(False)
    lib = api.lib
    for name, args in (
            ("params", (0, dl["state"], dl["x"], dl["dt"], dl["A"], dl["B"], dl["C"])),
            ("state", (params, 0, dl["x"], dl["dt"], dl["A"], dl["B"], dl["C"])),
            ("dt", (params, dl["state"], dl["x"], 0, dl["A"], dl["B"], dl["C"])),
            ("C", (params, dl["state"], dl["x"], dl["dt"], dl["A"], dl["B"], 0))):
        status = lib.ssm_selective_state_update(*args, 0, 0, 0, 0, dl["out"], 0)
        assert status == libssm.InvalidArgumentError.status_code
        assert api.last_error().startswith(name + ": must not be NULL"), api.last_error()
    status = lib.ssm_selective_state_update(params, dl["state"], dl["x"], dl["dt"], dl["A"],
                                            dl["B"], dl["C"], 0, 0, 0, 0, 0, 0)
    assert status == libssm.InvalidArgumentError.status_code
    assert api.last_error().startswith("out: must not be NULL")


def test_jax_state_is_refused():
    # JAX arrays cannot be written in place: the state is refused, naming it, before any call.
    jnp = pytest.importorskip("jax.numpy")
    x = {k: v.numpy() if isinstance(v, torch.Tensor) else v for k, v in valid_inputs().items()}
    x = {k: jnp.asarray(v) if isinstance(v, np.ndarray) else v for k, v in x.items()}
    x["out"] = None
    with pytest.raises(libssm.InvalidArgumentError, match="^state: JAX arrays are immutable"):
        call(x)
