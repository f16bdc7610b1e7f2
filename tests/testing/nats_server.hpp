// A real nats-server on 127.0.0.1 with a free port, for integration tests. Stopped and its
// files removed when the handle is destroyed.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "tests/testing/child_process.hpp"

namespace kvr::testing {

/// One nats-server process listening on loopback only.
class NatsServer {
 public:
  /// Starts a server on a free port (or on `port` when given, e.g. to restart on the same port);
  /// nullopt, with the reason in `error`, when it does not come up within a few seconds.
  /// `extra_args` go to nats-server as given (credentials, TLS), on restarts too.
  static std::unique_ptr<NatsServer> start(std::string* error,
                                           std::optional<std::uint16_t> port = {},
                                           std::vector<std::string> extra_args = {});

  ~NatsServer();

  std::uint16_t port() const { return port_; }
  /// "nats://127.0.0.1:<port>".
  std::string url() const;
  /// Stops the server (SIGTERM, then SIGKILL).
  void stop();
  /// Kills the server as a crash would (SIGKILL: clients see their connections drop without a
  /// goodbye) and reaps it; restart() brings it back on the same port.
  void kill();
  /// Starts it again on the same port after stop().
  bool restart(std::string* error);
  ChildProcess& process() { return *process_; }

 private:
  NatsServer() = default;
  bool launch(std::optional<std::uint16_t> port, std::string* error);
  std::unique_ptr<TemporaryDirectory> directory_;
  std::optional<ChildProcess> process_;
  std::vector<std::string> extra_args_;
  std::uint16_t port_ = 0;
  int launches_ = 0;
};

/// Writes a self-signed certificate for 127.0.0.1 (cert.pem) and its key (key.pem) into `dir`
/// with the openssl tool, for TLS servers in tests; false, with the tool's log in `error`, when
/// it fails.
bool make_self_signed_certificate(const std::filesystem::path& dir, std::string* error);

}  // namespace kvr::testing
