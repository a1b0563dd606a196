// The exception boundary of every C entry point: nothing may throw across the C ABI, so a C++
// exception from the body (std::bad_alloc from a host buffer, or a bug) becomes a status.
#pragma once

#include <exception>
#include <new>

#include "error.h"

namespace ssm {

template <class Body>
ssm_status guarded(const char* function, Body&& body) noexcept {
  try {
    clear_error();
    return body();
  } catch (const std::bad_alloc&) {
    return fail(SSM_ERROR_INTERNAL, "%s: out of host memory", function);
  } catch (const std::exception& e) {
    return fail(SSM_ERROR_INTERNAL, "%s: unexpected C++ exception: %s", function, e.what());
  } catch (...) {
    return fail(SSM_ERROR_INTERNAL, "%s: unexpected C++ exception", function);
  }
}

}  // namespace ssm
