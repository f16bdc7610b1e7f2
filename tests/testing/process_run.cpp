#include "tests/testing/process_run.hpp"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include "tests/testing/child_process.hpp"

namespace kvr::testing {

ProcessRun run_process(const std::vector<std::string>& argv, const std::filesystem::path& log_file,
                       std::chrono::milliseconds timeout) {
  ProcessRun run;
  auto process = ChildProcess::start(argv, log_file);
  if (!process) return run;
  run.exit_code = process->wait(timeout);
  if (!run.exit_code) process->stop();
  run.output = process->log();
  return run;
}

SilentListener::SilentListener() {
  listener_ = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof(address);
  if (listener_ >= 0 &&
      ::bind(listener_, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0 &&
      ::listen(listener_, 16) == 0 &&
      ::getsockname(listener_, reinterpret_cast<sockaddr*>(&address), &length) == 0) {
    port_ = ntohs(address.sin_port);
  }
}

SilentListener::~SilentListener() {
  for (const int connection : connections_) ::close(connection);
  if (listener_ >= 0) ::close(listener_);
}

bool SilentListener::accept_one(std::chrono::milliseconds timeout) {
  if (port_ == 0) return false;
  pollfd ready{listener_, POLLIN, 0};
  if (::poll(&ready, 1, static_cast<int>(timeout.count())) != 1) return false;
  const int connection = ::accept(listener_, nullptr, nullptr);
  if (connection < 0) return false;
  connections_.push_back(connection);
  return true;
}

}  // namespace kvr::testing
