// SIGINT and SIGTERM for kvr's long-running subcommands (node, mocker): blocked in every thread
// and awaited on a thread of their own, so that a signal stops the process promptly whatever it
// is doing, startup included.
#pragma once

#include <memory>
#include <stop_token>
#include <string>

namespace kvr::cli {

/// The termination signals of one process. Until ready() a signal ends the process at once with
/// exit code 128 + the signal (startup has handed out nothing that the kernel does not reclaim:
/// sockets close, routers expire workers that never deregistered); from ready() on the first
/// signal requests a stop through stop_source() and a second one ends the process at once.
class StopSignals {
 public:
  /// Blocks SIGINT and SIGTERM and starts the thread that waits for them. Call before any other
  /// thread starts, so that every thread inherits the blocked signals. `command` prefixes the
  /// log line of an early exit (e.g. "kvr node").
  static std::shared_ptr<StopSignals> install(std::string command);

  /// Startup is over: from now on a signal requests a stop instead of ending the process.
  void ready();
  /// Requested by the first signal after ready(); others (a timer) may request it too.
  std::stop_source stop_source() const;
  /// Waits until a stop is requested; the signal that requested it (0: someone else did).
  int wait();

 private:
  struct State;
  explicit StopSignals(std::shared_ptr<State> state) : state_(std::move(state)) {}
  std::shared_ptr<State> state_;
};

}  // namespace kvr::cli
