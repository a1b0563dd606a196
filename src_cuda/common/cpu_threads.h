// How many OpenMP threads a CPU reference uses, and which one is running: shared so every op
// stays on the caller's thread below the same amount of work, and builds without OpenMP work.
#pragma once

#include <cstdint>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace ssm {

// Threads for a call doing `work` inner-loop steps of a few flops each (state updates, elements):
// starting an OpenMP team costs tens of microseconds, more than small calls take on one thread,
// so those stay on the caller's thread.
inline int max_threads(int64_t work) {
#ifdef _OPENMP
  return work < (int64_t(1) << 18) ? 1 : omp_get_max_threads();
#else
  (void)work;
  return 1;
#endif
}

inline int thread_index() {
#ifdef _OPENMP
  return omp_get_thread_num();
#else
  return 0;
#endif
}

}  // namespace ssm
