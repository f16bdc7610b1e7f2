// The selector actor as a shell over its partition core, on CAF's deterministic test coordinator:
// no thread runs an actor until the test says so, and timers fire only when the test triggers
// them. Checked: an answer now is the reply; a queued request's promise is kept and delivered when
// a booking frees capacity, or when the queue's wake-up ends its wait; removed workers reach the
// discovery side; a stopping selector answers every request still waiting.
#include "actors/selector/selector_actor.hpp"

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <caf/actor_system.hpp>
#include <caf/actor_system_config.hpp>
#include <caf/event_based_actor.hpp>
#include <caf/scheduler/test_coordinator.hpp>
#include <caf/send.hpp>
#include <caf/typed_event_based_actor.hpp>
#include <gtest/gtest.h>

#include "actors/actor_types.hpp"
#include "discovery/block_hash.hpp"
#include "messages/clock.hpp"
#include "messages/metrics/node_metrics.hpp"
#include "selection/config/router_policy_config.hpp"
#include "selection/policies/builtin_policies.hpp"
#include "tests/testing/worker_registration.hpp"
#include "tests/unit/actors/coordinated_actors.hpp"

namespace kvr::actors {
namespace {

using namespace std::chrono_literals;

constexpr std::uint32_t kBlockSize = 16;

// The answers a route client got, in order: a worker id, or the error's code.
struct Answers {
  std::vector<std::expected<WorkerId, Error>> routes;
  std::vector<WorkerId> removed;
};

// Records the workers a selector reports removed. (Spawned with an argument: CAF 0.17's
// initialisation of an actor without one binds a null reference, which UBSan reports.)
removal_watcher_actor::behavior_type removal_watcher(removal_watcher_actor::pointer,
                                                     Answers* answers) {
  return {[answers](removed_atom, const std::vector<WorkerId>& workers) {
    answers->removed.insert(answers->removed.end(), workers.begin(), workers.end());
  }};
}

// Sends one route request to `selector` and records its answer.
void route_client(caf::event_based_actor* self, const selector_actor& selector,
                  RouteRequest request, Answers* answers) {
  self->request(selector, caf::infinite, route_atom::value, std::move(request))
      .then([answers](SelectorReply& reply) {
        if (reply.result) {
          answers->routes.emplace_back(reply.result->worker.worker_id);
        } else {
          answers->routes.emplace_back(std::unexpected(reply.result.error().code));
        }
      });
}

class SelectorActorTest : public testing::CoordinatedActorsTest {
 protected:
  ~SelectorActorTest() override {
    if (selector_) caf::anon_send_exit(selector_, caf::exit_reason::user_shutdown);
    scheduler_.run();
  }

  SelectorActorConfig config() {
    SelectorActorConfig config{{}, services()};
    config.options.router.block_size = kBlockSize;
    config.options.booking_ttl = 60s;
    config.options.partition = {"m", "default"};
    config.plugins = &plugins_;
    return config;
  }

  // The class `default` is busy above 100 active prefill tokens; a request waits at most 5 s.
  SelectorActorConfig queueing_config() {
    SelectorActorConfig result = config();
    classifiers::PolicyClassConfig busy;
    busy.name = "default";
    busy.prefill_busy_threshold = 100;
    const std::vector<classifiers::PolicyClassConfig> classes{busy};
    result.policy_classes =
        classifiers::resolve_policy_classes(classes, classifiers::default_policy_class());
    result.queue_max_wait = 5s;
    return result;
  }

  void spawn(SelectorActorConfig selector_config) {
    // A watcher of removed workers, as the discovery actor is.
    auto watcher = system_.spawn(removal_watcher, &answers_);
    selector_config.discovery = watcher;
    selector_ = system_.spawn(selector_behavior, std::move(selector_config));
    scheduler_.run();
  }

  void add_worker(WorkerId id) {
    caf::anon_send(selector_, worker_up_atom::value,
                   testing::worker_registration(id, "m", kBlockSize, 10s));
    WorkerLoadReport report{id, 1, {{0, discovery::ConfirmedLoad{}}}};
    caf::anon_send(selector_, load_atom::value, std::move(report));
    scheduler_.run();
  }

  // Sends a route request of `blocks` blocks of its own from a client actor; its answer lands in
  // answers_ once the scheduler has run far enough.
  void route(const std::string& id, std::size_t blocks) {
    RouteRequest request;
    request.partition = {"m", "default"};
    request.selection.request_id = id;
    request.selection.prompt_tokens = blocks * kBlockSize;
    std::optional<BlockHash> parent;
    for (std::size_t i = 0; i < blocks; ++i) {
      parent = discovery::BlockHasher::chain(parent, std::hash<std::string>{}(id) + i);
      request.selection.block_hashes.push_back(*parent);
    }
    system_.spawn(route_client, selector_, std::move(request), &answers_);
    scheduler_.run();
  }

  void booking(const std::string& id, bool release) {
    caf::anon_send(selector_, booking_atom::value, BookingUpdate{{"m", "default"}, {id, release}});
    scheduler_.run();
  }

  double metric(std::string_view name) const {
    return metrics_->value(name, {{"partition", "m/default"}});
  }

  selector_actor selector_;
  Answers answers_;
};

TEST_F(SelectorActorTest, AnAnswerNowIsTheReplyAndTheGaugesFollowTheBookings) {
  spawn(config());
  add_worker(1);
  EXPECT_EQ(metric("kvr_workers"), 1);
  route("a", 2);
  ASSERT_EQ(answers_.routes.size(), 1U);
  EXPECT_EQ(answers_.routes[0], 1U);
  EXPECT_EQ(metric("kvr_bookings_open"), 1);
  booking("a", true);
  EXPECT_EQ(metric("kvr_bookings_open"), 0);
}

// The hit-rate ceilings are a diagnostic: a message of the selector's own records them, so that
// the answer leaves before them (the node's scheduler yields an actor's thread after each message
// and runs the actors the answer went to first; the test coordinator runs the selector on instead).
TEST_F(SelectorActorTest, TheHitRateCeilingsAreRecordedInAMessageOfTheirOwn) {
  SelectorActorConfig selector_config = config();
  selector_config.hit_rate_ceilings = metrics::HitRateCeilingsOptions{};
  spawn(std::move(selector_config));
  add_worker(1);
  const metrics::Labels model{{"model", "m"}};
  RouteRequest request;
  request.partition = {"m", "default"};
  request.selection.request_id = "a";
  request.selection.prompt_tokens = 4 * kBlockSize;
  std::optional<BlockHash> parent;
  for (std::size_t i = 0; i < 4; ++i) {
    parent = discovery::BlockHasher::chain(parent, 100 + i);
    request.selection.block_hashes.push_back(*parent);
  }
  system_.spawn(route_client, selector_, request, &answers_);
  // Up to the route's own message: the request is booked, its ceilings not yet recorded.
  while (metric("kvr_bookings_open") == 0 && scheduler_.try_run_once()) {
  }
  ASSERT_EQ(metric("kvr_bookings_open"), 1);
  EXPECT_EQ(metrics_->value("kvr_routed_prompt_tokens_total", model), 0);
  scheduler_.run();
  ASSERT_EQ(answers_.routes.size(), 1U);
  EXPECT_EQ(metrics_->value("kvr_routed_prompt_tokens_total", model), 4 * kBlockSize);

  // The same prompt again: its first three blocks are reusable under the workload ceiling.
  request.selection.request_id = "b";
  system_.spawn(route_client, selector_, request, &answers_);
  scheduler_.run();
  ASSERT_EQ(answers_.routes.size(), 2U);
  EXPECT_EQ(
      metrics_->value("kvr_ceiling_cached_tokens_total", {{"model", "m"}, {"ceiling", "workload"}}),
      3 * kBlockSize);
}

TEST_F(SelectorActorTest, AQueuedRequestIsAnsweredWhenAFirstTokenFreesItsWorker) {
  spawn(queueing_config());
  add_worker(1);
  route("a", 8);
  route("b", 8);
  ASSERT_EQ(answers_.routes.size(), 1U) << "b waits: its only worker is busy for its class";
  EXPECT_EQ(metrics_->value("kvr_queue_depth", {{"partition", "m/default"}, {"class", "default"}}),
            1);
  booking("a", false);
  ASSERT_EQ(answers_.routes.size(), 2U);
  EXPECT_EQ(answers_.routes[1], 1U);
}

TEST_F(SelectorActorTest, TheQueuesWakeUpEndsAWaitWithTimeout) {
  SelectorActorConfig selector_config = queueing_config();
  // The tick (which would end the wait too) comes long after the queue's wake-up.
  selector_config.tick_interval = 1h;
  spawn(std::move(selector_config));
  add_worker(1);
  route("a", 8);
  route("b", 8);
  ASSERT_EQ(answers_.routes.size(), 1U);
  // Nothing frees the worker; the wait limit passes and the wake-up the selector armed fires.
  clock_->advance(5s);
  ASSERT_TRUE(scheduler_.trigger_timeout());
  scheduler_.run();
  ASSERT_EQ(answers_.routes.size(), 2U);
  EXPECT_EQ(answers_.routes[1], std::unexpected(Error::timeout));
}

TEST_F(SelectorActorTest, AnExpiredWorkerIsReportedToTheDiscoverySide) {
  spawn(config());
  add_worker(7);
  clock_->advance(11s);
  // The first timer pending is the selector's tick.
  ASSERT_TRUE(scheduler_.trigger_timeout());
  scheduler_.run();
  EXPECT_EQ(answers_.removed, std::vector<WorkerId>{7});
  EXPECT_EQ(metric("kvr_workers_expired_total"), 1);
}

TEST_F(SelectorActorTest, AStoppingSelectorAnswersTheRequestsThatWait) {
  spawn(queueing_config());
  add_worker(1);
  route("a", 8);
  route("b", 8);
  ASSERT_EQ(answers_.routes.size(), 1U);
  caf::anon_send_exit(selector_, caf::exit_reason::user_shutdown);
  selector_ = nullptr;
  scheduler_.run();
  ASSERT_EQ(answers_.routes.size(), 2U);
  EXPECT_EQ(answers_.routes[1], std::unexpected(Error::unavailable));
}

}  // namespace
}  // namespace kvr::actors
