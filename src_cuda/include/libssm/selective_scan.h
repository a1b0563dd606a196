/* libssm selective scan (Mamba-1): forward and backward.
 *
 * For every batch b, channel d and state n, with t = 0 .. seqlen-1:
 *
 *   dt[b,d,t]    = softplus(delta[b,d,t] + delta_bias[d])   if params->delta_softplus
 *                  delta[b,d,t] + delta_bias[d]              otherwise (delta_bias = 0 when absent)
 *   h[b,d,n,t]   = exp(dt[b,d,t] * A[d,n]) * h[b,d,n,t-1] + dt[b,d,t] * B[.,n,t] * u[b,d,t]
 *   h[b,d,n,-1]  = initial_state[b,d,n]                      (0 when absent)
 *   y[b,d,t]     = sum_n C[.,n,t] * h[b,d,n,t] + D[d] * u[b,d,t]   (D = 0 when absent)
 *   out[b,d,t]   = y[b,d,t] * silu(z[b,d,t])                 if z is given, else y[b,d,t]
 *   last_state[b,d,n] = h[b,d,n,seqlen-1]
 *
 * B[.,n,t] (and likewise C) takes one of three forms, each chosen by the tensor's ndim:
 *   ndim 3, (batch, dstate, seqlen):          B[b,n,t]                   (variable, one group)
 *   ndim 4, (batch, groups, dstate, seqlen):  B[b, d / (dim/groups), n, t]  (variable, grouped;
 *                                             groups must divide dim)
 *   ndim 2, (dim, dstate):                    B[d,n], the same at every step  (fixed)
 *
 * Sizes: batch >= 0, dim >= 1, seqlen >= 1, 1 <= dstate <= 256. Indexing is 64-bit.
 * dtypes: u, delta, z, B, C, initial_state, out, last_state and every gradient of them are
 * float32, float16 or bfloat16, each chosen independently; A, D, delta_bias and their
 * gradients are float32. The recurrent state and all accumulation are float32.
 * Strides: any strides (in elements, DLPack convention; NULL strides mean compact row-major)
 * are honoured for inputs; an output must not overlap itself or any input.
 * Device: all tensors on the CPU (kDLCPU), or all on one CUDA device (kDLCUDA). The CPU path
 * runs synchronously on the calling thread and ignores the stream; the CUDA path enqueues on
 * `stream` (a cudaStream_t; NULL is the legacy default stream) and returns at once.
 */
#ifndef LIBSSM_SELECTIVE_SCAN_H_
#define LIBSSM_SELECTIVE_SCAN_H_

#include "libssm/core.h"

#ifdef __cplusplus
extern "C" {
#endif

/* @cdef-begin */
/* Options. struct_size must be sizeof(ssm_selective_scan_params) as the caller compiled it,
 * so later versions can append fields: fields past struct_size take their defaults. */
typedef struct ssm_selective_scan_params {
  size_t struct_size;
  int32_t delta_softplus; /* nonzero: dt = softplus(delta + delta_bias); default 0 */
} ssm_selective_scan_params;

/* Bytes of workspace ssm_selective_scan_fwd needs for these sizes and this device.
 * [in] u (batch, dim, seqlen), A (dim, dstate), B, C: as for ssm_selective_scan_fwd.
 * [out] bytes. */
SSM_API ssm_status ssm_selective_scan_fwd_workspace_size(
    const ssm_selective_scan_params* params, const DLTensor* u, const DLTensor* A,
    const DLTensor* B, const DLTensor* C, size_t* bytes);

/* Forward selective scan (formula above).
 * [in]  u (batch, dim, seqlen), delta (batch, dim, seqlen), A (dim, dstate) float32,
 *       B and C (each one of the three forms above),
 *       D (dim,) float32 or NULL, z (batch, dim, seqlen) or NULL,
 *       delta_bias (dim,) float32 or NULL, initial_state (batch, dim, dstate) or NULL.
 * [out] out (batch, dim, seqlen); last_state (batch, dim, dstate) or NULL.
 * [in]  workspace: at least ssm_selective_scan_fwd_workspace_size bytes, 256-byte aligned,
 *       on the tensors' device (NULL when that size is 0); stream: cudaStream_t or NULL. */
SSM_API ssm_status ssm_selective_scan_fwd(
    const ssm_selective_scan_params* params, const DLTensor* u, const DLTensor* delta,
    const DLTensor* A, const DLTensor* B, const DLTensor* C, const DLTensor* D,
    const DLTensor* z, const DLTensor* delta_bias, const DLTensor* initial_state,
    DLTensor* out, DLTensor* last_state, void* workspace, size_t workspace_bytes,
    void* stream);

/* Bytes of workspace ssm_selective_scan_bwd needs (same arguments as the fwd query). */
SSM_API ssm_status ssm_selective_scan_bwd_workspace_size(
    const ssm_selective_scan_params* params, const DLTensor* u, const DLTensor* A,
    const DLTensor* B, const DLTensor* C, size_t* bytes);

/* Backward selective scan: gradients of a scalar loss L through the forward above, given
 * dout = dL/dout and dlast_state = dL/dlast_state. The forward is recomputed from the inputs
 * (nothing but the inputs is kept between forward and backward).
 * [in]  u, delta, A, B, C, D, z, delta_bias, initial_state: exactly as given to the forward;
 *       dout (batch, dim, seqlen); dlast_state (batch, dim, dstate) or NULL (zero).
 * [out] du, ddelta (batch, dim, seqlen); dA (dim, dstate) float32; dB, dC in the form and
 *       shape of B and C; dD (dim,) float32; dz (batch, dim, seqlen);
 *       ddelta_bias (dim,) float32; dinitial_state (batch, dim, dstate).
 *       Any gradient may be NULL to skip it; a gradient given for an input that is NULL
 *       (dD without D, ...) is an error. Gradients are written, not accumulated into.
 *       dA, dB, dC, dD and ddelta_bias are sums over channels or batches taken with
 *       floating-point atomics on CUDA, so their last bits may differ from run to run.
 * Memory: the CUDA backward recomputes the forward; its workspace holds the state every k
 *       steps, 4 * batch * dim * npad * ceil(seqlen / k) bytes (k = 16, or 8 at dstate > 128;
 *       npad = dstate rounded up to a power of two >= 4), plus float32 sums of dA, dB, dC, dD
 *       and ddelta_bias.
 * [in]  workspace: at least ssm_selective_scan_bwd_workspace_size bytes, 256-byte aligned,
 *       on the tensors' device; stream as for the forward. */
SSM_API ssm_status ssm_selective_scan_bwd(
    const ssm_selective_scan_params* params, const DLTensor* u, const DLTensor* delta,
    const DLTensor* A, const DLTensor* B, const DLTensor* C, const DLTensor* D,
    const DLTensor* z, const DLTensor* delta_bias, const DLTensor* initial_state,
    const DLTensor* dout, const DLTensor* dlast_state, DLTensor* du, DLTensor* ddelta,
    DLTensor* dA, DLTensor* dB, DLTensor* dC, DLTensor* dD, DLTensor* dz,
    DLTensor* ddelta_bias, DLTensor* dinitial_state, void* workspace,
    size_t workspace_bytes, void* stream);
/* @cdef-end */

#ifdef __cplusplus
}
#endif

#endif /* LIBSSM_SELECTIVE_SCAN_H_ */
