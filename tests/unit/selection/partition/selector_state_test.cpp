// The selector's plain state: registration checks, routing over KV events and approximate
// (routing-fed) caches, booking before the answer, releases exactly once, worker removal by
// deregistration and liveness expiry, request validation, and the overlap a route reports.
#include "selection/partition/selector_state.hpp"

#include <functional>
#include <map>
#include <numeric>
#include <set>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "discovery/block_hash.hpp"
#include "selection/config/router_policy_config.hpp"
#include "selection/policies/builtin_policies.hpp"
#include "tests/testing/worker_registration.hpp"

namespace kvr {
namespace {

using namespace std::chrono_literals;

constexpr std::uint32_t kBlockSize = 16;
constexpr std::string_view kModel = "llama";
const TimePoint kStart{std::chrono::seconds(1000)};

// Chained hashes of `length` blocks; prompts with the same `branch` share every block, prompts
// with different branches share the first `shared` blocks.
std::vector<BlockHash> prompt_blocks(std::size_t length, std::uint64_t branch,
                                     std::size_t shared = 0) {
  std::vector<BlockHash> hashes;
  std::optional<BlockHash> parent;
  for (std::size_t i = 0; i < length; ++i) {
    parent = discovery::BlockHasher::chain(parent, i < shared ? i : branch * 1000 + i);
    hashes.push_back(*parent);
  }
  return hashes;
}

discovery::WorkerRegistration registration(WorkerId id, bool publishes_kv_events = true) {
  auto worker = testing::worker_registration(id, std::string{kModel}, kBlockSize, 10s);
  worker.publishes_kv_events = publishes_kv_events;
  return worker;
}

KvEventBatch stored(WorkerId id, EventId event_id, std::vector<BlockHash> blocks,
                    std::optional<BlockHash> parent = std::nullopt,
                    StorageTier tier = StorageTier::Device) {
  return KvEventBatch{.worker = {id, 0},
                      .incarnation = 1,
                      .event_id = event_id,
                      .events = {KvStoredEvent{parent, std::move(blocks), tier}}};
}

class SelectorStateTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto registered = selection::register_builtin_policies(registry_);
    ASSERT_TRUE(registered) << registered.error().message();
  }

  // A selector whose aggregated workers use `policy` (a built-in type; empty: the default), its
  // options changed by `adjust`.
  SelectorState& make_state(std::string policy = {}, std::uint32_t block_size = kBlockSize,
                            const std::function<void(SelectorOptions&)>& adjust = {}) {
    selection::RouterPolicyConfig config;
    if (!policy.empty()) {
      config.worker_selection[static_cast<std::size_t>(WorkerType::Aggregated)] = policy;
    }
    auto plugins = registry_.resolve_plugins(config);
    EXPECT_TRUE(plugins) << plugins.error().message();
    plugins_ = std::make_unique<plugins::RouterPlugins>(std::move(*plugins));
    SelectorOptions options;
    options.partition.model = std::string{kModel};
    options.router.block_size = block_size;
    options.router.seed = 42;
    options.booking_ttl = 30s;
    if (adjust) adjust(options);
    state_ = std::make_unique<SelectorState>(std::move(options), *plugins_);
    return *state_;
  }

  // Registers workers and gives each an (empty) load report, as a live worker sends at start.
  void add_workers(std::initializer_list<WorkerId> ids, bool publishes_kv_events = true) {
    for (const WorkerId id : ids) {
      auto added = state_->register_worker(registration(id, publishes_kv_events), kStart);
      ASSERT_TRUE(added) << added.error().message();
      ASSERT_TRUE(state_->update_load({id, 0}, discovery::ConfirmedLoad{}));
    }
  }

  std::expected<RouteOutcome, RouteFailure> route(const std::string& request_id,
                                                  const std::vector<BlockHash>& blocks,
                                                  std::size_t extra_tokens = 0,
                                                  TimePoint now = kStart) {
    RouteRequest input;
    input.selection.request_id = request_id;
    input.selection.prompt_tokens = blocks.size() * kBlockSize + extra_tokens;
    input.selection.block_hashes = blocks;
    return state_->route(input, now);
  }

  plugins::RouterPluginRegistry registry_;
  std::unique_ptr<plugins::RouterPlugins> plugins_;
  std::unique_ptr<SelectorState> state_;
};

// ---- registration -------------------------------------------------------------------------

TEST_F(SelectorStateTest, RefusesAWorkerOfAnotherPartitionNamingTheField) {
  auto& state = make_state();
  auto other_model = registration(1);
  other_model.model = "mistral";
  const auto refused = state.register_worker(other_model, kStart);
  ASSERT_FALSE(refused);
  EXPECT_EQ(refused.error().field, "model");
  EXPECT_NE(refused.error().reason.find("mistral"), std::string::npos) << refused.error().reason;

  auto other_group = registration(2);
  other_group.routing_group = "batch";
  const auto refused_group = state.register_worker(other_group, kStart);
  ASSERT_FALSE(refused_group);
  EXPECT_EQ(refused_group.error().field, "routing_group");
  EXPECT_NE(refused_group.error().message().find("batch"), std::string::npos)
      << refused_group.error().message();
  EXPECT_EQ(state.partition_workers().catalog().size(), 0U);
}

TEST_F(SelectorStateTest, RefusesAWorkerWithAnotherBlockSize) {
  auto& state = make_state();
  auto worker = registration(1);
  worker.block_size = 2 * kBlockSize;
  const auto refused = state.register_worker(worker, kStart);
  ASSERT_FALSE(refused);
  EXPECT_EQ(refused.error().field, "block_size");
  EXPECT_EQ(state.partition_workers().catalog().size(), 0U);
  EXPECT_TRUE(state.workers(WorkerType::Aggregated).empty());
}

TEST_F(SelectorStateTest, RegisteredWorkersAreOfferedInIdOrder) {
  auto& state = make_state();
  add_workers({30, 10, 20});
  const auto rows = state.workers(WorkerType::Aggregated);
  ASSERT_EQ(rows.size(), 3U);
  EXPECT_EQ(rows[0].worker.worker_id, 10U);
  EXPECT_EQ(rows[1].worker.worker_id, 20U);
  EXPECT_EQ(rows[2].worker.worker_id, 30U);
  EXPECT_TRUE(state.workers(WorkerType::Prefill).empty());
}

// ---- routing over the KV index ------------------------------------------------------------

TEST_F(SelectorStateTest, DefaultPolicyRoutesToTheWorkerHoldingThePromptsBlocks) {
  auto& state = make_state();
  EXPECT_EQ(state.policy_name(WorkerType::Aggregated), plugins::kDefaultPolicyName);
  add_workers({1, 2, 3});
  const auto blocks = prompt_blocks(8, 7);
  ASSERT_TRUE(state.apply_kv_events(stored(2, 1, blocks)));
  const auto routed = route("r1", blocks, 5);
  ASSERT_TRUE(routed) << routed.error().message;
  EXPECT_EQ(routed->worker, (WorkerWithDpRank{2, 0}));
  EXPECT_EQ(routed->device_overlap_blocks, 8U);
  EXPECT_EQ(routed->uncached_prefill_tokens, 5U);
  EXPECT_EQ(routed->eligible_workers, 3U);
}

TEST_F(SelectorStateTest, OutcomeCarriesOverlapByTierAndUncachedPrefillTokens) {
  auto& state = make_state();
  add_workers({1, 2});
  const auto blocks = prompt_blocks(6, 3);
  // Worker 1 holds the first three blocks on device and the fourth on host.
  ASSERT_TRUE(state.apply_kv_events(stored(1, 1, {blocks.begin(), blocks.begin() + 3})));
  ASSERT_TRUE(state.apply_kv_events(stored(1, 2, {blocks[3]}, blocks[2], StorageTier::Host)));
  const auto routed = route("r1", blocks, 4);  // 6 * 16 + 4 = 100 prompt tokens
  ASSERT_TRUE(routed) << routed.error().message;
  EXPECT_EQ(routed->worker, (WorkerWithDpRank{1, 0}));
  EXPECT_EQ(routed->device_overlap_blocks, 3U);
  EXPECT_EQ(routed->host_overlap_blocks, 1U);
  EXPECT_EQ(routed->disk_overlap_blocks, 0U);
  EXPECT_EQ(routed->uncached_prefill_tokens, 100U - 4 * kBlockSize);
  EXPECT_EQ(routed->booking_expires_at, kStart + 30s);
  // The booking carries the same uncached tokens.
  EXPECT_EQ(state.partition_workers().load().rank_load({1, 0})->booked_prefill_tokens,
            100U - 4 * kBlockSize);
}

TEST_F(SelectorStateTest, OutcomeNamesEachScorerOfItsCost) {
  make_state();
  add_workers({1});
  const auto routed = route("r1", prompt_blocks(4, 1));
  ASSERT_TRUE(routed) << routed.error().message;
  ASSERT_TRUE(routed->scorer_names);
  ASSERT_EQ(routed->scorer_names->size(), routed->scorer_costs.size());
  EXPECT_NE(routed->scorer_names->front().find("KvCostScorer"), std::string::npos);
}

TEST_F(SelectorStateTest, PolicyWithoutCacheSignalsStillGetsTheChosenWorkersOverlap) {
  auto& state = make_state("round-robin");
  add_workers({1, 2});
  const auto blocks = prompt_blocks(6, 9);
  ASSERT_TRUE(state.apply_kv_events(stored(1, 1, {blocks.begin(), blocks.begin() + 2})));
  ASSERT_TRUE(state.apply_kv_events(stored(2, 1, {blocks.begin(), blocks.begin() + 5})));
  // Round-robin serves worker 1 first, then worker 2, whatever they hold.
  const auto first = route("r1", blocks, 3);
  ASSERT_TRUE(first) << first.error().message;
  EXPECT_EQ(first->worker.worker_id, 1U);
  EXPECT_EQ(first->device_overlap_blocks, 2U);
  EXPECT_EQ(first->uncached_prefill_tokens, 4U * kBlockSize + 3);
  const auto second = route("r2", blocks, 3);
  ASSERT_TRUE(second) << second.error().message;
  EXPECT_EQ(second->worker.worker_id, 2U);
  EXPECT_EQ(second->device_overlap_blocks, 5U);
  EXPECT_EQ(second->uncached_prefill_tokens, 1U * kBlockSize + 3);
  EXPECT_EQ(state.partition_workers().load().rank_load({2, 0})->booked_prefill_tokens,
            1U * kBlockSize + 3);
}

// ---- booking ------------------------------------------------------------------------------

TEST_F(SelectorStateTest, RouteBooksSoTheNextLeastLoadedRouteGoesElsewhere) {
  auto& state = make_state("least-loaded");
  add_workers({1, 2});
  const auto first = route("r1", prompt_blocks(4, 1));
  ASSERT_TRUE(first) << first.error().message;
  EXPECT_EQ(state.partition_workers().load().rank_load(first->worker)->open_bookings, 1U);
  const auto second = route("r2", prompt_blocks(4, 2));
  ASSERT_TRUE(second) << second.error().message;
  EXPECT_NE(first->worker, second->worker);
}

TEST_F(SelectorStateTest, RouteBooksSoTheNextKvCostRouteGoesElsewhere) {
  make_state();
  add_workers({1, 2});
  std::set<WorkerId> chosen;
  for (int i = 0; i < 2; ++i) {
    const auto routed = route(fmt::format("r{}", i), prompt_blocks(4, 10 + i));
    ASSERT_TRUE(routed) << routed.error().message;
    chosen.insert(routed->worker.worker_id);
  }
  EXPECT_EQ(chosen, (std::set<WorkerId>{1, 2}));
}

TEST_F(SelectorStateTest, BookingsSpreadLoadBeforeTheFirstLoadReport) {
  auto& state = make_state("least-loaded");
  // A router that just started (or took over the partition) has no load reports yet; its own
  // bookings are then the whole estimate, and a burst must not herd onto one worker.
  for (const WorkerId id : {1, 2, 3, 4})
    ASSERT_TRUE(state.register_worker(registration(id), kStart));
  std::map<WorkerId, int> per_worker;
  for (int i = 0; i < 8; ++i) {
    const auto routed = route(fmt::format("r{}", i), prompt_blocks(4, 100 + i));
    ASSERT_TRUE(routed) << routed.error().message;
    ++per_worker[routed->worker.worker_id];
  }
  EXPECT_EQ(per_worker, (std::map<WorkerId, int>{{1, 2}, {2, 2}, {3, 2}, {4, 2}}));
}

TEST_F(SelectorStateTest, BusyPrefillThresholdDoesNotCountAReportedBookingTwice) {
  selection::RouterPolicyConfig config;
  auto plugins = registry_.resolve_plugins(config);
  ASSERT_TRUE(plugins);
  plugins_ = std::make_unique<plugins::RouterPlugins>(std::move(*plugins));
  SelectorOptions options;
  options.partition.model = std::string{kModel};
  options.router.block_size = kBlockSize;
  options.router.busy_prefill_tokens_threshold = 100;
  state_ = std::make_unique<SelectorState>(std::move(options), *plugins_);
  add_workers({1});
  const auto blocks = prompt_blocks(5, 1);  // 80 uncached tokens
  ASSERT_TRUE(route("r1", blocks));
  // The worker's report already counts r1's 80 prefill tokens: 80 in total, not 160.
  ASSERT_TRUE(state_->update_load(
      {1, 0}, discovery::ConfirmedLoad{.active_requests = 1, .active_prefill_tokens = 80}));
  const auto rows = state_->workers(WorkerType::Aggregated);
  ASSERT_EQ(rows.size(), 1U);
  EXPECT_EQ(rows[0].active_prefill_tokens, 80U);
  const auto small = prompt_blocks(1, 2);
  EXPECT_TRUE(route("r2", small)) << "80 prefill tokens do not exceed the threshold of 100";
  // Now 80 reported + 16 booked since; one more booking of 16 passes 100 and the worker is busy.
  ASSERT_TRUE(route("r3", prompt_blocks(1, 3)));
  EXPECT_EQ(state_->workers(WorkerType::Aggregated)[0].active_prefill_tokens, 112U);
  const auto refused = route("r4", prompt_blocks(1, 4));
  ASSERT_FALSE(refused);
  EXPECT_EQ(refused.error().code, Error::no_workers) << refused.error().message;
}

TEST_F(SelectorStateTest, BusyKvUsageThresholdCountsBookingsSinceTheReport) {
  make_state({}, kBlockSize,
             [](SelectorOptions& options) { options.router.busy_kv_usage_threshold = 0.5; });
  add_workers({1});  // 1000 blocks
  ASSERT_TRUE(state_->update_load({1, 0}, discovery::ConfirmedLoad{.kv_blocks_used = 450}));
  ASSERT_TRUE(route("r1", prompt_blocks(60, 1)));
  // 450 reported + 60 booked since: 51 % in use, above the threshold.
  EXPECT_DOUBLE_EQ(state_->workers(WorkerType::Aggregated)[0].kv_usage.value(), 0.51);
  const auto refused = route("r2", prompt_blocks(1, 2));
  ASSERT_FALSE(refused);
  EXPECT_EQ(refused.error().code, Error::no_workers) << refused.error().message;
  // A report that counts r1 replaces the estimate: 490 blocks, below the threshold again.
  ASSERT_TRUE(state_->update_load(
      {1, 0}, discovery::ConfirmedLoad{.active_requests = 1, .kv_blocks_used = 490}));
  EXPECT_TRUE(route("r3", prompt_blocks(1, 3)));
}

// A worker that registered no capacity has no KV usage: neither the host's busy threshold nor a
// policy class's kv_busy_threshold ever counts it as full, whatever its report says.
TEST_F(SelectorStateTest, BusyKvUsageThresholdNeverMarksAWorkerWithoutCapacityBusy) {
  make_state({}, kBlockSize,
             [](SelectorOptions& options) { options.router.busy_kv_usage_threshold = 0.5; });
  add_workers({1});  // 1000 blocks
  auto unknown = registration(2);
  unknown.total_kv_blocks.reset();
  ASSERT_TRUE(state_->register_worker(unknown, kStart));
  ASSERT_TRUE(state_->update_load({1, 0}, discovery::ConfirmedLoad{.kv_blocks_used = 900}));
  ASSERT_TRUE(state_->update_load({2, 0}, discovery::ConfirmedLoad{.kv_blocks_used = 900}));

  const auto descriptors = state_->workers(WorkerType::Aggregated);
  ASSERT_EQ(descriptors.size(), 2U);
  EXPECT_DOUBLE_EQ(descriptors[0].kv_usage.value(), 0.9);
  EXPECT_FALSE(descriptors[1].kv_usage.has_value());
  RouteRequest queued;
  queued.selection.request_id = "q";
  std::vector<classifiers::WorkerPrefillLoad> loads;
  state_->eligible_prefill_loads(queued, loads);
  ASSERT_EQ(loads.size(), 2U);
  EXPECT_DOUBLE_EQ(loads[0].kv_usage.value(), 0.9);
  EXPECT_FALSE(loads[1].kv_usage.has_value());
  // The worker with a capacity is busy; the one without takes every request.
  for (int i = 0; i < 3; ++i) {
    const auto routed = route("r" + std::to_string(i), prompt_blocks(60, 10 + i));
    ASSERT_TRUE(routed) << routed.error().message;
    EXPECT_EQ(routed->worker, (WorkerWithDpRank{2, 0}));
  }
}

// What selection policies read of a worker without a capacity: its load, and no total.
TEST_F(SelectorStateTest, PoliciesSeeNoTotalKvBlocksForAWorkerWithoutCapacity) {
  auto& state = make_state();
  add_workers({1});
  auto unknown = registration(2);
  unknown.total_kv_blocks.reset();
  ASSERT_TRUE(state.register_worker(unknown, kStart));
  ASSERT_TRUE(state.update_load({2, 0}, discovery::ConfirmedLoad{.active_requests = 3}));
  ASSERT_EQ(state.workers(WorkerType::Aggregated).size(), 2U);

  selection::SelectionRequest request;
  request.prompt_tokens = 4 * kBlockSize;
  request.block_hashes = prompt_blocks(4, 1);
  const std::vector<std::uint32_t> rows{0, 1};
  std::vector<selection::WorkerLoadInput> loads(rows.size());
  state.compute_signals(request, WorkerType::Aggregated, rows, {}, loads);
  ASSERT_TRUE(loads[0].is_available());
  EXPECT_EQ(loads[0].total_kv_blocks(), 1000U);
  ASSERT_TRUE(loads[1].is_available());
  EXPECT_EQ(loads[1].active_requests(), 3U);
  EXPECT_EQ(loads[1].total_kv_blocks(), std::nullopt);
}

TEST_F(SelectorStateTest, FirstTokenAndReleaseReleaseTheBookingExactlyOnce) {
  auto& state = make_state();
  add_workers({1});
  const auto routed = route("r1", prompt_blocks(4, 1), 8);
  ASSERT_TRUE(routed);
  const auto& load = state.partition_workers().load();
  EXPECT_EQ(load.rank_load({1, 0})->booked_prefill_tokens, 4U * kBlockSize + 8);

  ASSERT_TRUE(state.first_token("r1"));
  EXPECT_EQ(load.rank_load({1, 0})->booked_prefill_tokens, 0U);
  EXPECT_EQ(load.rank_load({1, 0})->open_bookings, 1U);
  EXPECT_EQ(state.first_token("r1").error(), discovery::LoadError::prefill_already_released);

  ASSERT_TRUE(state.release("r1", discovery::BookingEnd::completed));
  EXPECT_EQ(load.rank_load({1, 0})->open_bookings, 0U);
  EXPECT_EQ(load.rank_load({1, 0})->booked_blocks, 0U);
  EXPECT_EQ(load.open_bookings(), 0U);
  EXPECT_EQ(state.release("r1", discovery::BookingEnd::completed).error(),
            discovery::LoadError::unknown_booking);
  EXPECT_EQ(state.first_token("r1").error(), discovery::LoadError::unknown_booking);
}

TEST_F(SelectorStateTest, ReusedRequestIdIsRefusedWhileItsBookingIsOpen) {
  make_state();
  add_workers({1, 2});
  ASSERT_TRUE(route("r1", prompt_blocks(2, 1)));
  const auto again = route("r1", prompt_blocks(2, 2));
  ASSERT_FALSE(again);
  EXPECT_EQ(again.error().code, Error::invalid_request);
  EXPECT_EQ(state_->partition_workers().load().open_bookings(), 1U);
}

TEST_F(SelectorStateTest, RefusedDuplicateLeavesTheRoundRobinPositionAlone) {
  make_state("round-robin");
  add_workers({1, 2});
  const auto first = route("r1", prompt_blocks(2, 1));
  ASSERT_TRUE(first) << first.error().message;
  EXPECT_EQ(first->worker.worker_id, 1U);
  ASSERT_FALSE(route("r1", prompt_blocks(2, 1)));
  // Had the duplicate reached the policy, the rotation would be back at worker 1.
  const auto second = route("r2", prompt_blocks(2, 2));
  ASSERT_TRUE(second) << second.error().message;
  EXPECT_EQ(second->worker.worker_id, 2U);
}

TEST_F(SelectorStateTest, UnreportedBookingIsReleasedWhenItsBookingEnds) {
  auto& state = make_state();
  add_workers({1});
  ASSERT_TRUE(route("r1", prompt_blocks(2, 1)));
  // The worker stays alive (heartbeats every 9 s against a 10 s liveness TTL); only the booking
  // ends.
  std::vector<WorkerId> removed;
  for (const auto at : {9s, 18s, 27s}) {
    ASSERT_TRUE(state.heartbeat(1, 1, kStart + at));
    state.expire(kStart + at, removed);
  }
  state.expire(kStart + 29s, removed);
  EXPECT_EQ(state.partition_workers().load().open_bookings(), 1U);
  state.expire(kStart + 30s, removed);
  EXPECT_TRUE(removed.empty());
  EXPECT_EQ(state.partition_workers().load().open_bookings(), 0U);
  EXPECT_EQ(state.release("r1", discovery::BookingEnd::completed).error(),
            discovery::LoadError::unknown_booking);
}

// ---- worker removal -----------------------------------------------------------------------

TEST_F(SelectorStateTest, DeregisteredWorkerIsNoLongerRouted) {
  auto& state = make_state();
  add_workers({1, 2});
  const auto blocks = prompt_blocks(6, 4);
  ASSERT_TRUE(state.apply_kv_events(stored(1, 1, blocks)));
  ASSERT_TRUE(route("before", blocks).has_value());
  EXPECT_EQ(state.partition_workers().load().open_bookings(), 1U);

  EXPECT_EQ(state.deregister(1, 2).error(), discovery::CatalogError::stale_incarnation);
  ASSERT_TRUE(state.deregister(1, 1));
  // Its bookings went with it.
  EXPECT_EQ(state.partition_workers().load().open_bookings(), 0U);
  for (int i = 0; i < 4; ++i) {
    const auto routed = route(fmt::format("after{}", i), blocks);
    ASSERT_TRUE(routed) << routed.error().message;
    EXPECT_EQ(routed->worker.worker_id, 2U);
    EXPECT_EQ(routed->device_overlap_blocks, 0U);
  }
  ASSERT_TRUE(state.deregister(2, 1));
  const auto none = route("last", blocks);
  ASSERT_FALSE(none);
  EXPECT_EQ(none.error().code, Error::no_workers);
}

TEST_F(SelectorStateTest, ExpiredLivenessRemovesTheWorkerFromRouting) {
  auto& state = make_state("round-robin");
  add_workers({1, 2});
  // Worker 2 keeps renewing its liveness; worker 1 stops.
  ASSERT_TRUE(state.heartbeat(2, 1, kStart + 8s));
  std::vector<WorkerId> removed;
  state.expire(kStart + 9s, removed);
  EXPECT_TRUE(removed.empty());
  state.expire(kStart + 10s, removed);
  EXPECT_EQ(removed, (std::vector<WorkerId>{1}));
  EXPECT_EQ(state.partition_workers().catalog().find(1), nullptr);
  ASSERT_EQ(state.workers(WorkerType::Aggregated).size(), 1U);
  for (int i = 0; i < 3; ++i) {
    const auto routed = route(fmt::format("r{}", i), prompt_blocks(2, i), 0, kStart + 10s);
    ASSERT_TRUE(routed) << routed.error().message;
    EXPECT_EQ(routed->worker.worker_id, 2U);
  }
  EXPECT_EQ(state.heartbeat(1, 1, kStart + 10s).error(), discovery::CatalogError::unknown_worker);
}

TEST_F(SelectorStateTest, LearnsTheBlockSizeFromTheFirstWorkerAndRefusesAnother) {
  auto& state = make_state({}, /*block_size=*/0);
  EXPECT_EQ(state.block_size(), 0U);
  auto first = registration(1);
  first.block_size = 64;
  ASSERT_TRUE(state.register_worker(first, kStart));
  EXPECT_EQ(state.block_size(), 64U);
  const auto refused = state.register_worker(registration(2), kStart);  // block size 16
  ASSERT_FALSE(refused);
  EXPECT_EQ(refused.error().field, "block_size");
  EXPECT_NE(refused.error().reason.find("worker 2"), std::string::npos) << refused.error().reason;
  EXPECT_NE(refused.error().reason.find("64"), std::string::npos) << refused.error().reason;
  EXPECT_EQ(state.partition_workers().catalog().size(), 1U);

  // Once the last worker has left, the next fleet sets the block size again.
  ASSERT_TRUE(state.deregister(1, 1));
  EXPECT_EQ(state.block_size(), 0U);
  ASSERT_TRUE(state.register_worker(registration(2), kStart));
  EXPECT_EQ(state.block_size(), kBlockSize);
  ASSERT_TRUE(state.update_load({2, 0}, discovery::ConfirmedLoad{}));
  EXPECT_TRUE(route("r1", prompt_blocks(3, 1))) << "policies are rebuilt for the new block size";
}

TEST_F(SelectorStateTest, NoWorkersNamesTheWorkersRefusedForTheirBlockSize) {
  auto& state = make_state();
  for (WorkerId id = 1; id <= 4; ++id) {
    auto worker = registration(id);
    worker.block_size = 64;
    ASSERT_FALSE(state.register_worker(worker, kStart));
  }
  const auto failed = route("r1", prompt_blocks(2, 1));
  ASSERT_FALSE(failed);
  EXPECT_EQ(failed.error().code, Error::no_workers);
  const std::string& message = failed.error().message;
  EXPECT_NE(message.find("4 workers of model 'llama' refused"), std::string::npos) << message;
  EXPECT_NE(message.find("4 at block size 64"), std::string::npos) << message;
  EXPECT_NE(message.find("routes at block size 16"), std::string::npos) << message;

  // A refusal is forgotten when the worker's liveness would have ended.
  std::vector<WorkerId> removed;
  state.expire(kStart + 11s, removed);
  const auto later = route("r2", prompt_blocks(2, 1), 0, kStart + 11s);
  ASSERT_FALSE(later);
  EXPECT_EQ(later.error().message.find("refused"), std::string::npos) << later.error().message;
}

TEST_F(SelectorStateTest, HashesTokenIdsAtThePartitionBlockSizeAndCacheNamespace) {
  auto& state = make_state({}, /*block_size=*/0);
  add_workers({1});
  std::vector<std::uint32_t> tokens(40);
  std::iota(tokens.begin(), tokens.end(), 1U);
  RouteRequest request;
  request.selection.request_id = "t1";
  request.selection.prompt_tokens = tokens.size();
  request.prompt_token_ids = tokens;
  request.cache_namespace = "lora-a";
  const auto routed = state.route(request, kStart);
  ASSERT_TRUE(routed) << routed.error().message;
  EXPECT_EQ(request.selection.block_hashes,
            discovery::BlockHasher(kBlockSize, "lora-a").sequence_hashes(tokens));
  EXPECT_EQ(request.selection.block_hashes.size(), 2U);
  EXPECT_TRUE(request.prompt_token_ids.empty());
  EXPECT_EQ(routed->uncached_prefill_tokens, 40U);
}

// ---- failures -----------------------------------------------------------------------------

TEST_F(SelectorStateTest, NoWorkersIsReportedAsNoWorkers) {
  make_state();
  const auto failed = route("r1", prompt_blocks(2, 1));
  ASSERT_FALSE(failed);
  EXPECT_EQ(failed.error().code, Error::no_workers);
  EXPECT_FALSE(failed.error().message.empty());
  EXPECT_EQ(state_->partition_workers().load().open_bookings(), 0U);
}

TEST_F(SelectorStateTest, NoWorkersOfTheRequestedTypeIsReportedAsNoWorkers) {
  auto& state = make_state();
  add_workers({1});
  const auto blocks = prompt_blocks(2, 1);
  RouteRequest input;
  input.selection.request_id = "p1";
  input.worker_type = WorkerType::Prefill;
  input.selection.prompt_tokens = blocks.size() * kBlockSize;
  input.selection.block_hashes = blocks;
  const auto failed = state.route(input, kStart);
  ASSERT_FALSE(failed);
  EXPECT_EQ(failed.error().code, Error::no_workers);
}

TEST_F(SelectorStateTest, MoreHashesThanFullBlocksIsAnInvalidRequest) {
  auto& state = make_state();
  add_workers({1});
  const auto blocks = prompt_blocks(4, 1);
  RouteRequest input;
  input.selection.request_id = "r1";
  input.selection.prompt_tokens = 4 * kBlockSize - 1;  // three full blocks
  input.selection.block_hashes = blocks;
  const auto failed = state.route(input, kStart);
  ASSERT_FALSE(failed);
  EXPECT_EQ(failed.error().code, Error::invalid_request);
  EXPECT_NE(failed.error().message.find("4 block hashes"), std::string::npos)
      << failed.error().message;
  EXPECT_EQ(state.partition_workers().load().open_bookings(), 0U);
  // Exactly as many hashes as full blocks is fine.
  input.selection.prompt_tokens = 4 * kBlockSize;
  EXPECT_TRUE(state.route(input, kStart));
}

TEST_F(SelectorStateTest, EmptyPromptIsAnInvalidRequest) {
  auto& state = make_state();
  add_workers({1});
  RouteRequest input;
  input.selection.request_id = "r1";
  const auto failed = state.route(input, kStart);
  ASSERT_FALSE(failed);
  EXPECT_EQ(failed.error().code, Error::invalid_request);
  EXPECT_EQ(state.partition_workers().load().open_bookings(), 0U);
}

TEST_F(SelectorStateTest, PromptShorterThanOneBlockIsRoutedWithoutHashes) {
  auto& state = make_state();
  add_workers({1});
  RouteRequest input;
  input.selection.request_id = "short";
  input.selection.prompt_tokens = kBlockSize - 1;
  const auto routed = state.route(input, kStart);
  ASSERT_TRUE(routed) << routed.error().message;
  EXPECT_EQ(routed->uncached_prefill_tokens, kBlockSize - 1);
  EXPECT_EQ(routed->device_overlap_blocks, 0U);
}

// ---- approximate mode ---------------------------------------------------------------------

TEST_F(SelectorStateTest, ApproximateWorkerAttractsTheSamePrefixAfterARoute) {
  auto& state = make_state();
  add_workers({1, 2, 3}, /*publishes_kv_events=*/false);
  const auto first_prompt = prompt_blocks(10, 5, /*shared=*/8);
  const auto first = route("r1", first_prompt);
  ASSERT_TRUE(first) << first.error().message;
  EXPECT_EQ(first->device_overlap_blocks, 0U);
  // The routing decision is the only evidence of the cache: the index now predicts it.
  EXPECT_EQ(state.partition_workers().index().blocks_held(first->worker, StorageTier::Device), 10U);
  ASSERT_TRUE(state.first_token("r1"));
  ASSERT_TRUE(state.release("r1", discovery::BookingEnd::completed));

  // A later request sharing the first eight blocks goes where they are predicted to be.
  const auto second = route("r2", prompt_blocks(12, 6, /*shared=*/8), 0, kStart + 1s);
  ASSERT_TRUE(second) << second.error().message;
  EXPECT_EQ(second->worker, first->worker);
  EXPECT_EQ(second->device_overlap_blocks, 8U);
  EXPECT_EQ(second->uncached_prefill_tokens, 4U * kBlockSize);
}

TEST_F(SelectorStateTest, WorkerPublishingEventsIsNotFilledFromRoutingDecisions) {
  auto& state = make_state();
  add_workers({1});
  const auto routed = route("r1", prompt_blocks(6, 1));
  ASSERT_TRUE(routed);
  EXPECT_EQ(state.partition_workers().index().blocks_held({1, 0}, StorageTier::Device), 0U);
}

// ---- text blocks (the `estimate` tokenizer mode) ---------------------------------------------

std::expected<RouteOutcome, RouteFailure> route_text(SelectorState& state, std::string id,
                                                     std::string text, TimePoint now = kStart) {
  RouteRequest request;
  request.selection.request_id = std::move(id);
  request.selection.prompt_tokens = discovery::estimated_prompt_tokens(text.size());
  request.prompt_text = std::move(text);
  return state.route(request, now);
}

TEST_F(SelectorStateTest, TextPromptIsHashedInByteBlocksIntoTheTextIndexOnly) {
  auto& state = make_state();
  add_workers({1});
  const std::string text(10 * kBlockSize * discovery::kTextBytesPerToken + 7, 'a');
  RouteRequest request;
  request.selection.request_id = "t1";
  request.selection.prompt_tokens = discovery::estimated_prompt_tokens(text.size());
  request.prompt_text = text;
  const auto routed = state.route(request, kStart);
  ASSERT_TRUE(routed) << routed.error().message;
  std::vector<BlockHash> expected;
  discovery::TextBlockHasher(kBlockSize).append_sequence_hashes(text, expected);
  EXPECT_EQ(request.selection.block_hashes, expected);
  EXPECT_EQ(request.selection.block_hashes.size(), 10U);
  EXPECT_EQ(request.selection.prompt_keys, selection::PromptKeys::text_blocks);
  EXPECT_TRUE(request.prompt_text.empty());
  // The decision is recorded where only text blocks are matched: a worker publishing KV events
  // keeps its KV index exactly as its events left it.
  EXPECT_EQ(state.partition_workers().text_index().blocks_held({1, 0}, StorageTier::Device), 10U);
  EXPECT_EQ(state.partition_workers().index().blocks_held({1, 0}, StorageTier::Device), 0U);
}

TEST_F(SelectorStateTest, RepeatedTextPrefixGoesWhereItWasRoutedWithItsOverlap) {
  auto& state = make_state();
  add_workers({1, 2, 3});
  const std::string shared(8 * kBlockSize * discovery::kTextBytesPerToken, 's');
  const auto first = route_text(state, "t1", shared + std::string(200, 'x'));
  ASSERT_TRUE(first) << first.error().message;
  EXPECT_EQ(first->device_overlap_blocks, 0U);
  ASSERT_TRUE(state.first_token("t1"));
  ASSERT_TRUE(state.release("t1", discovery::BookingEnd::completed));

  const auto second = route_text(state, "t2", shared + std::string(300, 'y'), kStart + 1s);
  ASSERT_TRUE(second) << second.error().message;
  EXPECT_EQ(second->worker, first->worker);
  EXPECT_EQ(second->device_overlap_blocks, 8U);
}

TEST_F(SelectorStateTest, TextBlocksNeverMatchEngineKvBlocks) {
  auto& state = make_state();
  add_workers({1, 2});
  const std::string text(4 * kBlockSize * discovery::kTextBytesPerToken, 'k');
  std::vector<BlockHash> text_blocks;
  discovery::TextBlockHasher(kBlockSize).append_sequence_hashes(text, text_blocks);
  // Worker 2's engine reports exactly these hashes as KV blocks: a text request must not see them.
  ASSERT_TRUE(state.apply_kv_events(stored(2, 1, text_blocks)));
  const auto routed = route_text(state, "t1", text);
  ASSERT_TRUE(routed) << routed.error().message;
  EXPECT_EQ(routed->device_overlap_blocks, 0U);
  ASSERT_TRUE(state.release("t1", discovery::BookingEnd::completed));

  // And a token-keyed request with those hashes sees worker 2's KV blocks, not the text index.
  const auto by_tokens = route("k1", text_blocks, 0, kStart + 1s);
  ASSERT_TRUE(by_tokens) << by_tokens.error().message;
  EXPECT_EQ(by_tokens->worker, (WorkerWithDpRank{2, 0}));
  EXPECT_EQ(by_tokens->device_overlap_blocks, 4U);
}

TEST_F(SelectorStateTest, TextBlocksLeaveWithTheirWorker) {
  auto& state = make_state();
  add_workers({1});
  const std::string text(3 * kBlockSize * discovery::kTextBytesPerToken, 'e');
  ASSERT_TRUE(route_text(state, "t1", text));
  EXPECT_EQ(state.partition_workers().text_index().blocks_held({1, 0}, StorageTier::Device), 3U);
  ASSERT_TRUE(state.deregister(1, 1));
  EXPECT_FALSE(state.partition_workers().text_index().slot_of({1, 0}));
}

// ---- query-only and exact targets ---------------------------------------------------------

// A policy whose every component counts its calls: which paths run the policy, and how often.
struct ComponentCalls {
  int filter = 0;
  int scorer = 0;
  int picker = 0;
  int total() const { return filter + scorer + picker; }
};

std::expected<void, plugins::RegistryError> register_counting_policy(
    plugins::RouterPluginRegistry& registry, std::shared_ptr<ComponentCalls> calls) {
  using namespace plugins::worker_selection;
  struct Filter final : WorkerFilter {
    std::shared_ptr<ComponentCalls> calls;
    PolicyResult<bool> keep(const WorkerSelectionContext&, const WorkerCandidate&) override {
      ++calls->filter;
      return true;
    }
  };
  struct Scorer final : WorkerScorer {
    std::shared_ptr<ComponentCalls> calls;
    WorkerInputs required_worker_inputs() const override { return WorkerInputs::PREFERRED_TAINT; }
    PolicyResult<double> score(const WorkerSelectionContext&, const WorkerCandidate&) override {
      ++calls->scorer;
      return 1.0;
    }
  };
  struct Picker final : WorkerPicker {
    std::shared_ptr<ComponentCalls> calls;
    PolicyResult<std::size_t> pick(const WorkerSelectionContext&, const WorkerInputView&) override {
      ++calls->picker;
      return std::size_t{0};
    }
  };
  return registry.register_worker_selection(
      "counting",
      [calls](const WorkerSelectionPolicyParameters&)
          -> std::expected<WorkerSelectionPolicyFactory, WorkerSelectionPolicyProviderError> {
        return
            [calls](const RouterConfig& config, WorkerType worker_type, const RoutingPartition&) {
              std::vector<std::unique_ptr<WorkerFilter>> filters;
              filters.push_back(std::make_unique<Filter>());
              static_cast<Filter&>(*filters.back()).calls = calls;
              std::vector<std::unique_ptr<WorkerScorer>> scorers;
              scorers.push_back(std::make_unique<Scorer>());
              static_cast<Scorer&>(*scorers.back()).calls = calls;
              auto picker = std::make_unique<Picker>();
              picker->calls = calls;
              return WorkerSelectionPolicy(config, worker_type, std::move(filters),
                                           std::move(scorers), std::move(picker));
            };
      });
}

// A query gets the decision a request would get, overlap and costs included, and holds nothing:
// the next query and the real route that follows see the same fleet.
TEST_F(SelectorStateTest, AQueryOnlyRequestIsAnsweredAsARouteAndBooksNothing) {
  auto& state = make_state();
  add_workers({1, 2});
  const auto blocks = prompt_blocks(6, 4);
  ASSERT_TRUE(state.apply_kv_events(stored(2, 1, blocks)));
  for (int i = 0; i < 3; ++i) {
    RouteRequest query;
    query.selection.request_id = "probe";
    query.selection.prompt_tokens = blocks.size() * kBlockSize + 3;
    query.selection.block_hashes = blocks;
    query.query_only = true;
    const auto answered = state.route(query, kStart);
    ASSERT_TRUE(answered) << answered.error().message;
    EXPECT_EQ(answered->worker, (WorkerWithDpRank{2, 0}));
    EXPECT_EQ(answered->device_overlap_blocks, 6U);
    EXPECT_EQ(answered->uncached_prefill_tokens, 3U);
    EXPECT_FALSE(answered->scorer_costs.empty());
    EXPECT_EQ(answered->booking_expires_at, TimePoint{});
  }
  for (const WorkerId id : {1, 2}) {
    EXPECT_EQ(state.partition_workers().load().rank_load({id, 0})->open_bookings, 0U);
  }
  // The same id routes for real afterwards: no booking of it was left open.
  const auto routed = route("probe", blocks, 3);
  ASSERT_TRUE(routed) << routed.error().message;
  EXPECT_EQ(routed->worker, (WorkerWithDpRank{2, 0}));
  EXPECT_EQ(state.partition_workers().load().rank_load({2, 0})->open_bookings, 1U);
}

// A pin is the caller's exact target: the policy's filter, scorer and picker never run (nor is
// the preferred-taint signal its scorer declared computed), and the pinned worker is booked even
// where the policy would have gone elsewhere.
TEST_F(SelectorStateTest, APinnedRequestTakesTheExactTargetPathWithoutThePolicy) {
  auto calls = std::make_shared<ComponentCalls>();
  ASSERT_TRUE(register_counting_policy(registry_, calls));
  auto& state = make_state("counting");
  add_workers({1, 2, 3});
  const auto blocks = prompt_blocks(4, 2);
  ASSERT_TRUE(state.apply_kv_events(stored(3, 1, blocks)));

  ASSERT_TRUE(route("free", blocks));
  EXPECT_EQ(calls->picker, 1) << "an unpinned request runs the policy";
  const int before = calls->total();

  RouteRequest pinned;
  pinned.selection.request_id = "pinned";
  pinned.selection.prompt_tokens = blocks.size() * kBlockSize;
  pinned.selection.block_hashes = blocks;
  pinned.selection.preferred_taints = {{"gpu-a", 0.5}};
  pinned.selection.pinned_worker =
      plugins::worker_selection::WorkerAffinityTarget{.worker_id = 3, .dp_rank = 0};
  const auto routed = state.route(pinned, kStart);
  ASSERT_TRUE(routed) << routed.error().message;
  EXPECT_EQ(routed->worker, (WorkerWithDpRank{3, 0}));
  EXPECT_EQ(routed->device_overlap_blocks, 4U);
  EXPECT_TRUE(routed->scorer_costs.empty());
  EXPECT_EQ(calls->total(), before) << "no component ran for the pinned request";
  EXPECT_EQ(state.partition_workers().load().rank_load({3, 0})->open_bookings, 1U);

  // A pin on a worker the request may not use fails naming why, still without the policy.
  RouteRequest excluded = pinned;
  excluded.selection.request_id = "excluded";
  excluded.selection.excluded_workers = {3};
  const auto refused = state.route(excluded, kStart);
  ASSERT_FALSE(refused);
  EXPECT_EQ(refused.error().code, Error::no_workers);
  EXPECT_EQ(calls->total(), before);
}

// A pin that names no rank targets every rank of its worker: the rank holding most of the prompt
// is booked.
TEST_F(SelectorStateTest, APinWithoutARankGoesToTheWorkersRankHoldingMostOfThePrompt) {
  auto& state = make_state();
  auto worker = registration(5);
  worker.data_parallel_size = 3;
  ASSERT_TRUE(state.register_worker(worker, kStart));
  const auto blocks = prompt_blocks(6, 8);
  KvEventBatch on_rank_2 = stored(5, 1, {blocks.begin(), blocks.begin() + 4});
  on_rank_2.worker.dp_rank = 2;
  KvEventBatch on_rank_1 = stored(5, 1, {blocks.begin(), blocks.begin() + 1});
  on_rank_1.worker.dp_rank = 1;
  ASSERT_TRUE(state.apply_kv_events(on_rank_2));
  ASSERT_TRUE(state.apply_kv_events(on_rank_1));
  RouteRequest pinned;
  pinned.selection.request_id = "any-rank";
  pinned.selection.prompt_tokens = blocks.size() * kBlockSize;
  pinned.selection.block_hashes = blocks;
  pinned.selection.pinned_worker = plugins::worker_selection::WorkerAffinityTarget{.worker_id = 5};
  const auto routed = state.route(pinned, kStart);
  ASSERT_TRUE(routed) << routed.error().message;
  EXPECT_EQ(routed->worker, (WorkerWithDpRank{5, 2}));
  EXPECT_EQ(routed->device_overlap_blocks, 4U);
}

// ---- policy factories ----------------------------------------------------------------------

// Registers `type`, whose factory counts its calls and builds what `make` returns.
void register_factory(plugins::RouterPluginRegistry& registry, std::string type,
                      std::shared_ptr<int> calls,
                      std::function<plugins::worker_selection::WorkerSelectionPolicy(
                          const plugins::worker_selection::RouterConfig&, WorkerType)>
                          make) {
  using namespace plugins::worker_selection;
  ASSERT_TRUE(registry.register_worker_selection(
      std::move(type),
      [calls, make](const WorkerSelectionPolicyParameters&)
          -> std::expected<WorkerSelectionPolicyFactory, WorkerSelectionPolicyProviderError> {
        return [calls, make](const RouterConfig& config, WorkerType worker_type,
                             const RoutingPartition&) {
          ++*calls;
          return make(config, worker_type);
        };
      }));
}

plugins::worker_selection::WorkerSelectionPolicy round_robin_like(
    const plugins::worker_selection::RouterConfig& config, WorkerType worker_type) {
  using namespace plugins::worker_selection;
  struct First final : WorkerPicker {
    PolicyResult<std::size_t> pick(const WorkerSelectionContext&, const WorkerInputView&) override {
      return std::size_t{0};
    }
  };
  return WorkerSelectionPolicy(config, worker_type, {}, std::make_unique<First>());
}

struct BuildFailure {
  std::string partition;
  WorkerType role;
  std::string reason;
};

// A role's factory runs once, when the partition learns its block size, not on a request; the
// policies survive the partition emptying and filling again, and are rebuilt only for a fleet
// of another block size.
TEST_F(SelectorStateTest, PoliciesAreBuiltWhenThePartitionLearnsItsBlockSizeAndOutliveItsWorkers) {
  auto calls = std::make_shared<int>(0);
  register_factory(registry_, "counted", calls, round_robin_like);
  auto& state = make_state("counted", /*block_size=*/0);
  EXPECT_EQ(*calls, 0) << "no block size yet: nothing to build with";
  add_workers({1});
  EXPECT_EQ(*calls, 1) << "built at the first registration (the other roles use the built-in)";
  ASSERT_TRUE(route("r1", prompt_blocks(2, 1)));
  ASSERT_TRUE(route("r2", prompt_blocks(2, 2)));
  EXPECT_EQ(*calls, 1) << "requests never run a factory";

  ASSERT_TRUE(state.deregister(1, 1));
  add_workers({2});
  EXPECT_EQ(*calls, 1) << "the same block size keeps the policies";
  ASSERT_TRUE(state.deregister(2, 1));
  auto bigger = registration(3);
  bigger.block_size = 2 * kBlockSize;
  ASSERT_TRUE(state.register_worker(bigger, kStart));
  EXPECT_EQ(*calls, 2) << "another block size is another configuration";
}

TEST_F(SelectorStateTest, APolicyWithAConfiguredBlockSizeIsBuiltWithThePartition) {
  auto calls = std::make_shared<int>(0);
  register_factory(registry_, "counted", calls, round_robin_like);
  make_state("counted");
  EXPECT_EQ(*calls, 1);
}

// A factory that throws, or returns a policy without a picker or for another role, fails that
// role's requests with policy_failed naming the policy and the cause, and is reported once; the
// partition's other roles route.
TEST_F(SelectorStateTest, AFactoryThatFailsFailsItsRolesRequestsNamingTheCause) {
  using plugins::worker_selection::WorkerSelectionPolicy;
  auto calls = std::make_shared<int>(0);
  register_factory(registry_, "fragile", calls,
                   [](const plugins::worker_selection::RouterConfig& config,
                      WorkerType worker_type) -> WorkerSelectionPolicy {
                     if (worker_type == WorkerType::Prefill) {
                       throw std::runtime_error("no GPU budget for prefill");
                     }
                     if (worker_type == WorkerType::Decode) {
                       return WorkerSelectionPolicy(config, worker_type, {}, nullptr);
                     }
                     if (worker_type == WorkerType::Encode) {
                       return round_robin_like(config, WorkerType::Aggregated);
                     }
                     return round_robin_like(config, worker_type);
                   });
  selection::RouterPolicyConfig config;
  for (auto& role : config.worker_selection) role = "fragile";
  auto plugins = registry_.resolve_plugins(config);
  ASSERT_TRUE(plugins) << plugins.error().message();
  plugins_ = std::make_unique<plugins::RouterPlugins>(std::move(*plugins));
  std::vector<BuildFailure> failures;
  SelectorOptions options;
  options.partition.model = std::string{kModel};
  options.router.block_size = kBlockSize;
  options.on_policy_build_failure =
      [&](const plugins::worker_selection::RoutingPartition& partition, WorkerType role,
          const std::string& reason) {
        failures.push_back({partition.model, role, reason});
      };
  SelectorState state{std::move(options), *plugins_};
  ASSERT_EQ(failures.size(), 3U);
  EXPECT_EQ(failures[0].role, WorkerType::Prefill);
  EXPECT_NE(failures[0].reason.find("threw: no GPU budget for prefill"), std::string::npos)
      << failures[0].reason;
  EXPECT_NE(failures[0].reason.find("'fragile'"), std::string::npos) << failures[0].reason;
  EXPECT_EQ(failures[1].role, WorkerType::Decode);
  EXPECT_NE(failures[1].reason.find("picker"), std::string::npos) << failures[1].reason;
  EXPECT_EQ(failures[2].role, WorkerType::Encode);
  EXPECT_NE(failures[2].reason.find("for aggregated requests"), std::string::npos)
      << failures[2].reason;

  for (const WorkerType role :
       {WorkerType::Aggregated, WorkerType::Prefill, WorkerType::Decode, WorkerType::Encode}) {
    auto worker = registration(10 + static_cast<WorkerId>(role));
    worker.role = role;
    ASSERT_TRUE(state.register_worker(worker, kStart));
    RouteRequest request;
    request.worker_type = role;
    request.selection.request_id = fmt::format("r-{}", as_str(role));
    request.selection.prompt_tokens = 2 * kBlockSize;
    request.selection.block_hashes = prompt_blocks(2, 3);
    const auto routed = state.route(request, kStart);
    if (role == WorkerType::Aggregated) {
      EXPECT_TRUE(routed) << routed.error().message;
      continue;
    }
    ASSERT_FALSE(routed) << as_str(role);
    EXPECT_EQ(routed.error().code, Error::policy_failed);
    EXPECT_NE(routed.error().message.find("could not be built"), std::string::npos)
        << routed.error().message;
  }
  EXPECT_EQ(*calls, 4);
  EXPECT_EQ(failures.size(), 3U) << "reported once, not per request";
}

// A bundle that nothing resolved (RouterPlugins{}) holds no factory: every role keeps the built-in
// default policy (kv-cost, named `default`) instead of failing its requests.
TEST_F(SelectorStateTest, AnEmptyPluginBundleRoutesEveryRoleWithTheBuiltInDefault) {
  plugins_ = std::make_unique<plugins::RouterPlugins>();
  std::vector<std::string> failures;
  SelectorOptions options;
  options.partition.model = std::string{kModel};
  options.router.block_size = kBlockSize;
  options.on_policy_build_failure = [&](const plugins::worker_selection::RoutingPartition&,
                                        WorkerType,
                                        const std::string& reason) { failures.push_back(reason); };
  state_ = std::make_unique<SelectorState>(std::move(options), *plugins_);
  EXPECT_EQ(failures, std::vector<std::string>{});

  for (const WorkerType role : kAllWorkerTypes) {
    auto worker = registration(10 + static_cast<WorkerId>(role));
    worker.role = role;
    ASSERT_TRUE(state_->register_worker(worker, kStart));
    RouteRequest request;
    request.worker_type = role;
    request.selection.request_id = fmt::format("r-{}", as_str(role));
    request.selection.prompt_tokens = 2 * kBlockSize;
    request.selection.block_hashes = prompt_blocks(2, 3);
    const auto routed = state_->route(request, kStart);
    ASSERT_TRUE(routed) << as_str(role) << ": " << routed.error().message;
    EXPECT_EQ(routed->worker.worker_id, worker.worker_id);
    ASSERT_TRUE(routed->scorer_names);
    ASSERT_EQ(routed->scorer_names->size(), 1U);
    EXPECT_NE(routed->scorer_names->front().find("KvCostScorer"), std::string::npos)
        << routed->scorer_names->front();
    EXPECT_EQ(state_->policy_name(role), "default");
  }
}

}  // namespace
}  // namespace kvr
