"""libssm.torch.Mamba and MambaLMHeadModel on the CPU: parameter names, shapes and
initialisation as mamba_ssm's (so its state_dicts load unchanged), output and every gradient
against the pure-PyTorch reference in float64 with the same weights, step() decoding and the
prompt-then-step cache against the full-sequence forward, greedy generation through the decode
path against re-running the whole sequence, sampling, and a short `python -m libssm demo`."""
import math

import pytest
import torch
import torch.nn.functional as F

import libssm.torch as ssm_torch
from libssm import _demo, _mamba_reference
from libssm._torch_mamba_lm import sample
from mamba_harness import (MAMBA_SSM_PARAMS, MIXER_ROWS, MixerCase, check_against_reference,
                           decode_token_by_token, greedy_by_full_forward, lm_forward, lm_reference,
                           make_lm, make_mixer, mixer_forward, mixer_input, mixer_reference,
                           reference_copy)
from references import selective_scan_torch

mixer_rows = pytest.mark.parametrize("case", MIXER_ROWS, ids=MixerCase.label)


# ---------------------------------------------------------------------------------------------
# Parameters and initialisation (no kernel runs).


@pytest.mark.parametrize("case", list(MAMBA_SSM_PARAMS), ids=MixerCase.label)
def test_parameters_are_mamba_ssm_names_and_shapes(case):
    mixer = ssm_torch.Mamba(**case.kwargs())
    shapes = {name: tuple(t.shape) for name, t in mixer.state_dict().items()}
    assert shapes == MAMBA_SSM_PARAMS[case]


@pytest.mark.parametrize("case", list(MAMBA_SSM_PARAMS), ids=MixerCase.label)
def test_mamba_ssm_state_dict_loads_unchanged(case, seed):
    g = torch.Generator().manual_seed(seed)
    state = {name: torch.randn(shape, generator=g) for name, shape in
             MAMBA_SSM_PARAMS[case].items()}
    mixer = ssm_torch.Mamba(**case.kwargs())
    mixer.load_state_dict(state, strict=True)
    for name, t in mixer.state_dict().items():
        assert torch.equal(t, state[name]), name
    again = ssm_torch.Mamba(**case.kwargs())
    again.load_state_dict(mixer.state_dict(), strict=True)
    x = mixer_input(case, seed)
    assert torch.equal(_mamba_reference.mamba_forward(again, x),
                       _mamba_reference.mamba_forward(mixer, x))


def test_initialisation_is_mamba_ssm():
    torch.manual_seed(0)
    dt_min, dt_max, floor = 0.001, 0.1, 1e-4
    mixer = ssm_torch.Mamba(64, d_state=16, dt_min=dt_min, dt_max=dt_max, dt_init_floor=floor,
                            dt_scale=2.0, dtype=torch.float16)
    assert mixer.d_inner == 128 and mixer.dt_rank == 4
    # A_log and D stay float32 whatever the module's dtype, as mamba_ssm keeps them.
    assert mixer.A_log.dtype == mixer.D.dtype == torch.float32
    assert mixer.in_proj.weight.dtype == torch.float16
    assert torch.equal(mixer.A_log, torch.log(torch.arange(1.0, 17.0)).repeat(128, 1))
    assert torch.equal(mixer.D, torch.ones(128))
    bound = 2.0 * 4 ** -0.5
    assert mixer.dt_proj.weight.abs().max().item() <= bound
    dt = F.softplus(mixer.dt_proj.bias.float())
    assert dt.min().item() >= dt_min * 0.99 and dt.max().item() <= dt_max * 1.01
    assert dt.std().item() > 0.01  # drawn, not constant
    assert getattr(mixer.dt_proj.bias, "_no_reinit", False)
    assert mixer.conv1d.groups == 128 and mixer.conv1d.padding == (3,)

    constant = ssm_torch.Mamba(16, dt_init="constant", dt_rank=4)
    assert torch.equal(constant.dt_proj.weight, torch.full((32, 4), 0.5))
    with pytest.raises(NotImplementedError, match="dt_init"):
        ssm_torch.Mamba(16, dt_init="bogus")


def test_lm_parameters_are_mamba_ssm_names_and_shapes():
    model = make_lm(0, vocab_size=13, n_layer=2, d_model=16)
    mixer = MAMBA_SSM_PARAMS[MixerCase()]
    expected = {"backbone.embedding.weight": (16, 16), "backbone.norm_f.weight": (16,),
                "lm_head.weight": (16, 16)}  # vocab 13 padded to a multiple of 8
    for i in range(2):
        expected["backbone.layers.%d.norm.weight" % i] = (16,)
        expected.update({"backbone.layers.%d.mixer.%s" % (i, k): v for k, v in mixer.items()})
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == expected
    assert model.lm_head.weight is model.backbone.embedding.weight
    untied = make_lm(0, tie_embeddings=False, rms_norm=False)
    assert untied.lm_head.weight is not untied.backbone.embedding.weight
    assert "backbone.layers.1.norm.bias" in untied.state_dict()
    # GPT-2's depth scaling: out_proj drawn as a default Linear, divided by sqrt(n_layer).
    torch.manual_seed(0)
    deep = ssm_torch.MambaLMHeadModel(ssm_torch.MambaConfig(d_model=64, n_layer=16,
                                                            vocab_size=8))
    limit = 1 / math.sqrt(128) / math.sqrt(16)
    assert deep.backbone.layers[3].mixer.out_proj.weight.abs().max().item() <= limit


def test_lm_refuses_blocks_it_does_not_build():
    for change in (dict(d_intermediate=32), dict(attn_layer_idx=[1]),
                   dict(ssm_cfg={"layer": "Mamba2"})):
        with pytest.raises(NotImplementedError, match="only Mamba1"):
            ssm_torch.MambaLMHeadModel(ssm_torch.MambaConfig(d_model=16, n_layer=2,
                                                             vocab_size=8, **change))


def test_step_and_cache_errors():
    mixer = ssm_torch.Mamba(16)
    conv_state, ssm_state = mixer.allocate_inference_cache(2, 10)
    assert conv_state.shape == (2, 32, 4) and ssm_state.shape == (2, 32, 16)
    with pytest.raises(ValueError, match="one token"):
        mixer.step(torch.randn(2, 3, 16), conv_state, ssm_state)
    with pytest.raises(ValueError, match="layer_idx"):
        mixer(torch.randn(2, 3, 16),
              inference_params=ssm_torch.InferenceParams(max_seqlen=8, max_batch_size=2))


# ---------------------------------------------------------------------------------------------
# The reference, against the suites' own scan reference and itself.


def test_reference_scan_matches_the_scan_suites_reference(seed):
    g = torch.Generator().manual_seed(seed)
    b, d, l, n = 2, 5, 9, 3
    u, delta, z = (torch.randn(b, d, l, generator=g, dtype=torch.float64) for _ in range(3))
    A = -torch.rand(d, n, generator=g, dtype=torch.float64)
    B, C = (torch.randn(b, n, l, generator=g, dtype=torch.float64) for _ in range(2))
    D, bias = torch.randn(d, generator=g, dtype=torch.float64), torch.rand(d, generator=g)
    got = _mamba_reference.selective_scan(u, delta, A, B, C, D, z, bias.double(), True)
    want = selective_scan_torch(u, delta, A, B, C, D, z, bias.double(), True)
    for a, b_ in zip(got, want):
        torch.testing.assert_close(a, b_, rtol=1e-12, atol=1e-12)


@mixer_rows
def test_reference_step_matches_reference_forward(case, seed):
    mixer = reference_copy(make_mixer(case, seed))
    x = mixer_input(case, seed, dtype=torch.float64)
    full, conv_state, ssm_state = _mamba_reference.mamba_forward(mixer, x, return_states=True)
    conv = torch.zeros(case.batch, mixer.d_inner, case.d_conv, dtype=torch.float64)
    state = torch.zeros(case.batch, mixer.d_inner, case.d_state, dtype=torch.float64)
    outs = []
    for t in range(case.seqlen):
        out, conv, state = _mamba_reference.mamba_step(mixer, x[:, t:t + 1], conv, state)
        outs.append(out)
    torch.testing.assert_close(torch.cat(outs, dim=1), full, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(conv, conv_state, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(state, ssm_state, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# libssm against the reference (these run libssm's conv1d, scan, norm and decode kernels).


@mixer_rows
def test_mixer_forward_and_gradients_match_reference(case, seed):
    mixer = make_mixer(case, seed)
    check_against_reference(mixer, mixer_forward, mixer_reference, [mixer_input(case, seed)],
                            torch.float32)


def test_prompt_with_gradient_matches_reference(seed):
    """A prompt that fills a decode cache with autograd on takes the composition of the ops
    (whose scan keeps the last state's gradient), not the fused training function: its output
    and gradients are the reference's all the same."""
    case = MixerCase(seqlen=10)
    mixer = make_mixer(case, seed, layer_idx=0)

    def run(module, leaves):
        params = ssm_torch.InferenceParams(max_seqlen=10, max_batch_size=case.batch)
        return module(leaves[0], inference_params=params)

    check_against_reference(mixer, run, mixer_reference, [mixer_input(case, seed)],
                            torch.float32)


def test_mixer_trains_under_autocast(seed):
    """float32 weights under torch.autocast(bfloat16), as the demo trains: the projections run
    in bfloat16 in the backward too, and every gradient comes back float32, near the float32
    run's."""
    case = MixerCase(batch=2, seqlen=16)
    runs = []
    for enabled in (False, True):
        mixer = make_mixer(case, seed)
        x = mixer_input(case, seed).requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled):
            out = mixer(x)
        out.float().square().sum().backward()
        runs.append([x.grad] + [p.grad for p in mixer.parameters()])
    for want, got in zip(*runs):
        assert got.dtype == torch.float32
        assert (got - want).norm() <= 5e-2 * want.norm()


def test_training_forward_keeps_xz_x_dbl_and_the_gated_output(seed):
    """What a training forward keeps for the backward, beyond the weights: in_proj's input,
    xz, x_proj's output and the gated scan output, as mamba_ssm's mamba_inner_fn; the conv
    output and dt are recomputed in the backward. Sizes are in elements of batch * seqlen
    rows (37 is prime: no weight's size is a multiple of it)."""
    case = MixerCase(batch=3, seqlen=37)
    mixer = make_mixer(case, seed)
    x = mixer_input(case, seed).requires_grad_()
    rows = case.batch * case.seqlen
    kept = {}

    def pack(t):
        if t.numel() % rows == 0:
            kept[(t.data_ptr(), t.numel())] = t.numel() // rows
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = mixer(x)
    d_inner, width = mixer.d_inner, mixer.dt_rank + 2 * mixer.d_state
    assert sorted(kept.values()) == sorted([case.d_model, 2 * d_inner, width, d_inner])
    out.sum().backward()
    assert x.grad is not None


@pytest.mark.parametrize("config", [dict(), dict(fused_add_norm=False),
                                    dict(rms_norm=False, residual_in_fp32=False)],
                         ids=["fused-rms", "unfused-rms", "fused-layernorm"])
def test_lm_forward_and_gradients_match_reference(config, seed):
    model = make_lm(seed, **config)
    ids = torch.randint(0, 13, (2, 11), generator=torch.Generator().manual_seed(seed))
    check_against_reference(model, lm_forward, lm_reference, [ids], torch.float32)


@mixer_rows
def test_step_decoding_matches_full_forward(case, seed):
    mixer = make_mixer(case, seed)
    x = mixer_input(case, seed)
    with torch.no_grad():
        full = mixer(x)
        steps = decode_token_by_token(mixer, x)
    torch.testing.assert_close(steps, full, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("prompt", [1, 3, 6])
def test_prompt_then_steps_match_full_forward(prompt, seed):
    """The first forward with inference_params fills the cache (the conv state left-padded
    when the prompt is shorter than the conv); later ones decode through step()."""
    case = MixerCase(seqlen=10)
    mixer = make_mixer(case, seed, layer_idx=3)
    x = mixer_input(case, seed)
    params = ssm_torch.InferenceParams(max_seqlen=10, max_batch_size=case.batch)
    with torch.no_grad():
        full = mixer(x)
        outs = [mixer(x[:, :prompt], inference_params=params)]
        params.seqlen_offset = prompt
        for t in range(prompt, case.seqlen):
            outs.append(mixer(x[:, t:t + 1], inference_params=params))
            params.seqlen_offset += 1
    assert set(params.key_value_memory_dict) == {3}
    torch.testing.assert_close(torch.cat(outs, dim=1), full, rtol=1e-4, atol=1e-5)


def test_preallocated_cache_is_the_one_filled(seed):
    """A cache from MambaLMHeadModel.allocate_inference_cache, handed in as mamba_ssm's
    CUDA-graph decoding does, is filled in place and decodes as a lazily made one."""
    model = make_lm(seed)
    tokens = torch.randint(0, 13, (2, 8), generator=torch.Generator().manual_seed(seed))
    cache = model.allocate_inference_cache(2, 8)
    assert sorted(cache) == [0, 1]
    assert [tuple(t.shape) for t in cache[1]] == [(2, 32, 4), (2, 32, 8)]
    logits = []
    with torch.no_grad():
        for params in (ssm_torch.InferenceParams(8, 2, key_value_memory_dict=cache),
                       ssm_torch.InferenceParams(8, 2)):
            out = [model(tokens[:, :5], inference_params=params).logits]
            for t in range(5, 8):
                params.seqlen_offset = t
                out.append(model(tokens[:, t:t + 1], inference_params=params).logits)
            logits.append(torch.cat(out, dim=1))
    assert all(state.abs().sum() > 0 for states in cache.values() for state in states)
    assert torch.equal(logits[0], logits[1])


@pytest.mark.parametrize("config", [dict(), dict(fused_add_norm=False, rms_norm=False)],
                         ids=["fused-rms", "unfused-layernorm"])
def test_greedy_generation_matches_full_sequence(config, seed):
    model = make_lm(seed, n_layer=3, **config)
    prompt = torch.randint(0, 13, (3, 5), generator=torch.Generator().manual_seed(seed))
    generated = model.generate(prompt, max_length=16)
    assert generated.shape == (3, 16) and torch.equal(generated[:, :5], prompt)
    assert torch.equal(generated, greedy_by_full_forward(model, prompt, 16))
    assert torch.equal(model.generate(prompt, max_length=5), prompt)


def test_sampled_generation_is_seeded_and_stays_in_top_k(seed):
    model = make_lm(seed)
    prompt = torch.randint(0, 13, (4, 3), generator=torch.Generator().manual_seed(seed))

    def run():
        g = torch.Generator().manual_seed(seed)
        return model.generate(prompt, max_length=12, top_k=3, temperature=0.8, generator=g)

    first = run()
    assert torch.equal(first, run())
    for t in range(3, 12):
        with torch.no_grad():
            logits = model(first[:, :t]).logits[:, -1]
        top = torch.topk(logits, 3, dim=-1).indices
        assert (top == first[:, t:t + 1]).any(dim=1).all(), "step %d left the top 3" % t
    with pytest.raises(ValueError, match="max_length"):
        model.generate(prompt, max_length=2)


def test_sample():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [5.0, 0.0, 0.0, 0.0]])
    assert torch.equal(sample(logits), torch.tensor([1, 0]))
    g = torch.Generator().manual_seed(0)
    draws = torch.stack([sample(logits, top_k=2, generator=g) for _ in range(200)])
    assert set(draws[:, 0].tolist()) == {1, 3}
    assert set(draws[:, 1].tolist()) <= {0, 1, 2, 3}
    cold = torch.stack([sample(logits, top_k=0, temperature=1e-3, generator=g)
                        for _ in range(20)])
    assert (cold == torch.tensor([1, 0])).all()


# ---------------------------------------------------------------------------------------------
# python -m libssm demo


def test_demo_examples_hide_the_answer_in_order():
    g = torch.Generator().manual_seed(0)
    examples = _demo.make_examples(g, 50, 20, 4, 6)
    assert examples.shape == (50, 25)
    context, answer = examples[:, :20], examples[:, 21:]
    assert (examples[:, 20] == _demo.SEPARATOR).all()
    assert ((answer >= _demo.FIRST_DATA) & (answer < _demo.FIRST_DATA + 6)).all()
    for row, ans in zip(context, answer):
        assert torch.equal(row[row != _demo.NOISE], ans)


def test_demo_rejects_bad_arguments(capsys):
    for argv in (["--steps", "0"], ["--seqlen", "7", "--copy", "4"], ["--copy", "1"],
                 ["--dtype", "int8"]):
        with pytest.raises(SystemExit):
            _demo.parse_args(argv)
    assert "--" in capsys.readouterr().err


def test_demo_runs_and_reports(capsys):
    status = _demo.main(["--steps", "4", "--batch", "4", "--seqlen", "12", "--copy", "2",
                         "--d-model", "16", "--layers", "1", "--d-state", "4", "--eval", "5",
                         "--ref-steps", "1", "--device", "cpu"])
    assert status == 0
    captured = capsys.readouterr()
    assert "training" in captured.err and "loss" in captured.err
    for line in ("trained 4 steps", "held-out accuracy, 5 examples", "training step (median)",
                 "pure-PyTorch reference", "generation (float32)", "reference check"):
        assert line in captured.out, line
