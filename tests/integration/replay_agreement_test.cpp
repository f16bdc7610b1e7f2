// `kvr replay` and a real node decide alike: one small trace goes through the partition core in
// replay (simulated engines, logical clock) and through a real `kvr node` with a `kvr mocker`
// fleet (driven by `kvr replay-live`), with the same policy and seed, and every request must go to
// the same worker in both. The trace spaces its requests so that the fleet is idle and its load
// reported before each arrival: then the decision depends only on the KV index, the load and the
// policy's random draws, all of which the two runs share.
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include <gtest/gtest.h>

#include "tests/testing/child_process.hpp"
#include "tests/testing/kvr_binary.hpp"
#include "tests/testing/kvr_processes.hpp"
#include "tests/testing/nats_server.hpp"
#include "tests/testing/process_run.hpp"

namespace kvr {
namespace {

using namespace std::chrono_literals;
using testing::ChildProcess;
using testing::KvrProcesses;
using testing::NatsServer;
using testing::read_file;
using testing::TemporaryDirectory;

constexpr int kWorkers = 4;
constexpr int kConversations = 5;
constexpr int kTurns = 4;
constexpr int kSpacingMs = 400;

// Turn t of conversation c: the conversation's first t + 2 blocks of 512 tokens (no block shared
// with another conversation), arriving turn by turn, one request every kSpacingMs.
void write_trace(const std::filesystem::path& path) {
  std::ofstream trace{path};
  int index = 0;
  for (int turn = 0; turn < kTurns; ++turn) {
    for (int conversation = 0; conversation < kConversations; ++conversation) {
      const int blocks = turn + 2;
      trace << "{\"timestamp\": " << index * kSpacingMs
            << ", \"input_length\": " << blocks * 512 - 100 << ", \"output_length\": 8"
            << ", \"hash_ids\": [";
      for (int block = 0; block < blocks; ++block) {
        trace << (block == 0 ? "" : ", ") << conversation * 1000 + block;
      }
      trace << "]}\n";
      ++index;
    }
  }
}

// trace index -> worker id, from a --decisions file.
std::map<std::size_t, std::uint64_t> read_decisions(const std::filesystem::path& path) {
  std::map<std::size_t, std::uint64_t> decisions;
  std::istringstream lines{read_file(path)};
  std::string label;
  std::size_t index = 0;
  std::uint64_t worker = 0;
  std::uint32_t rank = 0;
  while (lines >> label >> index >> worker >> rank) decisions[index] = worker;
  return decisions;
}

class ReplayAgreementTest : public ::testing::Test {
 protected:
  void SetUp() override {
    write_trace(trace_path_);
    std::ofstream yaml{policy_path_};
    // A fixed seed: both runs draw the same tie-breaks.
    yaml << "worker_selection:\n"
            "  aggregated: agree\n"
            "  instances:\n"
            "    - {name: agree, type: kv-cost, parameters: {seed: 7}}\n";
  }

  TemporaryDirectory directory_;
  std::filesystem::path trace_path_ = directory_.path() / "trace.jsonl";
  std::filesystem::path policy_path_ = directory_.path() / "policy.yaml";
};

TEST_F(ReplayAgreementTest, ANodeAndAReplayRouteEveryRequestOfAnIdleFleetToTheSameWorker) {
  const auto replayed = directory_.path() / "replay.tsv";
  const auto replay = testing::run_process(
      {kvr::testing::kvr_binary(), "replay", "--quiet", "--trace", trace_path_.string(),
       "--workers", std::to_string(kWorkers), "--block-size", "64", "--num-gpu-blocks", "4096",
       "--router-policy-config", policy_path_.string(), "--policies", "agree", "--decisions",
       replayed.string()},
      directory_.path() / "replay.log", 120s);
  ASSERT_EQ(replay.exit_code, 0) << replay.output;

  std::string error;
  auto server = NatsServer::start(&error);
  ASSERT_TRUE(server) << error;
  KvrProcesses kvr{kvr::testing::kvr_binary(), server->url(), "agree", directory_.path()};
  auto mocker = kvr.start_mocker({.workers = kWorkers,
                                  .worker_id_base = 1,
                                  .block_size = 64,
                                  .num_gpu_blocks = 4096,
                                  .time_scale = "20",
                                  .load_interval_ms = 20});
  ASSERT_TRUE(mocker);
  auto node = kvr.start_node(
      {.block_size = 64, .extra = {"--router-policy-config", policy_path_.string()}});
  ASSERT_TRUE(node);
  const auto routed = directory_.path() / "live.tsv";
  auto live = kvr.start({"replay-live"},
                        {"--quiet", "--trace", trace_path_.string(), "--timeout", "30",
                         "--decisions", routed.string()},
                        "live.log");
  ASSERT_TRUE(live);
  const auto status = live->wait(120s);
  ASSERT_EQ(status, 0) << read_file(kvr.log_path("live.log")) << "---- node\n" << node->log();

  const auto expected = read_decisions(replayed);
  const auto actual = read_decisions(routed);
  ASSERT_EQ(expected.size(), static_cast<std::size_t>(kConversations * kTurns))
      << read_file(replayed);
  ASSERT_EQ(actual.size(), expected.size()) << read_file(routed);
  std::set<std::uint64_t> workers_used;
  for (const auto& [index, worker] : expected) {
    EXPECT_EQ(actual.at(index), worker) << "request " << index << " of the trace";
    workers_used.insert(worker);
  }
  // Not a degenerate trace: conversations spread over the fleet, each kept on its worker.
  EXPECT_GT(workers_used.size(), 1U);
  for (int turn = 1; turn < kTurns; ++turn) {
    for (int conversation = 0; conversation < kConversations; ++conversation) {
      EXPECT_EQ(expected.at(static_cast<std::size_t>(turn * kConversations + conversation)),
                expected.at(static_cast<std::size_t>(conversation)))
          << "conversation " << conversation << " left its worker at turn " << turn;
    }
  }
}

}  // namespace
}  // namespace kvr
