"""A pure-PyTorch evaluation of the Mamba-1 mixer and of the small LM built on it: the forward
over a whole sequence, the one-token decode step, and the LM's forward. It calls no libssm op
and reads the parameters of modules laid out as mamba_ssm's (in_proj, conv1d, x_proj, dt_proj,
A_log, D, out_proj; backbone.embedding, backbone.layers.{i}.norm/mixer, backbone.norm_f,
lm_head), so it runs on libssm.torch's modules, or on float64 copies of them, with the same
weights. `python -m libssm demo` times training through it; the tests check libssm against it.

The scan is the textbook one (mamba_ssm's selective_scan_ref): (batch, dim, seqlen, dstate)
decays and inputs made up front, then a loop over time, in float32 or the inputs' wider dtype."""

import torch
import torch.nn.functional as F


def selective_scan(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False):
    """(out, last_state) of the Mamba-1 selective scan (libssm/selective_scan.h) from a zero
    state. u, delta, z: (batch, dim, seqlen); A: (dim, dstate); B, C: (batch, dstate, seqlen);
    D, delta_bias: (dim,). Differentiable in every input."""
    dtype = u.dtype
    work = torch.promote_types(dtype, torch.float32)
    u, delta, B, C = (t.to(work) for t in (u, delta, B, C))
    if delta_bias is not None:
        delta = delta + delta_bias.to(work)[:, None]
    if delta_softplus:
        delta = F.softplus(delta)
    decay = torch.exp(delta[..., None] * A.to(work)[:, None, :])  # (batch, dim, seqlen, dstate)
    drive = (delta * u)[..., None] * B.transpose(1, 2)[:, None, :, :]
    h = u.new_zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for t in range(u.shape[2]):
        h = decay[:, :, t] * h + drive[:, :, t]
        ys.append(torch.einsum("bdn,bn->bd", h, C[:, :, t]))
    y = torch.stack(ys, dim=2)
    if D is not None:
        y = y + D.to(work)[:, None] * u
    if z is not None:
        y = y * F.silu(z.to(work))
    return y.to(dtype), h


def mamba_forward(mixer, hidden_states, return_states=False):
    """The mixer's output (batch, seqlen, d_model) for hidden_states (batch, seqlen, d_model);
    with return_states, also the decode cache after the last token: (conv_state (batch,
    d_inner, d_conv), the last d_conv inputs of the conv, zero-padded on the left; ssm_state
    (batch, d_inner, d_state))."""
    seqlen = hidden_states.shape[1]
    xz = F.linear(hidden_states, mixer.in_proj.weight, mixer.in_proj.bias).transpose(1, 2)
    x, z = xz.chunk(2, dim=1)  # (batch, d_inner, seqlen) each
    conv_state = F.pad(x, (mixer.d_conv - seqlen, 0))
    x = F.conv1d(x, mixer.conv1d.weight, mixer.conv1d.bias, padding=mixer.d_conv - 1,
                 groups=mixer.d_inner)[..., :seqlen]
    x = F.silu(x)
    dt, B, C = torch.split(F.linear(x.transpose(1, 2), mixer.x_proj.weight),
                           [mixer.dt_rank, mixer.d_state, mixer.d_state], dim=-1)
    dt = F.linear(dt, mixer.dt_proj.weight).transpose(1, 2)
    A = -torch.exp(mixer.A_log)
    y, ssm_state = selective_scan(x, dt, A, B.transpose(1, 2), C.transpose(1, 2), mixer.D, z,
                                  mixer.dt_proj.bias, delta_softplus=True)
    out = F.linear(y.transpose(1, 2), mixer.out_proj.weight, mixer.out_proj.bias)
    return (out, conv_state, ssm_state) if return_states else out


def mamba_step(mixer, hidden_states, conv_state, ssm_state):
    """One decode step: hidden_states (batch, 1, d_model) -> (out (batch, 1, d_model), conv_state,
    ssm_state), the two states new tensors (the inputs are left as they were)."""
    x, z = F.linear(hidden_states[:, 0], mixer.in_proj.weight, mixer.in_proj.bias).chunk(2, -1)
    conv_state = torch.cat([conv_state[:, :, 1:], x[:, :, None].to(conv_state.dtype)], dim=-1)
    x = (conv_state * mixer.conv1d.weight[:, 0, :]).sum(-1)  # depthwise (d_inner, 1, d_conv)
    if mixer.conv1d.bias is not None:
        x = x + mixer.conv1d.bias
    x = F.silu(x)
    dt, B, C = torch.split(F.linear(x, mixer.x_proj.weight),
                           [mixer.dt_rank, mixer.d_state, mixer.d_state], dim=-1)
    dt = F.softplus(F.linear(dt, mixer.dt_proj.weight) + mixer.dt_proj.bias)
    work = torch.promote_types(ssm_state.dtype, torch.float32)
    dt, x, z, B, C = (t.to(work) for t in (dt, x, z, B, C))
    A = -torch.exp(mixer.A_log.to(work))
    h = torch.exp(dt[..., None] * A) * ssm_state.to(work) + (dt * x)[..., None] * B[:, None, :]
    y = torch.einsum("bdn,bn->bd", h, C) + mixer.D.to(work) * x
    y = (y * F.silu(z)).to(hidden_states.dtype)
    out = F.linear(y, mixer.out_proj.weight, mixer.out_proj.bias)
    return out[:, None], conv_state, h.to(ssm_state.dtype)


def _norm(norm, x):
    """An RMSNorm or LayerNorm module's formula, in torch ops."""
    if isinstance(norm, torch.nn.LayerNorm):
        return F.layer_norm(x, norm.normalized_shape, norm.weight, norm.bias, norm.eps)
    eps = norm.eps if norm.eps is not None else torch.finfo(x.dtype).eps
    rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return x * rstd * norm.weight


def lm_forward(model, input_ids):
    """Logits (batch, seqlen, vocab) of a model laid out as mamba_ssm's MambaLMHeadModel with
    Mamba mixers and no MLPs: embedding, then per layer residual += mixer(norm(residual)),
    then norm_f and lm_head. The residual stream is kept in float32 when the model's
    residual_in_fp32 says so."""
    backbone = model.backbone
    residual = backbone.embedding(input_ids)
    if backbone.residual_in_fp32:
        residual = residual.float()
    for layer in backbone.layers:
        normed = _norm(layer.norm, residual.to(layer.norm.weight.dtype))
        residual = residual + mamba_forward(layer.mixer, normed).to(residual.dtype)
    hidden = _norm(backbone.norm_f, residual.to(backbone.norm_f.weight.dtype))
    return F.linear(hidden, model.lm_head.weight)
