"""A small float64 NumPy evaluation of the selective-state decode step (libssm/state_update.h) for
`python -m libssm check` on tiny cases. Like _reference.py for the selective scan, it is written
from the formula alone and shares nothing with the library it checks."""

import numpy as np


def step(inputs, dt_softplus):
    """(out, new_state) in float64 for either layout; inputs: dict with state, x, dt, A, B, C,
    D, z, dt_bias (None when absent) and state_batch_indices (None or ints, negative for a
    padding row). The inputs are not modified."""
    f = {k: None if v is None else np.asarray(v, dtype=np.float64) for k, v in inputs.items()
         if k != "state_batch_indices"}
    mamba1 = f["state"].ndim == 3
    if mamba1:  # one head, one group
        f = {k: None if v is None else (v[None] if k in ("A", "D", "dt_bias") else v[:, None])
             for k, v in f.items()}
    state = f["state"].copy()
    batch, nheads, headdim = f["x"].shape
    per_group = nheads // f["B"].shape[1]
    idx = inputs.get("state_batch_indices")
    out = np.zeros((batch, nheads, headdim))
    for b in range(batch):
        s = b if idx is None else int(idx[b])
        if s < 0:
            continue
        for h in range(nheads):
            g = h // per_group
            for p in range(headdim):
                dt = f["dt"][b, h, p] + (0.0 if f["dt_bias"] is None else f["dt_bias"][h, p])
                if dt_softplus and dt <= 20.0:
                    dt = np.log1p(np.exp(dt))
                x = f["x"][b, h, p]
                new = (state[s, h, p] * np.exp(f["A"][h, p] * dt)
                       + f["B"][b, g] * dt * x)
                state[s, h, p] = new
                y = float(new @ f["C"][b, g])
                if f["D"] is not None:
                    y += f["D"][h, p] * x
                if f["z"] is not None:
                    z = f["z"][b, h, p]
                    y *= z / (1.0 + np.exp(-z))
                out[b, h, p] = y
    if mamba1:
        return out[:, 0], state[:, 0]
    return out, state
