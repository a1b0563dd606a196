// The fused-norm backward keeping 1 slice(s) of 8 columns a thread in registers.
#include "../norm_kernels.cuh"

namespace ssm {
template cudaError_t launch_norm_bwd<1>(const NormArgs&, const NormPlan&, cudaStream_t);
template int norm_bwd_blocks_per_sm<1>(int);
}  // namespace ssm
