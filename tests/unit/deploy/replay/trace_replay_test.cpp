// Trace replay through the selector state and simulated engines: equal inputs and seed give
// byte-equal reports, cache-aware routing beats round-robin on conversations, the infinite-cache
// ceiling bounds it, every request completes, and router-policy YAML instances can be replayed.
#include "deploy/replay/trace_replay.hpp"

#include <random>

#include <gtest/gtest.h>

#include "selection/config/router_policy_config.hpp"
#include "selection/policies/builtin_policies.hpp"

namespace kvr::replay {
namespace {

using simulation::TraceRequest;

// `conversations` conversations of `turns` turns. Every prompt starts with one shared system
// block (hash id 0); each turn repeats the conversation so far and adds two 512-token blocks, the
// last one partial. Turn t of conversation c arrives at t * turn_gap_ms + c * 150 ms, so turns of
// one conversation are far apart and the fleet is never saturated.
std::vector<TraceRequest> conversation_trace(std::uint32_t conversations, std::uint32_t turns,
                                             std::uint64_t turn_gap_ms = 3000) {
  std::vector<TraceRequest> trace;
  for (std::uint32_t turn = 0; turn < turns; ++turn) {
    for (std::uint32_t conversation = 0; conversation < conversations; ++conversation) {
      TraceRequest request;
      request.timestamp_ms = turn * turn_gap_ms + conversation * 150;
      request.hash_ids.push_back(0);
      for (std::uint32_t block = 0; block < 2 * (turn + 1); ++block) {
        request.hash_ids.push_back(1 + conversation * 1000 + block);
      }
      request.input_length = static_cast<std::uint32_t>(request.hash_ids.size()) *
                                 simulation::kMooncakeTraceBlockSize -
                             100;
      request.output_length = 32;
      trace.push_back(std::move(request));
    }
  }
  return trace;
}

// A busier trace with random prefix sharing, drawn from a fixed seed.
std::vector<TraceRequest> random_trace(std::size_t requests, std::uint32_t seed) {
  std::mt19937 random{seed};
  std::uniform_int_distribution<std::uint32_t> prefix_of{0, 7};
  std::uniform_int_distribution<std::uint32_t> extra_blocks{1, 4};
  std::uniform_int_distribution<std::uint32_t> gap_ms{0, 60};
  std::uniform_int_distribution<std::uint32_t> output{1, 64};
  std::vector<TraceRequest> trace;
  std::uint64_t now = 0;
  for (std::size_t i = 0; i < requests; ++i) {
    TraceRequest request;
    now += gap_ms(random);
    request.timestamp_ms = now;
    const std::uint32_t prefix = prefix_of(random);
    for (std::uint32_t block = 0; block < 3; ++block)
      request.hash_ids.push_back(prefix * 10 + block);
    const std::uint32_t extra = extra_blocks(random);
    for (std::uint32_t block = 0; block < extra; ++block) {
      request.hash_ids.push_back(100'000 + static_cast<std::uint32_t>(i) * 10 + block);
    }
    request.input_length =
        static_cast<std::uint32_t>(request.hash_ids.size()) * simulation::kMooncakeTraceBlockSize;
    request.output_length = output(random);
    trace.push_back(std::move(request));
  }
  return trace;
}

class TraceReplayTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto registered = selection::register_builtin_policies(registry_);
    ASSERT_TRUE(registered) << registered.error().message();
  }

  plugins::RouterPlugins plugins_for(const std::string& policy) {
    selection::RouterPolicyConfig config;
    config.worker_selection[static_cast<std::size_t>(WorkerType::Aggregated)] = policy;
    auto plugins = registry_.resolve_plugins(config);
    EXPECT_TRUE(plugins) << plugins.error().message();
    return std::move(*plugins);
  }

  static ReplayOptions options(std::size_t workers, std::uint64_t seed = 0) {
    ReplayOptions options;
    options.workers = workers;
    options.seed = seed;
    return options;
  }

  // The whole report of one replay, as `kvr replay --json` writes it.
  std::string replay_json(const TraceReplay& replay, const std::vector<std::string>& policies) {
    simulation::ReplayReport report;
    report.trace = replay.trace_name();
    report.requests = replay.size();
    report.workers = replay.options().workers;
    report.seed = replay.options().seed;
    report.block_size = replay.options().engine.block_size;
    report.infinite_cache_hit_rate = replay.infinite_cache_hit_rate();
    for (std::size_t i = 0; i < policies.size(); ++i) {
      report.policies.push_back(replay.run(policies[i], plugins_for(policies[i]), i));
    }
    return simulation::to_json(report);
  }

  plugins::RouterPluginRegistry registry_;
};

TEST_F(TraceReplayTest, SameInputsAndSeedGiveByteIdenticalReports) {
  ReplayOptions replay_options = options(4, 7);
  replay_options.router.temperature = 0.5;  // kv-cost samples: its random choices must repeat
  const std::vector<std::string> policies{"kv-cost", "random", "power-of-two"};
  const TraceReplay replay{"random", random_trace(120, 3), replay_options};
  const std::string first = replay_json(replay, policies);
  const std::string second = replay_json(replay, policies);
  EXPECT_EQ(first, second);
  // A replay built afresh from the same inputs agrees too.
  const TraceReplay again{"random", random_trace(120, 3), replay_options};
  EXPECT_EQ(replay_json(again, policies), first);
}

TEST_F(TraceReplayTest, SeedDrivesTheRandomPolicy) {
  const TraceReplay seeded_one{"random", random_trace(120, 3), options(4, 1)};
  const TraceReplay seeded_two{"random", random_trace(120, 3), options(4, 2)};
  EXPECT_NE(replay_json(seeded_one, {"random"}), replay_json(seeded_two, {"random"}));
}

TEST_F(TraceReplayTest, KvCostBeatsRoundRobinOnConversationsAndStaysUnderTheCeiling) {
  // Five conversations on four workers: round-robin moves every conversation to another worker
  // at each turn, so only the system block is reused; kv-cost follows each conversation.
  const TraceReplay replay{"conversations", conversation_trace(5, 8), options(4)};
  const auto kv_cost = replay.run("kv-cost", plugins_for("kv-cost"));
  const auto round_robin = replay.run("round-robin", plugins_for("round-robin"));
  const double ceiling = replay.infinite_cache_hit_rate();
  EXPECT_EQ(kv_cost.completed, replay.size());
  EXPECT_EQ(round_robin.completed, replay.size());
  EXPECT_GT(kv_cost.hit_rate, round_robin.hit_rate + 0.3)
      << "kv-cost " << kv_cost.hit_rate << ", round-robin " << round_robin.hit_rate;
  EXPECT_GT(round_robin.hit_rate, 0.0) << "the shared system block is reused";
  EXPECT_GE(ceiling, kv_cost.hit_rate);
  EXPECT_GT(kv_cost.hit_rate, 0.9 * ceiling)
      << "an unsaturated fleet lets kv-cost reach nearly every reusable prefix";
}

TEST_F(TraceReplayTest, EveryRequestCompletesUnderEveryBuiltinPolicy) {
  const TraceReplay replay{"random", random_trace(80, 11), options(3, 5)};
  for (const std::string_view type : selection::builtin_policy_types()) {
    const std::string policy{type};
    const auto report = replay.run(policy, plugins_for(policy));
    EXPECT_EQ(report.completed, replay.size()) << policy;
    EXPECT_EQ(report.failed, 0U) << policy;
    EXPECT_TRUE(report.failures.empty()) << policy << ": " << report.failures.front().first;
  }
}

TEST_F(TraceReplayTest, ReportFieldsDescribeTheRun) {
  const TraceReplay replay{"conversations", conversation_trace(5, 4), options(4)};
  const auto report = replay.run("kv-cost", plugins_for("kv-cost"));
  EXPECT_EQ(report.policy, "kv-cost");
  EXPECT_EQ(report.requests, 20U);
  EXPECT_EQ(report.completed, 20U);
  EXPECT_EQ(report.failed, 0U);
  EXPECT_TRUE(report.failures.empty());
  EXPECT_GE(report.load_imbalance, 1.0);
  EXPECT_GT(report.hit_rate, 0.0);
  EXPECT_LE(report.hit_rate, 1.0);
  EXPECT_GT(report.makespan_s, 0.0);
  EXPECT_GT(report.output_tokens_per_s, 0.0);
  EXPECT_GT(report.utilization, 0.0);
  EXPECT_LE(report.utilization, 1.0);
  EXPECT_GT(report.ttft_ms.p50, 0.0);
  EXPECT_LE(report.ttft_ms.p50, report.ttft_ms.p90);
  EXPECT_LE(report.ttft_ms.p90, report.ttft_ms.p99);
  EXPECT_LE(report.ttft_ms.p99, report.ttft_ms.max);
  EXPECT_LE(report.ttft_ms.max, report.e2e_ms.max);
}

TEST_F(TraceReplayTest, ProgressIsReportedForEveryRoutedRequest) {
  std::vector<std::pair<std::size_t, std::size_t>> progress;
  ReplayOptions replay_options = options(2);
  replay_options.on_progress = [&progress](std::size_t policy, std::size_t done) {
    progress.emplace_back(policy, done);
  };
  const TraceReplay replay{"conversations", conversation_trace(3, 2), replay_options};
  (void)replay.run("round-robin", plugins_for("round-robin"), 3);
  ASSERT_EQ(progress.size(), 6U);
  for (std::size_t i = 0; i < progress.size(); ++i) {
    EXPECT_EQ(progress[i], (std::pair<std::size_t, std::size_t>{3, i + 1}));
  }
}

TEST_F(TraceReplayTest, RequestTheEngineCannotHoldIsCountedAsFailed) {
  ReplayOptions replay_options = options(2);
  replay_options.engine.num_gpu_blocks = 64;  // 4096 tokens
  auto trace = conversation_trace(2, 1);      // 1436-token prompts: they fit
  TraceRequest huge;
  huge.timestamp_ms = trace.back().timestamp_ms + 10;
  huge.hash_ids = {1, 2, 3, 4, 5, 6, 7, 8, 9};
  huge.input_length = 9 * simulation::kMooncakeTraceBlockSize;
  huge.output_length = 4;
  trace.push_back(huge);
  const TraceReplay replay{"too-big", std::move(trace), replay_options};
  const auto report = replay.run("kv-cost", plugins_for("kv-cost"));
  EXPECT_EQ(report.completed, 2U);
  EXPECT_EQ(report.failed, 1U);
  ASSERT_EQ(report.failures.size(), 1U);
  EXPECT_NE(report.failures.front().first.find("exceeds_kv_capacity"), std::string::npos)
      << report.failures.front().first;
  EXPECT_EQ(report.failures.front().second, 1U);
}

TEST_F(TraceReplayTest, RouterPolicyYamlInstanceCanBeReplayed) {
  // A kv-cost instance that gives no credit for cached blocks: only load decides, so it loses
  // the conversations' prefixes that the default kv-cost keeps.
  constexpr std::string_view kYaml = R"(
worker_selection:
  aggregated: load-only
  instances:
    - name: load-only
      type: kv-cost
      parameters:
        device_overlap_credit: 0.0
        host_overlap_credit: 0.0
        disk_overlap_credit: 0.0
        seed: 9
)";
  auto config = selection::parse_router_policy_config(kYaml, "replay-test.yaml");
  ASSERT_TRUE(config) << config.error();
  auto plugins = registry_.resolve_plugins(*config);
  ASSERT_TRUE(plugins) << plugins.error().message();
  EXPECT_EQ(plugins->selection_for(WorkerType::Aggregated).instance_name, "load-only");
  EXPECT_EQ(plugins->selection_for(WorkerType::Aggregated).type, "kv-cost");

  const TraceReplay replay{"conversations", conversation_trace(5, 8), options(4)};
  const auto load_only = replay.run("load-only", *plugins);
  const auto kv_cost = replay.run("kv-cost", plugins_for("kv-cost"));
  EXPECT_EQ(load_only.policy, "load-only");
  EXPECT_EQ(load_only.completed, replay.size());
  EXPECT_EQ(load_only.failed, 0U);
  EXPECT_LT(load_only.hit_rate + 0.2, kv_cost.hit_rate)
      << "load-only " << load_only.hit_rate << ", kv-cost " << kv_cost.hit_rate;
}

TEST_F(TraceReplayTest, InfiniteCacheHitRateCountsEveryRepeatedPrefix) {
  // Two identical 1024-token prompts at a 64-token block size: the second reuses all but its
  // last block (one token is always computed), so 960 of 2048 prompt tokens are cached.
  TraceRequest request;
  request.hash_ids = {5, 6};
  request.input_length = 1024;
  request.output_length = 1;
  TraceRequest repeat = request;
  repeat.timestamp_ms = 1;
  const TraceReplay replay{"repeat", {request, repeat}, options(1)};
  EXPECT_DOUBLE_EQ(replay.infinite_cache_hit_rate(), 960.0 / 2048.0);
  EXPECT_DOUBLE_EQ(TraceReplay("empty", {}, options(1)).infinite_cache_hit_rate(), 0.0);
}

}  // namespace
}  // namespace kvr::replay
