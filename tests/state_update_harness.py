"""How the decode-step suites call libssm.selective_state_update and judge what comes back: the
rows of cases the CPU and CUDA suites share (a base plus rows that each vary one axis), calls
through the generic API and straight into ssm_selective_state_update with buffers the test owns,
and the checks of out and of the state written in place against the float64 references."""
import torch

import harness
import libssm
from references import StateUpdateCase, assert_close, state_update_references

BASE = StateUpdateCase()
FULL = BASE.replace(D=True, z=True, dt_bias=True, softplus=True)
MAMBA1 = StateUpdateCase(layout="mamba1", nheads=1, ngroups=1, headdim=7)
MAMBA1_FULL = MAMBA1.replace(D=True, z=True, dt_bias=True, softplus=True)
# What mamba_ssm's Mamba-2 step passes: dt, dt_bias, D and A repeated along headdim (and dstate)
# with stride 0, and z absent (the gated norm follows instead).
MAMBA2_STEP = FULL.replace(tie=True, z=False)

OPTION_ROWS = (
    BASE,
    BASE.replace(D=True),
    BASE.replace(z=True),
    BASE.replace(dt_bias=True),
    BASE.replace(softplus=True),
    FULL,
    MAMBA1,
    MAMBA1.replace(D=True),
    MAMBA1.replace(z=True),
    MAMBA1.replace(dt_bias=True),
    MAMBA1.replace(softplus=True),
    MAMBA1_FULL,
)
GROUP_ROWS = (
    FULL.replace(ngroups=1),
    FULL.replace(ngroups=4),
    FULL.replace(nheads=6, ngroups=3),
    MAMBA2_STEP,
    MAMBA2_STEP.replace(z=True),
    MAMBA2_STEP.replace(ngroups=1, D=False, dt_bias=False),
)
SIZE_ROWS = (
    FULL.replace(dstate=1),
    FULL.replace(dstate=2),
    FULL.replace(dstate=17),
    FULL.replace(dstate=128),
    FULL.replace(dstate=256),
    MAMBA2_STEP.replace(dstate=128),
    MAMBA2_STEP.replace(dstate=256),
    MAMBA1_FULL.replace(dstate=1),
    MAMBA1_FULL.replace(dstate=256, headdim=3),
    FULL.replace(headdim=1),
    FULL.replace(nheads=1, ngroups=1),
    FULL.replace(batch=1),
    MAMBA1_FULL.replace(batch=1, headdim=1),
    FULL.replace(batch=7, nheads=3, headdim=11, ngroups=1, dstate=24),
    FULL.replace(batch=0),
    MAMBA1.replace(headdim=0),
)
INDEX_ROWS = (
    FULL.replace(indices="perm"),
    FULL.replace(indices="pad"),
    FULL.replace(indices="pad", index_dtype="int32"),
    FULL.replace(indices="pad", batch=1),
    MAMBA1_FULL.replace(indices="perm", index_dtype="int32"),
    MAMBA1_FULL.replace(indices="pad", batch=5),
    MAMBA2_STEP.replace(indices="pad", batch=4),
    FULL.replace(extra_slots=2),
    MAMBA1.replace(extra_slots=3),
)
ROWS = OPTION_ROWS + GROUP_ROWS + SIZE_ROWS + INDEX_ROWS


def case_id(case):
    return case.label()


def operands(inputs):
    """The inputs as selective_state_update's arguments after state."""
    return [inputs[n] for n in ("x", "dt", "A", "B", "C", "D", "z", "dt_bias")]


def run(case, inputs, **extra):
    """libssm.selective_state_update for the case (inputs["state"] is updated in place)."""
    return libssm.selective_state_update(inputs["state"], *operands(inputs),
                                         dt_softplus=case.softplus,
                                         state_batch_indices=inputs["state_batch_indices"],
                                         **extra)


def to_cpu(tensors):
    return {k: None if v is None else v.detach().cpu() for k, v in tensors.items()}


def references(case, inputs):
    """The float64 references and plain baselines of out and the new state, from the inputs as
    they are now (call before the state is updated)."""
    return state_update_references(to_cpu(inputs), case.options())


def used_slots(case, inputs):
    """The state slots the rows update (padding rows use none)."""
    idx = inputs["state_batch_indices"]
    if idx is None:
        return list(range(case.batch))
    return [int(s) for s in idx.cpu().tolist() if s >= 0]


def check(case, inputs, before, out, refs):
    """out against the reference (exactly zero on padding rows) and the state written in place
    against it: updated slots within tolerance of their dtype, every other slot bit-identical
    to `before` (the state as it was before the call)."""
    state = inputs["state"].detach().cpu()
    before = before.detach().cpu()
    x = inputs["x"]
    assert harness.dtype_of(out) == harness.dtype_of(x)
    assert tuple(out.shape) == tuple(x.shape)
    out = out.detach().cpu() if isinstance(out, torch.Tensor) else torch.from_numpy(out)
    assert_close("out", out, *refs["out"])
    idx = inputs["state_batch_indices"]
    if idx is not None:
        pad = idx.cpu() < 0
        assert torch.equal(out[pad], torch.zeros_like(out[pad])), "padding rows not zero"
    used = used_slots(case, inputs)
    if used:
        assert_close("state", state[used], refs["state"][0][used], refs["state"][1][used])
    untouched = [s for s in range(state.shape[0]) if s not in set(used)]
    if untouched:
        assert torch.equal(state[untouched].contiguous().view(torch.uint8),
                           before[untouched].contiguous().view(torch.uint8)), \
            "state slots no row names were changed"


def run_and_check(case, inputs, **extra):
    """One call through the generic API against the references; returns out."""
    refs = references(case, inputs)
    before = inputs["state"].clone()
    out = run(case, inputs, **extra)
    check(case, inputs, before, out, refs)
    return out


class StateUpdateCApi(harness.CApi):
    """The shared cffi handle plus ssm_selective_state_update on torch tensors."""

    def params(self, dt_softplus, struct_size=None):
        p = self.keep(self.ffi.new("ssm_selective_state_update_params *"))
        p.struct_size = (self.ffi.sizeof("ssm_selective_state_update_params")
                         if struct_size is None else struct_size)
        p.dt_softplus = int(dt_softplus)
        return self.address(p)

    def update(self, case, inputs, out, params=None):
        """ssm_selective_state_update into `out`; raises libssm errors."""
        params = self.params(case.softplus) if params is None else params
        dl = [self.dltensor(inputs[n]) for n in ("state", "x", "dt", "A", "B", "C", "D", "z",
                                                 "dt_bias", "state_batch_indices")]
        self.check(self.lib.ssm_selective_state_update(params, *dl, self.dltensor(out),
                                                       self.stream_of(inputs["x"])))
