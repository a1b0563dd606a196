/* libssm selective-state decode step: one token of the selective scan against a recurrent state
 * kept by the caller and updated in place (mamba_ssm's selective_state_update), for Mamba-1 and
 * Mamba-2 layouts and continuous batching.
 *
 * Shapes come in one of two layouts, chosen by state's ndim:
 *
 *                     Mamba-1 (state 3-d)          Mamba-2 (state 4-d)
 *   state             (batch_state, dim, dstate)   (batch_state, nheads, headdim, dstate)
 *   x, dt, z, out     (batch, dim)                 (batch, nheads, headdim)
 *   A                 (dim, dstate)                (nheads, headdim, dstate)
 *   B, C              (batch, dstate)              (batch, ngroups, dstate)
 *   D, dt_bias        (dim,)                       (nheads, headdim)
 *   state_batch_indices (batch,)                   (batch,)
 *
 * Mamba-1 is Mamba-2 with nheads = ngroups = 1 and headdim = dim; below, the Mamba-2 names are
 * used. Head h reads group g = h / (nheads / ngroups) of B and C; ngroups must divide nheads.
 * For every row b < batch, head h, channel p and state n, with s = state_batch_indices[b]
 * (s = b when state_batch_indices is NULL):
 *
 *   dt'[b,h,p]  = softplus(dt[b,h,p] + dt_bias[h,p])   if params->dt_softplus (softplus(v) is v
 *                                                       above 20), else dt[b,h,p] + dt_bias[h,p]
 *                                                       (dt_bias = 0 when NULL)
 *   new[n]      = state[s,h,p,n] * exp(A[h,p,n] * dt'[b,h,p]) + B[b,g,n] * dt'[b,h,p] * x[b,h,p]
 *   state[s,h,p,n] = new[n], rounded to state's dtype
 *   y           = sum_n new[n] * C[b,g,n] + D[h,p] * x[b,h,p]     (D = 0 when NULL)
 *   out[b,h,p]  = y * silu(z[b,h,p]) if z is given, else y
 *
 * out is computed from new[n] before it is rounded to state's dtype (as mamba_ssm's kernel does).
 * A negative state_batch_indices[b] marks a padding row: out[b] is written as zeros and no state
 * is read or written. Without state_batch_indices, batch_state may exceed batch (state rows from
 * batch on are left as they are). Non-negative indices must be below batch_state and distinct:
 * the CPU path checks both and fails with nothing written; the CUDA path cannot read the indices
 * on the host, so it leaves the state alone and writes NaN to out[b] for an index >= batch_state,
 * and a repeated index leaves its state slot (and those rows' out) with unspecified values.
 *
 * Sizes: batch, nheads, headdim >= 0; 1 <= dstate <= 256; 1 <= ngroups. Indexing is 64-bit.
 * dtypes: state is float32, float16 or bfloat16 and keeps its dtype; every other float operand
 * is float32, float16 or bfloat16, each chosen independently; state_batch_indices is int32 or
 * int64. Arithmetic is float32 on CUDA, float64 on the CPU.
 * Strides: any strides (in elements) are honoured, including 0 on broadcast axes: Mamba-2 passes
 * dt, dt_bias and A with stride 0 along headdim and dstate (one value per head), which the CUDA
 * path detects and turns into one exponential per row. state and out must not overlap
 * themselves, each other or any input. The CUDA path is fastest with state contiguous along
 * dstate and 16-byte aligned rows.
 * Device: all tensors on the CPU, or all on one CUDA device; the CUDA path enqueues on `stream`
 * (a cudaStream_t; NULL is the legacy default stream), needs no workspace and can be captured
 * in a CUDA graph.
 */
#ifndef LIBSSM_STATE_UPDATE_H_
#define LIBSSM_STATE_UPDATE_H_

#include "libssm/core.h"

#ifdef __cplusplus
extern "C" {
#endif

/* @cdef-begin */
/* Options. struct_size must be sizeof(ssm_selective_state_update_params) as the caller
 * compiled it, so later versions can append fields; every field of this version must be set. */
typedef struct ssm_selective_state_update_params {
  size_t struct_size;
  int32_t dt_softplus; /* nonzero: dt' = softplus(dt + dt_bias) */
} ssm_selective_state_update_params;

/* One decode step (formula above).
 * [in,out] state: read and updated in place, in its own dtype.
 * [in]  x, dt; A; B, C; D or NULL; z or NULL; dt_bias or NULL; state_batch_indices or NULL.
 * [out] out.
 * [in]  stream: cudaStream_t or NULL. */
SSM_API ssm_status ssm_selective_state_update(const ssm_selective_state_update_params* params,
                                              DLTensor* state, const DLTensor* x,
                                              const DLTensor* dt, const DLTensor* A,
                                              const DLTensor* B, const DLTensor* C,
                                              const DLTensor* D, const DLTensor* z,
                                              const DLTensor* dt_bias,
                                              const DLTensor* state_batch_indices, DLTensor* out,
                                              void* stream);
/* @cdef-end */

#ifdef __cplusplus
}
#endif

#endif /* LIBSSM_STATE_UPDATE_H_ */
