// The fused-norm forward keeping 4 slice(s) of 8 columns a thread in registers.
#include "../norm_kernels.cuh"

namespace ssm {
template cudaError_t launch_norm_fwd<4>(const NormArgs&, const NormPlan&, cudaStream_t);
}  // namespace ssm
