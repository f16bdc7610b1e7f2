#include "classifiers/queue/policy_class_queue.hpp"

#include <chrono>
#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace kvr::classifiers {
namespace {

using namespace std::chrono_literals;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

PolicyClassConfig policy_class(std::string name, std::uint64_t quantum = kDefaultQuantum,
                               QueueOrder order = QueueOrder::Fcfs) {
  PolicyClassConfig config;
  config.name = std::move(name);
  config.quantum = quantum;
  config.order = order;
  return config;
}

QueuedRequest request(std::string id, std::string policy_class = "default",
                      std::uint64_t cost = 100) {
  QueuedRequest queued;
  queued.request_id = std::move(id);
  queued.policy_class = std::move(policy_class);
  queued.scheduling_cost_tokens = cost;
  queued.uncached_tokens = cost;
  return queued;
}

QueuedRequest pinned(std::string id, WorkerWithDpRank worker,
                     std::string policy_class = "default") {
  QueuedRequest queued = request(std::move(id), std::move(policy_class));
  queued.pinned_worker = worker;
  return queued;
}

const auto kAlways = [](const PolicyClassConfig&, const QueuedRequest&) { return true; };

void enqueue_all(PolicyClassQueue& queue, std::vector<QueuedRequest> requests) {
  for (QueuedRequest& queued : requests) {
    const std::string id = queued.request_id;
    auto accepted = queue.enqueue(std::move(queued), 1);
    ASSERT_TRUE(accepted.has_value()) << id << ": " << accepted.error().message();
  }
}

std::vector<std::string> drain_ids(PolicyClassQueue& queue, DispatchCheck check = kAlways) {
  std::vector<std::string> ids;
  queue.drain(check, [&](QueuedRequest&& queued) { ids.push_back(queued.request_id); });
  return ids;
}

// Dequeues `dequeues` requests from two backlogged classes of equal-cost requests and returns how
// many each class got.
std::map<std::string, int> backlogged_shares(std::uint64_t quantum_a, std::uint64_t quantum_b,
                                             std::uint64_t cost_a, std::uint64_t cost_b,
                                             int dequeues) {
  PolicyClassQueue queue{{policy_class("a", quantum_a), policy_class("b", quantum_b)}};
  for (int i = 0; i < dequeues; ++i) {
    EXPECT_TRUE(queue.enqueue(request("a" + std::to_string(i), "a", cost_a), 1).has_value());
    EXPECT_TRUE(queue.enqueue(request("b" + std::to_string(i), "b", cost_b), 1).has_value());
  }
  std::map<std::string, int> served;
  for (int i = 0; i < dequeues; ++i) {
    auto next = queue.next_dispatchable(kAlways);
    EXPECT_TRUE(next.has_value());
    if (!next) break;
    ++served[next->policy_class];
  }
  // Both classes stayed backlogged throughout.
  EXPECT_GT(queue.depth("a")->requests, 0U);
  EXPECT_GT(queue.depth("b")->requests, 0U);
  return served;
}

TEST(PolicyClassQueueTest, DeficitRoundRobinServesQuanta512To128AboutFourToOne) {
  auto served = backlogged_shares(512, 128, 100, 100, 320);
  ASSERT_GT(served["b"], 0);
  const double ratio = static_cast<double>(served["a"]) / served["b"];
  EXPECT_GE(ratio, 3.5) << served["a"] << ":" << served["b"];
  EXPECT_LE(ratio, 4.5) << served["a"] << ":" << served["b"];
  EXPECT_EQ(served["a"] + served["b"], 320);
}

TEST(PolicyClassQueueTest, DeficitRoundRobinServesEqualQuantaAboutOneToOne) {
  auto served = backlogged_shares(256, 256, 100, 100, 320);
  ASSERT_GT(served["b"], 0);
  const double ratio = static_cast<double>(served["a"]) / served["b"];
  EXPECT_GE(ratio, 0.95) << served["a"] << ":" << served["b"];
  EXPECT_LE(ratio, 1.05) << served["a"] << ":" << served["b"];
}

TEST(PolicyClassQueueTest, DeficitRoundRobinSharesTokensNotRequests) {
  // Equal quanta, class a's requests cost twice b's: b is served about twice as often.
  auto served = backlogged_shares(256, 256, 200, 100, 300);
  ASSERT_GT(served["a"], 0);
  const double ratio = static_cast<double>(served["b"]) / served["a"];
  EXPECT_GE(ratio, 1.8) << served["a"] << ":" << served["b"];
  EXPECT_LE(ratio, 2.2) << served["a"] << ":" << served["b"];
}

TEST(PolicyClassQueueTest, CostsFarAboveTheQuantaKeepTheRatioWithoutSpinning) {
  // 2^40 tokens per request against quanta of 1 and 3: a round-by-round loop would never end.
  auto served = backlogged_shares(1, 3, std::uint64_t{1} << 40, std::uint64_t{1} << 40, 80);
  ASSERT_GT(served["a"], 0);
  const double ratio = static_cast<double>(served["b"]) / served["a"];
  EXPECT_GE(ratio, 2.5) << served["a"] << ":" << served["b"];
  EXPECT_LE(ratio, 3.5) << served["a"] << ":" << served["b"];
}

TEST(PolicyClassQueueTest, AClassPassedOverGainsNoCredit) {
  PolicyClassQueue queue{{policy_class("a", 100), policy_class("b", 100)}};
  for (int i = 0; i < 40; ++i) {
    ASSERT_TRUE(queue.enqueue(request("a" + std::to_string(i), "a"), 1).has_value());
    ASSERT_TRUE(queue.enqueue(request("b" + std::to_string(i), "b"), 1).has_value());
  }
  const auto only_b = [](const PolicyClassConfig& config, const QueuedRequest&) {
    return config.name == "b";
  };
  for (int i = 0; i < 10; ++i) {
    auto next = queue.next_dispatchable(only_b);
    ASSERT_TRUE(next.has_value());
    EXPECT_EQ(next->policy_class, "b");
  }
  // Once a can be served again, the two alternate: a gets no burst for the turns it missed.
  int served_a = 0;
  for (int i = 0; i < 10; ++i) {
    auto next = queue.next_dispatchable(kAlways);
    ASSERT_TRUE(next.has_value());
    served_a += next->policy_class == "a" ? 1 : 0;
  }
  EXPECT_GE(served_a, 4);
  EXPECT_LE(served_a, 6);
}

TEST(PolicyClassQueueTest, StrictPriorityComesBeforeArrivalAndClassTurns) {
  PolicyClassQueue queue{{policy_class("a", 1'000'000), policy_class("b", 1)}};
  QueuedRequest urgent = request("urgent", "b");
  urgent.priority = 5;
  QueuedRequest middle = request("middle", "a");
  middle.priority = 2;
  enqueue_all(queue, {request("a1", "a"), request("a2", "a"), request("b1", "b"), middle,
                      std::move(urgent)});
  const auto ids = drain_ids(queue);
  ASSERT_EQ(ids.size(), 5U);
  EXPECT_EQ(ids[0], "urgent");
  EXPECT_EQ(ids[1], "middle");
}

TEST(PolicyClassQueueTest, AHigherPriorityRequestInABlockedLaneDoesNotBlockOthers) {
  PolicyClassQueue queue{{policy_class("default")}};
  QueuedRequest high = pinned("high", {1, 0});
  high.priority = 9;
  enqueue_all(queue, {std::move(high), request("low")});
  const auto worker_1_busy = [](const PolicyClassConfig&, const QueuedRequest& queued) {
    return queued.pinned_worker != WorkerWithDpRank{1, 0};
  };
  EXPECT_THAT(drain_ids(queue, worker_1_busy), ElementsAre("low"));
  EXPECT_THAT(drain_ids(queue), ElementsAre("high"));
}

TEST(PolicyClassQueueTest, DueTimesComeEarliestFirstThenThoseWithout) {
  PolicyClassQueue queue{{policy_class("default")}};
  const QueueTimePoint start{};
  QueuedRequest late = request("late");
  late.due_at = start + 5s;
  QueuedRequest soon = request("soon");
  soon.due_at = start + 2s;
  enqueue_all(queue, {request("none"), std::move(late), std::move(soon)});
  EXPECT_THAT(drain_ids(queue), ElementsAre("soon", "late", "none"));
}

TEST(PolicyClassQueueTest, ExpireRemovesTheRequestsWhoseDueTimeHasCome) {
  PolicyClassQueue queue{{policy_class("default")}};
  const QueueTimePoint start{};
  std::vector<QueuedRequest> requests;
  for (auto [id, due] : {std::pair{"d3", 3s}, std::pair{"d1", 1s}, std::pair{"d2", 2s}}) {
    QueuedRequest queued = request(id);
    queued.due_at = start + due;
    requests.push_back(std::move(queued));
  }
  requests.push_back(request("none"));
  enqueue_all(queue, std::move(requests));
  EXPECT_EQ(queue.earliest_due(), start + 1s);

  EXPECT_TRUE(queue.expire(start + 500ms).empty());
  std::vector<std::string> expired;
  for (const QueuedRequest& queued : queue.expire(start + 2s)) expired.push_back(queued.request_id);
  EXPECT_THAT(expired, ElementsAre("d1", "d2"));
  EXPECT_EQ(queue.size(), 2U);
  EXPECT_FALSE(queue.contains("d1"));
  EXPECT_EQ(queue.earliest_due(), start + 3s);
  EXPECT_THAT(drain_ids(queue), ElementsAre("d3", "none"));
  EXPECT_EQ(queue.earliest_due(), std::nullopt);
}

TEST(PolicyClassQueueTest, FcfsServesByArrival) {
  PolicyClassQueue queue{{policy_class("default", kDefaultQuantum, QueueOrder::Fcfs)}};
  enqueue_all(queue, {request("r1", "default", 300), request("r2", "default", 100),
                      request("r3", "default", 200)});
  EXPECT_THAT(drain_ids(queue), ElementsAre("r1", "r2", "r3"));
}

TEST(PolicyClassQueueTest, WsptServesTheCheapestFirstWithTiesByArrival) {
  PolicyClassQueue queue{{policy_class("default", kDefaultQuantum, QueueOrder::Wspt)}};
  enqueue_all(queue, {request("r1", "default", 300), request("r2", "default", 100),
                      request("r3", "default", 200), request("r4", "default", 100)});
  EXPECT_THAT(drain_ids(queue), ElementsAre("r2", "r4", "r3", "r1"));
}

TEST(PolicyClassQueueTest, ABusyPinnedWorkerBlocksNoOneElse) {
  PolicyClassQueue queue{{policy_class("default")}};
  const WorkerWithDpRank busy{1, 0};
  const WorkerWithDpRank free{2, 0};
  enqueue_all(queue, {pinned("p1", busy), pinned("p2", busy), pinned("q1", free), request("u1"),
                      request("u2")});
  bool worker_1_busy = true;
  const auto check = [&](const PolicyClassConfig&, const QueuedRequest& queued) {
    return !(worker_1_busy && queued.pinned_worker == busy);
  };
  EXPECT_THAT(drain_ids(queue, check), ElementsAre("q1", "u1", "u2"));
  EXPECT_EQ(queue.size(), 2U);
  // The worker frees: its lane drains, in arrival order.
  worker_1_busy = false;
  EXPECT_THAT(drain_ids(queue, check), ElementsAre("p1", "p2"));
  EXPECT_TRUE(queue.empty());
}

TEST(PolicyClassQueueTest, ABusyUnpinnedLaneLetsPinnedLanesGo) {
  PolicyClassQueue queue{{policy_class("default")}};
  enqueue_all(queue, {request("u1"), pinned("p1", {3, 1})});
  const auto only_pinned = [](const PolicyClassConfig&, const QueuedRequest& queued) {
    return queued.pinned_worker.has_value();
  };
  EXPECT_THAT(drain_ids(queue, only_pinned), ElementsAre("p1"));
  EXPECT_THAT(drain_ids(queue), ElementsAre("u1"));
}

TEST(PolicyClassQueueTest, DrainStopsWhenCapacityIsUsedUp) {
  PolicyClassQueue queue{{policy_class("default")}};
  enqueue_all(queue, {request("r1"), request("r2"), request("r3")});
  int free_slots = 2;
  const auto has_capacity = [&](const PolicyClassConfig&, const QueuedRequest&) {
    return free_slots > 0;
  };
  std::vector<std::string> dispatched;
  const std::size_t count = queue.drain(has_capacity, [&](QueuedRequest&& queued) {
    dispatched.push_back(queued.request_id);
    --free_slots;
  });
  EXPECT_EQ(count, 2U);
  EXPECT_THAT(dispatched, ElementsAre("r1", "r2"));
  EXPECT_TRUE(queue.contains("r3"));
  EXPECT_EQ(queue.next_dispatchable(has_capacity), std::nullopt);
  EXPECT_EQ(queue.size(), 1U);
}

TEST(PolicyClassQueueTest, RequestLimitScalesWithEligibleWorkersAndRefusesTheNewcomer) {
  PolicyClassConfig limited = policy_class("default");
  limited.request_queue_limit_per_worker = 2;
  PolicyClassQueue queue{{limited}};
  for (int i = 0; i < 4; ++i) {
    ASSERT_TRUE(queue.enqueue(request("r" + std::to_string(i)), 2).has_value());
  }
  auto refused = queue.enqueue(request("r4"), 2);
  ASSERT_FALSE(refused.has_value());
  EXPECT_EQ(refused.error().kind(), QueueError::Kind::QueueFull);
  EXPECT_THAT(std::string{refused.error().message()}, HasSubstr("'default' is full"));
  EXPECT_EQ(queue.size(), 4U);
  EXPECT_FALSE(queue.contains("r4"));
  // A third eligible worker makes room for two more.
  EXPECT_TRUE(queue.enqueue(request("r4"), 3).has_value());
  EXPECT_TRUE(queue.enqueue(request("r5"), 3).has_value());
  EXPECT_FALSE(queue.enqueue(request("r6"), 3).has_value());
  EXPECT_THAT(drain_ids(queue), ElementsAre("r0", "r1", "r2", "r3", "r4", "r5"));
}

TEST(PolicyClassQueueTest, TokenLimitCountsQueuedUncachedTokens) {
  PolicyClassConfig limited = policy_class("default");
  limited.uncached_token_queue_limit_per_worker = 1000;
  PolicyClassQueue queue{{limited}};
  ASSERT_TRUE(queue.enqueue(request("r1", "default", 600), 1).has_value());
  auto refused = queue.enqueue(request("r2", "default", 500), 1);
  ASSERT_FALSE(refused.has_value());
  EXPECT_EQ(refused.error().kind(), QueueError::Kind::QueueFull);
  EXPECT_TRUE(queue.enqueue(request("r3", "default", 400), 1).has_value());
  EXPECT_EQ(queue.depth("default")->uncached_tokens, 1000U);
  // Dispatching frees the tokens.
  ASSERT_TRUE(queue.next_dispatchable(kAlways).has_value());
  EXPECT_EQ(queue.depth("default")->uncached_tokens, 400U);
  EXPECT_TRUE(queue.enqueue(request("r2", "default", 500), 1).has_value());
}

TEST(PolicyClassQueueTest, AClassWithALimitRefusesWhileNoWorkerIsEligible) {
  PolicyClassConfig limited = policy_class("default");
  limited.request_queue_limit_per_worker = 8;
  PolicyClassQueue queue{{limited, policy_class("unlimited")}};
  EXPECT_FALSE(queue.enqueue(request("r1"), 0).has_value());
  EXPECT_TRUE(queue.enqueue(request("r2", "unlimited"), 0).has_value());
}

TEST(PolicyClassQueueTest, LimitsApplyPerClass) {
  PolicyClassConfig limited = policy_class("a");
  limited.request_queue_limit_per_worker = 1;
  PolicyClassQueue queue{{limited, policy_class("b")}};
  ASSERT_TRUE(queue.enqueue(request("a1", "a"), 1).has_value());
  EXPECT_FALSE(queue.enqueue(request("a2", "a"), 1).has_value());
  EXPECT_TRUE(queue.enqueue(request("b1", "b"), 1).has_value());
  EXPECT_TRUE(queue.enqueue(request("b2", "b"), 1).has_value());
}

TEST(PolicyClassQueueTest, RefusesAnUnknownClassAndADuplicateId) {
  PolicyClassQueue queue{{policy_class("default")}};
  auto unknown = queue.enqueue(request("r1", "batch"), 1);
  ASSERT_FALSE(unknown.has_value());
  EXPECT_EQ(unknown.error().kind(), QueueError::Kind::UnknownClass);
  EXPECT_THAT(std::string{unknown.error().message()}, HasSubstr("'batch'"));

  ASSERT_TRUE(queue.enqueue(request("r1"), 1).has_value());
  auto duplicate = queue.enqueue(request("r1"), 1);
  ASSERT_FALSE(duplicate.has_value());
  EXPECT_EQ(duplicate.error().kind(), QueueError::Kind::DuplicateRequest);
  EXPECT_EQ(queue.size(), 1U);
}

TEST(PolicyClassQueueTest, ADuplicateIdIsReportedAsSuchEvenWhenTheClassIsFull) {
  PolicyClassConfig limited = policy_class("default");
  limited.request_queue_limit_per_worker = 1;
  PolicyClassQueue queue{{limited}};
  ASSERT_TRUE(queue.enqueue(request("r1"), 1).has_value());
  auto duplicate = queue.enqueue(request("r1"), 1);
  ASSERT_FALSE(duplicate.has_value());
  EXPECT_EQ(duplicate.error().kind(), QueueError::Kind::DuplicateRequest);
  auto full = queue.enqueue(request("r2"), 1);
  ASSERT_FALSE(full.has_value());
  EXPECT_EQ(full.error().kind(), QueueError::Kind::QueueFull);
  EXPECT_THAT(drain_ids(queue), ElementsAre("r1"));
}

TEST(PolicyClassQueueTest, DispatchMayEnqueueDuringDrain) {
  PolicyClassQueue queue{{policy_class("default")}};
  enqueue_all(queue, {request("r1"), request("r2")});
  std::vector<std::string> dispatched;
  queue.drain(kAlways, [&](QueuedRequest&& queued) {
    dispatched.push_back(queued.request_id);
    if (queued.request_id == "r1") {
      EXPECT_TRUE(queue.enqueue(request("r3"), 1).has_value());
    }
  });
  EXPECT_THAT(dispatched, ElementsAre("r1", "r2", "r3"));
}

TEST(PolicyClassQueueTest, AMovedQueueKeepsItsRequests) {
  PolicyClassQueue original{{policy_class("default")}};
  QueuedRequest due = request("r2");
  due.due_at = QueueTimePoint{} + 1s;
  enqueue_all(original, {request("r1"), std::move(due), pinned("r3", {1, 0})});
  PolicyClassQueue moved{std::move(original)};
  EXPECT_EQ(moved.size(), 3U);
  EXPECT_TRUE(moved.remove("r3").has_value());
  EXPECT_EQ(moved.expire(QueueTimePoint{} + 1s).size(), 1U);
  EXPECT_THAT(drain_ids(moved), ElementsAre("r1"));
}

TEST(PolicyClassQueueTest, RemoveTakesOutOneRequestAndKeepsTheOrder) {
  PolicyClassQueue queue{{policy_class("default")}};
  QueuedRequest due = request("r2");
  due.due_at = QueueTimePoint{} + 1s;
  enqueue_all(queue, {request("r1"), std::move(due), pinned("r3", {4, 0}), request("r4")});
  auto removed = queue.remove("r2");
  ASSERT_TRUE(removed.has_value());
  EXPECT_EQ(removed->request_id, "r2");
  EXPECT_EQ(queue.earliest_due(), std::nullopt);
  EXPECT_TRUE(queue.remove("r3").has_value());
  EXPECT_EQ(queue.remove("r3"), std::nullopt);
  EXPECT_EQ(queue.remove("unknown"), std::nullopt);
  EXPECT_EQ(queue.depth("default")->requests, 2U);
  EXPECT_THAT(drain_ids(queue), ElementsAre("r1", "r4"));
}

TEST(PolicyClassQueueTest, AssignsArrivalSequencesAndReportsDepthsPerClass) {
  PolicyClassQueue queue{{policy_class("a"), policy_class("b")}};
  enqueue_all(queue, {request("a1", "a", 10), request("b1", "b", 20), request("a2", "a", 30)});
  const auto depths = queue.depths();
  ASSERT_EQ(depths.size(), 2U);
  EXPECT_EQ(depths[0].name, "a");
  EXPECT_EQ(depths[0].requests, 2U);
  EXPECT_EQ(depths[0].uncached_tokens, 40U);
  EXPECT_EQ(depths[1].name, "b");
  EXPECT_EQ(depths[1].requests, 1U);
  EXPECT_EQ(queue.depth("c"), std::nullopt);
  ASSERT_NE(queue.find_class("b"), nullptr);
  EXPECT_EQ(queue.find_class("c"), nullptr);

  std::vector<std::uint64_t> sequences;
  queue.drain(kAlways,
              [&](QueuedRequest&& queued) { sequences.push_back(queued.arrival_sequence); });
  EXPECT_EQ(std::set<std::uint64_t>(sequences.begin(), sequences.end()),
            (std::set<std::uint64_t>{0, 1, 2}));
}

TEST(PolicyClassQueueTest, ChecksEachLaneHeadAtMostOncePerDispatch) {
  PolicyClassQueue queue{{policy_class("a"), policy_class("b")}};
  enqueue_all(queue, {request("a1", "a"), request("a2", "a"), pinned("p1", {1, 0}, "a"),
                      pinned("p2", {1, 0}, "a"), pinned("p3", {2, 0}, "a"), request("b1", "b")});
  int checks = 0;
  const auto refuse_all = [&](const PolicyClassConfig&, const QueuedRequest&) {
    ++checks;
    return false;
  };
  EXPECT_EQ(queue.next_dispatchable(refuse_all), std::nullopt);
  // Four non-empty lanes: a's unpinned, a's for worker 1 and worker 2, b's unpinned.
  EXPECT_LE(checks, 4);
  EXPECT_GE(checks, 1);
  EXPECT_EQ(queue.size(), 6U);
}

}  // namespace
}  // namespace kvr::classifiers
