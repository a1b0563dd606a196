// The checks of entry_checks.h.
#include "entry_checks.h"

#include "error.h"

namespace ssm {

ssm_status check_workspace(const void* workspace, size_t workspace_bytes, size_t needed,
                           const char* query) {
  if (needed == 0) return SSM_SUCCESS;
  if (workspace == nullptr)
    return fail(SSM_ERROR_WORKSPACE, "workspace: NULL, but this call needs %zu bytes (see %s)",
                needed, query);
  if (workspace_bytes < needed)
    return fail(SSM_ERROR_WORKSPACE, "workspace_bytes: %zu, but this call needs %zu (see %s)",
                workspace_bytes, needed, query);
  if (reinterpret_cast<uintptr_t>(workspace) % kWorkspaceAlignment != 0)
    return fail(SSM_ERROR_WORKSPACE, "workspace: %p is not %zu-byte aligned", workspace,
                size_t(kWorkspaceAlignment));
  return SSM_SUCCESS;
}

ssm_status fail_no_cuda() {
  return fail(SSM_ERROR_CUDA, "%s", "libssm was built without CUDA support");
}

ssm_status fail_cuda_dispatch_without_cuda() {
  return fail(SSM_ERROR_INTERNAL, "%s", "CUDA tensors reached dispatch in a CPU-only build");
}

}  // namespace ssm
