"""libssm.torch.Mamba: the Mamba-1 mixer of mamba_ssm.modules.mamba_simple.Mamba, with the same
constructor arguments, parameter names, shapes and initialisation, so a mamba_ssm state_dict
loads unchanged. The projections are torch matmuls; the causal conv1d, the selective scan (with
the z gate, dt bias and softplus), and the decode step's conv update and state update are
libssm's kernels, through the torch adapters of their families.

Activations along the sequence are kept channel-major: a (batch, channels, seqlen) tensor laid out
as (channels, batch, seqlen), as in_proj's one matmul leaves x and z. The conv and the scan read
and write it along seqlen, and its transpose is a (batch * seqlen, channels) matrix view that
x_proj, out_proj and their gradients multiply with no copy (the contiguous layout needs a
transposing copy for each, ~0.1 ms a layer at batch 16). Between the two projections the mixer is
one autograd function which, as mamba_ssm's mamba_inner_fn, keeps only xz, x_proj's output and
the gated scan output for the backward, recomputes the conv output and dt there, and writes the
gradients of x and z into one buffer, where the composition of the ops kept the conv output, dt
and a copy of the scan output, and concatenated dx and dz."""

import math

import torch
import torch.nn.functional as F
from torch import nn

from . import _torch_conv1d as _conv1d
from . import _torch_direct as _direct
from . import _torch_scan as _scan
from ._torch_conv1d import causal_conv1d_fn, causal_conv1d_update
from ._torch_scan import selective_scan
from ._torch_state_update import selective_state_update

__all__ = ["Mamba"]


def _channel_major(batch, channels, seqlen, like):
    """An uninitialised (batch, channels, seqlen) tensor laid out as (channels, batch, seqlen)."""
    return torch.empty(channels, batch, seqlen, dtype=like.dtype,
                       device=like.device).transpose(0, 1)


def _rows(t):
    """(batch, channels, seqlen) -> its (batch * seqlen, channels) matrix: a view of a
    channel-major t (a copy otherwise)."""
    return t.transpose(0, 1).reshape(t.shape[1], -1).t()


def _scan_inputs(x_dbl, dt_proj_weight, batch, seqlen, d_state):
    """delta (batch, d_inner, seqlen), channel-major, and B, C (batch, d_state, seqlen) from
    x_proj's output x_dbl (batch * seqlen, dt_rank + 2 d_state)."""
    dt_rank = dt_proj_weight.shape[1]
    delta = (dt_proj_weight @ x_dbl[:, :dt_rank].t()).view(-1, batch, seqlen).transpose(0, 1)
    B, C = (x_dbl[:, i:i + d_state].view(batch, seqlen, d_state).transpose(1, 2).contiguous()
            for i in (dt_rank, dt_rank + d_state))
    return delta, B, C


def _inner_fwd(xz, conv_weight, conv_bias, x_proj_weight, dt_proj_weight, out_proj_weight,
               out_proj_bias, A, D, delta_bias, ssm_state):
    """xz (batch, 2 d_inner, seqlen) -> (out (batch, seqlen, d_model), x_dbl, y), where y is the
    gated scan output (channel-major); ssm_state, when given, receives the last state."""
    batch, _, seqlen = xz.shape
    x, z = xz.chunk(2, dim=1)
    conv_out, _ = _conv1d.fwd(x, conv_weight, conv_bias, None, None, False, True,
                              out=_channel_major(batch, x.shape[1], seqlen, x))
    x_dbl = _rows(conv_out) @ x_proj_weight.t()
    delta, B, C = _scan_inputs(x_dbl, dt_proj_weight, batch, seqlen, A.shape[1])
    y, last_state = _scan.fwd(conv_out, delta, A, B, C, D, z, delta_bias, None, True,
                              ssm_state is not None,
                              out=_channel_major(batch, x.shape[1], seqlen, x))
    if ssm_state is not None:
        ssm_state.copy_(last_state)
    out = F.linear(_rows(y), out_proj_weight, out_proj_bias)
    return out.view(batch, seqlen, -1), x_dbl, y


class _MambaInnerFunction(torch.autograd.Function):
    """The mixer from xz to out_proj's output, differentiable in xz and every parameter it
    uses (see the module's docstring for what is kept and recomputed)."""

    @staticmethod
    def forward(ctx, xz, conv_weight, conv_bias, x_proj_weight, dt_proj_weight, out_proj_weight,
                out_proj_bias, A, D, delta_bias):
        out, x_dbl, y = _inner_fwd(xz, conv_weight, conv_bias, x_proj_weight, dt_proj_weight,
                                   out_proj_weight, out_proj_bias, A, D, delta_bias, None)
        ctx.save_for_backward(xz, conv_weight, conv_bias, x_proj_weight, dt_proj_weight,
                              out_proj_weight, A, D, delta_bias, x_dbl, y)
        ctx.out_proj_bias = out_proj_bias is not None
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        (xz, conv_weight, conv_bias, x_proj_weight, dt_proj_weight, out_proj_weight, A, D,
         delta_bias, x_dbl, y) = ctx.saved_tensors
        needs = ctx.needs_input_grad
        batch, _, seqlen = xz.shape
        x, z = xz.chunk(2, dim=1)
        d_inner, dt_rank, d_state = x.shape[1], dt_proj_weight.shape[1], A.shape[1]
        conv_out, _ = _conv1d.fwd(x, conv_weight, conv_bias, None, None, False, True,
                                  out=_channel_major(batch, d_inner, seqlen, x))
        delta, B, C = _scan_inputs(x_dbl, dt_proj_weight, batch, seqlen, d_state)

        dout = dout.reshape(batch * seqlen, -1)
        dy = (out_proj_weight.t() @ dout.t()).view(d_inner, batch, seqlen).transpose(0, 1)
        dout_proj_weight = dout.t() @ _rows(y) if needs[5] else None
        dout_proj_bias = dout.sum(0) if ctx.out_proj_bias and needs[6] else None

        dxz = _channel_major(batch, 2 * d_inner, seqlen, xz)
        dx, dz = dxz.chunk(2, dim=1)
        dconv_out = _channel_major(batch, d_inner, seqlen, xz)
        ddelta = _channel_major(batch, d_inner, seqlen, xz)
        mask = (True, True, needs[7], True, True, D is not None and needs[8], True,
                delta_bias is not None and needs[9], False)
        _, _, dA, dB, dC, dD, _, ddelta_bias, _ = _scan.bwd(
            conv_out, delta, A, B, C, dy, D, z, delta_bias, None, None, True, mask,
            out=(dconv_out, ddelta, None, None, None, None, dz, None, None))

        dx_dbl = torch.empty_like(x_dbl)
        for i, g in ((dt_rank, dB), (dt_rank + d_state, dC)):
            dx_dbl[:, i:i + d_state].view(batch, seqlen, d_state).copy_(g.transpose(1, 2))
        ddelta = _rows(ddelta)
        ddt_proj_weight = ddelta.t() @ x_dbl[:, :dt_rank] if needs[4] else None
        dx_dbl[:, :dt_rank] = ddelta @ dt_proj_weight
        dx_proj_weight = dx_dbl.t() @ _rows(conv_out) if needs[3] else None
        # dconv_out += dx_dbl @ x_proj_weight, in place through the matrix view.
        _rows(dconv_out).t().addmm_(x_proj_weight.t(), dx_dbl.t())
        _, dconv_weight, dconv_bias, _ = _conv1d.bwd(
            x, conv_weight, conv_bias, None, None, dconv_out, None, True,
            (True, needs[1], conv_bias is not None and needs[2], False), dx_out=dx)
        return (dxz, dconv_weight, dconv_bias, dx_proj_weight, ddt_proj_weight, dout_proj_weight,
                dout_proj_bias, dA, dD, ddelta_bias)


class Mamba(nn.Module):
    """Mamba-1 mixer: (batch, seqlen, d_model) -> (batch, seqlen, d_model).

    d_inner = expand * d_model channels; dt_rank "auto" is ceil(d_model / 16). dt_proj's bias
    starts at softplus^-1 of a dt drawn log-uniformly in [dt_min, dt_max] (floored at
    dt_init_floor) and A_log at log(1 .. d_state) in every channel; A_log and D are float32
    whatever `dtype` says, as in mamba_ssm. use_fast_path is accepted for mamba_ssm's signature:
    libssm has one path. layer_idx names this layer's entry in an inference cache."""

    def __init__(self, d_model, d_state=16, d_conv=4, expand=2, dt_rank="auto", dt_min=0.001,
                 dt_max=0.1, dt_init="random", dt_scale=1.0, dt_init_floor=1e-4,
                 conv_bias=True, bias=False, use_fast_path=True, layer_idx=None, device=None,
                 dtype=None):
        factory = {"device": device, "dtype": dtype}
        super().__init__()
        self.d_model = d_model
        self.d_state = d_state
        self.d_conv = d_conv
        self.expand = expand
        self.d_inner = int(expand * d_model)
        self.dt_rank = math.ceil(d_model / 16) if dt_rank == "auto" else dt_rank
        self.use_fast_path = use_fast_path
        self.layer_idx = layer_idx
        self.activation = "silu"

        self.in_proj = nn.Linear(d_model, 2 * self.d_inner, bias=bias, **factory)
        self.conv1d = nn.Conv1d(self.d_inner, self.d_inner, d_conv, padding=d_conv - 1,
                                groups=self.d_inner, bias=conv_bias, **factory)
        self.x_proj = nn.Linear(self.d_inner, self.dt_rank + 2 * d_state, bias=False, **factory)
        self.dt_proj = nn.Linear(self.dt_rank, self.d_inner, bias=True, **factory)
        self.out_proj = nn.Linear(self.d_inner, d_model, bias=bias, **factory)

        # dt_proj's output starts with the variance of its input, whatever dt_rank is.
        std = self.dt_rank ** -0.5 * dt_scale
        if dt_init == "constant":
            nn.init.constant_(self.dt_proj.weight, std)
        elif dt_init == "random":
            nn.init.uniform_(self.dt_proj.weight, -std, std)
        else:
            raise NotImplementedError("dt_init: expected 'random' or 'constant', got %r"
                                      % (dt_init,))
        log_min, log_max = math.log(dt_min), math.log(dt_max)
        dt = torch.exp(torch.rand(self.d_inner, **factory) * (log_max - log_min) + log_min)
        dt = dt.clamp(min=dt_init_floor)
        with torch.no_grad():
            # softplus(bias) = dt: the inverse is dt + log(1 - exp(-dt)), written with expm1
            # because 1 - exp(-dt) cancels for the small dt drawn here.
            self.dt_proj.bias.copy_(dt + torch.log(-torch.expm1(-dt)))
        # A model-level re-initialisation (mamba_ssm's _init_weights) zeroes Linear biases
        # except those marked so.
        self.dt_proj.bias._no_reinit = True

        # S4D-real: A = -(1 .. d_state) in every channel, kept as its log so it stays negative.
        A = torch.arange(1, d_state + 1, dtype=torch.float32, device=device)
        self.A_log = nn.Parameter(torch.log(A).repeat(self.d_inner, 1))
        self.A_log._no_weight_decay = True
        self.D = nn.Parameter(torch.ones(self.d_inner, device=device))
        self.D._no_weight_decay = True

    def _conv_weight(self):
        return self.conv1d.weight[:, 0, :]  # nn.Conv1d's depthwise (d_inner, 1, d_conv)

    def forward(self, hidden_states, inference_params=None):
        """hidden_states (batch, seqlen, d_model) -> same shape. With inference_params (an object
        with seqlen_offset and key_value_memory_dict, as mamba_ssm's InferenceParams), the
        first call (seqlen_offset 0) fills this layer's cache and later calls decode one token
        each through step()."""
        batch, seqlen, _ = hidden_states.shape
        conv_state = ssm_state = None
        if inference_params is not None:
            conv_state, ssm_state = self._get_states_from_cache(inference_params, batch)
            if inference_params.seqlen_offset > 0:
                return self.step(hidden_states, conv_state, ssm_state)[0]

        # One matmul gives (2 d_inner, batch * seqlen), viewed as (batch, 2 d_inner, seqlen)
        # with seqlen contiguous, the axis the conv and the scan read along: x and z need no
        # copy.
        xz = self.in_proj.weight @ hidden_states.reshape(batch * seqlen, -1).t()
        xz = xz.view(-1, batch, seqlen).transpose(0, 1)
        if self.in_proj.bias is not None:
            xz = xz + self.in_proj.bias.to(xz.dtype)[:, None]
        if conv_state is not None:
            # The last d_conv inputs, zero-padded on the left when the prompt is shorter.
            conv_state.copy_(F.pad(xz[:, :self.d_inner], (self.d_conv - seqlen, 0)))
        A = -torch.exp(self.A_log.float())
        proj = (self.x_proj.weight, self.dt_proj.weight, self.out_proj.weight,
                self.out_proj.bias)
        if torch.is_autocast_enabled(xz.device.type):
            # Autocast does not reach into the function's backward, whose matmuls then meet
            # float32 weights and the autocast dtype's gradients: the casts are made here,
            # differentiable, as autocast makes them for the composed path's matmuls.
            dtype = torch.get_autocast_dtype(xz.device.type)
            proj = tuple(None if w is None else w.to(dtype) for w in proj)
        args = (xz, self._conv_weight(), self.conv1d.bias, *proj, A,
                self.D.float(), self.dt_proj.bias.float())
        route = _direct.path(args)
        if route is _direct.DIRECT:
            return _inner_fwd(*args, ssm_state)[0]
        if route is _direct.AUTOGRAD and ssm_state is None:
            return _MambaInnerFunction.apply(*args)
        return self._composed_forward(xz, A, ssm_state)

    def _composed_forward(self, xz, A, ssm_state):
        """The mixer after in_proj as a composition of libssm.torch's ops: the path for
        torch.compile and tensor subclasses (which the ops' registrations know), and for a
        gradient through a prompt that fills a decode cache (the scan's last state keeps its
        gradient)."""
        batch, _, seqlen = xz.shape
        x, z = xz.chunk(2, dim=1)
        x = causal_conv1d_fn(x, self._conv_weight(), self.conv1d.bias,
                             activation=self.activation)

        x_dbl = self.x_proj(x.transpose(1, 2).reshape(batch * seqlen, self.d_inner))
        dt, B, C = torch.split(x_dbl, [self.dt_rank, self.d_state, self.d_state], dim=-1)
        dt = (self.dt_proj.weight @ dt.t()).view(-1, batch, seqlen).transpose(0, 1)
        B = B.view(batch, seqlen, self.d_state).transpose(1, 2).contiguous()
        C = C.view(batch, seqlen, self.d_state).transpose(1, 2).contiguous()
        y = selective_scan(x, dt, A, B, C, self.D.float(), z=z,
                           delta_bias=self.dt_proj.bias.float(), delta_softplus=True,
                           return_last_state=ssm_state is not None)
        if ssm_state is not None:
            y, last_state = y
            ssm_state.copy_(last_state)
        return self.out_proj(y.transpose(1, 2))

    def step(self, hidden_states, conv_state, ssm_state):
        """Decode one token: hidden_states (batch, 1, d_model) -> (out (batch, 1, d_model),
        conv_state, ssm_state), the states (from allocate_inference_cache) updated in place."""
        if hidden_states.shape[1] != 1:
            raise ValueError("hidden_states: step() decodes one token, expected shape "
                             "(batch, 1, %d), got %s" % (self.d_model,
                                                         tuple(hidden_states.shape)))
        x, z = self.in_proj(hidden_states[:, 0]).chunk(2, dim=-1)
        x = causal_conv1d_update(x, conv_state, self._conv_weight(), self.conv1d.bias,
                                 self.activation)
        dt, B, C = torch.split(self.x_proj(x), [self.dt_rank, self.d_state, self.d_state],
                               dim=-1)
        # dt's bias and softplus are left to the state update, which applies them in float32.
        dt = F.linear(dt, self.dt_proj.weight)
        A = -torch.exp(self.A_log.float())
        y = selective_state_update(ssm_state, x, dt, A, B, C, self.D.float(), z=z,
                                   dt_bias=self.dt_proj.bias.float(), dt_softplus=True)
        return self.out_proj(y)[:, None], conv_state, ssm_state

    def allocate_inference_cache(self, batch_size, max_seqlen, dtype=None, **kwargs):
        """Zeroed (conv_state (batch_size, d_inner, d_conv), ssm_state (batch_size, d_inner,
        d_state)) on this module's device, in `dtype`, else in conv1d's and dt_proj's weight
        dtypes, as mamba_ssm's (whose conv state also keeps d_conv inputs, one more than the
        conv reads). max_seqlen and other keyword arguments are accepted for mamba_ssm's
        signature and not needed: the state does not grow."""
        device = self.out_proj.weight.device
        conv_state = torch.zeros(batch_size, self.d_inner, self.d_conv, device=device,
                                 dtype=dtype or self.conv1d.weight.dtype)
        ssm_state = torch.zeros(batch_size, self.d_inner, self.d_state, device=device,
                                dtype=dtype or self.dt_proj.weight.dtype)
        return conv_state, ssm_state

    def _get_states_from_cache(self, inference_params, batch_size):
        if self.layer_idx is None:
            raise ValueError("inference_params given to a Mamba with no layer_idx: the cache "
                             "is keyed by layer_idx")
        cache = inference_params.key_value_memory_dict
        if self.layer_idx not in cache:
            cache[self.layer_idx] = self.allocate_inference_cache(batch_size, 0)
        return cache[self.layer_idx]
