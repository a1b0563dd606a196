// Thread-local error state behind ssm_last_error(): every failing path records a message that
// names the argument, and returns its status code to the entry point.
#pragma once

#include "libssm/core.h"

namespace ssm {

// Records a printf-style message for this thread and returns `code`.
ssm_status fail(ssm_status code, const char* fmt, ...) __attribute__((format(printf, 2, 3)));

// Called at the start of every entry point, so ssm_last_error() speaks of the last call only.
void clear_error();

}  // namespace ssm
