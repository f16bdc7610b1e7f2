// The partition core driven directly, no actor system and no clock: each test feeds inputs with
// the time and checks the effects (answers, dumps, removals, fleet, wake-ups, events) and gauges.
#include "selection/partition/partition_router.hpp"

#include <algorithm>

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

template <class Event>
std::size_t count(const PartitionEffects& effects) {
  return static_cast<std::size_t>(std::ranges::count_if(
      effects.events,
      [](const PartitionEvent& event) { return std::holds_alternative<Event>(event); }));
}

class PartitionRouterTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(selection::register_builtin_policies(registry_));
    auto plugins = registry_.resolve_plugins(selection::RouterPolicyConfig{});
    ASSERT_TRUE(plugins) << plugins.error().message();
    plugins_ = std::make_unique<plugins::RouterPlugins>(std::move(*plugins));
    options_.options.partition.model = std::string{kModel};
    options_.options.router.block_size = kBlockSize;
    options_.options.booking_ttl = 60s;
  }

  // The class `default` is busy above 100 active prefill tokens; a request waits at most 5 s.
  void queue_while_busy() {
    classifiers::PolicyClassConfig busy;
    busy.name = "default";
    busy.prefill_busy_threshold = 100;
    const std::vector<classifiers::PolicyClassConfig> classes{busy};
    options_.policy_classes =
        classifiers::resolve_policy_classes(classes, classifiers::default_policy_class());
    options_.queue_max_wait = 5s;
  }

  PartitionRouter& make() {
    router_ = std::make_unique<PartitionRouter>(options_, *plugins_);
    return *router_;
  }

  discovery::WorkerRegistration worker(WorkerId id, std::chrono::milliseconds ttl = 10s) {
    auto registration = testing::worker_registration(id, std::string{kModel}, kBlockSize, ttl);
    registration.dump_subject = "dump." + std::to_string(id);
    registration.generate_subject = "generate." + std::to_string(id);
    registration.publishes_kv_events = true;
    return registration;
  }

  void add_worker(WorkerId id, TimePoint now = kStart) { add(worker(id), now); }

  // A worker whose engine did not say its KV capacity.
  void add_worker_without_capacity(WorkerId id, TimePoint now = kStart) {
    auto registration = worker(id);
    registration.total_kv_blocks.reset();
    add(std::move(registration), now);
  }

  void add(discovery::WorkerRegistration registration, TimePoint now) {
    const WorkerId id = registration.worker_id;
    router_->register_worker(std::move(registration), now, effects_);
    router_->update_load({id, 1, {{0, discovery::ConfirmedLoad{}}}}, now, effects_);
    effects_.clear();
  }

  // The CeilingsRecorded events of the effects, which are cleared.
  // The ceilings of the prompts routed since the last call, recorded as the selector actor does
  // once the answers have left (effects' ceilings_due says that some wait).
  std::vector<partition_event::CeilingsRecorded> ceilings_recorded() {
    const bool due = effects_.ceilings_due;
    router_->record_due_ceilings(effects_);
    std::vector<partition_event::CeilingsRecorded> recorded;
    for (const PartitionEvent& event : effects_.events) {
      if (const auto* e = std::get_if<partition_event::CeilingsRecorded>(&event)) {
        recorded.push_back(*e);
      }
    }
    EXPECT_EQ(due, !recorded.empty()) << "ceilings_due tells whether any wait";
    effects_.clear();
    return recorded;
  }

  // A request of `blocks` full blocks of its own (no shared prefix unless `prefix` is given).
  RouteRequest request(std::string id, std::size_t blocks, std::string prefix = {}) {
    RouteRequest input;
    input.selection.request_id = id;
    input.selection.prompt_tokens = blocks * kBlockSize;
    const std::string seed = prefix.empty() ? id : prefix;
    std::optional<BlockHash> parent;
    for (std::size_t i = 0; i < blocks; ++i) {
      parent = discovery::BlockHasher::chain(parent, std::hash<std::string>{}(seed) + i);
      input.selection.block_hashes.push_back(*parent);
    }
    return input;
  }

  std::optional<RouteReply> route(RouteRequest input, TimePoint now = kStart) {
    return router_->route(input, next_ticket_++, now, effects_);
  }

  WorkerId worker_of(const std::optional<RouteReply>& reply) {
    EXPECT_TRUE(reply && reply->result)
        << (reply && !reply->result ? reply->result.error().message : "no answer now");
    return reply && reply->result ? reply->result->worker.worker_id : 0;
  }

  plugins::RouterPluginRegistry registry_;
  std::unique_ptr<plugins::RouterPlugins> plugins_;
  PartitionRouterOptions options_;
  std::unique_ptr<PartitionRouter> router_;
  PartitionEffects effects_;
  RouteTicket next_ticket_ = 1;
};

TEST_F(PartitionRouterTest, AnswersAtOnceWithoutWorkersAndBooksOnTheWorkerThatJoined) {
  make();
  auto none = route(request("a", 2));
  ASSERT_TRUE(none);
  ASSERT_FALSE(none->result);
  EXPECT_EQ(none->result.error().code, Error::no_workers);

  router_->register_worker(worker(7), kStart, effects_);
  EXPECT_TRUE(effects_.fleet_changed);
  EXPECT_EQ(count<partition_event::WorkerJoined>(effects_), 1U);
  EXPECT_EQ(router_->fleet().workers.size(), 1U);
  effects_.clear();

  auto routed = route(request("b", 2));
  EXPECT_EQ(worker_of(routed), 7U);
  EXPECT_EQ(routed->generate_subject, "generate.7");
  EXPECT_EQ(router_->gauges().bookings_open, 1U);
  ASSERT_TRUE(router_->change_booking({"b", true}, kStart, effects_));
  EXPECT_EQ(router_->gauges().bookings_open, 0U);
  EXPECT_FALSE(router_->change_booking({"b", true}, kStart, effects_))
      << "a booking is released once";
}

TEST_F(PartitionRouterTest, AKvEventGapAsksForOneDumpPerRetryPeriod) {
  make();
  add_worker(3);  // asked for its dump at registration
  KvEventBatch batch{.worker = {3, 0}, .incarnation = 1, .event_id = 5, .events = {}};
  router_->apply_kv_events(batch, kStart + 2s, effects_);
  ASSERT_EQ(effects_.dumps.size(), 1U);
  EXPECT_EQ(effects_.dumps[0].dump_subject, "dump.3");
  EXPECT_EQ(count<partition_event::KvEventGap>(effects_), 1U);
  effects_.clear();

  batch.event_id = 9;
  router_->apply_kv_events(batch, kStart + 2s + 100ms, effects_);
  EXPECT_TRUE(effects_.dumps.empty()) << "within dump_retry of the last request";
  effects_.clear();
  batch.event_id = 12;
  router_->apply_kv_events(batch, kStart + 4s, effects_);
  EXPECT_EQ(effects_.dumps.size(), 1U);
}

TEST_F(PartitionRouterTest, LeasesAreHeldWhileTheLinkIsDownAndDumpsArePacedAfterItReturns) {
  options_.resync_dumps_per_tick = 1;
  make();
  add_worker(1);
  add_worker(2);
  router_->tick(kStart, effects_);  // sends worker 2's registration dump, paced behind worker 1's
  router_->set_link(false, kStart, effects_);
  router_->tick(kStart + 30s, effects_);
  EXPECT_TRUE(effects_.removed.empty()) << "no liveness runs out while the node cannot hear";
  effects_.clear();

  router_->set_link(true, kStart + 30s, effects_);
  ASSERT_EQ(count<partition_event::LinkRestored>(effects_), 1U);
  effects_.clear();
  // Both workers are heard from again; one dump per tick.
  router_->heartbeat({1, 1}, kStart + 30s, effects_);
  router_->heartbeat({2, 1}, kStart + 30s, effects_);
  EXPECT_EQ(effects_.dumps.size(), 1U);
  effects_.clear();
  router_->tick(kStart + 30s + 100ms, effects_);
  EXPECT_EQ(effects_.dumps.size(), 1U);
  effects_.clear();
  // Worker 2 stays silent for a whole TTL after the reconnect and leaves.
  router_->heartbeat({1, 1}, kStart + 38s, effects_);
  router_->tick(kStart + 41s, effects_);
  EXPECT_EQ(effects_.removed, std::vector<WorkerId>{2});
  EXPECT_TRUE(effects_.fleet_changed);
}

TEST_F(PartitionRouterTest, AQueuedRequestIsAnsweredUnderItsTicketWhenCapacityFrees) {
  queue_while_busy();
  make();
  ASSERT_TRUE(router_->queues());
  add_worker(1);
  EXPECT_EQ(worker_of(route(request("a", 8))), 1U);
  const RouteTicket waiting_ticket = next_ticket_;
  EXPECT_FALSE(route(request("b", 8))) << "every worker is busy for its class";
  EXPECT_EQ(router_->gauges().queued, 1U);
  ASSERT_TRUE(effects_.wake_at);
  EXPECT_EQ(*effects_.wake_at, kStart + 5s);
  effects_.clear();

  ASSERT_TRUE(router_->change_booking({"a", false}, kStart + 1s, effects_));
  ASSERT_EQ(effects_.answers.size(), 1U);
  EXPECT_EQ(effects_.answers[0].first, waiting_ticket);
  ASSERT_TRUE(effects_.answers[0].second.result);
  EXPECT_EQ(count<partition_event::QueueOutcome>(effects_), 1U);
  EXPECT_EQ(count<partition_event::QueueWaited>(effects_), 1U);
}

TEST_F(PartitionRouterTest, AWaitLimitOrACancelEndsAQueuedRequestWithAnExplicitAnswer) {
  queue_while_busy();
  make();
  add_worker(1);
  ASSERT_TRUE(route(request("a", 8)));
  EXPECT_FALSE(route(request("b", 8)));
  EXPECT_FALSE(route(request("c", 8)));
  effects_.clear();

  router_->cancel("c", kStart + 1s, effects_);
  ASSERT_EQ(effects_.answers.size(), 1U);
  EXPECT_EQ(effects_.answers[0].second.result.error().code, Error::unavailable);
  effects_.clear();

  router_->wake(kStart + 5s, effects_);
  ASSERT_EQ(effects_.answers.size(), 1U);
  EXPECT_EQ(effects_.answers[0].second.result.error().code, Error::timeout);
  EXPECT_EQ(router_->gauges().queued, 0U);
}

TEST_F(PartitionRouterTest, AFencedPartitionRoutesOnlyWhileItsLeaseLiesAhead) {
  options_.fenced = true;
  options_.ownership_wait = 2s;
  make();
  add_worker(1);
  const RouteTicket first = next_ticket_;
  EXPECT_FALSE(route(request("a", 2))) << "waits for the lease";
  router_->set_owned_until(kStart + 10s, kStart + 1s, effects_);
  ASSERT_EQ(effects_.answers.size(), 1U);
  EXPECT_EQ(effects_.answers[0].first, first);
  EXPECT_TRUE(effects_.answers[0].second.result);
  effects_.clear();

  EXPECT_FALSE(route(request("b", 2), kStart + 11s)) << "the lease ran out";
  router_->tick(kStart + 14s, effects_);
  ASSERT_EQ(effects_.answers.size(), 1U);
  EXPECT_EQ(effects_.answers[0].second.result.error().code, Error::unavailable);
}

// A node that starts, or takes a partition over, while its workers sit idle would never see a KV
// event gap: each worker it learns of is asked for its dump once per rank, paced per tick.
TEST_F(PartitionRouterTest, EveryWorkerLearntOfIsAskedForItsDumpOncePacedPerTick) {
  for (const bool fenced : {false, true}) {
    options_.fenced = fenced;
    options_.resync_dumps_per_tick = 2;
    make();
    if (fenced) router_->set_owned_until(kStart + 1h, kStart, effects_);
    effects_.clear();
    discovery::WorkerRegistration ranks = worker(4);
    ranks.data_parallel_size = 3;
    router_->register_worker(ranks, kStart, effects_);
    ASSERT_EQ(effects_.dumps.size(), 2U) << "fenced " << fenced;
    EXPECT_EQ(effects_.dumps[0].worker, (WorkerWithDpRank{4, 0}));
    EXPECT_EQ(effects_.dumps[1].worker, (WorkerWithDpRank{4, 1}));
    effects_.clear();
    router_->tick(kStart + 100ms, effects_);
    ASSERT_EQ(effects_.dumps.size(), 1U);
    EXPECT_EQ(effects_.dumps[0].worker, (WorkerWithDpRank{4, 2}));
    effects_.clear();
    // The same registration again (a refresh) asks for nothing.
    router_->register_worker(ranks, kStart + 200ms, effects_);
    router_->tick(kStart + 300ms, effects_);
    EXPECT_TRUE(effects_.dumps.empty()) << "fenced " << fenced;
    // A worker that publishes no KV events has no dump to give.
    discovery::WorkerRegistration quiet = worker(5);
    quiet.publishes_kv_events = false;
    router_->register_worker(quiet, kStart + 300ms, effects_);
    EXPECT_TRUE(effects_.dumps.empty());
    effects_.clear();
  }
}

TEST_F(PartitionRouterTest, HardSessionAffinityKeepsASessionOnItsWorker) {
  options_.affinity.ttl = 60s;
  make();
  add_worker(1);
  add_worker(2);
  auto in_session = [&](std::string id) {
    RouteRequest input = request(std::move(id), 4);
    input.selection.session.emplace("conversation", std::nullopt, std::nullopt, std::nullopt);
    return input;
  };
  const WorkerId first = worker_of(route(in_session("a")));
  // The bound worker is the busier one now, and still gets the session's next turns.
  EXPECT_EQ(worker_of(route(in_session("b"))), first);
  EXPECT_EQ(worker_of(route(in_session("c"))), first);
  EXPECT_EQ(router_->gauges().session_bindings, 1U);
}

// Soft session affinity in route mode, where a client may report only its completion: a request
// that completes without a first token binds the session and moves its binding, as a first token
// would; one cancelled before a first token leaves the binding where it was.
TEST_F(PartitionRouterTest, ACompletionWithoutAFirstTokenMovesTheSoftSessionBinding) {
  options_.affinity.ttl = 60s;
  options_.affinity.mode = SessionAffinityMode::soft;
  make();
  add_worker(1);
  add_worker(2);
  auto in_session = [&](std::string id, std::optional<WorkerId> pin = std::nullopt) {
    RouteRequest input = request(std::move(id), 4);
    input.selection.session.emplace("conversation", std::nullopt, std::nullopt, std::nullopt);
    if (pin) {
      input.selection.pinned_worker =
          plugins::worker_selection::WorkerAffinityTarget{.worker_id = *pin};
    }
    return input;
  };
  const auto ended = [&](std::string id, discovery::BookingEnd end, TimePoint now) {
    return router_->change_booking({std::move(id), true, end, AffinityAction::finish}, now,
                                   effects_);
  };
  const auto bound_to = [&](TimePoint now) {
    const auto binding = router_->affinity().binding("conversation", now);
    return binding ? binding->worker_id : 0;
  };

  const WorkerId first = worker_of(route(in_session("a")));
  ASSERT_TRUE(ended("a", discovery::BookingEnd::completed, kStart + 1s));
  EXPECT_EQ(bound_to(kStart + 1s), first);

  const WorkerId other = first == 1 ? 2 : 1;
  ASSERT_EQ(worker_of(route(in_session("b", other), kStart + 2s)), other);
  ASSERT_TRUE(ended("b", discovery::BookingEnd::cancelled, kStart + 3s));
  EXPECT_EQ(bound_to(kStart + 3s), first);

  effects_.clear();
  ASSERT_EQ(worker_of(route(in_session("c", other), kStart + 4s)), other);
  ASSERT_TRUE(ended("c", discovery::BookingEnd::completed, kStart + 5s));
  EXPECT_EQ(bound_to(kStart + 5s), other);
  EXPECT_EQ(count<partition_event::SessionRebound>(effects_), 1U);
}

TEST_F(PartitionRouterTest, ADeregisteredWorkerIsRemovedAndReportedOnce) {
  make();
  add_worker(5);
  router_->deregister({5, 1}, kStart, effects_);
  EXPECT_EQ(effects_.removed, std::vector<WorkerId>{5});
  EXPECT_TRUE(effects_.fleet_changed);
  effects_.clear();
  router_->deregister({5, 1}, kStart, effects_);
  EXPECT_TRUE(effects_.removed.empty());
  EXPECT_EQ(count<partition_event::MessageRefused>(effects_), 1U);
}

// The node's rank budget is shared by partitions: a registration it cannot hold is refused, and
// ranks come back when a worker shrinks, deregisters, expires or its partition goes away.
TEST_F(PartitionRouterTest, RegistrationsAreBoundedByWorkersAndTheNodesRankEntries) {
  auto budget = std::make_shared<RankBudget>(10);
  options_.rank_budget = budget;
  options_.max_workers = 3;
  make();
  const auto register_with = [&](WorkerId id, std::uint32_t ranks, std::chrono::milliseconds ttl) {
    auto registration = worker(id, ttl);
    registration.data_parallel_size = ranks;
    effects_.clear();
    router_->register_worker(registration, kStart, effects_);
    return count<partition_event::MessageRefused>(effects_) == 0;
  };
  EXPECT_TRUE(register_with(1, 4, 10s));
  EXPECT_TRUE(register_with(2, 4, 1s));
  EXPECT_EQ(budget->held(), 8U);
  // A registration the catalog refuses takes nothing.
  auto wrong_block = worker(5);
  wrong_block.block_size = kBlockSize * 2;
  router_->register_worker(wrong_block, kStart, effects_);
  EXPECT_EQ(count<partition_event::MessageRefused>(effects_), 1U);
  EXPECT_EQ(budget->held(), 8U);
  // Three more ranks than the budget holds: refused, naming the cap, nothing taken.
  EXPECT_FALSE(register_with(3, 3, 10s));
  const auto* refused = std::get_if<partition_event::MessageRefused>(&effects_.events.front());
  ASSERT_NE(refused, nullptr);
  EXPECT_NE(refused->reason.find("--router-max-rank-entries"), std::string::npos)
      << refused->reason;
  EXPECT_EQ(budget->held(), 8U);
  // A worker registering again with fewer ranks gives the rest back.
  EXPECT_TRUE(register_with(1, 1, 10s));
  EXPECT_EQ(budget->held(), 5U);
  EXPECT_TRUE(register_with(3, 3, 10s));
  EXPECT_EQ(budget->held(), 8U);
  // A fourth worker exceeds the partition's cap of three, whatever its ranks.
  EXPECT_FALSE(register_with(4, 1, 10s));
  refused = std::get_if<partition_event::MessageRefused>(&effects_.events.front());
  ASSERT_NE(refused, nullptr);
  EXPECT_NE(refused->reason.find("--router-max-workers-per-partition"), std::string::npos);
  // Expiry and deregistration give ranks back; so does the partition going away.
  router_->tick(kStart + 2s, effects_);
  EXPECT_EQ(budget->held(), 4U);
  router_->deregister({1, 1}, kStart + 2s, effects_);
  EXPECT_EQ(budget->held(), 3U);
  router_.reset();
  EXPECT_EQ(budget->held(), 0U);
}

TEST_F(PartitionRouterTest, ShuttingDownAnswersEveryWaitingRequest) {
  options_.fenced = true;
  make();
  add_worker(1);
  EXPECT_FALSE(route(request("a", 2)));
  EXPECT_FALSE(route(request("b", 2)));
  router_->shut_down(effects_);
  ASSERT_EQ(effects_.answers.size(), 2U);
  for (const auto& [ticket, reply] : effects_.answers) {
    EXPECT_EQ(reply.result.error().code, Error::unavailable);
  }
}

TEST_F(PartitionRouterTest, RoutedTokenPromptsRunThroughTheHitRateCeilings) {
  options_.hit_rate_ceilings = metrics::HitRateCeilingsOptions{};
  make();
  ASSERT_NE(router_->ceilings(), nullptr);
  add_worker(1);
  const auto ceilings_of = [this] { return ceilings_recorded(); };

  ASSERT_TRUE(route(request("a", 4)));
  auto first = ceilings_of();
  ASSERT_EQ(first.size(), 1U);
  EXPECT_EQ(first[0].prompt_tokens, 4 * kBlockSize);
  EXPECT_EQ(first[0].workload_cached_tokens, 0);
  // The same prefix again: three blocks reusable (the last token is always computed), and the
  // fleet's 1000 blocks hold them.
  ASSERT_TRUE(route(request("b", 4, "a")));
  auto again = ceilings_of();
  ASSERT_EQ(again.size(), 1U);
  EXPECT_EQ(again[0].workload_cached_tokens, 3 * kBlockSize);
  EXPECT_EQ(again[0].capacity_cached_tokens, 3 * kBlockSize);

  // A request that is refused reached no cache; a text prompt's blocks are bytes, not tokens.
  ASSERT_TRUE(route(request("b", 4, "a")));
  EXPECT_TRUE(ceilings_of().empty());
  RouteRequest text = request("t", 0);
  text.prompt_text = std::string(4 * kBlockSize * discovery::kTextBytesPerToken, 'x');
  text.selection.prompt_tokens = discovery::estimated_prompt_tokens(text.prompt_text.size());
  EXPECT_NE(worker_of(route(std::move(text))), 0U);
  EXPECT_TRUE(ceilings_of().empty());

  options_.hit_rate_ceilings.reset();
  make();
  EXPECT_EQ(router_->ceilings(), nullptr) << "off unless asked for";
}

// Recorded later (the owner's call), the ceilings still see the prompts in the order they were
// routed: the second sees the first's blocks.
TEST_F(PartitionRouterTest, DueCeilingsAreRecordedInTheOrderTheirPromptsWereRouted) {
  options_.hit_rate_ceilings = metrics::HitRateCeilingsOptions{};
  make();
  add_worker(1);
  ASSERT_TRUE(route(request("a", 4)));
  ASSERT_TRUE(route(request("b", 4, "a")));
  EXPECT_TRUE(effects_.ceilings_due);
  const auto recorded = ceilings_recorded();
  ASSERT_EQ(recorded.size(), 2U);
  EXPECT_EQ(recorded[0].workload_cached_tokens, 0);
  EXPECT_EQ(recorded[1].workload_cached_tokens, 3 * kBlockSize);
  EXPECT_TRUE(ceilings_recorded().empty()) << "each prompt once";
}

TEST_F(PartitionRouterTest, KvUsageIsReportedWhenItMovesByAPercent) {
  options_.report_kv_usage = true;
  make();
  add_worker(1);
  discovery::ConfirmedLoad load;
  load.kv_blocks_used = 100;
  router_->update_load({1, 1, {{0, load}}}, kStart, effects_);
  ASSERT_TRUE(effects_.kv_usage);
  EXPECT_EQ(effects_.kv_usage->used, 100U);
  EXPECT_EQ(effects_.kv_usage->total, 1000U);
  effects_.clear();
  load.kv_blocks_used = 105;
  router_->update_load({1, 1, {{0, load}}}, kStart, effects_);
  EXPECT_FALSE(effects_.kv_usage) << "moved by less than 0.01";
}

// A worker without a capacity adds no KV blocks to the capacity ceiling's cache: with only such
// workers it holds nothing, while the workload ceiling still sees the reuse.
TEST_F(PartitionRouterTest, TheCapacityCeilingCountsOnlyTheCapacitiesWorkersRegistered) {
  options_.hit_rate_ceilings = metrics::HitRateCeilingsOptions{};
  make();
  add_worker_without_capacity(1);
  ASSERT_TRUE(route(request("a", 4)));
  ASSERT_EQ(ceilings_recorded().size(), 1U);
  ASSERT_TRUE(route(request("b", 4, "a")));
  auto again = ceilings_recorded();
  ASSERT_EQ(again.size(), 1U);
  EXPECT_EQ(again[0].workload_cached_tokens, 3 * kBlockSize);
  EXPECT_EQ(again[0].capacity_cached_tokens, 0U);

  // A worker with a capacity joins: its 1000 blocks make the capacity cache.
  router_->register_worker(worker(2), kStart, effects_);
  effects_.clear();
  ASSERT_TRUE(route(request("c", 4)));
  ASSERT_EQ(ceilings_recorded().size(), 1U);
  ASSERT_TRUE(route(request("d", 4, "c")));
  auto known = ceilings_recorded();
  ASSERT_EQ(known.size(), 1U);
  EXPECT_EQ(known[0].capacity_cached_tokens, 3 * kBlockSize);
}

// The fleet's KV usage, which request classifiers (kv-capacity-pause) read, is that of the ranks
// with a capacity: a rank without one is left out of used and total alike.
TEST_F(PartitionRouterTest, KvUsageLeavesOutRanksWithoutACapacity) {
  options_.report_kv_usage = true;
  make();
  add_worker(1);
  add_worker_without_capacity(2);
  discovery::ConfirmedLoad full;
  full.kv_blocks_used = 5000;
  router_->update_load({2, 1, {{0, full}}}, kStart, effects_);
  EXPECT_FALSE(effects_.kv_usage) << "worker 2's report moved nothing";
  discovery::ConfirmedLoad load;
  load.kv_blocks_used = 300;
  router_->update_load({1, 1, {{0, load}}}, kStart, effects_);
  ASSERT_TRUE(effects_.kv_usage);
  EXPECT_EQ(effects_.kv_usage->used, 300U);
  EXPECT_EQ(effects_.kv_usage->total, 1000U);
}

TEST_F(PartitionRouterTest, NoKvUsageIsReportedWhileNoWorkerHasACapacity) {
  options_.report_kv_usage = true;
  make();
  router_->register_worker(
      [&] {
        auto registration = worker(1);
        registration.total_kv_blocks.reset();
        return registration;
      }(),
      kStart, effects_);
  discovery::ConfirmedLoad load;
  load.kv_blocks_used = 900;
  router_->update_load({1, 1, {{0, load}}}, kStart, effects_);
  EXPECT_FALSE(effects_.kv_usage);
  // The classifier's fleet lists the worker, with no capacity.
  const PartitionFleet fleet = router_->fleet();
  ASSERT_EQ(fleet.workers.size(), 1U);
  EXPECT_EQ(fleet.workers[0].worker(), (WorkerWithDpRank{1, 0}));
  EXPECT_EQ(fleet.workers[0].total_kv_blocks(), std::nullopt);
}

TEST_F(PartitionRouterTest, ALearningPolicyIsToldOfEachBookingItsFirstTokenAndItsEnd) {
  selection::RouterPolicyConfig config;
  config.worker_selection[static_cast<std::size_t>(WorkerType::Aggregated)] = "predicted-ttft";
  auto plugins = registry_.resolve_plugins(config);
  ASSERT_TRUE(plugins) << plugins.error().message();
  plugins_ = std::make_unique<plugins::RouterPlugins>(std::move(*plugins));
  make();
  add_worker(1);
  add_worker(2);
  const auto observations = [&] {
    for (const auto& [role, value] : router_->state().learnt_values()) {
      if (value.name == "observations") return value.value;
    }
    return -1.0;
  };
  EXPECT_EQ(observations(), 0.0);

  const WorkerId chosen = worker_of(route(request("a", 10)));
  effects_.clear();
  ASSERT_TRUE(router_->change_booking({"a", false}, kStart + 120ms, effects_));
  std::vector<partition_event::TtftPredicted> predicted;
  for (const PartitionEvent& event : effects_.events) {
    if (const auto* e = std::get_if<partition_event::TtftPredicted>(&event))
      predicted.push_back(*e);
  }
  ASSERT_EQ(predicted.size(), 1U);
  EXPECT_EQ(predicted[0].worker.worker_id, chosen);
  EXPECT_DOUBLE_EQ(predicted[0].observed_seconds, 0.120);
  EXPECT_GT(predicted[0].predicted_seconds, 0.0);
  EXPECT_EQ(observations(), 1.0);
  effects_.clear();
  ASSERT_TRUE(router_->change_booking({"a", true}, kStart + 500ms, effects_));
  EXPECT_EQ(count<partition_event::TtftPredicted>(effects_), 0U);

  // Ended before its first token: forgotten, nothing learnt.
  worker_of(route(request("b", 10)));
  ASSERT_TRUE(router_->change_booking({"b", true}, kStart + 1s, effects_));
  // Pinned: booked without the policy, so without the signals to learn from.
  RouteRequest pinned = request("c", 10);
  pinned.selection.pinned_worker = plugins::worker_selection::WorkerAffinityTarget{.worker_id = 2};
  EXPECT_EQ(worker_of(route(std::move(pinned))), 2U);
  effects_.clear();
  ASSERT_TRUE(router_->change_booking({"c", false}, kStart + 2s, effects_));
  EXPECT_EQ(count<partition_event::TtftPredicted>(effects_), 0U);
  EXPECT_EQ(observations(), 1.0);
}

}  // namespace
}  // namespace kvr
