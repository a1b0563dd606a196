"""A Mamba-1 language model on libssm.torch's modules, laid out as mamba_ssm's MambaLMHeadModel
(backbone.embedding, backbone.layers.{i}.norm / .mixer, backbone.norm_f, lm_head; same config
fields and initialisation) so the two load each other's state_dicts, and its generation: the
prompt through the full-sequence path, then one token a step through the decode path
(Mamba.step with its conv and SSM states). Blocks are Mamba mixers with no MLP or attention."""

import dataclasses
import math
from collections import namedtuple
from typing import Optional

import torch
from torch import nn

from ._torch_mamba import Mamba
from ._torch_norm import LayerNorm, RMSNorm

__all__ = ["MambaConfig", "MambaLMHeadModel", "InferenceParams"]

CausalLMOutput = namedtuple("CausalLMOutput", ["logits"])


@dataclasses.dataclass
class MambaConfig:
    """mamba_ssm.models.config_mamba.MambaConfig's fields and defaults. Only Mamba-1 blocks
    without MLPs are built here: d_intermediate must be 0, attn_layer_idx empty and
    ssm_cfg's "layer" (if any) "Mamba1"; ssm_cfg's other entries go to Mamba."""
    d_model: int = 2560
    d_intermediate: int = 0
    n_layer: int = 64
    vocab_size: int = 50277
    ssm_cfg: dict = dataclasses.field(default_factory=dict)
    attn_layer_idx: list = dataclasses.field(default_factory=list)
    attn_cfg: dict = dataclasses.field(default_factory=dict)
    rms_norm: bool = True
    residual_in_fp32: bool = True
    fused_add_norm: bool = True
    pad_vocab_size_multiple: int = 8
    tie_embeddings: bool = True


@dataclasses.dataclass
class InferenceParams:
    """The decode cache, as mamba_ssm.utils.generation.InferenceParams: each Mamba keeps its
    (conv_state, ssm_state) in key_value_memory_dict under its layer_idx; seqlen_offset is the
    number of tokens already seen (0: the next forward is the prompt)."""
    max_seqlen: int
    max_batch_size: int
    seqlen_offset: int = 0
    key_value_memory_dict: dict = dataclasses.field(default_factory=dict)


def _init_weights(module, n_layer, initializer_range=0.02, rescale_prenorm_residual=True):
    """mamba_ssm's initialisation (GPT-2's scheme): Linear biases zeroed unless marked
    _no_reinit, embeddings N(0, initializer_range), and each out_proj re-drawn as torch's
    default Linear init divided by sqrt(n_layer), so the residual stream's variance does not
    grow with depth."""
    if isinstance(module, nn.Linear):
        if module.bias is not None and not getattr(module.bias, "_no_reinit", False):
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, std=initializer_range)
    if rescale_prenorm_residual:
        for name, p in module.named_parameters():
            if name == "out_proj.weight":
                nn.init.kaiming_uniform_(p, a=math.sqrt(5))
                with torch.no_grad():
                    p /= math.sqrt(n_layer)


class Block(nn.Module):
    """Add, norm, mixer: forward(hidden_states, residual) returns (mixer(norm(residual')),
    residual') with residual' = hidden_states + residual (hidden_states alone in the first
    block), in float32 when residual_in_fp32. With fused_add_norm the add and the norm are
    one libssm kernel."""

    def __init__(self, d_model, layer_idx, ssm_cfg, norm_cls, fused_add_norm, residual_in_fp32,
                 factory):
        super().__init__()
        self.residual_in_fp32 = residual_in_fp32
        self.fused_add_norm = fused_add_norm
        self.norm = norm_cls(d_model)
        self.mixer = Mamba(d_model, layer_idx=layer_idx, **ssm_cfg, **factory)

    def forward(self, hidden_states, residual=None, inference_params=None):
        if self.fused_add_norm:
            hidden_states, residual = self.norm(
                hidden_states, residual=residual, prenorm=True,
                residual_dtype=torch.float32 if self.residual_in_fp32 else None)
        else:
            residual = hidden_states if residual is None else hidden_states + residual
            hidden_states = self.norm(residual.to(self.norm.weight.dtype))
            if self.residual_in_fp32:
                residual = residual.float()
        return self.mixer(hidden_states, inference_params=inference_params), residual

    def allocate_inference_cache(self, batch_size, max_seqlen, dtype=None):
        return self.mixer.allocate_inference_cache(batch_size, max_seqlen, dtype=dtype)


class MixerModel(nn.Module):
    """Embedding, n_layer Blocks, final norm: input_ids (batch, seqlen) -> (batch, seqlen,
    d_model)."""

    def __init__(self, config, vocab_size, factory):
        super().__init__()
        self.residual_in_fp32 = config.residual_in_fp32
        self.fused_add_norm = config.fused_add_norm
        norm = RMSNorm if config.rms_norm else LayerNorm
        eps = 1e-5  # mamba_ssm's norm_epsilon, which its config does not carry

        def norm_cls(d):
            return norm(d, eps=eps, **factory)

        ssm_cfg = {k: v for k, v in config.ssm_cfg.items() if k != "layer"}
        self.embedding = nn.Embedding(vocab_size, config.d_model, **factory)
        self.layers = nn.ModuleList(
            Block(config.d_model, i, ssm_cfg, norm_cls, config.fused_add_norm,
                  config.residual_in_fp32, factory) for i in range(config.n_layer))
        self.norm_f = norm_cls(config.d_model)

    def forward(self, input_ids, inference_params=None):
        hidden_states = self.embedding(input_ids)
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(hidden_states, residual, inference_params)
        if self.fused_add_norm:
            return self.norm_f(hidden_states, residual=residual)
        residual = hidden_states + residual
        return self.norm_f(residual.to(self.norm_f.weight.dtype))


class MambaLMHeadModel(nn.Module):
    """mamba_ssm's MambaLMHeadModel built from libssm.torch modules: forward(input_ids,
    position_ids=None, inference_params=None, num_last_tokens=0) returns a namedtuple with
    `logits` (batch, seqlen or num_last_tokens, vocab); generate() decodes. vocab_size is
    rounded up to a multiple of pad_vocab_size_multiple; lm_head shares the embedding's
    weight when tie_embeddings."""

    def __init__(self, config, initializer_cfg=None, device=None, dtype=None):
        super().__init__()
        ssm_layer = config.ssm_cfg.get("layer", "Mamba1")
        if config.d_intermediate or config.attn_layer_idx or ssm_layer != "Mamba1":
            raise NotImplementedError(
                "MambaLMHeadModel: only Mamba1 blocks without MLP or attention are built here "
                "(config.d_intermediate=%r, attn_layer_idx=%r, ssm_cfg layer=%r)"
                % (config.d_intermediate, config.attn_layer_idx, ssm_layer))
        self.config = config
        factory = {"device": device, "dtype": dtype}
        vocab_size = -(-config.vocab_size // config.pad_vocab_size_multiple) \
            * config.pad_vocab_size_multiple
        self.backbone = MixerModel(config, vocab_size, factory)
        self.lm_head = nn.Linear(config.d_model, vocab_size, bias=False, **factory)
        self.apply(lambda m: _init_weights(m, config.n_layer, **(initializer_cfg or {})))
        if config.tie_embeddings:
            self.lm_head.weight = self.backbone.embedding.weight

    def allocate_inference_cache(self, batch_size, max_seqlen, dtype=None):
        """{layer_idx: (conv_state, ssm_state)} for every layer (see Mamba)."""
        return {i: layer.allocate_inference_cache(batch_size, max_seqlen, dtype=dtype)
                for i, layer in enumerate(self.backbone.layers)}

    def forward(self, input_ids, position_ids=None, inference_params=None, num_last_tokens=0):
        """position_ids is accepted for mamba_ssm's signature (a Mamba needs no positions)."""
        hidden_states = self.backbone(input_ids, inference_params=inference_params)
        if num_last_tokens > 0:
            hidden_states = hidden_states[:, -num_last_tokens:]
        return CausalLMOutput(logits=self.lm_head(hidden_states))

    @torch.inference_mode()
    def generate(self, input_ids, max_length, top_k=1, temperature=1.0,
                 generator: Optional[torch.Generator] = None):
        """Continue input_ids (batch, prompt_len) to (batch, max_length) tokens: the prompt goes
        through the full-sequence path, which leaves every layer's decode state in an
        InferenceParams cache, then each new token goes through Mamba.step. top_k 1 is greedy;
        otherwise tokens are sampled from softmax(logits / temperature) over the top_k most
        likely (top_k 0: all), drawing from `generator` when given."""
        batch, prompt_len = input_ids.shape
        if not 0 < prompt_len <= max_length:
            raise ValueError("max_length: expected at least the prompt's length %d (and a "
                             "prompt of one token or more), got %d" % (prompt_len, max_length))
        params = InferenceParams(max_seqlen=max_length, max_batch_size=batch)
        tokens = [input_ids]
        for _ in range(max_length - prompt_len):
            logits = self(tokens[-1], inference_params=params, num_last_tokens=1).logits[:, -1]
            params.seqlen_offset += tokens[-1].shape[1]
            tokens.append(sample(logits, top_k, temperature, generator)[:, None])
        return torch.cat(tokens, dim=1)


def sample(logits, top_k=1, temperature=1.0, generator=None):
    """Next tokens (batch,) from logits (batch, vocab): the argmax when top_k is 1, else a draw
    from softmax(logits / temperature) restricted to the top_k largest logits (0: all)."""
    if top_k == 1:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]
