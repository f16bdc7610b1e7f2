// Invariant checks used across kvr: KVR_ASSERT in debug builds only, KVR_CHECK always.
// A failed check aborts with the condition, file and line: it marks a bug, never bad input.
#pragma once

#include <cstdio>
#include <cstdlib>

namespace kvr::detail {

[[noreturn]] inline void check_failed(const char* condition, const char* file, int line) {
  std::fprintf(stderr, "kvr: check failed: %s (%s:%d)\n", condition, file, line);
  std::abort();
}

}  // namespace kvr::detail

/// Always evaluated: aborts when `condition` is false.
#define KVR_CHECK(condition) \
  ((condition) ? static_cast<void>(0) : ::kvr::detail::check_failed(#condition, __FILE__, __LINE__))

#ifdef NDEBUG
/// Debug builds only: the condition is not evaluated in release builds.
#define KVR_ASSERT(condition) static_cast<void>(0)
#else
#define KVR_ASSERT(condition) KVR_CHECK(condition)
#endif
