// deploy/cluster/local_cluster.sh as a user runs it, in its --check mode: it starts nats-server
// with JetStream, three `kvr node --cluster` processes and a mocker fleet over four models, waits
// until `kvr cluster status` shows every partition owned, prints that status and stops every
// process it started.
#include <cerrno>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <signal.h>

#include "tests/testing/child_process.hpp"
#include "tests/testing/kvr_binary.hpp"
#include "tests/testing/loopback_http.hpp"
#include "tests/testing/process_run.hpp"

namespace kvr {
namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;

// The pids the script wrote, one a line.
std::vector<pid_t> pids_in(const fs::path& file) {
  std::vector<pid_t> pids;
  std::ifstream in{file};
  for (long pid = 0; in >> pid;) pids.push_back(static_cast<pid_t>(pid));
  return pids;
}

bool alive(pid_t pid) { return ::kill(pid, 0) == 0 || errno != ESRCH; }

TEST(LocalClusterTest, CheckModeBringsUpThreeNodesOwningEveryPartitionAndStopsEverything) {
  testing::TemporaryDirectory directory;
  const fs::path run_dir = directory.path() / "run";
  const std::string ports =
      fmt::format("{},{},{}", testing::free_port(), testing::free_port(), testing::free_port());
  const testing::ProcessRun run =
      testing::run_process({"bash", fs::path{KVR_SOURCE_DIR} / "deploy/cluster/local_cluster.sh",
                            "--kvr", kvr::testing::kvr_binary(), "--dir", run_dir.string(),
                            "--namespace", "local-test", "--models", "4", "--metrics-ports", ports,
                            "--lease-ttl-ms", "1500", "--timeout", "40", "--check"},
                           directory.path() / "local_cluster.log", 60s);
  const std::vector<pid_t> pids = pids_in(run_dir / "pids");
  // Whatever happened, nothing the script started outlives the test.
  std::vector<pid_t> survivors;
  for (pid_t pid : pids) {
    if (pid > 1 && alive(pid)) {
      survivors.push_back(pid);
      ::kill(pid, SIGKILL);
    }
  }

  ASSERT_EQ(run.exit_code, 0) << run.output;
  EXPECT_NE(run.output.find("cluster 'local-test': 3 members; 4 partitions: 4 owned,"),
            std::string::npos)
      << run.output;
  for (int m = 0; m < 4; ++m) {
    EXPECT_NE(run.output.find(fmt::format("model-{}/default  owned  node-", m)), std::string::npos)
        << run.output;
  }
  EXPECT_NE(run.output.find("check passed"), std::string::npos) << run.output;
  // nats-server, four mockers and three nodes, each logging where the script said.
  EXPECT_EQ(pids.size(), 8U);
  EXPECT_NE(run.output.find((run_dir / "logs").string()), std::string::npos) << run.output;
  for (const char* log : {"nats-server.log", "node-0.log", "node-1.log", "node-2.log",
                          "mocker-0.log", "mocker-3.log"}) {
    EXPECT_TRUE(fs::exists(run_dir / "logs" / log)) << log;
  }
  EXPECT_TRUE(survivors.empty()) << survivors.size() << " processes outlived the script";
}

}  // namespace
}  // namespace kvr
