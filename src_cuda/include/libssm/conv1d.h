/* libssm causal depthwise conv1d (causal-conv1d's causal_conv1d_fn and causal_conv1d_update):
 * the forward and backward over whole sequences, and the decode step that convolves one or a
 * few new tokens against a conv state kept by the caller and updated in place.
 *
 * Forward. W = width (2 <= W <= 8). For batch b, channel c and position t = 0 .. seqlen-1:
 *
 *   xs(p)      = x[b,c,p]                       for 0 <= p < seqlen
 *                initial_states[b,c,p+W-1]      for -(W-1) <= p < 0  (0 when initial_states is
 *                                               NULL)
 *   same(p,t)  = seq_idx[b,max(p,0)] == seq_idx[b,t]   (1 when seq_idx is NULL): positions of
 *                another packed sequence read as 0; initial_states belong to the sequence of
 *                position 0
 *   z[b,c,t]   = bias[c] + sum_{k=0}^{W-1} weight[c,k] * xs(t-(W-1)+k) * same(t-(W-1)+k, t)
 *                (bias 0 when NULL)
 *   out[b,c,t] = silu(z[b,c,t]) if params->activation is SSM_CONV1D_SILU, else z[b,c,t]
 *   final_states[b,c,j] = xs(p) * same(p, seqlen-1), p = seqlen-(W-1)+j, j = 0 .. W-2
 *                (the state that continues the last sequence; with seqlen 0 it is
 *                initial_states, or 0)
 *
 * Backward: the gradients of a scalar loss through the forward, given dout and dfinal_states.
 *
 * Decode step (ssm_causal_conv1d_update). x holds one new token (batch, dim) or seqlen new
 * tokens (batch, dim, seqlen); conv_state is (batch_state, dim, state_len), state_len >= W-1.
 * For row b, s = conv_state_indices[b] (s = b when NULL), and every channel c:
 *
 *   without cache_seqlens: v = conv_state[s,c,0 .. state_len-1] followed by x[b,c,0 .. seqlen-1]
 *     out[b,c,t] = act(bias[c] + sum_k weight[c,k] * v[state_len + t - (W-1) + k])
 *     conv_state[s,c,i] = v[seqlen + i] afterwards (the last state_len entries of v)
 *   with cache_seqlens (conv_state is a circular buffer), q = cache_seqlens[b]:
 *     v = conv_state[s,c,(q-(W-1)+j) mod state_len] for j = 0 .. W-2, followed by x[b,c,:]
 *     out[b,c,t] = act(bias[c] + sum_k weight[c,k] * v[t+k])
 *     conv_state[s,c,(q+t) mod state_len] = x[b,c,t] for t = 0 .. seqlen-1 in order (a later
 *     token overwrites an earlier one when seqlen > state_len); mod is taken into
 *     [0, state_len); cache_seqlens itself is not advanced (the caller adds seqlen)
 *
 * act is silu or the identity as for the forward; state entries are rounded to conv_state's
 * dtype, and out is computed from x's values, not from their rounded copies in the state.
 * A negative conv_state_indices[b] marks a padding row: out[b] is written as zeros and no state
 * is read or written. Without conv_state_indices, batch_state may exceed batch (state rows from
 * batch on are left as they are). Non-negative indices must be below batch_state and distinct:
 * the CPU path checks both and fails with nothing written; the CUDA path cannot read the
 * indices on the host, so it leaves the state alone and writes NaN to out[b] for an index
 * >= batch_state, and a repeated index leaves its state slot (and those rows' out) unspecified.
 *
 * Sizes: batch, dim, seqlen >= 0; 2 <= W <= 8; state_len >= W-1. Indexing is 64-bit.
 * dtypes: x, out, dout and dx share one dtype, float32, float16 or bfloat16; weight, bias,
 * initial_states, final_states, conv_state and the other gradients are float32, float16 or
 * bfloat16, each chosen independently; seq_idx is int32 (as in causal-conv1d: the kernels keep
 * a window of ids per position in registers); cache_seqlens and conv_state_indices are int32 or
 * int64. All arithmetic is float32 on CUDA (float64 on the CPU).
 * Strides: any strides (in elements) are honoured for every tensor; an output must not overlap
 * itself or any input (conv_state, read and written, counts as an output). The CUDA path is
 * fastest with x and out contiguous along seqlen (rows 16-byte aligned) or along dim
 * (channel-last).
 * Device: all tensors on the CPU, or all on one CUDA device. The CUDA path enqueues on `stream`
 * (a cudaStream_t; NULL is the legacy default stream) and can be captured in a CUDA graph.
 */
#ifndef LIBSSM_CONV1D_H_
#define LIBSSM_CONV1D_H_

#include "libssm/core.h"

#ifdef __cplusplus
extern "C" {
#endif

/* @cdef-begin */
typedef enum ssm_conv1d_activation {
  SSM_CONV1D_NONE = 0, /* out = z */
  SSM_CONV1D_SILU = 1  /* out = z * sigmoid(z) */
} ssm_conv1d_activation;

/* Options of every conv1d entry point. struct_size must be sizeof(ssm_causal_conv1d_params) as
 * the caller compiled it, so later versions can append fields; every field of this version
 * must be set. */
typedef struct ssm_causal_conv1d_params {
  size_t struct_size;
  int32_t activation; /* ssm_conv1d_activation */
} ssm_causal_conv1d_params;

/* Forward (formula above).
 * [in]  x (batch, dim, seqlen); weight (dim, W); bias (dim,) or NULL;
 *       initial_states (batch, dim, W-1) or NULL; seq_idx (batch, seqlen) or NULL.
 * [out] out (batch, dim, seqlen), x's dtype; final_states (batch, dim, W-1) or NULL.
 * [in]  stream: cudaStream_t or NULL. */
SSM_API ssm_status ssm_causal_conv1d_fwd(const ssm_causal_conv1d_params* params,
                                         const DLTensor* x, const DLTensor* weight,
                                         const DLTensor* bias, const DLTensor* initial_states,
                                         const DLTensor* seq_idx, DLTensor* out,
                                         DLTensor* final_states, void* stream);

/* Bytes of workspace ssm_causal_conv1d_bwd needs for these sizes, this layout of x and this
 * device (0 on the CPU).
 * [in] x (batch, dim, seqlen) and weight (dim, W), as they will be passed to the backward.
 * [out] bytes. */
SSM_API ssm_status ssm_causal_conv1d_bwd_workspace_size(const ssm_causal_conv1d_params* params,
                                                        const DLTensor* x,
                                                        const DLTensor* weight, size_t* bytes);

/* Backward: gradients of a scalar loss L given dout = dL/dout and dfinal_states =
 * dL/dfinal_states (NULL: zero).
 * [in]  x, weight, bias, initial_states, seq_idx: as given to the forward (bias is needed
 *       to recompute silu's argument); dout (batch, dim, seqlen), x's dtype;
 *       dfinal_states (batch, dim, W-1) or NULL.
 * [out] dx (batch, dim, seqlen), x's dtype; dweight (dim, W); dbias (dim,);
 *       dinitial_states (batch, dim, W-1). Each may be NULL to skip it; dbias without bias or
 *       dinitial_states without initial_states is an error. Gradients are written, not
 *       accumulated into. dweight and dbias are sums over batch and seqlen taken in a fixed
 *       order: the same inputs give the same bits on every run.
 * [in]  workspace: at least ssm_causal_conv1d_bwd_workspace_size bytes, 256-byte aligned, on
 *       the tensors' device (NULL when that size is 0); stream as for the forward. */
SSM_API ssm_status ssm_causal_conv1d_bwd(const ssm_causal_conv1d_params* params,
                                         const DLTensor* x, const DLTensor* weight,
                                         const DLTensor* bias, const DLTensor* initial_states,
                                         const DLTensor* seq_idx, const DLTensor* dout,
                                         const DLTensor* dfinal_states, DLTensor* dx,
                                         DLTensor* dweight, DLTensor* dbias,
                                         DLTensor* dinitial_states, void* workspace,
                                         size_t workspace_bytes, void* stream);

/* Decode step (formula above).
 * [in]     x (batch, dim) or (batch, dim, seqlen); weight (dim, W); bias (dim,) or NULL;
 *          cache_seqlens (batch,) or NULL; conv_state_indices (batch,) or NULL.
 * [in,out] conv_state (batch_state, dim, state_len): read and updated in place.
 * [out]    out: shaped like x, x's dtype.
 * [in]     stream: cudaStream_t or NULL. */
SSM_API ssm_status ssm_causal_conv1d_update(const ssm_causal_conv1d_params* params,
                                            const DLTensor* x, DLTensor* conv_state,
                                            const DLTensor* weight, const DLTensor* bias,
                                            const DLTensor* cache_seqlens,
                                            const DLTensor* conv_state_indices, DLTensor* out,
                                            void* stream);
/* @cdef-end */

#ifdef __cplusplus
}
#endif

#endif /* LIBSSM_CONV1D_H_ */
