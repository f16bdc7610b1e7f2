// Starts and supervises a child process for integration tests: output to a log file, bounded
// waits, and termination when the handle is destroyed (even when the test fails).
#pragma once

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include <sys/types.h>
#include <time.h>

namespace kvr::testing {

/// A running child process. Destroying the handle terminates the child (SIGTERM, then SIGKILL).
class ChildProcess {
 public:
  /// Starts `argv[0]` (searched on PATH) with stdout and stderr appended to `log_file`.
  static std::optional<ChildProcess> start(const std::vector<std::string>& argv,
                                           const std::filesystem::path& log_file);

  ChildProcess(ChildProcess&& other) noexcept;
  ChildProcess& operator=(ChildProcess&& other) noexcept;
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;
  ~ChildProcess();

  pid_t pid() const { return pid_; }
  /// True until the child has exited (reaps it if it has).
  bool running();
  /// Sends `signal` (e.g. SIGTERM, SIGKILL, SIGSTOP).
  void signal(int signal) const;
  /// Waits up to `timeout` for the child to exit; its exit code, or the negated signal number.
  std::optional<int> wait(std::chrono::milliseconds timeout);
  /// SIGTERM, a grace period, then SIGKILL; returns the exit status as wait() does.
  std::optional<int> stop(std::chrono::milliseconds grace = std::chrono::milliseconds(3000));
  /// The log file's contents so far (for failure messages).
  std::string log() const;

 private:
  ChildProcess(pid_t pid, std::filesystem::path log_file)
      : pid_(pid), log_file_(std::move(log_file)) {}
  pid_t pid_ = -1;
  std::filesystem::path log_file_;
  std::optional<int> exit_status_;
};

/// Children started from now on run AddressSanitizer with a 1 MiB quarantine (freed memory waits
/// there, 256 MiB by default, and would read as growth in a memory test); the rest of
/// ASAN_OPTIONS is kept.
void use_small_asan_quarantine_in_children();

/// Resident memory of a process in KiB (VmRSS of /proc/<pid>/status); 0 when unreadable.
std::uint64_t resident_kib(pid_t pid);

/// A fresh temporary directory, removed with the handle.
class TemporaryDirectory {
 public:
  TemporaryDirectory();
  ~TemporaryDirectory();
  TemporaryDirectory(const TemporaryDirectory&) = delete;
  TemporaryDirectory& operator=(const TemporaryDirectory&) = delete;
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

/// Polls `condition` every few milliseconds until it holds or `timeout` passes.
template <class Condition>
bool wait_until(Condition condition, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!condition()) {
    if (std::chrono::steady_clock::now() >= deadline) return false;
    struct timespec pause {
      0, 5'000'000
    };
    nanosleep(&pause, nullptr);
  }
  return true;
}

}  // namespace kvr::testing
