#include "deploy/cli/stop_signals.hpp"

#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <thread>

#include <signal.h>

namespace kvr::cli {

struct StopSignals::State {
  std::string command;
  sigset_t signals{};
  std::stop_source stop;
  std::mutex mutex;
  std::condition_variable_any wake;
  bool ready = false;
  int received = 0;  // the signal that requested the stop
};

namespace {

[[noreturn]] void exit_now(const std::string& command, int signal, const char* when) {
  std::fprintf(stderr, "%s: signal %d %s; exiting\n", command.c_str(), signal, when);
  std::fflush(stderr);
  std::_Exit(128 + signal);
}

}  // namespace

std::shared_ptr<StopSignals> StopSignals::install(std::string command) {
  auto state = std::make_shared<State>();
  state->command = std::move(command);
  sigemptyset(&state->signals);
  sigaddset(&state->signals, SIGINT);
  sigaddset(&state->signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &state->signals, nullptr);
  // Detached: it blocks in sigwait for the life of the process, and owns its share of the state.
  std::thread{[state] {
    bool stopping = false;
    for (;;) {
      int signal = 0;
      if (sigwait(&state->signals, &signal) != 0) continue;
      std::unique_lock lock{state->mutex};
      if (!state->ready) exit_now(state->command, signal, "during startup");
      if (stopping) exit_now(state->command, signal, "while stopping");
      stopping = true;
      state->received = signal;
      lock.unlock();
      state->stop.request_stop();
    }
  }}.detach();
  return std::shared_ptr<StopSignals>(new StopSignals(std::move(state)));
}

void StopSignals::ready() {
  std::lock_guard lock{state_->mutex};
  state_->ready = true;
}

std::stop_source StopSignals::stop_source() const { return state_->stop; }

int StopSignals::wait() {
  std::unique_lock lock{state_->mutex};
  // Returns once a stop is requested, by a signal or by anyone else holding the stop source.
  state_->wake.wait(lock, state_->stop.get_token(), [] { return false; });
  return state_->received;
}

}  // namespace kvr::cli
