// The fixture the integration tests of kvr processes share: a nats-server of their own on loopback,
// a client connected to it (for recorders and requests) and the kvr processes of one namespace.
#pragma once

#include <memory>
#include <optional>
#include <string>

#include <gtest/gtest.h>

#include "messages/nats/nats_client.hpp"
#include "tests/testing/child_process.hpp"
#include "tests/testing/kvr_processes.hpp"
#include "tests/testing/nats_server.hpp"

namespace kvr::testing {

/// Client options that reconnect forever, quickly: for tests that restart the server under it.
nats::NatsOptions reconnecting_client();

/// Starts the server, connects the client and makes `kvr_` in SetUp(). A fixture that adds to
/// SetUp() calls this one first and stops when it failed (HasFatalFailure()).
class KvrClusterTest : public ::testing::Test {
 protected:
  /// `binary` is the kvr executable, `ns` the namespace of every process; `client_options` are
  /// the client's (its URL is the server's).
  /// `server_args` go to the nats-server (e.g. {"-js"}).
  KvrClusterTest(std::string binary, std::string ns, nats::NatsOptions client_options = {},
                 std::vector<std::string> server_args = {});

  void SetUp() override;

  TemporaryDirectory directory_;
  std::unique_ptr<NatsServer> server_;
  std::unique_ptr<nats::NatsClient> client_;
  std::optional<KvrProcesses> kvr_;

 private:
  std::string binary_;
  std::string namespace_;
  nats::NatsOptions client_options_;
  std::vector<std::string> server_args_;
};

}  // namespace kvr::testing
