"""A small float64 NumPy evaluation of the selective-scan formula (libssm/selective_scan.h) and
its gradients by central finite differences, for `python -m libssm check` on tiny cases. It is
written from the formula alone, so it shares nothing with the library it checks."""

import numpy as np

from .selective_scan import INPUT_NAMES


def _per_channel(BC, dim):
    """B or C in any of its three forms as (batch or 1, dim, dstate, seqlen or 1)."""
    if BC.ndim == 2:  # fixed (dim, dstate)
        return BC[None, :, :, None]
    if BC.ndim == 3:  # (batch, dstate, seqlen)
        return BC[:, None, :, :]
    groups = BC.shape[1]  # (batch, groups, dstate, seqlen)
    return np.repeat(BC, dim // groups, axis=1)


def forward(inputs, delta_softplus):
    """(out, last_state) in float64; inputs: dict name -> array or None."""
    g = {k: (None if v is None else np.asarray(v, dtype=np.float64)) for k, v in inputs.items()}
    u, delta, A = g["u"], g["delta"], g["A"]
    batch, dim, seqlen = u.shape
    dt = delta + (0.0 if g["delta_bias"] is None else g["delta_bias"][None, :, None])
    if delta_softplus:
        dt = np.logaddexp(0.0, dt)
    B = _per_channel(g["B"], dim)
    C = _per_channel(g["C"], dim)
    h = (np.zeros((batch, dim, A.shape[1])) if g["initial_state"] is None
         else g["initial_state"].copy())
    y = np.empty((batch, dim, seqlen))
    for t in range(seqlen):
        tb, tc = min(t, B.shape[3] - 1), min(t, C.shape[3] - 1)
        step = dt[:, :, t, None]
        h = np.exp(step * A) * h + step * B[:, :, :, tb] * u[:, :, t, None]
        y[:, :, t] = (C[:, :, :, tc] * h).sum(axis=-1)
    if g["D"] is not None:
        y = y + g["D"][None, :, None] * u
    if g["z"] is not None:
        z = g["z"]
        y = y * z / (1.0 + np.exp(-z))
    return y, h


def gradients(inputs, delta_softplus, dout, dlast_state, eps=1e-6):
    """dL/d(every present input) for L = sum(out * dout) + sum(last_state * dlast_state), by
    central differences of the float64 forward (error ~1e-9 at these sizes)."""
    dout = np.asarray(dout, dtype=np.float64)
    dlast = None if dlast_state is None else np.asarray(dlast_state, dtype=np.float64)

    def loss(values):
        out, last = forward(values, delta_softplus)
        total = (out * dout).sum()
        return total + ((last * dlast).sum() if dlast is not None else 0.0)

    return central_differences(loss, inputs, INPUT_NAMES, eps)


def central_differences(loss, inputs, names, eps):
    """{name: dloss/dinputs[name]} for each of `names` (None where the input is None), by
    central differences of `loss` over float64 copies of the inputs."""
    values = {k: (None if v is None else np.array(v, dtype=np.float64))
              for k, v in inputs.items()}
    grads = {}
    for name in names:
        x = values.get(name)
        if x is None:
            grads[name] = None
            continue
        grad = np.empty_like(x)
        flat, gflat = x.reshape(-1), grad.reshape(-1)
        for i in range(flat.size):
            keep = flat[i]
            flat[i] = keep + eps
            up = loss(values)
            flat[i] = keep - eps
            down = loss(values)
            flat[i] = keep
            gflat[i] = (up - down) / (2 * eps)
        grads[name] = grad
    return grads
