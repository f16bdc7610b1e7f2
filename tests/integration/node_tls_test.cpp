// A cluster over TLS: a nats-server that accepts only TLS, `kvr mocker` workers, `kvr node` and
// `kvr route`, each verifying the server's certificate with --nats-tls-ca.
#include <optional>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tests/testing/loopback_http.hpp"
#include "tests/testing/nats_server.hpp"

namespace kvr {
namespace {

using namespace std::chrono_literals;
using testing::ChildProcess;
using testing::NatsServer;
using testing::TemporaryDirectory;
using testing::wait_until;

TEST(NodeTlsTest, MockerNodeAndRouteWorkOverVerifiedTls) {
  TemporaryDirectory directory;
  std::string error;
  ASSERT_TRUE(testing::make_self_signed_certificate(directory.path(), &error)) << error;
  const std::string ca = (directory.path() / "cert.pem").string();
  auto server = NatsServer::start(
      &error, std::nullopt,
      {"--tls", "--tlscert", ca, "--tlskey", (directory.path() / "key.pem").string()});
  ASSERT_TRUE(server) << error;
  const std::vector<std::string> nats{"--nats", server->url(), "--nats-tls-ca",
                                      ca,       "--namespace", "tls"};
  auto with_nats = [&](std::vector<std::string> argv) {
    argv.insert(argv.begin() + 2, nats.begin(), nats.end());
    return argv;
  };

  auto mocker = ChildProcess::start(with_nats({KVR_BINARY, "mocker", "--workers", "2",
                                               "--block-size", "16", "--time-scale", "20"}),
                                    directory.path() / "mocker.log");
  ASSERT_TRUE(mocker);
  const int metrics_port = testing::free_port();
  auto node = ChildProcess::start(with_nats({KVR_BINARY, "node", "--block-size", "16",
                                             "--metrics-port", std::to_string(metrics_port)}),
                                  directory.path() / "node.log");
  ASSERT_TRUE(node);

  // `kvr route` exits 0 once a worker was chosen; the workers need a moment to register.
  const std::vector<std::string> route =
      with_nats({KVR_BINARY, "route", "--text",
                 "a prompt long enough for two blocks of sixteen tokens", "--timeout-ms", "2000"});
  std::optional<ChildProcess> client;
  const bool routed = wait_until(
      [&] {
        client = ChildProcess::start(route, directory.path() / "route.log");
        return client && client->wait(10s) == 0;
      },
      30s);
  ASSERT_TRUE(routed) << "kvr route:\n"
                      << (client ? client->log() : "") << "\n---- node log\n"
                      << node->log() << "\n---- mocker log\n"
                      << mocker->log();
  EXPECT_NE(client->log().find(": worker "), std::string::npos) << client->log();
  EXPECT_TRUE(node->running());

  // Without the CA the client cannot verify the server and says so.
  std::vector<std::string> unverified{KVR_BINARY,    "route", "--nats", server->url(),
                                      "--namespace", "tls",   "--text", "hello"};
  auto refused = ChildProcess::start(unverified, directory.path() / "refused.log");
  ASSERT_TRUE(refused);
  EXPECT_EQ(refused->wait(30s), 2);
  EXPECT_NE(refused->log().find("cannot connect"), std::string::npos) << refused->log();
}

}  // namespace
}  // namespace kvr
