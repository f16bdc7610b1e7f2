// The commands a new user types first, each with its defaults: `kvr mocker --nats URL`,
// `kvr node --nats URL`, then `kvr route --nats URL --text hello` is answered by a worker. The
// mocker's default block size (64) is not the node's business: a partition learns it from its
// first worker. `kvr route --query-only` answers the same question without booking.
#include <gtest/gtest.h>

#include "tests/testing/kvr_binary.hpp"
#include "tests/testing/nats_server.hpp"
#include "tests/testing/process_run.hpp"

namespace kvr {
namespace {

using namespace std::chrono_literals;
using testing::ChildProcess;
using testing::NatsServer;
using testing::ProcessRun;
using testing::run_process;
using testing::TemporaryDirectory;
using testing::wait_until;

TEST(CliDefaultsTest, MockerNodeAndRouteWithTheirDefaultsRouteToAWorker) {
  TemporaryDirectory directory;
  std::string error;
  auto server = NatsServer::start(&error);
  ASSERT_TRUE(server) << error;

  auto mocker = ChildProcess::start({kvr::testing::kvr_binary(), "mocker", "--nats", server->url()},
                                    directory.path() / "mocker.log");
  ASSERT_TRUE(mocker);
  auto node = ChildProcess::start({kvr::testing::kvr_binary(), "node", "--nats", server->url()},
                                  directory.path() / "node.log");
  ASSERT_TRUE(node);

  // The workers and the node come up in any order; `kvr route` exits 0 once a worker was chosen.
  ProcessRun route;
  const bool routed = wait_until(
      [&] {
        route = run_process(
            {kvr::testing::kvr_binary(), "route", "--nats", server->url(), "--text", "hello"},
            directory.path() / "route.log", 30s);
        return route.exit_code == 0 || !node->running() || !mocker->running();
      },
      60s);
  ASSERT_TRUE(routed && route.exit_code == 0) << "kvr route:\n"
                                              << route.output << "\n---- node log\n"
                                              << node->log() << "\n---- mocker log\n"
                                              << mocker->log();
  EXPECT_NE(route.output.find(": worker "), std::string::npos) << route.output;

  // `--query-only` asks what the request would get, with its overlap and costs, and books nothing.
  const ProcessRun query = run_process({kvr::testing::kvr_binary(), "route", "--nats",
                                        server->url(), "--text", "hello", "--query-only"},
                                       directory.path() / "query.log", 30s);
  ASSERT_EQ(query.exit_code, 0) << query.output;
  EXPECT_NE(query.output.find(": worker "), std::string::npos) << query.output;
  EXPECT_NE(query.output.find("no booking (query only)"), std::string::npos) << query.output;
  EXPECT_NE(query.output.find("costs: "), std::string::npos) << query.output;
}

}  // namespace
}  // namespace kvr
