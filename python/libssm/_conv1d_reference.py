"""A small float64 NumPy evaluation of the causal conv1d formula (libssm/conv1d.h) and its
gradients by central finite differences, for `python -m libssm check` on tiny cases. Like
_reference.py for the selective scan, it is written from the formula alone and shares nothing
with the library it checks."""

import numpy as np

from ._reference import central_differences

INPUT_NAMES = ("x", "weight", "bias", "initial_states")


def forward(inputs, silu):
    """(out, final_states) in float64. inputs: x, weight, bias, initial_states (arrays or
    None) and seq_idx (int array or None)."""
    g = {k: (None if inputs.get(k) is None else np.asarray(inputs[k], dtype=np.float64))
         for k in INPUT_NAMES}
    x, weight, bias, init = g["x"], g["weight"], g["bias"], g["initial_states"]
    seq = inputs.get("seq_idx")
    batch, dim, seqlen = x.shape
    width = weight.shape[1]
    padded = np.concatenate([np.zeros((batch, dim, width - 1)) if init is None else init, x],
                            axis=-1)
    ids = None
    if seq is not None and seqlen:
        seq = np.asarray(seq)
        ids = np.concatenate([np.repeat(seq[:, :1], width - 1, axis=1), seq], axis=1)
    out = np.zeros((batch, dim, seqlen)) if bias is None else \
        np.broadcast_to(bias[None, :, None], (batch, dim, seqlen)).copy()
    for k in range(width):
        term = weight[None, :, k, None] * padded[..., k:k + seqlen]
        if ids is not None:
            term = term * (ids[:, k:k + seqlen] == ids[:, width - 1:])[:, None, :]
        out = out + term
    if silu:
        out = out / (1.0 + np.exp(-out))
    final = padded[..., seqlen:].copy()
    if ids is not None:
        final = final * (ids[:, seqlen:] == ids[:, -1:])[:, None, :]
    return out, final


def gradients(inputs, silu, dout, dfinal_states, eps=1e-6):
    """dL/d(every present float input) for L = sum(out * dout) + sum(final_states *
    dfinal_states), by central differences of the float64 forward."""
    dout = np.asarray(dout, dtype=np.float64)
    dfinal = None if dfinal_states is None else np.asarray(dfinal_states, dtype=np.float64)

    def loss(values):
        out, final = forward(dict(values, seq_idx=inputs.get("seq_idx")), silu)
        return (out * dout).sum() + ((final * dfinal).sum() if dfinal is not None else 0.0)

    # C-contiguous copies: central_differences steps each input through a flat view of it.
    floats = {k: None if inputs.get(k) is None else np.ascontiguousarray(inputs[k])
              for k in INPUT_NAMES}
    return central_differences(loss, floats, INPUT_NAMES, eps)
