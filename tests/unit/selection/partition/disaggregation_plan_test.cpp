// Conditional disaggregation in the partition core: a generate request's first route (RouteHop::
// plan) in a partition of prefill and decode workers books a prefill worker for the prefill hop,
// or a decode worker that serves it alone, and says why; the decode hop after a transfer books
// no prefill tokens. The settings come from the router-policy YAML's models.<model>.disaggregation.
#include <gtest/gtest.h>

#include "discovery/block_hash.hpp"
#include "selection/config/router_policy_config.hpp"
#include "selection/partition/partition_router.hpp"
#include "selection/policies/builtin_policies.hpp"
#include "tests/testing/worker_registration.hpp"

namespace kvr {
namespace {

using namespace std::chrono_literals;

constexpr std::uint32_t kBlockSize = 16;
const TimePoint kStart{std::chrono::seconds(1000)};

class DisaggregationPlanTest : public ::testing::Test {
 protected:
  // Builds the partition core of model "llama" with the router-policy YAML `yaml`.
  void SetUp() override { ASSERT_TRUE(selection::register_builtin_policies(registry_)); }

  void make(const std::string& yaml = "{}") {
    router_.reset();  // before the plugins it routes with
    auto config = selection::parse_router_policy_config(yaml, "test.yaml");
    ASSERT_TRUE(config) << config.error();
    auto plugins = registry_.resolve_plugins(*config);
    ASSERT_TRUE(plugins) << plugins.error().message();
    plugins_ = std::make_unique<plugins::RouterPlugins>(std::move(*plugins));
    PartitionRouterOptions options;
    options.options.partition.model = "llama";
    options.options.router.block_size = kBlockSize;
    router_ = std::make_unique<PartitionRouter>(options, *plugins_);
  }

  void add_worker(WorkerId id, WorkerType role, std::uint64_t queued_prefill_tokens = 0) {
    auto registration = testing::worker_registration(id, "llama", kBlockSize, 10s);
    registration.role = role;
    registration.publishes_kv_events = true;
    registration.generate_subject = "generate." + std::to_string(id);
    router_->register_worker(std::move(registration), kStart, effects_);
    discovery::ConfirmedLoad load;
    load.active_prefill_tokens = queued_prefill_tokens;
    if (queued_prefill_tokens > 0) load.active_requests = 1;
    router_->update_load({id, 1, {{0, load}}}, kStart, effects_);
    effects_.clear();
  }

  // `worker` holds the first `blocks` blocks of the prompt with `seed`.
  void store(WorkerId worker, const std::string& seed, std::size_t blocks) {
    KvEventBatch batch{.worker = {worker, 0}, .incarnation = 1, .event_id = ++event_ids_[worker]};
    batch.events.emplace_back(KvStoredEvent{.block_hashes = hashes(seed, blocks)});
    router_->apply_kv_events(batch, kStart, effects_);
    effects_.clear();
  }

  static std::vector<BlockHash> hashes(const std::string& seed, std::size_t blocks) {
    std::vector<BlockHash> chain;
    std::optional<BlockHash> parent;
    for (std::size_t i = 0; i < blocks; ++i) {
      parent = discovery::BlockHasher::chain(parent, std::hash<std::string>{}(seed) + i);
      chain.push_back(*parent);
    }
    return chain;
  }

  // A generate request's first route: `blocks` full blocks of the prompt with `seed`.
  RouteRequest request(std::string id, const std::string& seed, std::size_t blocks,
                       RouteHop hop = RouteHop::plan) {
    RouteRequest input;
    input.selection.request_id = std::move(id);
    input.selection.prompt_tokens = blocks * kBlockSize;
    input.selection.block_hashes = hashes(seed, blocks);
    input.hop = hop;
    return input;
  }

  RouteReply route(RouteRequest input) {
    auto reply = router_->route(input, next_ticket_++, kStart, effects_);
    EXPECT_TRUE(reply) << "answered at once";
    return reply ? std::move(*reply) : RouteReply{std::unexpected(RouteFailure{}), {}, {}};
  }

  std::vector<DisaggregationReason> decided() {
    std::vector<DisaggregationReason> reasons;
    for (const PartitionEvent& event : effects_.events) {
      if (const auto* e = std::get_if<partition_event::DisaggregationDecided>(&event)) {
        reasons.push_back(e->reason);
      }
    }
    effects_.clear();
    return reasons;
  }

  plugins::RouterPluginRegistry registry_;
  std::unique_ptr<plugins::RouterPlugins> plugins_;
  std::unique_ptr<PartitionRouter> router_;
  PartitionEffects effects_;
  std::map<WorkerId, EventId> event_ids_;
  RouteTicket next_ticket_ = 1;
};

TEST_F(DisaggregationPlanTest, ARequestNamingNoRoleTakesThePrefillHopToThePrefillWorkerHoldingIt) {
  make();
  add_worker(1, WorkerType::Prefill);
  add_worker(2, WorkerType::Prefill);
  add_worker(3, WorkerType::Decode);
  store(2, "conversation", 6);

  const RouteReply reply = route(request("r", "conversation", 8));
  ASSERT_TRUE(reply.result) << reply.result.error().message;
  EXPECT_EQ(reply.result->worker.worker_id, 2U) << "the prefill worker with the prefix";
  ASSERT_TRUE(reply.disaggregation);
  EXPECT_TRUE(reply.disaggregation->prefill_hop());
  EXPECT_EQ(reply.disaggregation->decode_uncached_tokens, 8 * kBlockSize);
  EXPECT_EQ(reply.generate_subject, "generate.2");
  EXPECT_EQ(decided(), std::vector{DisaggregationReason::disaggregated});
}

TEST_F(DisaggregationPlanTest, AShortUncachedRemainderOnTheBestDecodeWorkerSkipsTheHop) {
  make("models: {llama: {disaggregation: {min_uncached_tokens: 64}}}");
  add_worker(1, WorkerType::Prefill);
  add_worker(2, WorkerType::Decode);
  add_worker(3, WorkerType::Decode);
  store(3, "conversation", 10);

  // 3 blocks to compute: a short prompt.
  RouteReply reply = route(request("short", "other", 3));
  ASSERT_TRUE(reply.result && reply.disaggregation);
  EXPECT_EQ(reply.disaggregation->reason, DisaggregationReason::short_prompt);
  EXPECT_NE(reply.result->worker.worker_id, 1U) << "a decode worker serves it";

  // 12 blocks, 10 of them cached on decode worker 3: 2 blocks left there.
  reply = route(request("follow-up", "conversation", 12));
  ASSERT_TRUE(reply.result && reply.disaggregation);
  EXPECT_EQ(reply.disaggregation->reason, DisaggregationReason::short_prompt);
  EXPECT_EQ(reply.disaggregation->decode_uncached_tokens, 2 * kBlockSize);
  EXPECT_EQ(reply.result->worker.worker_id, 3U);

  // 5 uncached blocks (80 tokens) everywhere: the hop.
  reply = route(request("long", "fresh", 5));
  ASSERT_TRUE(reply.result && reply.disaggregation);
  EXPECT_EQ(reply.disaggregation->reason, DisaggregationReason::disaggregated);
  EXPECT_EQ(reply.result->worker.worker_id, 1U);
  EXPECT_EQ(decided(),
            (std::vector{DisaggregationReason::short_prompt, DisaggregationReason::short_prompt,
                         DisaggregationReason::disaggregated}));
}

TEST_F(DisaggregationPlanTest, APrefillPoolSlowerThanPrefillingLocallyIsSkippedWhenChecked) {
  make("models: {llama: {disaggregation: {prefill_queue_check: true}}}");
  add_worker(1, WorkerType::Prefill, /*queued_prefill_tokens=*/50'000);
  add_worker(2, WorkerType::Decode);

  RouteReply reply = route(request("a", "a", 4));
  ASSERT_TRUE(reply.result && reply.disaggregation);
  EXPECT_EQ(reply.disaggregation->reason, DisaggregationReason::prefill_queue);
  EXPECT_EQ(reply.result->worker.worker_id, 2U);

  // Without the check the hop is taken whatever the queue.
  make();
  add_worker(1, WorkerType::Prefill, 50'000);
  add_worker(2, WorkerType::Decode);
  reply = route(request("a", "a", 4));
  ASSERT_TRUE(reply.result && reply.disaggregation);
  EXPECT_EQ(reply.disaggregation->reason, DisaggregationReason::disaggregated);
}

TEST_F(DisaggregationPlanTest, WithoutAnEligiblePrefillWorkerTheDecodeWorkerServesAlone) {
  make();
  add_worker(1, WorkerType::Prefill);
  add_worker(2, WorkerType::Decode);
  RouteRequest input = request("a", "a", 4);
  input.selection.excluded_workers = {1};  // it failed this request already
  const RouteReply reply = route(std::move(input));
  ASSERT_TRUE(reply.result && reply.disaggregation);
  EXPECT_EQ(reply.disaggregation->reason, DisaggregationReason::no_prefill_worker);
  EXPECT_EQ(reply.result->worker.worker_id, 2U);
}

TEST_F(DisaggregationPlanTest, AggregatedWorkersAndPinsServeARequestWithoutAPlan) {
  make();
  add_worker(1, WorkerType::Aggregated);
  add_worker(2, WorkerType::Prefill);
  add_worker(3, WorkerType::Decode);
  RouteReply reply = route(request("a", "a", 4));
  ASSERT_TRUE(reply.result);
  EXPECT_EQ(reply.result->worker.worker_id, 1U);
  EXPECT_FALSE(reply.disaggregation);

  RouteRequest pinned = request("b", "b", 4);
  pinned.worker_type = WorkerType::Decode;
  pinned.selection.pinned_worker = plugins::worker_selection::WorkerAffinityTarget{3, std::nullopt};
  reply = route(std::move(pinned));
  ASSERT_TRUE(reply.result);
  EXPECT_EQ(reply.result->worker.worker_id, 3U);
  EXPECT_FALSE(reply.disaggregation);
  EXPECT_TRUE(decided().empty());
}

TEST_F(DisaggregationPlanTest, TheDecodeHopAfterATransferBooksNoPrefillTokens) {
  make();
  add_worker(1, WorkerType::Prefill);
  add_worker(2, WorkerType::Decode);
  RouteRequest decode = request("a", "a", 4, RouteHop::decode_after_transfer);
  decode.worker_type = WorkerType::Decode;
  const RouteReply reply = route(std::move(decode));
  ASSERT_TRUE(reply.result);
  EXPECT_EQ(reply.result->worker.worker_id, 2U);
  EXPECT_FALSE(reply.disaggregation);
  const auto load = router_->state().partition_workers().load().rank_load({2, 0});
  ASSERT_TRUE(load);
  EXPECT_EQ(load->prefill_tokens_since_report, 0);
  EXPECT_EQ(router_->gauges().bookings_open, 1U) << "booked all the same";

  // An ordinary decode route books the prompt's prefill.
  RouteRequest ordinary = request("b", "b", 4, RouteHop::single);
  ordinary.worker_type = WorkerType::Decode;
  ASSERT_TRUE(route(std::move(ordinary)).result);
  EXPECT_EQ(
      router_->state().partition_workers().load().rank_load({2, 0})->prefill_tokens_since_report,
      4 * kBlockSize);
}

TEST_F(DisaggregationPlanTest, TheYamlSettingsAreValidatedNamingTheKey) {
  auto config = selection::parse_router_policy_config(
      "models: {llama: {disaggregation: {min_uncached_tokens: 256, prefill_queue_check: true, "
      "transfer_valid_ms: 5000}}}",
      "test.yaml");
  ASSERT_TRUE(config) << config.error();
  const auto settings = selection::disaggregation_of(config->models, "llama");
  EXPECT_EQ(settings.min_uncached_tokens, 256U);
  EXPECT_TRUE(settings.prefill_queue_check);
  EXPECT_EQ(settings.transfer_valid, 5000ms);
  EXPECT_EQ(selection::disaggregation_of(config->models, "other").min_uncached_tokens, 0U);

  auto bad = selection::parse_router_policy_config(
      "models: {llama: {disaggregation: {transfer_valid_ms: 0}}}", "test.yaml");
  ASSERT_FALSE(bad);
  EXPECT_NE(bad.error().find("models.llama.disaggregation.transfer_valid_ms"), std::string::npos)
      << bad.error();
  bad = selection::parse_router_policy_config(
      "models: {llama: {disaggregation: {min_uncached: 5}}}", "test.yaml");
  ASSERT_FALSE(bad);
  EXPECT_NE(bad.error().find("min_uncached"), std::string::npos) << bad.error();
  bad = selection::parse_router_policy_config(
      "models: {llama: {disaggregation: {prefill_queue_check: 3}}}", "test.yaml");
  ASSERT_FALSE(bad);
  EXPECT_NE(bad.error().find("prefill_queue_check"), std::string::npos) << bad.error();
}

}  // namespace
}  // namespace kvr
