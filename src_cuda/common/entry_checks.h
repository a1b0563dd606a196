// Checks that the entry points of every op share beyond their tensors (dlpack_check.h): the
// caller's workspace, and CUDA tensors arriving at a library built without CUDA.
#pragma once

#include <cstddef>
#include <cstdint>

#include "libssm/core.h"

namespace ssm {

// The alignment every public header promises for a workspace: kernels may place vectorised
// partial sums at its start.
constexpr uintptr_t kWorkspaceAlignment = 256;

// workspace and workspace_bytes against the `needed` bytes that the size query named `query`
// reports for this call; with needed == 0 any workspace (NULL included) is accepted.
ssm_status check_workspace(const void* workspace, size_t workspace_bytes, size_t needed,
                           const char* query);

// SSM_ERROR_CUDA for a call whose tensors are on a CUDA device when libssm has no CUDA path.
ssm_status fail_no_cuda();

// SSM_ERROR_INTERNAL for CUDA tensors that reached an op's dispatch in a build without CUDA:
// the entry checks should have refused them with fail_no_cuda.
ssm_status fail_cuda_dispatch_without_cuda();

}  // namespace ssm
