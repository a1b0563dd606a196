"""libssm.causal_conv1d, causal_conv1d_bwd and causal_conv1d_update (the causal depthwise conv1d
and its decode step; the formulas are in libssm/conv1d.h) for any DLPack array: numpy, torch,
CuPy, JAX. Inputs are borrowed through their capsules, outputs allocated by the caller's
framework (channel-last when x is, so the kernels read and write one layout). Torch inputs take
the direct path instead (see _torch_conv1d), or, while torch.compile traces, the registered
torch.ops.libssm custom ops."""

import collections

from . import _call
from .errors import InvalidArgumentError, error_for_status

__all__ = ["causal_conv1d", "causal_conv1d_bwd", "causal_conv1d_update", "Conv1dGrads"]

Conv1dGrads = collections.namedtuple("Conv1dGrads", ["dx", "dweight", "dbias", "dinitial_states"])

ACTIVATIONS = (None, "silu", "swish")


def silu_of(activation):
    """Whether `activation` (None, "silu" or "swish", as causal-conv1d takes it) is SiLU."""
    if activation not in ACTIVATIONS:
        raise InvalidArgumentError("activation: expected None, 'silu' or 'swish', got %r"
                                   % (activation,))
    return activation is not None


# The two option sets, built once per library; index by silu. Each struct is written once and
# only read afterwards, so calls on any thread may share it.
_params = {}


def params(library, silu):
    """(keep-alive, address) of the ssm_causal_conv1d_params for silu (a bool)."""
    entry = _params.get((id(library), silu))
    if entry is None:
        ffi = library.ffi
        p = ffi.new("ssm_causal_conv1d_params *")
        p.struct_size = ffi.sizeof("ssm_causal_conv1d_params")
        p.activation = library.lib.SSM_CONV1D_SILU if silu else library.lib.SSM_CONV1D_NONE
        entry = _params[(id(library), silu)] = (p, library.address(p))
    return entry


def _shape_strides(call, address):
    """(shape, strides in elements) of a borrowed DLTensor; () for address 0."""
    if not address:
        return (), ()
    t = call.library.ffi.cast("DLTensor *", address)
    shape = tuple(t.shape[i] for i in range(t.ndim))
    if t.strides == call.library.ffi.NULL:
        strides, step = [], 1
        for n in reversed(shape):
            strides.append(step)
            step *= n
        return shape, tuple(reversed(strides))
    return shape, tuple(t.strides[i] for i in range(t.ndim))


def _new_like_x(call, x, x_shape, x_strides, name):
    """A new (batch, dim, seqlen) array like x, and its DLTensor: channel-last (contiguous along
    dim) when x is and the caller's framework allocates, else contiguous."""
    allocator = call.allocator
    batch, dim, seqlen = x_shape
    channel_last = (len(x_strides) == 3 and x_strides[1] == 1 and seqlen > 1 and dim > 1
                    and allocator.caller == allocator.backing)
    with allocator.on_stream():
        if channel_last:
            array = allocator.empty((batch, seqlen, dim), x).swapaxes(1, 2)
        else:
            array = allocator.empty(x_shape, x)
    return array, allocator.describe(call.library.slots, call.slot(), name, array)


def _width(call, weight_address):
    shape, _ = _shape_strides(call, weight_address)
    return shape[1] if len(shape) == 2 else None


def causal_conv1d(x, weight, bias=None, *, activation=None, initial_states=None,
                  return_final_states=False, seq_idx=None, out=None, stream=None):
    """Causal depthwise conv1d (libssm/conv1d.h): out[b,c,t] = act(bias[c] + sum_k weight[c,k] *
    x[b,c,t-(width-1)+k]), x before position 0 taken from initial_states (else 0).

    x: (batch, dim, seqlen), any strides (contiguous along seqlen or channel-last are fastest);
    weight: (dim, width), 2 <= width <= 8; bias: (dim,); initial_states: (batch, dim, width-1);
    seq_idx: (batch, seqlen) int32, the packed sequence of each position (no position reads
    another sequence's inputs). activation: None, "silu" or "swish". out: written and returned
    if given, else a new array like x (framework, device, dtype, layout). stream: as for
    libssm.selective_scan (required for CUDA arrays other than torch and cupy).
    Returns out, or (out, final_states) when return_final_states: final_states (batch, dim,
    width-1) in x's dtype are the last width-1 inputs of the last sequence (zero where they
    belong to another one), the initial_states that continue it."""
    silu = silu_of(activation)
    if stream is None and _call.torch_arrays((x, weight, bias, initial_states, seq_idx, out)):
        from . import _torch_conv1d
        run = _torch_conv1d.compiled_fwd if _call.torch_compiling() else _torch_conv1d.fwd
        result, final = run(x, weight, bias, seq_idx, initial_states, return_final_states, silu,
                            out)
        return (result, final) if return_final_states else result

    call = _call.Call(x, "x", stream)
    keep, pparams = params(call.library, silu)
    px, pw = call.borrow(x, "x"), call.borrow(weight, "weight")
    shape, strides = _shape_strides(call, px)
    width = _width(call, pw)
    # With x or weight of the wrong rank nothing is allocated: the library's message about them
    # is the one raised.
    sized = len(shape) == 3 and width is not None
    out_given = out is not None
    if out_given:
        pout = call.borrow(out, "out", writable=True)
    elif sized:
        out, pout = _new_like_x(call, x, shape, strides, "out")
    else:
        pout = 0
    final, pfinal = None, 0
    if return_final_states and sized:
        final, pfinal = call.empty((shape[0], shape[1], max(width - 1, 0)), x, "final_states")
    status = call.library.lib.ssm_causal_conv1d_fwd(
        pparams, px, pw, call.borrow(bias, "bias"), call.borrow(initial_states, "initial_states"),
        call.borrow(seq_idx, "seq_idx"), pout, pfinal, call.stream)
    if status:
        raise error_for_status(status, call.library.last_error())
    result = call.allocator.result
    if not out_given:
        out = result(out)
    return (out, result(final)) if return_final_states else out


def _needs(needs, bias, initial_states):
    """needs as 4 booleans (dx, dweight, dbias, dinitial_states)."""
    if needs is None:
        return (True, True, bias is not None, initial_states is not None)
    needs = tuple(bool(n) for n in needs)
    if len(needs) != 4:
        raise InvalidArgumentError("needs: expected 4 booleans (dx, dweight, dbias, "
                                   "dinitial_states) or None, got %d" % len(needs))
    for wanted, input_, name in ((needs[2], bias, "bias"),
                                 (needs[3], initial_states, "initial_states")):
        if wanted and input_ is None:
            raise InvalidArgumentError("needs: d%s asked for, but %s is None; a gradient needs "
                                       "its input" % (name, name))
    return needs


def causal_conv1d_bwd(x, weight, dout, bias=None, *, activation=None, initial_states=None,
                      seq_idx=None, dfinal_states=None, needs=None, stream=None):
    """Causal conv1d backward: gradients of a loss L given dout = dL/dout (x's dtype) and
    dfinal_states = dL/dfinal_states (None: zero). x, weight, bias, initial_states, seq_idx
    and activation as given to causal_conv1d.

    needs: (dx, dweight, dbias, dinitial_states) booleans; None means dx, dweight, and dbias /
    dinitial_states where bias / initial_states are given. Returns Conv1dGrads(dx, dweight,
    dbias, dinitial_states), None where not computed, each shaped and typed like its input (dx
    in x's layout). dweight and dbias are the same bits on every run."""
    silu = silu_of(activation)
    needs = _needs(needs, bias, initial_states)
    if stream is None and _call.torch_arrays((x, weight, dout, bias, initial_states, seq_idx,
                                              dfinal_states)):
        from . import _torch_conv1d
        run = _torch_conv1d.compiled_bwd if _call.torch_compiling() else _torch_conv1d.bwd
        return Conv1dGrads(*run(x, weight, bias, seq_idx, initial_states, dout, dfinal_states,
                                silu, needs))

    call = _call.Call(x, "x", stream)
    lib = call.library.lib
    keep, pparams = params(call.library, silu)
    px, pw = call.borrow(x, "x"), call.borrow(weight, "weight")
    ws, ws_address, ws_bytes = call.workspace(lib.ssm_causal_conv1d_bwd_workspace_size, pparams,
                                              px, pw)
    # The size query has validated x and weight, so their shapes can be trusted here.
    shape, strides = _shape_strides(call, px)
    grads, addresses = [None] * 4, [0] * 4
    if needs[0]:
        grads[0], addresses[0] = _new_like_x(call, x, shape, strides, "dx")
    for i, like, name in ((1, weight, "dweight"), (2, bias, "dbias"),
                          (3, initial_states, "dinitial_states")):
        if needs[i]:
            grads[i], addresses[i] = call.empty(tuple(like.shape), like, name)
    status = lib.ssm_causal_conv1d_bwd(
        pparams, px, pw, call.borrow(bias, "bias"), call.borrow(initial_states, "initial_states"),
        call.borrow(seq_idx, "seq_idx"), call.borrow(dout, "dout"),
        call.borrow(dfinal_states, "dfinal_states"), *addresses, ws_address, ws_bytes,
        call.stream)
    if status:
        call.library.raise_for(status)
    return Conv1dGrads(*(call.allocator.result(g) for g in grads))


def causal_conv1d_update(x, conv_state, weight, bias=None, *, activation=None,
                         cache_seqlens=None, conv_state_indices=None, out=None, stream=None):
    """One decode step of the causal conv1d (libssm/conv1d.h): convolves the new tokens x
    (batch, dim) or (batch, dim, seqlen) against conv_state (batch_state, dim, state_len),
    state_len >= width-1, which is updated in place (so it must be writable: not a JAX array).

    cache_seqlens: (batch,) int32/int64; when given conv_state is a circular buffer whose
    entries up to cache_seqlens[b] (mod state_len) are the last tokens. conv_state_indices:
    (batch,) int32/int64, the state row of each batch row (continuous batching); a negative
    index marks a padding row, whose out is zeros and whose state is left alone; the others must
    be below batch_state and distinct (checked on the CPU; see libssm/conv1d.h for CUDA).
    weight, bias, activation as for causal_conv1d. Returns out, shaped like x in x's dtype
    (out= if given)."""
    silu = silu_of(activation)
    arrays = (x, conv_state, weight, bias, cache_seqlens, conv_state_indices, out)
    if stream is None and _call.torch_arrays(arrays):
        from . import _torch_conv1d
        run = (_torch_conv1d.compiled_update if _call.torch_compiling()
               else _torch_conv1d.update)
        return run(x, conv_state, weight, bias, silu, cache_seqlens, conv_state_indices, out)

    call = _call.Call(x, "x", stream)
    keep, pparams = params(call.library, silu)
    px = call.borrow(x, "x")
    pstate = call.borrow(conv_state, "conv_state", writable=True)
    if out is None:
        shape, _ = _shape_strides(call, px)
        out, pout = call.empty(shape, x, "out")
        out_given = False
    else:
        pout, out_given = call.borrow(out, "out", writable=True), True
    status = call.library.lib.ssm_causal_conv1d_update(
        pparams, px, pstate, call.borrow(weight, "weight"), call.borrow(bias, "bias"),
        call.borrow(cache_seqlens, "cache_seqlens"),
        call.borrow(conv_state_indices, "conv_state_indices"), pout, call.stream)
    if status:
        call.library.raise_for(status)
    return out if out_given else call.allocator.result(out)
