// A cluster over TLS: a nats-server that accepts only TLS, `kvr mocker` workers, `kvr node` and
// `kvr route`, each verifying the server's certificate with --nats-tls-ca.
#include <optional>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tests/testing/kvr_binary.hpp"
#include "tests/testing/kvr_processes.hpp"
#include "tests/testing/loopback_http.hpp"
#include "tests/testing/nats_server.hpp"

namespace kvr {
namespace {

using namespace std::chrono_literals;
using testing::ChildProcess;
using testing::KvrProcesses;
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
  const KvrProcesses kvr{
      kvr::testing::kvr_binary(), server->url(), "tls", directory.path(), {"--nats-tls-ca", ca}};

  auto mocker = kvr.start_mocker({.workers = 2, .block_size = 16, .time_scale = "20"});
  ASSERT_TRUE(mocker);
  const std::uint16_t metrics_port = testing::free_port();
  auto node = kvr.start_node({.block_size = 16, .metrics_port = metrics_port});
  ASSERT_TRUE(node);

  // `kvr route` exits 0 once a worker was chosen; the workers need a moment to register.
  const std::vector<std::string> route{
      "--text", "a prompt long enough for two blocks of sixteen tokens", "--timeout-ms", "2000"};
  std::optional<ChildProcess> client;
  const bool routed = wait_until(
      [&] {
        client = kvr.start({"route"}, route, "route.log");
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
  const KvrProcesses unverified{kvr::testing::kvr_binary(), server->url(), "tls", directory.path()};
  auto refused = unverified.start({"route"}, {"--text", "hello"}, "refused.log");
  ASSERT_TRUE(refused);
  EXPECT_EQ(refused->wait(30s), 4);  // no decision: no connection
  EXPECT_NE(refused->log().find("cannot connect"), std::string::npos) << refused->log();
}

}  // namespace
}  // namespace kvr
