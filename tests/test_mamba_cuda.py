"""libssm.torch.Mamba and MambaLMHeadModel on a CUDA GPU (select with -m cuda; skipped without
one), in float32 and bfloat16: output and every gradient against the float64 reference on the
CPU with the same weights, step() decoding against it, greedy generation through the decode
path against re-running the whole sequence, `python -m libssm demo` on the GPU, and, where
mamba_ssm is importable, the same weights in mamba_ssm's Mamba: libssm's error against the
float64 reference may be at most the tolerance factor times mamba_ssm's."""
import pytest
import torch

from libssm import _demo, _mamba_reference
from mamba_harness import (MIXER_ROWS, MixerCase, check_against_reference, decode_token_by_token,
                           greedy_by_full_forward, lm_forward, lm_reference, make_lm, make_mixer,
                           mixer_forward, mixer_input, mixer_reference, reference_copy)
from references import assert_close

pytestmark = pytest.mark.cuda
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])

# The CPU rows plus sizes that cross the scan's and the conv's chunking: a long sequence not a
# multiple of any chunk, a wide model, the largest conv width, and a batch of many sequences.
CUDA_ROWS = MIXER_ROWS + (
    MixerCase(d_model=64, d_state=16, seqlen=333),
    MixerCase(d_model=256, d_state=16, seqlen=130, batch=3),
    MixerCase(d_model=48, d_state=32, d_conv=8, seqlen=77),
    MixerCase(d_model=32, batch=17, seqlen=5),
)


@DTYPES
@pytest.mark.parametrize("case", CUDA_ROWS, ids=MixerCase.label)
def test_mixer_forward_and_gradients_match_reference(case, dtype, seed):
    mixer = make_mixer(case, seed, device="cuda", dtype=dtype)
    x = mixer_input(case, seed, device="cuda", dtype=dtype)
    check_against_reference(mixer, mixer_forward, mixer_reference, [x], dtype)


@DTYPES
def test_lm_forward_and_gradients_match_reference(dtype, seed):
    model = make_lm(seed, device="cuda", d_model=64, n_layer=3).to(dtype)
    ids = torch.randint(0, 13, (4, 50), generator=torch.Generator().manual_seed(seed))
    check_against_reference(model, lm_forward, lm_reference, [ids.cuda()], dtype)


@DTYPES
@pytest.mark.parametrize("case", [MixerCase(), MixerCase(d_conv=2, seqlen=3),
                                  MixerCase(d_model=64, d_state=16, seqlen=40, batch=5)],
                         ids=MixerCase.label)
def test_step_decoding_matches_reference(case, dtype, seed):
    """step() token by token against the float64 reference forward; the bound comes from the
    reference's own decode step run in the same dtype (its state kept in that dtype too)."""
    mixer = make_mixer(case, seed, device="cuda", dtype=dtype)
    x = mixer_input(case, seed, device="cuda", dtype=dtype)
    with torch.no_grad():
        steps = decode_token_by_token(mixer, x)
        ref64 = _mamba_reference.mamba_forward(reference_copy(mixer), x.cpu().double())
        plain_mixer = reference_copy(mixer, dtype)
        conv = torch.zeros(case.batch, mixer.d_inner, case.d_conv, dtype=dtype)
        state = torch.zeros(case.batch, mixer.d_inner, case.d_state, dtype=dtype)
        plain = []
        for t in range(case.seqlen):
            out, conv, state = _mamba_reference.mamba_step(plain_mixer, x[:, t:t + 1].cpu(),
                                                           conv, state)
            plain.append(out)
    assert_close("decode", steps, ref64, torch.cat(plain, dim=1), dtype)


def test_greedy_generation_matches_full_sequence(seed):
    model = make_lm(seed, device="cuda", d_model=64, n_layer=3)
    prompt = torch.randint(0, 13, (8, 20), generator=torch.Generator().manual_seed(seed))
    prompt = prompt.cuda()
    generated = model.generate(prompt, max_length=40)
    assert torch.equal(generated, greedy_by_full_forward(model, prompt, 40))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_demo_runs_on_the_gpu(dtype, capsys):
    status = _demo.main(["--steps", "20", "--batch", "8", "--seqlen", "24", "--copy", "3",
                         "--d-model", "32", "--layers", "2", "--eval", "16", "--ref-steps", "2",
                         "--device", "cuda", "--dtype", dtype])
    assert status == 0
    out = capsys.readouterr().out
    assert "on cuda" in out and "generation (%s)" % dtype in out


# ---------------------------------------------------------------------------------------------
# Parity with mamba_ssm: the same weights in both modules.


def _mamba_ssm_twin(mixer):
    simple = pytest.importorskip("mamba_ssm.modules.mamba_simple")
    twin = simple.Mamba(mixer.d_model, d_state=mixer.d_state, d_conv=mixer.d_conv,
                        expand=mixer.expand, dt_rank=mixer.dt_rank,
                        conv_bias=mixer.conv1d.bias is not None,
                        bias=mixer.in_proj.bias is not None, layer_idx=mixer.layer_idx,
                        device="cuda", dtype=mixer.in_proj.weight.dtype)
    twin.load_state_dict(mixer.state_dict(), strict=True)
    return twin


@DTYPES
@pytest.mark.parametrize("case", [MixerCase(d_model=64, d_state=16, seqlen=333),
                                  MixerCase(d_model=256, d_state=16, seqlen=130, batch=3)],
                         ids=MixerCase.label)
def test_parity_with_mamba_ssm(case, dtype, seed):
    """Output and gradients of libssm's Mamba against the float64 reference, bounded by the
    error of mamba_ssm's Mamba (its fused fast path) holding the same weights."""
    mixer = make_mixer(case, seed, device="cuda", dtype=dtype)
    twin = _mamba_ssm_twin(mixer)
    x = mixer_input(case, seed, device="cuda", dtype=dtype)
    g = torch.Generator().manual_seed(seed ^ 0x77)
    cotangent = torch.randn(x.shape, generator=g, dtype=torch.float64)

    def run(module, inputs, forward):
        leaf = inputs.detach().clone().requires_grad_()
        out = forward(module, [leaf])
        out.backward(cotangent.to(out.device, out.dtype))
        return out.detach(), leaf.grad, {n: p.grad for n, p in module.named_parameters()}

    ours, ours_dx, ours_grads = run(mixer, x, mixer_forward)
    theirs, theirs_dx, theirs_grads = run(twin, x, mixer_forward)
    ref, ref_dx, ref_grads = run(reference_copy(mixer), x.cpu().double(), mixer_reference)
    assert_close("output", ours, ref, theirs, dtype)
    assert_close("dx", ours_dx, ref_dx, theirs_dx, dtype)
    for name, grad in ref_grads.items():
        assert_close("d" + name, ours_grads[name], grad, theirs_grads[name], dtype)


@DTYPES
def test_decode_parity_with_mamba_ssm(dtype, seed):
    case = MixerCase(d_model=64, d_state=16, seqlen=24, batch=4)
    mixer = make_mixer(case, seed, device="cuda", dtype=dtype)
    twin = _mamba_ssm_twin(mixer)
    x = mixer_input(case, seed, device="cuda", dtype=dtype)
    with torch.no_grad():
        ours = decode_token_by_token(mixer, x)
        theirs = decode_token_by_token(twin, x)
        ref = _mamba_reference.mamba_forward(reference_copy(mixer), x.cpu().double())
    assert_close("decode", ours, ref, theirs, dtype)
