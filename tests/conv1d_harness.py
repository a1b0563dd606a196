"""How the conv1d suites call libssm and judge what comes back: the rows of cases the CPU and CUDA
suites share, calls through the generic Python API (libssm.causal_conv1d / causal_conv1d_bwd /
causal_conv1d_update), calls straight into the C entry points with buffers the test owns
(NaN-poisoned, any dtype, any strides), the decode step's cases, and the checks of every output
and gradient against the float64 references."""
import dataclasses

import numpy as np
import torch

import harness
import libssm
from harness import dtype_of, poisoned_like
from references import (Conv1dCase, assert_close, assert_close_to, conv1d_reference,
                        conv1d_update_numpy)

# Rows vary one axis at a time from BASE (Mamba's configuration: width 4, bias, SiLU), FULL
# (initial and final states) or PACKED (packed sequences of 10, 1, 20 and 6 positions).
BASE = Conv1dCase()
FULL = BASE.replace(initial_states=True, final_states=True)
PACKED = BASE.replace(seq_idx=(10, 1, 20, 6), final_states=True)
OPTION_ROWS = (
    BASE,
    BASE.replace(bias=False),
    BASE.replace(silu=False),
    BASE.replace(width=2),
    BASE.replace(width=3),
    BASE.replace(width=5),
    BASE.replace(width=6),
    BASE.replace(width=7),
    BASE.replace(width=8),
    BASE.replace(initial_states=True),
    BASE.replace(final_states=True),
    FULL,
    FULL.replace(width=2, silu=False),
    FULL.replace(width=8, bias=False),
    PACKED,
    PACKED.replace(initial_states=True),
    PACKED.replace(initial_states=True, width=8),
    PACKED.replace(seq_idx=(1, 30, 6), width=2),
    BASE.replace(layout="channel_last"),
    FULL.replace(layout="channel_last"),
    FULL.replace(layout="channel_last", width=7, silu=False),
    PACKED.replace(layout="channel_last", initial_states=True),
)
SIZE_ROWS = (
    FULL.replace(seqlen=1),
    FULL.replace(seqlen=2),
    FULL.replace(seqlen=2, width=8),
    FULL.replace(seqlen=8),
    FULL.replace(seqlen=64, width=5),
    FULL.replace(dim=1),
    FULL.replace(dim=7, batch=1),
    FULL.replace(seqlen=0),
    FULL.replace(batch=0),
    FULL.replace(seqlen=1, layout="channel_last"),
    PACKED.replace(seqlen=5, seq_idx=(1, 1, 3), initial_states=True),
)
ROWS = OPTION_ROWS + SIZE_ROWS


def case_id(case):
    return case.label()


def activation(case):
    return "silu" if case.silu else None


def run_forward(case, inputs, **extra):
    """libssm.causal_conv1d for the case: out, or (out, final_states) with final states."""
    return libssm.causal_conv1d(inputs["x"], inputs["weight"], inputs["bias"],
                                activation=activation(case),
                                initial_states=inputs["initial_states"],
                                return_final_states=case.final_states, seq_idx=inputs["seq_idx"],
                                **extra)


def run_backward(case, inputs, dout, dfinal_states, **extra):
    """libssm.causal_conv1d_bwd for the case: a Conv1dGrads."""
    return libssm.causal_conv1d_bwd(inputs["x"], inputs["weight"], dout, inputs["bias"],
                                    activation=activation(case),
                                    initial_states=inputs["initial_states"],
                                    seq_idx=inputs["seq_idx"], dfinal_states=dfinal_states,
                                    **extra)


def to_cpu(tensors):
    return {k: None if v is None else (v.detach().cpu() if isinstance(v, torch.Tensor) else v)
            for k, v in tensors.items()}


def as_torch(a):
    """A result (torch tensor or NumPy array, any device) as a CPU torch tensor."""
    if isinstance(a, torch.Tensor):
        return a.detach().cpu()
    return torch.from_numpy(np.asarray(a))


# ---------------------------------------------------------------------------------------------
# Checks.


def reference_forward(case, inputs):
    """{name: (float64 reference, plain float32 evaluation)} for out and final_states."""
    cpu = to_cpu(inputs)
    ref = conv1d_reference(cpu, case.silu)
    plain = conv1d_reference(cpu, case.silu, precision=torch.float32)
    return {n: (ref[n], plain[n]) for n in ("out", "final_states")}


def check_forward(case, inputs, result, refs=None):
    """out (and final_states when the case returns them) against the references: out like x in
    x's dtype, final_states (batch, dim, width-1) in x's dtype. Returns the references used."""
    refs = refs or reference_forward(case, inputs)
    x = inputs["x"]
    out, final = result if case.final_states else (result, None)
    assert dtype_of(out) == dtype_of(x), dtype_of(out)
    assert_close("out", as_torch(out), *refs["out"], dtype=dtype_of(x))
    if case.final_states:
        assert dtype_of(final) == dtype_of(x), dtype_of(final)
        assert_close("final_states", as_torch(final), *refs["final_states"],
                     dtype=dtype_of(x))
    return refs


def reference_backward(case, inputs, dout, dfinal_states):
    """{name: (float64 reference, plain float32 evaluation)} for dx, dweight, dbias and
    dinitial_states (those whose input is present)."""
    cpu = to_cpu(inputs)
    dout, dfinal = as_torch(dout), None if dfinal_states is None else as_torch(dfinal_states)
    ref = conv1d_reference(cpu, case.silu, dout, dfinal)
    plain = conv1d_reference(cpu, case.silu, dout, dfinal, precision=torch.float32)
    return {n: (ref[n], plain[n]) for n in ("dx", "dweight", "dbias", "dinitial_states")
            if n in ref}


def check_backward(case, inputs, grads, dout, dfinal_states, refs=None):
    """Every field of a Conv1dGrads against float64 autograd of the torch formula, each in its
    input's dtype; None for absent inputs. Returns the references used."""
    refs = refs or reference_backward(case, inputs, dout, dfinal_states)
    assert tuple(grads._fields) == ("dx", "dweight", "dbias", "dinitial_states")
    for name in ("x", "weight", "bias", "initial_states"):
        g = getattr(grads, "d" + name)
        if inputs[name] is None:
            assert g is None, f"d{name} given for an absent {name}"
            continue
        assert g is not None, f"d{name} missing"
        assert dtype_of(g) == dtype_of(inputs[name]), f"d{name}: dtype {dtype_of(g)}"
        assert_close("d" + name, as_torch(g), *refs["d" + name])
    return refs


def check_agree(got, expected, refs):
    """Two implementations' results (dicts by name, e.g. GPU and the library's CPU path) agree
    within the bound each must meet against the reference."""
    for name, value in got.items():
        if value is None:
            continue
        ref64, plain = refs[name]
        assert_close_to(name + " vs CPU", as_torch(value), as_torch(expected[name]), ref64,
                        plain, dtype_of(value))


# ---------------------------------------------------------------------------------------------
# Calls straight into the C entry points, with buffers the test owns.


class Conv1dCApi(harness.CApi):
    """The shared cffi handle plus the conv1d entry points on torch tensors."""

    def params(self, silu, struct_size=None, activation=None):
        p = self.keep(self.ffi.new("ssm_causal_conv1d_params *"))
        p.struct_size = (self.ffi.sizeof("ssm_causal_conv1d_params") if struct_size is None
                         else struct_size)
        p.activation = int(bool(silu)) if activation is None else activation
        return self.address(p)

    def forward(self, silu, inputs, out, final_states=None, params=None):
        """ssm_causal_conv1d_fwd into the given outputs; raises libssm errors."""
        params = self.params(silu) if params is None else params
        dl = {n: self.dltensor(inputs[n]) for n in ("x", "weight", "bias", "initial_states")}
        self.check(self.lib.ssm_causal_conv1d_fwd(
            params, dl["x"], dl["weight"], dl["bias"], dl["initial_states"],
            self.dltensor(inputs["seq_idx"]), self.dltensor(out), self.dltensor(final_states),
            self.stream_of(inputs["x"])))

    def backward(self, silu, inputs, dout, dfinal_states, grads, params=None):
        """ssm_causal_conv1d_bwd into grads (a dict dx/dweight/dbias/dinitial_states -> tensor
        or None), with a workspace of the size the library asks for."""
        params = self.params(silu) if params is None else params
        x, weight = self.dltensor(inputs["x"]), self.dltensor(inputs["weight"])
        size = self.keep(self.ffi.new("size_t *"))
        self.check(self.lib.ssm_causal_conv1d_bwd_workspace_size(params, x, weight,
                                                                 self.address(size)))
        ws, nbytes = self.workspace(size[0], inputs["x"].device)
        out = [self.dltensor(grads.get(n)) for n in ("dx", "dweight", "dbias",
                                                     "dinitial_states")]
        self.check(self.lib.ssm_causal_conv1d_bwd(
            params, x, weight, self.dltensor(inputs["bias"]),
            self.dltensor(inputs["initial_states"]), self.dltensor(inputs["seq_idx"]),
            self.dltensor(dout), self.dltensor(dfinal_states), *out, ws, nbytes,
            self.stream_of(inputs["x"])))

    def update(self, silu, inputs, out, params=None):
        """ssm_causal_conv1d_update on the inputs of a decode step (conv_state in place)."""
        params = self.params(silu) if params is None else params
        self.check(self.lib.ssm_causal_conv1d_update(
            params, self.dltensor(inputs["x"]), self.dltensor(inputs["conv_state"]),
            self.dltensor(inputs["weight"]), self.dltensor(inputs["bias"]),
            self.dltensor(inputs["cache_seqlens"]),
            self.dltensor(inputs["conv_state_indices"]), self.dltensor(out),
            self.stream_of(inputs["x"])))


def poisoned_forward(case, inputs):
    """NaN-filled out (x's layout) and final_states (when the case returns them)."""
    x = inputs["x"]
    out = torch.full_like(x, float("nan"))
    final = None
    if case.final_states:
        final = torch.full((case.batch, case.dim, case.width - 1), float("nan"), dtype=x.dtype,
                           device=x.device)
    return out, final


def poisoned_grads(inputs):
    """NaN-filled buffers for every gradient that applies."""
    grads = {"dx": torch.full_like(inputs["x"], float("nan"))}
    for name in ("weight", "bias", "initial_states"):
        grads["d" + name] = None if inputs[name] is None else poisoned_like(inputs[name])
    return grads


def c_forward_backward(case, inputs, dout, dfinal_states):
    """The forward and backward through the C entry points into NaN-poisoned buffers:
    (forward result as run_forward returns it, Conv1dGrads)."""
    api = Conv1dCApi()
    out, final = poisoned_forward(case, inputs)
    api.forward(case.silu, inputs, out, final)
    grads = poisoned_grads(inputs)
    api.backward(case.silu, inputs, dout, dfinal_states, grads)
    result = (out, final) if case.final_states else out
    return result, libssm.Conv1dGrads(**grads)


# ---------------------------------------------------------------------------------------------
# The decode step.


@dataclasses.dataclass(frozen=True)
class UpdateCase:
    """One decode-step configuration. seqlen None: x is (batch, dim), one token. circular: pass
    cache_seqlens (values spread over several multiples of state_len). indices: None, "perm"
    (state rows in another order, batch_state > batch) or "padding" (some rows padding)."""
    batch: int = 3
    dim: int = 6
    width: int = 4
    state_len: int = 3
    seqlen: int = None
    bias: bool = True
    silu: bool = True
    circular: bool = False
    indices: str = None

    def replace(self, **kw):
        return dataclasses.replace(self, **kw)

    def label(self):
        base = UpdateCase()
        diff = [f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self)
                if getattr(self, f.name) != getattr(base, f.name)]
        return ",".join(diff) or "base"

    @property
    def batch_state(self):
        return self.batch + 2 if self.indices else self.batch


UPDATE_BASE = UpdateCase()
UPDATE_ROWS = (
    UPDATE_BASE,
    UPDATE_BASE.replace(bias=False),
    UPDATE_BASE.replace(silu=False),
    UPDATE_BASE.replace(width=2, state_len=1),
    UPDATE_BASE.replace(width=8, state_len=7),
    UPDATE_BASE.replace(state_len=6),
    UPDATE_BASE.replace(seqlen=1),
    UPDATE_BASE.replace(seqlen=3),
    UPDATE_BASE.replace(seqlen=5, state_len=4),
    UPDATE_BASE.replace(circular=True, state_len=8),
    UPDATE_BASE.replace(circular=True, state_len=3),
    UPDATE_BASE.replace(circular=True, state_len=5, seqlen=3),
    UPDATE_BASE.replace(circular=True, state_len=4, seqlen=6),
    UPDATE_BASE.replace(indices="perm"),
    UPDATE_BASE.replace(indices="padding"),
    UPDATE_BASE.replace(indices="padding", circular=True, state_len=6, seqlen=2),
    UPDATE_BASE.replace(dim=1, batch=1),
    UPDATE_BASE.replace(dim=7, width=5, state_len=9),
    UPDATE_BASE.replace(batch=0),
)


def update_id(case):
    return case.label()


def make_update_inputs(case, dtype, seed, device="cpu", state_dtype=None, weight_dtype=None,
                       index_dtype=torch.int32):
    """x in `dtype`; conv_state in state_dtype (default `dtype`); weight and bias in
    weight_dtype (default `dtype`); cache_seqlens and conv_state_indices in index_dtype."""
    g = torch.Generator().manual_seed(seed)
    b, d, w = case.batch, case.dim, case.width

    def randn(shape, dt, scale=1.0):
        return (scale * torch.randn(shape, generator=g, dtype=torch.float64)).to(dt).to(device)

    x_shape = (b, d) if case.seqlen is None else (b, d, case.seqlen)
    cache_seqlens = indices = None
    if case.circular:
        cache_seqlens = torch.randint(0, 3 * case.state_len + 1, (b,), generator=g)
        cache_seqlens = cache_seqlens.to(index_dtype).to(device)
    if case.indices:
        order = torch.randperm(case.batch_state, generator=g)[:b]
        if case.indices == "padding":
            order[::2] = -1
        indices = order.to(index_dtype).to(device)
    return {
        "x": randn(x_shape, dtype),
        "conv_state": randn((case.batch_state, d, case.state_len), state_dtype or dtype),
        "weight": randn((d, w), weight_dtype or dtype, w ** -0.5),
        "bias": randn((d,), weight_dtype or dtype, 0.5) if case.bias else None,
        "cache_seqlens": cache_seqlens,
        "conv_state_indices": indices,
    }


def reference_update(case, inputs):
    """(out float64 reference, out plain float32 baseline, expected conv_state in its dtype).
    The new state holds copies of x and old state values, so it is expected exactly."""
    cpu = to_cpu(inputs)
    args = (cpu["x"], cpu["conv_state"], cpu["weight"], cpu["bias"], case.silu,
            cpu["cache_seqlens"], cpu["conv_state_indices"])
    out64, state64 = conv1d_update_numpy(*args)
    f32 = {k: (v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
           for k, v in cpu.items()}
    plain, _ = conv1d_update_numpy(f32["x"], f32["conv_state"], f32["weight"], f32["bias"],
                                   case.silu, f32["cache_seqlens"], f32["conv_state_indices"])
    plain = torch.from_numpy(plain).float()
    return (torch.from_numpy(out64), plain,
            torch.from_numpy(state64).to(inputs["conv_state"].dtype))


def run_update(case, inputs, **extra):
    """libssm.causal_conv1d_update for the case (conv_state updated in place)."""
    return libssm.causal_conv1d_update(inputs["x"], inputs["conv_state"], inputs["weight"],
                                       inputs["bias"], activation="silu" if case.silu else None,
                                       cache_seqlens=inputs["cache_seqlens"],
                                       conv_state_indices=inputs["conv_state_indices"], **extra)


def check_update(case, inputs, out, state_after, expected):
    """out against the reference, and the state exactly as expected (padding rows' and unused
    rows' states unchanged)."""
    out64, plain, state = expected
    x = inputs["x"]
    assert dtype_of(out) == dtype_of(x) and tuple(out.shape) == tuple(x.shape)
    assert_close("out", as_torch(out), out64, plain, dtype=dtype_of(x))
    got = as_torch(state_after)
    assert torch.equal(got, state), "conv_state: max difference %g" % (
        (got.double() - state.double()).abs().max().item())
