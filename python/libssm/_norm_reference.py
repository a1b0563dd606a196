"""A small float64 NumPy evaluation of the fused-norm formula (libssm/norm.h) and its gradients
by central finite differences, for `python -m libssm check` on tiny cases. Like _reference.py
for the selective scan, it is written from the formula alone and shares nothing with the
library it checks."""

import numpy as np

from ._reference import central_differences

INPUT_NAMES = ("x", "residual", "weight", "bias", "z")


def _silu(v):
    return v / (1.0 + np.exp(-v))


def forward(inputs, opts):
    """(y, residual_out, mean or None, rstd) in float64; mean and rstd are (rows, ngroups).
    inputs: dict name -> array or None; opts: kind, eps, group_size, norm_before_gate,
    zero_centered_weight."""
    g = {k: (None if v is None else np.asarray(v, dtype=np.float64)) for k, v in inputs.items()}
    x = g["x"]
    hidden = x.shape[-1]
    s = x if g["residual"] is None else x + g["residual"]
    z = g["z"]
    gated = s * _silu(z) if z is not None and not opts["norm_before_gate"] else s
    group = opts["group_size"] or hidden
    grouped = gated.reshape(-1, hidden // group, group)
    mean = grouped.mean(axis=-1, keepdims=True) if opts["kind"] == "layer" else 0.0
    centred = grouped - mean
    rstd = 1.0 / np.sqrt((centred ** 2).mean(axis=-1, keepdims=True) + opts["eps"])
    w = np.ones(hidden) if g["weight"] is None else \
        g["weight"] + (1.0 if opts["zero_centered_weight"] else 0.0)
    o = (centred * rstd).reshape(x.shape) * w + (0.0 if g["bias"] is None else g["bias"])
    y = o * _silu(z) if z is not None and opts["norm_before_gate"] else o
    rows = grouped.shape[0]
    return (y, s, None if opts["kind"] != "layer" else mean.reshape(rows, -1),
            rstd.reshape(rows, -1))


def gradients(inputs, opts, dy, dresidual_out, eps=1e-6):
    """dL/d(every present input) for L = sum(y * dy) + sum(residual_out * dresidual_out), by
    central differences of the float64 forward."""
    dy = np.asarray(dy, dtype=np.float64)
    dro = None if dresidual_out is None else np.asarray(dresidual_out, dtype=np.float64)

    def loss(values):
        y, s, _, _ = forward(values, opts)
        return (y * dy).sum() + ((s * dro).sum() if dro is not None else 0.0)

    return central_differences(loss, inputs, INPUT_NAMES, eps)
