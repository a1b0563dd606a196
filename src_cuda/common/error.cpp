// The thread-local error state behind ssm_last_error(). Messages are formatted into a fixed
// per-thread buffer, so recording an error never allocates and cannot itself fail. The C entry
// point lives here too, beside the only buffer it may return.
#include "error.h"

#include <cstdarg>
#include <cstdio>

namespace ssm {

namespace {
thread_local char g_message[1024] = "";
}  // namespace

ssm_status fail(ssm_status code, const char* fmt, ...) {
  va_list args;
  va_start(args, fmt);
  std::vsnprintf(g_message, sizeof g_message, fmt, args);
  va_end(args);
  return code;
}

void clear_error() { g_message[0] = '\0'; }

}  // namespace ssm

extern "C" SSM_API const char* ssm_last_error(void) { return ssm::g_message; }
