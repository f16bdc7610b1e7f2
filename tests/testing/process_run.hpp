// Helpers for tests of command-line processes: run one to its exit with a deadline, and a
// loopback TCP listener that accepts connections but never speaks (a server that hangs a client's
// handshake, so that a process can be caught in its startup).
#pragma once

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

namespace kvr::testing {

/// How a process run to its end went.
struct ProcessRun {
  /// The exit code, or the negated signal number; nullopt when it did not end in time (it was
  /// killed then) or could not start.
  std::optional<int> exit_code;
  /// Everything it wrote to stdout and stderr.
  std::string output;
};

/// Starts `argv` with its output in `log_file` and waits up to `timeout` for it to exit.
ProcessRun run_process(const std::vector<std::string>& argv, const std::filesystem::path& log_file,
                       std::chrono::milliseconds timeout);

/// A socket listening on 127.0.0.1 that completes TCP handshakes and then stays silent.
class SilentListener {
 public:
  SilentListener();
  ~SilentListener();
  SilentListener(const SilentListener&) = delete;
  SilentListener& operator=(const SilentListener&) = delete;

  std::uint16_t port() const { return port_; }
  /// Waits up to `timeout` for a client to connect, and keeps its connection open.
  bool accept_one(std::chrono::milliseconds timeout);

 private:
  int listener_ = -1;
  std::vector<int> connections_;
  std::uint16_t port_ = 0;
};

}  // namespace kvr::testing
