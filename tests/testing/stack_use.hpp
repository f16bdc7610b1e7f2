// How much of a thread's stack a piece of work uses: for the tests that show a recursion bound
// keeps the deepest input it allows far from the end of the stacks the node's threads get.
#pragma once

#include <cstddef>
#include <cstring>
#include <functional>
#include <optional>

#include <pthread.h>
#include <sys/mman.h>
#include <unistd.h>

namespace kvr::testing {

/// A quarter of the 8 MB stack a thread (main, Asio, gRPC, CAF, httplib) gets by default.
inline constexpr std::size_t kQuarterOfAThreadStack = std::size_t{2} << 20;

/// How many bytes below the top of `stack` differ from `pattern`: how deep a thread went. Not
/// instrumented: AddressSanitizer may still mark frames of the ended thread in that memory.
__attribute__((no_sanitize_address)) inline std::size_t bytes_written(const unsigned char* stack,
                                                                      std::size_t size,
                                                                      unsigned char pattern) {
  std::size_t untouched = 0;
  while (untouched < size && stack[untouched] == pattern) ++untouched;
  return size - untouched;
}

/// Runs `work` on a thread of its own with a stack of `stack_bytes` (a multiple of the page size)
/// and an inaccessible page below it, and returns how many bytes of the stack it used (the stack
/// is filled with a pattern first and read back after); nullopt when the thread could not be
/// started. Work that needs more than the stack crashes the test on the guard page.
inline std::optional<std::size_t> stack_used_by(const std::function<void()>& work,
                                                std::size_t stack_bytes) {
  constexpr unsigned char kPattern = 0x5A;
  const auto page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  void* mapped =
      mmap(nullptr, page + stack_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (mapped == MAP_FAILED) return std::nullopt;
  auto* guard = static_cast<unsigned char*>(mapped);
  unsigned char* stack = guard + page;
  std::optional<std::size_t> used;
  if (mprotect(guard, page, PROT_NONE) == 0) {
    std::memset(stack, kPattern, stack_bytes);
    pthread_attr_t attributes;
    pthread_attr_init(&attributes);
    pthread_attr_setstack(&attributes, stack, stack_bytes);
    pthread_t thread;
    const auto run = [](void* argument) -> void* {
      (*static_cast<const std::function<void()>*>(argument))();
      return nullptr;
    };
    // pthread_create takes a void*; `work` is only read through it.
    void* argument = const_cast<std::function<void()>*>(&work);
    const int started = pthread_create(&thread, &attributes, run, argument);
    pthread_attr_destroy(&attributes);
    if (started == 0) {
      pthread_join(thread, nullptr);
      // The stack grows down: the lowest byte written marks how deep it went.
      used = bytes_written(stack, stack_bytes, kPattern);
    }
  }
  munmap(mapped, page + stack_bytes);
  return used;
}

}  // namespace kvr::testing
