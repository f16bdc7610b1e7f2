// A partition's admission queue over a real SelectorState: a request waits only while every
// eligible worker is busy for its class, freed capacity (a first token) dispatches it, limits
// refuse the newcomer, due times and the wait limit refuse with their own codes, pins wait in
// their own lane, and a cancelled request leaves without a trace.
#include "selection/partition/partition_queue.hpp"

#include <gtest/gtest.h>

#include "discovery/block_hash.hpp"
#include "selection/config/router_policy_config.hpp"
#include "selection/policies/builtin_policies.hpp"
#include "tests/testing/worker_registration.hpp"

namespace kvr {
namespace {

using namespace std::chrono_literals;
using classifiers::PolicyClassConfig;

constexpr std::uint32_t kBlockSize = 16;
constexpr std::string_view kModel = "llama";
const TimePoint kStart{std::chrono::seconds(1000)};

// A class that is busy above `threshold` active prefill tokens.
PolicyClassConfig busy_above(std::string name, std::uint64_t threshold) {
  PolicyClassConfig config;
  config.name = std::move(name);
  config.prefill_busy_threshold = threshold;
  return config;
}

class PartitionQueueTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(selection::register_builtin_policies(registry_));
    auto plugins = registry_.resolve_plugins(selection::RouterPolicyConfig{});
    ASSERT_TRUE(plugins) << plugins.error().message();
    plugins_ = std::make_unique<plugins::RouterPlugins>(std::move(*plugins));
    SelectorOptions options;
    options.partition.model = std::string{kModel};
    options.router.block_size = kBlockSize;
    options.booking_ttl = 60s;
    selector_ = std::make_unique<SelectorState>(std::move(options), *plugins_);
  }

  void make_queue(std::vector<PolicyClassConfig> classes, std::chrono::milliseconds max_wait = 5s) {
    queue_ = std::make_unique<PartitionQueue>(PartitionQueueOptions{
        classifiers::resolve_policy_classes(classes, classifiers::default_policy_class()),
        max_wait});
  }

  void add_worker(WorkerId id) {
    auto added = selector_->register_worker(
        testing::worker_registration(id, std::string{kModel}, kBlockSize, 60s), kStart);
    ASSERT_TRUE(added) << added.error().message();
    ASSERT_TRUE(selector_->update_load({id, 0}, discovery::ConfirmedLoad{}));
  }

  // A request of `blocks` full blocks of its own (no shared prefix).
  RouteRequest request(std::string id, std::size_t blocks, std::string policy_class = "default") {
    RouteRequest input;
    input.selection.request_id = id;
    input.selection.prompt_tokens = blocks * kBlockSize;
    std::optional<BlockHash> parent;
    for (std::size_t i = 0; i < blocks; ++i) {
      parent = discovery::BlockHasher::chain(parent, std::hash<std::string>{}(id) + i);
      input.selection.block_hashes.push_back(*parent);
    }
    input.policy_class = std::move(policy_class);
    return input;
  }

  // Offers a request as the selector does: prepared first; routed at once on route_now.
  std::expected<PartitionQueue::Admission, RouteFailure> offer(RouteRequest input,
                                                               TimePoint now = kStart) {
    EXPECT_TRUE(selector_->prepare(input, now));
    auto admission = queue_->offer(*selector_, input, next_ticket_++, now);
    if (admission && *admission == PartitionQueue::Admission::route_now) {
      auto routed = selector_->route(input, now);
      EXPECT_TRUE(routed) << routed.error().message;
      if (routed) routed_to_[input.id()] = routed->worker.worker_id;
    }
    return admission;
  }

  // Drains, routing what comes out; returns the ids dispatched, in order.
  std::vector<std::string> drain(TimePoint now = kStart) {
    std::vector<std::string> dispatched;
    queue_->drain(*selector_, [&](WaitingRoute&& waiting) {
      dispatched.push_back(waiting.request.id());
      auto routed = selector_->route(waiting.request, now);
      EXPECT_TRUE(routed) << routed.error().message;
      if (routed) routed_to_[waiting.request.id()] = routed->worker.worker_id;
    });
    return dispatched;
  }

  plugins::RouterPluginRegistry registry_;
  std::unique_ptr<plugins::RouterPlugins> plugins_;
  std::unique_ptr<SelectorState> selector_;
  std::unique_ptr<PartitionQueue> queue_;
  QueueTicket next_ticket_ = 1;
  std::map<std::string, WorkerId> routed_to_;
};

TEST_F(PartitionQueueTest, QueuesOnlyWhileEveryEligibleWorkerIsBusyAndDrainsOnFirstToken) {
  make_queue({busy_above("default", 100)});
  add_worker(1);
  add_worker(2);
  // 128 uncached tokens each: one request makes a worker busy (> 100).
  EXPECT_EQ(offer(request("a", 8)), PartitionQueue::Admission::route_now);
  EXPECT_EQ(offer(request("b", 8)), PartitionQueue::Admission::route_now);
  EXPECT_NE(routed_to_["a"], routed_to_["b"]);
  EXPECT_EQ(offer(request("c", 8)), PartitionQueue::Admission::queued);
  EXPECT_EQ(queue_->size(), 1U);
  EXPECT_TRUE(drain().empty()) << "nothing freed: c keeps waiting";

  ASSERT_TRUE(selector_->first_token("a"));
  EXPECT_EQ(drain(), std::vector<std::string>{"c"});
  EXPECT_EQ(routed_to_["c"], routed_to_["a"]);
  EXPECT_TRUE(queue_->empty());
  EXPECT_FALSE(queue_->next_expiry());
}

TEST_F(PartitionQueueTest, ANewcomerJoinsANonEmptyQueueRatherThanOvertakingIt) {
  make_queue({busy_above("default", 100)});
  add_worker(1);
  EXPECT_EQ(offer(request("a", 8)), PartitionQueue::Admission::route_now);
  EXPECT_EQ(offer(request("b", 8)), PartitionQueue::Admission::queued);
  ASSERT_TRUE(selector_->first_token("a"));
  // Capacity is free, but b waits first: the newcomer is queued behind it and b goes first.
  EXPECT_EQ(offer(request("c", 8)), PartitionQueue::Admission::queued);
  EXPECT_EQ(drain(), std::vector<std::string>{"b"});
  EXPECT_EQ(queue_->size(), 1U);
}

TEST_F(PartitionQueueTest, ARequestWithNoEligibleWorkerGoesToSelectionAtOnce) {
  make_queue({busy_above("default", 100)});
  RouteRequest lonely = request("lonely", 8);
  ASSERT_TRUE(selector_->prepare(lonely, kStart));
  EXPECT_EQ(queue_->offer(*selector_, lonely, 6, kStart), PartitionQueue::Admission::route_now)
      << "no worker at all: selection answers no_workers";
  add_worker(1);
  EXPECT_EQ(offer(request("busy", 8)), PartitionQueue::Admission::route_now);
  RouteRequest excluded = request("excluded", 8);
  excluded.selection.excluded_workers = {1};
  ASSERT_TRUE(selector_->prepare(excluded, kStart));
  EXPECT_EQ(queue_->offer(*selector_, excluded, 7, kStart), PartitionQueue::Admission::route_now);
}

TEST_F(PartitionQueueTest, AClassOverItsLimitRefusesTheNewcomerAndKeepsTheQueued) {
  PolicyClassConfig limited = busy_above("default", 100);
  limited.request_queue_limit_per_worker = 1;
  make_queue({limited});
  add_worker(1);
  EXPECT_EQ(offer(request("a", 8)), PartitionQueue::Admission::route_now);
  EXPECT_EQ(offer(request("b", 8)), PartitionQueue::Admission::queued);
  const auto refused = offer(request("c", 8));
  ASSERT_FALSE(refused);
  EXPECT_EQ(refused.error().code, Error::overloaded);
  EXPECT_NE(refused.error().message.find("queue_full"), std::string::npos)
      << refused.error().message;
  EXPECT_EQ(queue_->size(), 1U);
  ASSERT_TRUE(selector_->first_token("a"));
  EXPECT_EQ(drain(), std::vector<std::string>{"b"});
}

TEST_F(PartitionQueueTest, AnUnknownClassOrAWaitingIdIsRefusedAsInvalid) {
  make_queue({busy_above("default", 100)});
  add_worker(1);
  EXPECT_EQ(offer(request("a", 8)), PartitionQueue::Admission::route_now);
  const auto unknown = offer(request("b", 8, "batch"));
  ASSERT_FALSE(unknown);
  EXPECT_EQ(unknown.error().code, Error::invalid_request);
  EXPECT_NE(unknown.error().message.find("batch"), std::string::npos);
  EXPECT_EQ(offer(request("c", 8)), PartitionQueue::Admission::queued);
  const auto duplicate = offer(request("c", 8));
  ASSERT_FALSE(duplicate);
  EXPECT_EQ(duplicate.error().code, Error::invalid_request);
  EXPECT_EQ(queue_->size(), 1U);
}

TEST_F(PartitionQueueTest, DueTimeAndWaitLimitRefuseWithTheirOwnCodes) {
  make_queue({busy_above("default", 100)}, 5s);
  add_worker(1);
  EXPECT_EQ(offer(request("a", 8)), PartitionQueue::Admission::route_now);
  RouteRequest due = request("due", 8);
  due.due_at = kStart + 1s;
  EXPECT_EQ(offer(due), PartitionQueue::Admission::queued);
  EXPECT_EQ(offer(request("patient", 8), kStart + 2s), PartitionQueue::Admission::queued);
  EXPECT_EQ(queue_->next_expiry(), kStart + 1s);

  EXPECT_TRUE(queue_->expire(kStart + 999ms).empty());
  auto expired = queue_->expire(kStart + 1s);
  ASSERT_EQ(expired.size(), 1U);
  EXPECT_EQ(expired[0].waiting.request.id(), "due");
  EXPECT_EQ(expired[0].waiting.ticket, 2U);
  EXPECT_EQ(expired[0].failure.code, Error::due_time_expired);
  EXPECT_EQ(queue_->next_expiry(), kStart + 7s) << "patient arrived at +2 s and waits 5 s";

  auto timed_out = queue_->expire(kStart + 7s);
  ASSERT_EQ(timed_out.size(), 1U);
  EXPECT_EQ(timed_out[0].waiting.request.id(), "patient");
  EXPECT_EQ(timed_out[0].failure.code, Error::timeout);
  EXPECT_TRUE(queue_->empty());
  EXPECT_FALSE(queue_->next_expiry());
}

TEST_F(PartitionQueueTest, ACancelledRequestLeavesAndItsIdMayWaitAgain) {
  make_queue({busy_above("default", 100)}, 5s);
  add_worker(1);
  EXPECT_EQ(offer(request("a", 8)), PartitionQueue::Admission::route_now);
  EXPECT_EQ(offer(request("b", 8)), PartitionQueue::Admission::queued);
  const auto cancelled = queue_->cancel("b");
  ASSERT_TRUE(cancelled);
  EXPECT_EQ(cancelled->request.id(), "b");
  EXPECT_FALSE(queue_->cancel("b"));
  EXPECT_FALSE(queue_->next_expiry());
  // The same id again, later: its own wait limit counts, not the cancelled one's.
  EXPECT_EQ(offer(request("b", 8), kStart + 3s), PartitionQueue::Admission::queued);
  EXPECT_TRUE(queue_->expire(kStart + 5s).empty());
  EXPECT_EQ(queue_->expire(kStart + 8s).size(), 1U);
}

TEST_F(PartitionQueueTest, APinnedRequestWaitsInItsWorkersLaneWithoutBlockingOthers) {
  make_queue({busy_above("default", 100)});
  add_worker(1);
  add_worker(2);
  EXPECT_EQ(offer(request("a", 8)), PartitionQueue::Admission::route_now);
  const WorkerId busy = routed_to_["a"];
  RouteRequest pinned = request("pinned", 8);
  pinned.selection.pinned_worker = plugins::worker_selection::WorkerAffinityTarget{busy, {}};
  EXPECT_EQ(offer(pinned), PartitionQueue::Admission::queued);
  // The other worker is free: a newcomer queues behind the pin's lane only long enough to drain.
  EXPECT_EQ(offer(request("free", 8)), PartitionQueue::Admission::queued);
  EXPECT_EQ(drain(), std::vector<std::string>{"free"});
  EXPECT_NE(routed_to_["free"], busy);
  ASSERT_TRUE(selector_->first_token("a"));
  EXPECT_EQ(drain(), std::vector<std::string>{"pinned"});
  EXPECT_EQ(routed_to_["pinned"], busy);
}

TEST_F(PartitionQueueTest, TheCostDefaultsToTheFewestUncachedTokensOnAnEligibleWorker) {
  add_worker(1);
  RouteRequest warm = request("warm", 8);
  ASSERT_TRUE(selector_->prepare(warm, kStart));
  EXPECT_EQ(selector_->fewest_uncached_tokens(warm), 8U * kBlockSize);
  const auto stored = selector_->apply_kv_events(KvEventBatch{
      .worker = {1, 0},
      .incarnation = 1,
      .event_id = 1,
      .events = {KvStoredEvent{
          std::nullopt,
          {warm.selection.block_hashes.begin(), warm.selection.block_hashes.begin() + 5},
          StorageTier::Device}}});
  ASSERT_TRUE(stored);
  EXPECT_EQ(selector_->fewest_uncached_tokens(warm), 3U * kBlockSize);
  warm.selection.excluded_workers = {1};
  EXPECT_EQ(selector_->fewest_uncached_tokens(warm), 8U * kBlockSize)
      << "an excluded worker's cache does not count";
}

TEST(PartitionQueueConfigTest, QueuesOnlyWithABusyThreshold) {
  EXPECT_FALSE(queues_requests({classifiers::default_policy_class()}));
  EXPECT_TRUE(queues_requests({classifiers::default_policy_class(0.5)}));
  PolicyClassConfig absolute;
  absolute.name = "batch";
  absolute.prefill_busy_threshold = 10;
  EXPECT_TRUE(queues_requests({classifiers::default_policy_class(), absolute}));
}

}  // namespace
}  // namespace kvr
