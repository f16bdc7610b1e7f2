// `kvr cluster status` against a real cluster: a nats-server with JetStream on loopback, one
// `kvr mocker` worker per model and two `kvr node --cluster` processes of different capacities.
// The command lists both members as they announced themselves and every partition with its live
// owner, the owner's epoch (its lease revision) and the owner placement wants (and so whether a
// handover is pending); after a node is
// killed it shows the survivor owning everything. Without JetStream, or with no cluster in the
// namespace, it exits 1 saying which; bad options exit 2.
#include <algorithm>
#include <chrono>
#include <map>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <signal.h>

#include "selection/cluster/placement.hpp"
#include "tests/testing/kvr_binary.hpp"
#include "tests/testing/kvr_cluster_test.hpp"
#include "tests/testing/loopback_http.hpp"
#include "tests/testing/process_run.hpp"

namespace kvr {
namespace {

using namespace std::chrono_literals;
using testing::ProcessRun;
using testing::wait_until;

constexpr std::string_view kNamespace = "ops";
constexpr int kModels = 3;

std::string model(int index) { return fmt::format("model-{}", index); }

// Runs `kvr cluster status <arguments>` against `nats_url` to its end (bounded).
class StatusRunner {
 public:
  StatusRunner(std::filesystem::path log_dir, std::string nats_url)
      : log_dir_(std::move(log_dir)), nats_url_(std::move(nats_url)) {}

  ProcessRun run(const std::vector<std::string>& arguments) {
    std::vector<std::string> argv{kvr::testing::kvr_binary(), "cluster", "status", "--nats",
                                  nats_url_};
    argv.insert(argv.end(), arguments.begin(), arguments.end());
    return testing::run_process(argv, log_dir_ / fmt::format("status-{}.log", runs_++), 20s);
  }

  // The JSON it printed for `ns`; null when it failed or printed none.
  nlohmann::json json(std::string_view ns) {
    const ProcessRun status = run({"--namespace", std::string{ns}, "--json"});
    if (status.exit_code != 0) return nullptr;
    return nlohmann::json::parse(status.output, nullptr, /*allow_exceptions=*/false);
  }

 private:
  std::filesystem::path log_dir_;
  std::string nats_url_;
  int runs_ = 0;
};

// The status lists `members` members and `partitions` partitions, each owned by a live member.
// (Whether each owner is already the desired one depends on handovers, which this test leaves
// to node_cluster_test.)
bool settled(const nlohmann::json& status, std::size_t members, std::size_t partitions) {
  if (!status.is_object()) return false;
  if (status["members"].size() != members || status["partitions"].size() != partitions) {
    return false;
  }
  return std::ranges::all_of(status["partitions"], [](const nlohmann::json& partition) {
    return partition["state"] == "owned";
  });
}

class ClusterStatusTest : public testing::KvrClusterTest {
 protected:
  ClusterStatusTest()
      : KvrClusterTest(kvr::testing::kvr_binary(), std::string{kNamespace}, {}, {"-js"}) {}

  void SetUp() override {
    KvrClusterTest::SetUp();
    if (HasFatalFailure()) return;
    status_.emplace(directory_.path(), server_->url());
    for (int m = 0; m < kModels; ++m) {
      auto mocker = kvr_->start_mocker({.workers = 1,
                                        .worker_id_base = static_cast<WorkerId>(100 + 10 * m),
                                        .block_size = 16,
                                        .num_gpu_blocks = 256,
                                        .extra = {"--model", model(m)}},
                                       fmt::format("mocker-{}.log", m));
      ASSERT_TRUE(mocker);
      mockers_.push_back(std::move(*mocker));
    }
    const std::vector<std::pair<std::string, std::string>> nodes{{"node-a", "1"}, {"node-b", "2"}};
    for (const auto& [id, capacity] : nodes) {
      const std::uint16_t port = testing::free_port();
      auto node = kvr_->start_node({.metrics_port = port,
                                    .extra = {"--cluster", "--node-id", id, "--node-capacity",
                                              capacity, "--cluster-lease-ttl-ms", "1500"}},
                                   id + ".log");
      ASSERT_TRUE(node);
      nodes_.push_back(std::move(*node));
      ASSERT_TRUE(testing::wait_until_healthy(port, 20s)) << nodes_.back().log();
    }
  }

  void TearDown() override {
    if (!HasFailure()) return;
    // Stopped first: a node's log reaches its file in full only when it exits.
    for (auto& node : nodes_) {
      (void)node.stop();
      std::cerr << "---- node log\n" << node.log();
    }
  }

  std::optional<StatusRunner> status_;
  std::vector<testing::ChildProcess> mockers_;
  std::vector<testing::ChildProcess> nodes_;
};

TEST_F(ClusterStatusTest, ListsTheMembersAndEachPartitionsOwnerEpochAndDesiredOwner) {
  nlohmann::json status;
  ASSERT_TRUE(wait_until(
      [&] {
        status = status_->json(kNamespace);
        return settled(status, 2, kModels);
      },
      20s))
      << status.dump(2);

  EXPECT_EQ(status["namespace"], kNamespace);
  std::map<std::string, nlohmann::json> members;
  for (const auto& member : status["members"]) members[member["node_id"]] = member;
  ASSERT_EQ(members.size(), 2U) << status.dump(2);
  ASSERT_TRUE(members.contains("node-a") && members.contains("node-b")) << status.dump(2);
  EXPECT_EQ(members["node-a"]["capacity"], 1.0);
  EXPECT_EQ(members["node-b"]["capacity"], 2.0);
  const auto now_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                          std::chrono::system_clock::now().time_since_epoch())
                          .count();
  for (const auto& [id, member] : members) {
    SCOPED_TRACE(id);
    // The middleman's address as the node bound it: loopback (the default) and a real port.
    const std::string address = member["address"];
    EXPECT_TRUE(address.starts_with("127.0.0.1:")) << address;
    EXPECT_GT(std::stoi(address.substr(address.find(':') + 1)), 0);
    EXPECT_NE(member["incarnation"].get<std::uint64_t>(), 0U);
    const auto started = member["started_at_unix_ms"].get<std::int64_t>();
    EXPECT_LE(started, now_ms);
    EXPECT_GT(started, now_ms - 120'000);
  }

  std::vector<std::string> partitions;
  for (const auto& partition : status["partitions"]) partitions.push_back(partition["partition"]);
  std::vector<std::string> expected;
  for (int m = 0; m < kModels; ++m) expected.push_back(model(m) + "/default");
  EXPECT_EQ(partitions, expected);
  // The desired owners are the placement every node computes over these members (capacity 1
  // and 2), and a partition elsewhere is a pending handover.
  const auto desired = cluster::assign(
      partitions, std::vector<cluster::PlacementMember>{{"node-a", 1.0}, {"node-b", 2.0}});
  int pending = 0;
  for (const auto& partition : status["partitions"]) {
    const std::string name = partition["partition"];
    SCOPED_TRACE(name);
    const std::string owner = partition["owner"];
    ASSERT_TRUE(members.contains(owner));
    // The lease names the owner's current process, and its epoch is a real revision.
    EXPECT_EQ(partition["owner_incarnation"], members[owner]["incarnation"]);
    EXPECT_GT(partition["epoch"].get<std::uint64_t>(), 0U);
    EXPECT_EQ(partition["handed_over"], false);
    ASSERT_TRUE(desired.contains(name));
    EXPECT_EQ(partition["desired_owner"], desired.at(name));
    const bool elsewhere = desired.at(name) != owner;
    EXPECT_EQ(partition["handover_pending"], elsewhere);
    pending += elsewhere ? 1 : 0;
  }
  EXPECT_EQ(status["summary"]["owned"], kModels);
  EXPECT_EQ(status["summary"]["handovers_pending"], pending);

  // The table says the same: the summary line, and a row per partition naming its state and a
  // member as its owner. (A handover may run between two reads, so the table is read until it
  // shows every partition owned, and checked on its own.)
  const std::string summary =
      fmt::format("cluster '{}': 2 members; {} partitions: {} owned", kNamespace, kModels, kModels);
  ProcessRun text;
  ASSERT_TRUE(wait_until(
      [&] {
        text = status_->run({"--namespace", std::string{kNamespace}});
        return text.exit_code == 0 && text.output.find(summary) != std::string::npos;
      },
      20s))
      << text.output;
  for (const std::string& partition : partitions) {
    const bool listed = text.output.find(partition + "  owned  node-a") != std::string::npos ||
                        text.output.find(partition + "  owned  node-b") != std::string::npos;
    EXPECT_TRUE(listed) << partition << "\n" << text.output;
  }
}

TEST_F(ClusterStatusTest, AfterANodeIsKilledTheSurvivorOwnsEveryPartition) {
  nlohmann::json status;
  ASSERT_TRUE(wait_until(
      [&] {
        status = status_->json(kNamespace);
        return settled(status, 2, kModels);
      },
      20s))
      << status.dump(2);
  nodes_[1].signal(SIGKILL);
  (void)nodes_[1].stop();
  // Its member record and leases age out with the 1.5 s TTL; node-a takes every partition.
  ASSERT_TRUE(wait_until(
      [&] {
        status = status_->json(kNamespace);
        return settled(status, 1, kModels);
      },
      15s))
      << status.dump(2);
  EXPECT_EQ(status["members"][0]["node_id"], "node-a");
  for (const auto& partition : status["partitions"]) EXPECT_EQ(partition["owner"], "node-a");
}

// A nats-server with JetStream but no node of the namespace.
class ClusterStatusWithoutNodesTest : public testing::KvrClusterTest {
 protected:
  ClusterStatusWithoutNodesTest()
      : KvrClusterTest(kvr::testing::kvr_binary(), std::string{kNamespace}, {}, {"-js"}) {}
};

TEST_F(ClusterStatusWithoutNodesTest, ExitsOneWhenTheNamespaceHasNoCluster) {
  StatusRunner status{directory_.path(), server_->url()};
  const ProcessRun run = status.run({"--namespace", "nobody"});
  EXPECT_EQ(run.exit_code, 1) << run.output;
  EXPECT_NE(run.output.find("no router cluster in namespace 'nobody'"), std::string::npos)
      << run.output;
  EXPECT_NE(run.output.find("kvr_nobody_members"), std::string::npos) << run.output;
  // It only reads: the buckets are still missing afterwards.
  const ProcessRun again = status.run({"--namespace", "nobody"});
  EXPECT_EQ(again.exit_code, 1) << again.output;
  EXPECT_NE(again.output.find("does not exist"), std::string::npos) << again.output;
}

// A nats-server started without -js.
class ClusterStatusWithoutJetStreamTest : public testing::KvrClusterTest {
 protected:
  ClusterStatusWithoutJetStreamTest()
      : KvrClusterTest(kvr::testing::kvr_binary(), std::string{kNamespace}) {}
};

TEST_F(ClusterStatusWithoutJetStreamTest, ExitsOneSayingJetStreamIsNotEnabled) {
  StatusRunner status{directory_.path(), server_->url()};
  const ProcessRun run = status.run({"--namespace", std::string{kNamespace}});
  EXPECT_EQ(run.exit_code, 1) << run.output;
  EXPECT_NE(run.output.find("JetStream is not enabled"), std::string::npos) << run.output;
  EXPECT_NE(run.output.find("-js"), std::string::npos) << run.output;
}

TEST(ClusterStatusUsageTest, BadOptionsAndAMissingSubcommandExitTwo) {
  testing::TemporaryDirectory directory;
  int runs = 0;
  for (const std::vector<std::string>& argv :
       {std::vector<std::string>{kvr::testing::kvr_binary(), "cluster"},
        std::vector<std::string>{kvr::testing::kvr_binary(), "cluster", "status", "--timeout-ms",
                                 "0"},
        std::vector<std::string>{kvr::testing::kvr_binary(), "cluster", "status", "--namespace",
                                 "a.b"},
        std::vector<std::string>{kvr::testing::kvr_binary(), "cluster", "status",
                                 "--no-such-flag"}}) {
    const ProcessRun run =
        testing::run_process(argv, directory.path() / fmt::format("usage-{}.log", runs++), 10s);
    EXPECT_EQ(run.exit_code, 2) << fmt::format("{}", fmt::join(argv, " ")) << "\n" << run.output;
  }
}

}  // namespace
}  // namespace kvr
