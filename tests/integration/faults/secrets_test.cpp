// No secret in any log: a nats-server that wants a password, and a `kvr node`, a `kvr mocker`
// and `kvr route` given it inside the NATS URL (as a deployment's environment often does). They
// serve as usual, and the password appears in no line any of them writes: not in the node's
// startup line, and not in the connect error of a URL whose server is not there.
#include <csignal>
#include <string>

#include <gtest/gtest.h>

#include "tests/testing/child_process.hpp"
#include "tests/testing/kvr_binary.hpp"
#include "tests/testing/kvr_processes.hpp"
#include "tests/testing/loopback_http.hpp"
#include "tests/testing/nats_server.hpp"
#include "tests/testing/process_run.hpp"

namespace kvr {
namespace {

using namespace std::chrono_literals;
using testing::free_port;
using testing::wait_until;

constexpr std::string_view kNamespace = "secrets";
constexpr std::string_view kPassword = "Pa55-w0rd-never-logged";

std::string url_with_password(std::uint16_t port) {
  return "nats://kvr:" + std::string{kPassword} + "@127.0.0.1:" + std::to_string(port);
}

TEST(NoSecretsInLogsTest, APasswordInTheNatsUrlIsNeverLogged) {
  std::string error;
  auto server = testing::NatsServer::start(&error, std::nullopt,
                                           {"--user", "kvr", "--pass", std::string{kPassword}});
  ASSERT_TRUE(server) << error;
  testing::TemporaryDirectory directory;
  const testing::KvrProcesses kvr{kvr::testing::kvr_binary(), url_with_password(server->port()),
                                  std::string{kNamespace}, directory.path()};
  const std::uint16_t metrics_port = free_port();
  auto node = kvr.start_node({.block_size = 16, .metrics_port = metrics_port});
  ASSERT_TRUE(node);
  ASSERT_TRUE(testing::wait_until_healthy(metrics_port, 20s)) << node->log();
  auto mocker = kvr.start_mocker({.workers = 1, .block_size = 16});
  ASSERT_TRUE(mocker);

  // Authenticated: the node routes to the mocker's worker.
  const auto route = [&](const std::string& url, const std::string& log) {
    return testing::run_process(
        {kvr::testing::kvr_binary(), "route", "--nats", url, "--namespace", std::string{kNamespace},
         "--model", "mock-model", "--text", "hello", "--timeout-ms", "1000"},
        directory.path() / log, 30s);
  };
  int attempt = 0;
  ASSERT_TRUE(wait_until(
      [&] {
        return route(url_with_password(server->port()),
                     "route-" + std::to_string(++attempt) + ".log")
                   .exit_code == 0;
      },
      20s))
      << node->log() << mocker->log();
  // No server there: the connect error names the URL, masked.
  const testing::ProcessRun unreachable = route(url_with_password(free_port()), "unreachable.log");
  EXPECT_EQ(unreachable.exit_code, 4) << unreachable.output;
  EXPECT_NE(unreachable.output.find("kvr:***@127.0.0.1"), std::string::npos) << unreachable.output;

  node->signal(SIGTERM);
  mocker->signal(SIGTERM);
  EXPECT_EQ(node->wait(20s), 0) << node->log();
  EXPECT_EQ(mocker->wait(20s), 0) << mocker->log();
  EXPECT_NE(node->log().find("kvr:***@127.0.0.1"), std::string::npos)
      << "the node's startup line names its NATS server, masked:\n"
      << node->log();
  int logs = 0;
  for (const auto& entry : std::filesystem::directory_iterator(directory.path())) {
    const std::string text = testing::read_file(entry.path());
    EXPECT_EQ(text.find(kPassword), std::string::npos) << entry.path() << ":\n" << text;
    ++logs;
  }
  EXPECT_GE(logs, 4) << "node, mocker and at least two routes";
}

}  // namespace
}  // namespace kvr
