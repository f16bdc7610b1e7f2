// Trace replay through the selector state and simulated engines: equal inputs and seed give
// byte-equal reports, cache-aware routing beats round-robin on conversations, the infinite-cache
// ceiling bounds it, every request completes, and router-policy YAML instances can be replayed.
// Admission runs in replay: a classifier caps or refuses requests (refusals are counted by code,
// per tenant too), the policy-class queue holds requests while the fleet is busy and their TTFT
// counts the wait, and tenant classes with deficit round robin protect a light tenant.
#include "deploy/replay/trace_replay.hpp"

#include <algorithm>
#include <map>
#include <random>
#include <set>

#include <fmt/format.h>
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

  // The plugins of a router-policy YAML (request classifier, policy classes, policies).
  plugins::RouterPlugins plugins_from_yaml(std::string_view yaml) {
    auto config = selection::parse_router_policy_config(yaml, "replay-test.yaml");
    EXPECT_TRUE(config) << config.error();
    if (!config) return plugins_for("kv-cost");
    auto plugins = registry_.resolve_plugins(*config);
    EXPECT_TRUE(plugins) << plugins.error().message();
    return plugins ? std::move(*plugins) : plugins_for("kv-cost");
  }

  // One policy's report as JSON, tenants and rejections included.
  static std::string report_json(const TraceReplay& replay, const plugins::RouterPlugins& plugins) {
    simulation::ReplayReport report;
    report.trace = replay.trace_name();
    report.requests = replay.size();
    report.workers = replay.options().workers;
    report.seed = replay.options().seed;
    report.policies.push_back(replay.run("admission", plugins));
    return simulation::to_json(report);
  }

  plugins::RouterPluginRegistry registry_;
};

// The most requests at the workers at once: each holds a worker from its dispatch to its
// completion (a request ending at the time another is dispatched is no longer counted).
std::size_t most_at_the_workers(const std::vector<simulation::ReplayRequestOutcome>& outcomes) {
  std::vector<std::pair<double, int>> changes;
  for (const auto& outcome : outcomes) {
    changes.emplace_back(outcome.dispatched_ms, +1);
    changes.emplace_back(outcome.stats.completion_ms, -1);
  }
  std::ranges::sort(changes);  // at equal times -1 sorts before +1
  std::size_t current = 0;
  std::size_t most = 0;
  for (const auto& [time, change] : changes) {
    current = change > 0 ? current + 1 : current - 1;
    most = std::max(most, current);
  }
  return most;
}

// Requests of `blocks` blocks of their own (no shared prefix), all arriving within a few ms.
std::vector<TraceRequest> burst_trace(std::size_t requests, std::uint32_t blocks) {
  std::vector<TraceRequest> trace;
  for (std::size_t i = 0; i < requests; ++i) {
    TraceRequest request;
    request.timestamp_ms = i;
    for (std::uint32_t block = 0; block < blocks; ++block) {
      request.hash_ids.push_back(static_cast<std::uint32_t>(i) * 100 + block);
    }
    request.input_length = blocks * simulation::kMooncakeTraceBlockSize;
    request.output_length = 8;
    trace.push_back(std::move(request));
  }
  return trace;
}

std::size_t count_of(const simulation::NamedCounts& counts, std::string_view name) {
  std::size_t sum = 0;
  for (const auto& [key, count] : counts) {
    if (key == name) sum += count;
  }
  return sum;
}

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

TEST_F(TraceReplayTest, TheCapacityBoundCeilingIsTheInfiniteCachesUnlessTheFleetIsSmaller) {
  const TraceReplay roomy{"conversations", conversation_trace(5, 8), options(4)};
  EXPECT_EQ(roomy.fleet_kv_blocks(), 4U * roomy.options().engine.num_gpu_blocks);
  EXPECT_DOUBLE_EQ(roomy.capacity_bound_hit_rate(), roomy.infinite_cache_hit_rate());
  // 200 blocks hold the five conversations' early turns, but from the third turn on the other
  // four evict a conversation's blocks before its next turn: far below the infinite cache.
  ReplayOptions small = options(1);
  small.engine.num_gpu_blocks = 200;
  const TraceReplay tight{"conversations", conversation_trace(5, 8), small};
  EXPECT_EQ(tight.fleet_kv_blocks(), 200U);
  EXPECT_GT(tight.capacity_bound_hit_rate(), 0.0);
  EXPECT_LT(tight.capacity_bound_hit_rate() + 0.2, tight.infinite_cache_hit_rate());
}

TEST_F(TraceReplayTest, ReportsTheRoutersPredictedAndTheEnginesDeliveredCachedTokens) {
  const TraceReplay replay{"conversations", conversation_trace(5, 8), options(4)};
  std::vector<simulation::ReplayRequestOutcome> outcomes;
  const auto kv_cost = replay.run("kv-cost", plugins_for("kv-cost"), 0, &outcomes);
  ASSERT_EQ(outcomes.size(), replay.size());
  EXPECT_TRUE(kv_cost.predicted_known);
  const metrics::CacheTotals& totals = kv_cost.cache_outcomes.totals;
  EXPECT_EQ(totals.requests, replay.size());
  EXPECT_DOUBLE_EQ(totals.delivered_hit_rate(), kv_cost.hit_rate);
  // Turns after the first find their conversation on the worker the router predicted.
  EXPECT_GT(totals.predicted_hit_rate(), 0.3) << totals.predicted_cached_tokens;
  for (const auto& outcome : outcomes) {
    ASSERT_TRUE(outcome.predicted_cached_tokens);
    EXPECT_LE(*outcome.predicted_cached_tokens, outcome.stats.prompt_tokens);
  }
}

TEST_F(TraceReplayTest, AMaxInFlightClassifierCapsTheRequestsAtTheWorkersAndAllComplete) {
  const TraceReplay replay{"random", random_trace(60, 5), options(4)};
  std::vector<simulation::ReplayRequestOutcome> uncapped;
  (void)replay.run("kv-cost", plugins_for("kv-cost"), 0, &uncapped);
  ASSERT_GT(most_at_the_workers(uncapped), 2U) << "the trace must be busy enough to cap";

  const auto plugins = plugins_from_yaml(
      "request_classifier: {type: max-in-flight, parameters: {max_in_flight: 2}}\n");
  std::vector<simulation::ReplayRequestOutcome> capped;
  const auto report = replay.run("max-in-flight", plugins, 0, &capped);
  EXPECT_EQ(report.completed, replay.size());
  EXPECT_EQ(report.failed, 0U);
  EXPECT_TRUE(report.rejected.empty());
  EXPECT_TRUE(report.failures.empty()) << report.failures.front().first;
  EXPECT_EQ(most_at_the_workers(capped), 2U);
  // The requests held back waited, and their TTFT counts the wait from their arrival.
  const auto waited = std::ranges::count_if(
      capped, [](const auto& outcome) { return outcome.dispatched_ms > outcome.stats.arrival_ms; });
  EXPECT_GT(waited, 10);
  for (const auto& outcome : capped) {
    EXPECT_GT(outcome.stats.ttft_ms(), outcome.dispatched_ms - outcome.stats.arrival_ms);
  }
}

TEST_F(TraceReplayTest, ATokenBucketInRejectModeGivesCountedRateLimitedOutcomes) {
  // About 33 requests/s of about 2,800 tokens each, against a rate of 20,000 tokens/s.
  const TraceReplay replay{"random", random_trace(120, 3), options(4)};
  const auto plugins = plugins_from_yaml(
      "request_classifier: {type: token-bucket, parameters: {rate_tokens_per_s: 20000, "
      "burst_tokens: 8000}}\n");
  const auto report = replay.run("token-bucket", plugins);
  const std::size_t rate_limited = count_of(report.rejected, "rate_limited");
  EXPECT_GT(rate_limited, 20U);
  EXPECT_EQ(simulation::total(report.rejected), rate_limited) << "no other code";
  EXPECT_EQ(report.completed + rate_limited, replay.size());
  EXPECT_EQ(report.failed, 0U) << "a rejection is an answer, not a failure";
  EXPECT_TRUE(report.failures.empty());
  const std::string json = report_json(replay, plugins);
  EXPECT_NE(json.find(fmt::format("\"rejected\": {{\n        \"rate_limited\": {}", rate_limited)),
            std::string::npos)
      << json;
}

TEST_F(TraceReplayTest, TheQueueHoldsRequestsWhileTheWorkerIsBusyAndTheirTtftCountsTheWait) {
  // Ten 2,048-token prompts at once on one worker; busy above 5% of its 8,192 batched tokens, so
  // one prefill at a time: the others wait in the router's queue, not in the engine.
  const std::vector<TraceRequest> trace = burst_trace(10, 4);
  ReplayOptions queued_options = options(1);
  queued_options.queue_threshold = 0.05;
  const TraceReplay queued{"burst", trace, queued_options};
  const TraceReplay unqueued{"burst", trace, options(1)};
  std::vector<simulation::ReplayRequestOutcome> outcomes;
  const auto report = queued.run("queued", plugins_for("kv-cost"), 0, &outcomes);
  std::vector<simulation::ReplayRequestOutcome> direct;
  const auto direct_report = unqueued.run("direct", plugins_for("kv-cost"), 0, &direct);
  EXPECT_EQ(report.completed, trace.size());
  EXPECT_TRUE(report.rejected.empty());
  ASSERT_EQ(outcomes.size(), trace.size());

  double longest_wait = 0;
  std::size_t waited = 0;
  for (const auto& outcome : outcomes) {
    EXPECT_DOUBLE_EQ(outcome.stats.arrival_ms,
                     static_cast<double>(trace[outcome.trace_index].timestamp_ms));
    const double wait = outcome.dispatched_ms - outcome.stats.arrival_ms;
    EXPECT_GE(wait, 0.0);
    if (wait > 0) ++waited;
    longest_wait = std::max(longest_wait, wait);
    EXPECT_GT(outcome.stats.ttft_ms(), wait) << "request " << outcome.trace_index;
  }
  EXPECT_GE(waited, 8U) << "all but the first request (or two) wait";
  EXPECT_GT(report.ttft_ms.max, longest_wait);
  // Without the queue nothing waits in the router.
  for (const auto& outcome : direct) {
    EXPECT_DOUBLE_EQ(outcome.dispatched_ms, outcome.stats.arrival_ms);
  }
  EXPECT_EQ(direct_report.completed, trace.size());
}

TEST_F(TraceReplayTest, RejectionsAndTtftAreReportedPerTenant) {
  // heavy sends five times light's traffic; each tenant has its own bucket, which only heavy's
  // rate exceeds.
  const std::vector<TraceRequest> trace = random_trace(240, 8);
  const auto tenants = parse_tenant_weights("heavy:5,light:1");
  ASSERT_TRUE(tenants);
  const TraceReplay replay{"random", trace, options(4), assign_tenants(*tenants, trace.size(), 0)};
  const auto plugins = plugins_from_yaml(
      "request_classifier: {type: token-bucket, parameters: {rate_tokens_per_s: 40000, "
      "burst_tokens: 20000}}\n");
  const auto report = replay.run("token-bucket", plugins);
  ASSERT_EQ(report.tenants.size(), 2U);
  const simulation::TenantReport& heavy = report.tenants[0];
  const simulation::TenantReport& light = report.tenants[1];
  EXPECT_EQ(heavy.tenant, "heavy");
  EXPECT_EQ(light.tenant, "light");
  EXPECT_EQ(heavy.requests, 200U);
  EXPECT_EQ(light.requests, 40U);
  EXPECT_GT(count_of(heavy.rejected, "rate_limited"), 0U);
  EXPECT_TRUE(light.rejected.empty());
  EXPECT_EQ(light.completed, 40U);
  EXPECT_EQ(heavy.completed + count_of(heavy.rejected, "rate_limited"), 200U);
  EXPECT_EQ(simulation::total(report.rejected), simulation::total(heavy.rejected));
  EXPECT_GT(light.ttft_ms.p50, 0.0);
  EXPECT_LE(light.ttft_ms.p50, light.ttft_ms.p99);
}

TEST_F(TraceReplayTest, TenantClassesWithDeficitRoundRobinProtectTheLightTenant) {
  // Two workers overloaded by a heavy tenant sending five times the light tenant's traffic.
  // Without classes the light tenant's requests wait behind the heavy ones in the engines; with a
  // class per tenant and equal quanta they are dispatched as soon as a worker frees up.
  const std::vector<TraceRequest> trace = random_trace(600, 21);
  const auto tenants = parse_tenant_weights("heavy:5,light:1");
  ASSERT_TRUE(tenants);
  ReplayOptions replay_options = options(2);
  replay_options.speedup = 3;
  const TraceReplay replay{"random", trace, replay_options,
                           assign_tenants(*tenants, trace.size(), 0)};
  const auto shared = replay.run("shared", plugins_for("kv-cost"));
  const auto classes = plugins_from_yaml(R"(
request_classifier:
  type: tenant-class
  parameters:
    tenants: [{tenant: heavy, policy_class: heavy}, {tenant: light, policy_class: light}]
policy_classes:
  - {name: heavy, quantum: 4096, prefill_busy_threshold_frac: 0.5}
  - {name: light, quantum: 4096, prefill_busy_threshold_frac: 0.5}
)");
  const auto fair = replay.run("tenant-class", classes);
  ASSERT_EQ(shared.tenants.size(), 2U);
  ASSERT_EQ(fair.tenants.size(), 2U);
  EXPECT_EQ(fair.tenants[1].completed + simulation::total(fair.tenants[1].rejected), 100U);
  EXPECT_TRUE(fair.tenants[1].rejected.empty());
  EXPECT_LT(fair.tenants[1].ttft_ms.p99, 0.5 * shared.tenants[1].ttft_ms.p99)
      << "light p99 TTFT with classes " << fair.tenants[1].ttft_ms.p99 << " ms, without "
      << shared.tenants[1].ttft_ms.p99 << " ms";
}

TEST_F(TraceReplayTest, AdmissionRunsGiveByteIdenticalReportsForEqualSeeds) {
  const std::vector<TraceRequest> trace = random_trace(200, 4);
  const auto tenants = parse_tenant_weights("a:2,b:1");
  ASSERT_TRUE(tenants);
  ReplayOptions replay_options = options(2, 9);
  replay_options.speedup = 2;
  replay_options.router.temperature = 0.5;
  const auto plugins = plugins_from_yaml(R"(
request_classifier: {type: max-in-flight, parameters: {max_in_flight: 6, per_tenant: true}}
policy_classes:
  - {name: default, quantum: 2048, prefill_busy_threshold_frac: 0.25}
)");
  const TraceReplay first{"random", trace, replay_options,
                          assign_tenants(*tenants, trace.size(), 9)};
  const TraceReplay second{"random", trace, replay_options,
                           assign_tenants(*tenants, trace.size(), 9)};
  const std::string json = report_json(first, plugins);
  EXPECT_EQ(report_json(first, plugins), json);
  EXPECT_EQ(report_json(second, plugins), json);
  EXPECT_NE(json.find("\"tenant\": \"b\""), std::string::npos) << json;
}

}  // namespace
}  // namespace kvr::replay

namespace kvr::replay {
namespace {

// Disaggregated serving in replay: every request takes the prefill hop to a prefill worker and
// is decoded on a decode worker, later turns of a conversation are prefilled where the earlier
// turns left their cache, and conditional disaggregation sends short remainders straight to a
// decode worker.
class DisaggregatedReplayTest : public TraceReplayTest {
 protected:
  plugins::RouterPlugins disaggregated_plugins(std::string_view disaggregation = "{}") {
    return plugins_from_yaml(
        fmt::format("worker_selection: {{aggregated: kv-cost, prefill: kv-cost, decode: kv-cost}}\n"
                    "models: {{replay: {{disaggregation: {}}}}}\n",
                    disaggregation));
  }

  static std::size_t decided(const simulation::PolicyReport& report, std::string_view reason) {
    return count_of(report.disaggregation, reason);
  }
};

TEST_F(DisaggregatedReplayTest, EveryRequestIsPrefilledThenDecodedOnTheirOwnPools) {
  ReplayOptions replay_options = options(4);
  replay_options.prefill_workers = 2;
  const TraceReplay replay{"conversations", conversation_trace(4, 5), replay_options};
  std::vector<simulation::ReplayRequestOutcome> outcomes;
  const auto report = replay.run("kv-cost", disaggregated_plugins(), 0, &outcomes);
  EXPECT_EQ(report.completed, replay.size());
  EXPECT_EQ(report.failed, 0U);
  EXPECT_EQ(decided(report, "disaggregated"), replay.size());
  ASSERT_EQ(outcomes.size(), replay.size());
  for (const auto& outcome : outcomes) {
    EXPECT_GT(outcome.worker.worker_id, 2U) << "decoded on a decode worker (3 or 4)";
    EXPECT_EQ(outcome.stats.output_tokens, 32U) << "the whole output, from the decode worker";
  }
  // Later turns repeat the conversation so far: their prefill reuses the prefill worker's cache.
  EXPECT_GT(report.hit_rate, 0.5 * replay.infinite_cache_hit_rate()) << report.hit_rate;
}

TEST_F(DisaggregatedReplayTest, ConditionalDisaggregationSendsShortRemaindersToDecode) {
  ReplayOptions replay_options = options(4);
  replay_options.prefill_workers = 2;
  const TraceReplay replay{"random", random_trace(80, 11), replay_options};
  // Prompts of 4 to 7 blocks of 512 tokens: a threshold of 3000 uncached tokens splits them.
  const auto always = replay.run("kv-cost", disaggregated_plugins());
  const auto conditional =
      replay.run("kv-cost", disaggregated_plugins("{min_uncached_tokens: 3000}"));
  EXPECT_EQ(always.completed, replay.size());
  EXPECT_EQ(conditional.completed, replay.size());
  EXPECT_EQ(decided(always, "disaggregated"), replay.size());
  EXPECT_GT(decided(conditional, "short_prompt"), 0U);
  EXPECT_GT(decided(conditional, "disaggregated"), 0U);
  EXPECT_EQ(decided(conditional, "short_prompt") + decided(conditional, "disaggregated"),
            replay.size());
}

TEST_F(DisaggregatedReplayTest, OutcomesNameThePrefillWorkerOfEachRequestThatTookTheHop) {
  ReplayOptions replay_options = options(4);
  replay_options.prefill_workers = 2;
  const TraceReplay replay{"random", random_trace(80, 11), replay_options};
  std::vector<simulation::ReplayRequestOutcome> outcomes;
  const auto report =
      replay.run("kv-cost", disaggregated_plugins("{min_uncached_tokens: 3000}"), 0, &outcomes);
  ASSERT_EQ(outcomes.size(), replay.size());
  std::size_t prefilled = 0;
  for (const auto& outcome : outcomes) {
    EXPECT_EQ(outcome.retries, 0U) << "request " << outcome.trace_index;
    EXPECT_GT(outcome.worker.worker_id, 2U) << "request " << outcome.trace_index;
    if (!outcome.prefill_worker) continue;
    ++prefilled;
    EXPECT_LE(outcome.prefill_worker->worker_id, 2U) << "request " << outcome.trace_index;
  }
  EXPECT_EQ(prefilled, decided(report, "disaggregated"));
  EXPECT_GT(decided(report, "short_prompt"), 0U);
}

TEST_F(DisaggregatedReplayTest, ARequestNoEngineCanHoldFailsOnceWithoutARetryOrASecondPlan) {
  ReplayOptions replay_options = options(4);
  replay_options.prefill_workers = 2;
  replay_options.engine.num_gpu_blocks = 64;  // 4096 tokens
  auto trace = conversation_trace(2, 1);      // 1436-token prompts: they fit
  TraceRequest huge;
  huge.timestamp_ms = trace.back().timestamp_ms + 10;
  huge.hash_ids = {1, 2, 3, 4, 5, 6, 7, 8, 9};
  huge.input_length = 9 * simulation::kMooncakeTraceBlockSize;
  huge.output_length = 4;
  trace.push_back(huge);
  const TraceReplay replay{"too-big", std::move(trace), replay_options};
  const auto report = replay.run("kv-cost", disaggregated_plugins());
  EXPECT_EQ(report.completed, 2U);
  EXPECT_EQ(report.failed, 1U);
  ASSERT_EQ(report.failures.size(), 1U);
  EXPECT_EQ(report.failures.front(),
            (std::pair<std::string, std::size_t>{"engine refused: exceeds_kv_capacity", 1}));
  // The refusal is the request's fault, not its prefill worker's: it is not planned again.
  EXPECT_EQ(decided(report, "disaggregated"), replay.size());
  EXPECT_EQ(decided(report, "no_prefill_worker"), 0U);
}

// Records what a classifier is told; every request admitted at once.
struct ClassifierLog {
  std::map<std::string, std::vector<WorkerId>> sent;
  std::map<std::string, int> ended;
};

class RecordingClassifier : public plugins::request_classifier::RequestClassifier {
 public:
  explicit RecordingClassifier(std::shared_ptr<ClassifierLog> log) : log_(std::move(log)) {}
  void on_event(const plugins::request_classifier::ClassifyEvent& event) override {
    namespace rc = plugins::request_classifier;
    if (const auto* sent = std::get_if<rc::Sent>(&event)) {
      log_->sent[sent->request_id].push_back(sent->worker.worker_id);
    } else if (const auto* completed = std::get_if<rc::Completed>(&event)) {
      ++log_->ended[completed->request_id];
    } else if (const auto* aborted = std::get_if<rc::Aborted>(&event)) {
      ++log_->ended[aborted->request_id];
    }
  }

 private:
  std::shared_ptr<ClassifierLog> log_;
};

TEST_F(DisaggregatedReplayTest, ClassifiersSeeEachRequestOnceOnItsDecodeWorkerNeverThePrefillHop) {
  auto log = std::make_shared<ClassifierLog>();
  ASSERT_TRUE(registry_.register_request_classifier(
      "recording",
      [log](const plugins::request_classifier::RequestClassifierParameters&)
          -> std::expected<plugins::request_classifier::RequestClassifierFactory,
                           plugins::request_classifier::RequestClassifierProviderError> {
        return [log](const plugins::request_classifier::RequestClassifierContext&) {
          return std::make_unique<RecordingClassifier>(log);
        };
      }));
  ReplayOptions replay_options = options(4);
  replay_options.prefill_workers = 2;
  const TraceReplay replay{"conversations", conversation_trace(3, 4), replay_options};
  const auto report =
      replay.run("kv-cost", plugins_from_yaml("request_classifier: {type: recording}\n"
                                              "models: {replay: {disaggregation: {}}}\n"));
  EXPECT_EQ(report.completed, replay.size());
  ASSERT_EQ(log->sent.size(), replay.size());
  for (const auto& [id, workers] : log->sent) {
    ASSERT_EQ(workers.size(), 1U) << id << " was sent more than once";
    EXPECT_GT(workers.front(), 2U) << id << " was told on prefill worker " << workers.front();
    EXPECT_EQ(log->ended[id], 1) << id;
  }
}

TEST_F(DisaggregatedReplayTest, EqualInputsGiveByteIdenticalReports) {
  ReplayOptions replay_options = options(4, 3);
  replay_options.prefill_workers = 1;
  const TraceReplay replay{"random", random_trace(60, 5), replay_options};
  const auto json = [&] {
    simulation::ReplayReport report;
    report.policies.push_back(
        replay.run("kv-cost", disaggregated_plugins("{min_uncached_tokens: 2500}")));
    return simulation::to_json(report);
  };
  EXPECT_EQ(json(), json());
}

}  // namespace
}  // namespace kvr::replay

namespace kvr::replay {
namespace {

// Sharded partitions in replay: each shard's core routes only its own workers, a conversation
// stays on its prefix's shard and keeps its cache, a hot prefix spills to other shards, and a
// disaggregated model has prefill and decode workers in every shard.
class ShardedReplayTest : public TraceReplayTest {
 protected:
  static ReplayOptions sharded(std::size_t workers, std::uint32_t shards) {
    ReplayOptions replay_options = options(workers);
    replay_options.sharding.shards = shards;
    return replay_options;
  }

  // The shard owning each worker, as the replay assigns them.
  static cluster::ShardMap shard_map(std::size_t workers, std::uint32_t shards,
                                     std::size_t prefill_workers = 0) {
    std::vector<cluster::ShardedWorker> fleet;
    for (std::size_t w = 0; w < workers; ++w) {
      const WorkerType role = prefill_workers == 0  ? WorkerType::Aggregated
                              : w < prefill_workers ? WorkerType::Prefill
                                                    : WorkerType::Decode;
      fleet.push_back({w + 1, static_cast<std::uint8_t>(role)});
    }
    cluster::ShardMap map{shards};
    (void)map.assign(fleet);
    return map;
  }
};

TEST_F(ShardedReplayTest, AConversationStaysOnItsPrefixsShardAndKeepsItsCache) {
  constexpr std::uint32_t kConversations = 8;
  const TraceReplay replay{"conversations", conversation_trace(kConversations, 5), sharded(8, 4)};
  std::vector<simulation::ReplayRequestOutcome> outcomes;
  const auto report = replay.run("kv-cost", plugins_for("kv-cost"), 0, &outcomes);
  EXPECT_EQ(report.completed, replay.size());
  EXPECT_EQ(report.shard_spills, 0U) << "the fleet is never saturated";
  ASSERT_EQ(report.shard_requests.size(), 4U);
  std::size_t routed = 0;
  std::size_t shards_used = 0;
  for (const std::size_t requests : report.shard_requests) {
    routed += requests;
    shards_used += requests > 0 ? 1 : 0;
  }
  EXPECT_EQ(routed, replay.size());
  EXPECT_GE(shards_used, 2U) << "conversations spread over the shards";
  // Every turn of a conversation (trace index turn * conversations + c) ran on a worker of one
  // shard.
  const cluster::ShardMap map = shard_map(8, 4);
  std::map<std::size_t, std::set<std::uint32_t>> shards_of_conversation;
  for (const auto& outcome : outcomes) {
    shards_of_conversation[outcome.trace_index % kConversations].insert(
        *map.shard_of(outcome.worker.worker_id));
  }
  for (const auto& [conversation, shards] : shards_of_conversation) {
    EXPECT_EQ(shards.size(), 1U) << "conversation " << conversation;
  }
  EXPECT_GT(report.hit_rate, 0.9 * replay.infinite_cache_hit_rate()) << report.hit_rate;
}

TEST_F(ShardedReplayTest, AHotPrefixSpillsToOtherShardsAndEveryRequestCompletes) {
  // 64 requests sharing their first three blocks arrive within 64 ms: their prefix's shard
  // cannot take them all sooner than the other shards could compute them afresh.
  std::vector<TraceRequest> trace;
  for (std::uint32_t i = 0; i < 64; ++i) {
    TraceRequest request;
    request.timestamp_ms = i;
    request.hash_ids = {1, 2, 3, 1000 + i};
    request.input_length = 4 * simulation::kMooncakeTraceBlockSize;
    request.output_length = 16;
    trace.push_back(std::move(request));
  }
  const TraceReplay replay{"hot", std::move(trace), sharded(8, 4)};
  const auto report = replay.run("kv-cost", plugins_for("kv-cost"));
  EXPECT_EQ(report.completed, replay.size());
  EXPECT_GT(report.shard_spills, 0U);
  const auto used = std::ranges::count_if(report.shard_requests,
                                          [](std::size_t requests) { return requests > 0; });
  EXPECT_GT(used, 1);
}

TEST_F(ShardedReplayTest, EveryShardOfADisaggregatedModelPrefillsAndDecodes) {
  ReplayOptions replay_options = sharded(8, 2);
  replay_options.prefill_workers = 4;
  const TraceReplay replay{"conversations", conversation_trace(6, 4), replay_options};
  std::vector<simulation::ReplayRequestOutcome> outcomes;
  const auto report = replay.run(
      "kv-cost",
      plugins_from_yaml("worker_selection: {aggregated: kv-cost, prefill: kv-cost, decode: "
                        "kv-cost}\nmodels: {replay: {disaggregation: {}}}\n"),
      0, &outcomes);
  EXPECT_EQ(report.completed, replay.size());
  EXPECT_EQ(count_of(report.disaggregation, "disaggregated"), replay.size());
  const cluster::ShardMap map = shard_map(8, 2, 4);
  std::set<std::uint32_t> decoding_shards;
  for (const auto& outcome : outcomes) {
    EXPECT_GT(outcome.worker.worker_id, 4U) << "decoded on a decode worker";
    decoding_shards.insert(*map.shard_of(outcome.worker.worker_id));
  }
  EXPECT_EQ(decoding_shards.size(), 2U);
}

TEST_F(ShardedReplayTest, EqualInputsGiveByteIdenticalReports) {
  const TraceReplay replay{"random", random_trace(150, 4), sharded(6, 3)};
  EXPECT_EQ(replay_json(replay, {"kv-cost"}), replay_json(replay, {"kv-cost"}));
  EXPECT_NE(replay_json(replay, {"kv-cost"}).find("\"shards\""), std::string::npos);
}

}  // namespace
}  // namespace kvr::replay
