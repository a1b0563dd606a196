"""What the Mamba module suites share: mamba_ssm's parameter table, seeded mixers and LMs with
their weights moved off the initialisation's special values, the check of libssm.torch's
modules (output and every gradient) against the pure-PyTorch reference (libssm._mamba_reference)
in float64 with the same weights, token-by-token decoding, and greedy generation by re-running
the whole sequence."""
import copy
import dataclasses

import torch

import libssm.torch as ssm_torch
from libssm import _mamba_reference
from references import assert_close


@dataclasses.dataclass(frozen=True)
class MixerCase:
    """Constructor arguments of a Mamba and the input it sees."""
    d_model: int = 16
    d_state: int = 8
    d_conv: int = 4
    expand: int = 2
    dt_rank: object = "auto"
    conv_bias: bool = True
    bias: bool = False
    batch: int = 2
    seqlen: int = 13

    def replace(self, **kw):
        return dataclasses.replace(self, **kw)

    def kwargs(self):
        return dict(d_model=self.d_model, d_state=self.d_state, d_conv=self.d_conv,
                    expand=self.expand, dt_rank=self.dt_rank, conv_bias=self.conv_bias,
                    bias=self.bias)

    def label(self):
        base = MixerCase()
        changed = ["%s=%s" % (f.name, getattr(self, f.name)) for f in dataclasses.fields(self)
                   if getattr(self, f.name) != getattr(base, f.name)]
        return ",".join(changed) or "base"


# Rows vary one axis at a time from the base case: projection biases on and conv bias off, an
# explicit dt_rank, the narrowest conv, no expansion with one state, a one-token sequence and
# one shorter than the conv (whose cache then needs left padding), and a longer one.
MIXER_ROWS = (
    MixerCase(),
    MixerCase(bias=True, conv_bias=False),
    MixerCase(dt_rank=5),
    MixerCase(d_conv=2),
    MixerCase(expand=1, d_state=1),
    MixerCase(seqlen=1),
    MixerCase(seqlen=3),
    MixerCase(batch=1, seqlen=70, d_model=24),
)

# mamba_ssm.modules.mamba_simple.Mamba's state_dict, name -> shape, for MixerCase() (d_inner 32,
# dt_rank ceil(16 / 16) = 1) and for one with every optional tensor flipped and dt_rank, d_conv
# and expand changed.
MAMBA_SSM_PARAMS = {
    MixerCase(): {
        "A_log": (32, 8), "D": (32,), "in_proj.weight": (64, 16),
        "conv1d.weight": (32, 1, 4), "conv1d.bias": (32,), "x_proj.weight": (17, 32),
        "dt_proj.weight": (32, 1), "dt_proj.bias": (32,), "out_proj.weight": (16, 32),
    },
    MixerCase(d_model=12, d_state=4, d_conv=3, expand=3, dt_rank=5, conv_bias=False,
              bias=True): {
        "A_log": (36, 4), "D": (36,), "in_proj.weight": (72, 12), "in_proj.bias": (72,),
        "conv1d.weight": (36, 1, 3), "x_proj.weight": (13, 36),
        "dt_proj.weight": (36, 5), "dt_proj.bias": (36,), "out_proj.weight": (12, 36),
        "out_proj.bias": (12,),
    },
}


def perturb(module, seed, scale=0.2):
    """Moves every parameter off its initial value (D = 1, zero biases, A_log's equal rows)
    by seeded noise, so a mixed-up index or a dropped term shows in the output."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float64)
            p.add_((scale * noise).to(p.dtype).to(p.device))
    return module


def make_mixer(case, seed, device="cpu", dtype=None, layer_idx=0):
    torch.manual_seed(seed)
    mixer = ssm_torch.Mamba(**case.kwargs(), layer_idx=layer_idx, device=device)
    return perturb(mixer, seed).to(dtype or torch.float32)


def make_lm(seed, device="cpu", vocab_size=13, n_layer=2, d_model=16, **config):
    torch.manual_seed(seed)
    config = ssm_torch.MambaConfig(d_model=d_model, n_layer=n_layer, vocab_size=vocab_size,
                                   ssm_cfg=dict(d_state=8), **config)
    return perturb(ssm_torch.MambaLMHeadModel(config, device=device), seed, scale=0.1)


def mixer_input(case, seed, device="cpu", dtype=torch.float32):
    g = torch.Generator().manual_seed(seed ^ 0x1234)
    x = torch.randn(case.batch, case.seqlen, case.d_model, generator=g, dtype=torch.float64)
    return x.to(dtype).to(device)


def reference_copy(module, dtype=torch.float64):
    """A copy with the same weights in `dtype` on the CPU, for the reference to run on."""
    return copy.deepcopy(module).to("cpu", dtype)


def _forward_backward(module, inputs, forward, dtype, device):
    """(output, input leaves, parameters) after forward(module, leaves) and a backward of a
    fixed random cotangent; floating inputs become leaves in `dtype` on `device`."""
    leaves = [(x.detach().to(device, dtype) if x.is_floating_point() else x.to(device))
              .requires_grad_(x.is_floating_point()) for x in inputs]
    out = forward(module, leaves)
    g = torch.Generator().manual_seed(7)
    cotangent = torch.randn(out.shape, generator=g, dtype=torch.float64)
    out.backward(cotangent.to(out.device, out.dtype))
    return out.detach(), leaves, dict(module.named_parameters())


# A whole mixer or model chains GEMMs, the conv, the scan and the gate: on the GPU cuBLAS's bf16
# GEMMs round at other points than the CPU reference's, so the same-dtype reference's error
# tracks the rounding less closely than for one kernel (seen: 0.145 against a bound of 0.132 on
# a bf16 mixer output of max |ref| 7.3). Single kernels keep the bound of references.py.
MODULE_SLACK = 2.0


def check_against_reference(module, run_libssm, run_reference, inputs, dtype):
    """Runs the module through libssm (run_libssm(module, leaves) -> output) and the reference
    (run_reference) on float64 and `dtype` copies of it on the CPU, then compares the output
    and the gradient of every parameter and floating input under one random cotangent, at the
    tolerance of `dtype` relative to the same-dtype reference's error."""
    device = next(module.parameters()).device
    out, leaves, params = _forward_backward(module, inputs, run_libssm, dtype, device)
    ref, ref_leaves, ref_params = _forward_backward(
        reference_copy(module), inputs, run_reference, torch.float64, "cpu")
    plain, plain_leaves, plain_params = _forward_backward(
        reference_copy(module, dtype), inputs, run_reference, dtype, "cpu")
    assert_close("output", out, ref, plain, dtype, MODULE_SLACK)
    for name, p in params.items():
        assert p.grad is not None, "%s: no gradient" % name
        assert_close("d" + name, p.grad, ref_params[name].grad, plain_params[name].grad, dtype,
                     MODULE_SLACK)
    for i, x in enumerate(leaves):
        if x.is_floating_point():
            assert_close("dinput%d" % i, x.grad, ref_leaves[i].grad, plain_leaves[i].grad,
                         dtype, MODULE_SLACK)


def decode_token_by_token(mixer, x):
    """The mixer's output for x (batch, seqlen, d_model) made by step() alone, from a zeroed
    cache, one token at a time."""
    conv_state, ssm_state = mixer.allocate_inference_cache(x.shape[0], x.shape[1])
    outs = []
    for t in range(x.shape[1]):
        out, conv_state_after, ssm_state_after = mixer.step(x[:, t:t + 1], conv_state,
                                                            ssm_state)
        assert conv_state_after is conv_state and ssm_state_after is ssm_state
        outs.append(out)
    return torch.cat(outs, dim=1)


def greedy_by_full_forward(model, prompt, max_length):
    """Greedy continuation of prompt to max_length tokens, each token chosen from a forward
    over the whole sequence so far: no cache, no decode step."""
    tokens = prompt
    with torch.no_grad():
        while tokens.shape[1] < max_length:
            nxt = model(tokens).logits[:, -1].argmax(dim=-1)
            tokens = torch.cat([tokens, nxt[:, None]], dim=1)
    return tokens


def mixer_forward(module, leaves):
    return module(leaves[0])


def mixer_reference(module, leaves):
    return _mamba_reference.mamba_forward(module, leaves[0])


def lm_forward(model, leaves):
    return model(leaves[0]).logits


def lm_reference(model, leaves):
    return _mamba_reference.lm_forward(model, leaves[0])
