/* libssm fused normalisation: RMSNorm or LayerNorm of the last axis, with an optional residual
 * add before it and an optional SiLU gate, forward and backward.
 *
 * Tensors are 2-d: rows x hidden. The hidden axis is cut into ngroups = hidden / group_size
 * groups of group_size consecutive columns (group_size 0 means hidden: one group), and each
 * (row, group) pair is normalised on its own. For row r, column j in group G:
 *
 *   s[r,j]   = x[r,j] + residual[r,j]            (x[r,j] when residual is NULL), in float32
 *   g[r,j]   = s[r,j] * silu(z[r,j])             if z is given and norm_before_gate == 0
 *              s[r,j]                            otherwise
 *   mean[r,G] = average of g over the group      (LayerNorm; 0 for RMSNorm)
 *   rstd[r,G] = 1 / sqrt(average of (g - mean)^2 over the group + eps)
 *   w[j]     = weight[j] + 1 if zero_centered_weight, else weight[j]  (1 when weight is NULL)
 *   o[r,j]   = (g[r,j] - mean[r,G]) * rstd[r,G] * w[j] + bias[j]   (bias 0 when NULL)
 *   y[r,j]   = o[r,j] * silu(z[r,j])             if z is given and norm_before_gate != 0
 *              o[r,j]                            otherwise
 *   residual_out[r,j] = s[r,j]                   (the pre-norm residual stream, rounded to
 *                                                 residual_out's dtype)
 *
 * Sizes: rows >= 0, 1 <= hidden <= 65536, group_size divides hidden. Indexing is 64-bit.
 * dtypes: x, residual, z, y, residual_out, dy, dresidual_out and the row-shaped gradients are
 * float32, float16 or bfloat16, each chosen independently (so the residual stream may be kept
 * in float32 while x and y are bfloat16); weight, bias, dweight and dbias likewise; mean and
 * rstd are float32. All arithmetic is float32 on CUDA (float64 reductions on the CPU).
 * Strides: the hidden axis (and weight, bias and their gradients) must be contiguous (stride
 * 1); rows may have any stride. Outputs must not overlap themselves or any input.
 * Device: all tensors on the CPU, or all on one CUDA device, as for the selective scan. The
 * CUDA path enqueues on `stream` (cudaStream_t; NULL is the legacy default stream).
 */
#ifndef LIBSSM_NORM_H_
#define LIBSSM_NORM_H_

#include "libssm/core.h"

#ifdef __cplusplus
extern "C" {
#endif

/* @cdef-begin */
typedef enum ssm_norm_kind {
  SSM_NORM_RMS = 0,   /* RMSNorm: no mean subtracted */
  SSM_NORM_LAYER = 1  /* LayerNorm */
} ssm_norm_kind;

/* Options. struct_size must be sizeof(ssm_norm_params) as the caller compiled it, so later
 * versions can append fields; every field of this version must be set. */
typedef struct ssm_norm_params {
  size_t struct_size;
  int32_t kind;                 /* ssm_norm_kind */
  float eps;                    /* added to the variance; >= 0 */
  int64_t group_size;           /* columns per normalised group; 0: hidden (one group) */
  int32_t zero_centered_weight; /* nonzero: scale by 1 + weight */
  int32_t norm_before_gate;     /* with z: nonzero y = norm(s) * silu(z); 0: y = norm(s * silu(z)) */
} ssm_norm_params;

/* Forward (formula above).
 * [in]  x (rows, hidden); residual (rows, hidden) or NULL; weight (hidden,) or NULL (no
 *       scale; zero_centered_weight must then be 0); bias (hidden,) or NULL;
 *       z (rows, hidden) or NULL.
 * [out] y (rows, hidden); residual_out (rows, hidden) or NULL;
 *       mean (rows, ngroups) float32 or NULL (LayerNorm only: it must be NULL for RMSNorm);
 *       rstd (rows, ngroups) float32 or NULL. mean and rstd may also be 1-d (rows,) when
 *       ngroups is 1. The backward needs rstd (and mean for LayerNorm), and the normalised
 *       input s: residual_out when a residual was added, else x.
 * [in]  stream: cudaStream_t or NULL. */
SSM_API ssm_status ssm_norm_fwd(const ssm_norm_params* params, const DLTensor* x,
                                const DLTensor* residual, const DLTensor* weight,
                                const DLTensor* bias, const DLTensor* z, DLTensor* y,
                                DLTensor* residual_out, DLTensor* mean, DLTensor* rstd,
                                void* stream);

/* Bytes of workspace ssm_norm_bwd needs for these sizes on this device (0 on the CPU).
 * [in] x (rows, hidden) and weight (hidden,) or NULL, as they will be passed to ssm_norm_bwd.
 * [out] bytes. */
SSM_API ssm_status ssm_norm_bwd_workspace_size(const ssm_norm_params* params,
                                               const DLTensor* x, const DLTensor* weight,
                                               size_t* bytes);

/* Backward: gradients of a scalar loss L through the forward, given dy = dL/dy and
 * dresidual_out = dL/dresidual_out (the gradient arriving at the pre-norm stream).
 * [in]  x: the normalised input s (rows, hidden): the forward's residual_out when it added a
 *       residual, else its x. weight, bias, z: as given to the forward. mean (LayerNorm) and
 *       rstd: as the forward wrote them. dy (rows, hidden); dresidual_out (rows, hidden) or NULL.
 * [out] dx (rows, hidden): dL/ds, which is both dL/dx and dL/dresidual of the forward;
 *       dresidual (rows, hidden): the same values in another dtype (for a float32 residual
 *       stream beside bfloat16 x), or NULL; dweight (hidden,); dbias (hidden,); dz (rows, hidden).
 *       Each may be NULL to skip it; dweight without weight, dbias without bias or dz without
 *       z is an error.
 *       Gradients are written, not accumulated into. dweight and dbias are sums over rows taken
 *       in a fixed order: the same inputs give the same bits on every run.
 * [in]  workspace: at least ssm_norm_bwd_workspace_size bytes, 256-byte aligned, on the
 *       tensors' device (NULL when that size is 0); stream as for the forward. */
SSM_API ssm_status ssm_norm_bwd(const ssm_norm_params* params, const DLTensor* x,
                                const DLTensor* weight, const DLTensor* bias,
                                const DLTensor* z, const DLTensor* mean, const DLTensor* rstd,
                                const DLTensor* dy, const DLTensor* dresidual_out, DLTensor* dx,
                                DLTensor* dresidual, DLTensor* dweight, DLTensor* dbias,
                                DLTensor* dz, void* workspace, size_t workspace_bytes,
                                void* stream);
/* @cdef-end */

#ifdef __cplusplus
}
#endif

#endif /* LIBSSM_NORM_H_ */
