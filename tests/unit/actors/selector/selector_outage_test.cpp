// The node's own NATS outage as the selector and discovery actors see it, on an injected clock and
// CAF's deterministic test coordinator (every message is handled before the clock moves on):
// while the connection is down no worker liveness expires, after the reconnect each worker's
// liveness runs one TTL from it (a worker silent since expires then, a live one stays), and every
// worker heard from again is asked for its KV dump, a bounded number per tick.
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
#include "actors/discovery/discovery_actor.hpp"
#include "actors/selector/selector_actor.hpp"
#include "messages/clock.hpp"
#include "messages/metrics/node_metrics.hpp"
#include "selection/config/router_policy_config.hpp"
#include "selection/policies/builtin_policies.hpp"
#include "tests/unit/actors/coordinated_actors.hpp"

namespace kvr::actors {
namespace {

using namespace std::chrono_literals;

discovery::WorkerRegistration registration(WorkerId id) {
  discovery::WorkerRegistration result;
  result.worker_id = id;
  result.incarnation = 1;
  result.model = "m";
  result.block_size = 4;
  result.total_kv_blocks = 100;
  result.liveness_ttl = 1s;
  result.generate_subject = "gen." + std::to_string(id);
  result.dump_subject = "dump." + std::to_string(id);
  return result;
}

RouteRequest request(std::string id) {
  RouteRequest data;
  data.selection.request_id = std::move(id);
  data.partition.model = "m";
  data.selection.prompt_tokens = 8;
  data.selection.block_hashes = {1, 2};
  return data;
}

// Sends one route request to `target` and records whether it was routed. (Spawned with arguments:
// CAF 0.17's initialisation of an actor without one binds a null reference, which UBSan reports.)
void route_client(caf::event_based_actor* self, const route_target_actor& target,
                  RouteRequest request, std::optional<bool>* routed) {
  self->request(target, caf::infinite, route_atom::value, std::move(request))
      .then([routed](SelectorReply& reply) { *routed = reply.result.has_value(); });
}

class SelectorOutageTest : public testing::CoordinatedActorsTest {
 protected:
  ~SelectorOutageTest() override {
    if (selector_) caf::anon_send_exit(selector_, caf::exit_reason::user_shutdown);
    if (discovery_) caf::anon_send_exit(discovery_, caf::exit_reason::user_shutdown);
    scheduler_.run();
  }

  // The expiry timer never fires (an hour, and the test triggers no timeout): the test sends
  // every tick.
  SelectorActorConfig selector_config() {
    SelectorActorConfig config{{}, services()};
    config.options.router.block_size = 4;
    config.options.booking_ttl = 60s;
    config.options.partition = {"m", "default"};
    config.plugins = &plugins_;
    config.tick_interval = 1h;
    return config;
  }

  // Sends a message and handles it (and whatever it causes) at the clock's current time.
  template <class Target, class... Ts>
  void send(const Target& target, Ts&&... xs) {
    caf::anon_send(target, std::forward<Ts>(xs)...);
    scheduler_.run();
  }

  // Whether a route request `target` answers now was routed.
  bool routes(const route_target_actor& target, const std::string& id) {
    std::optional<bool> routed;
    system_.spawn(route_client, target, request(id), &routed);
    scheduler_.run();
    if (!routed) ADD_FAILURE() << "route " << id << " got no answer";
    return routed.value_or(false);
  }

  double metric(std::string_view name) const {
    return metrics_->value(name, {{"partition", "m/default"}});
  }

  selector_actor selector_;
  discovery_actor discovery_;
};

TEST_F(SelectorOutageTest, NoLivenessExpiresWhileDisconnectedAndASilentWorkerExpiresOneTtlAfter) {
  selector_ = system_.spawn(selector_behavior, selector_config());
  scheduler_.run();
  for (WorkerId id : {11, 12}) send(selector_, worker_up_atom::value, registration(id));
  ASSERT_TRUE(routes(selector_, "before"));
  EXPECT_EQ(metric("kvr_workers"), 2);
  // Each worker the selector learns of is asked for its KV state once.
  EXPECT_EQ(publisher_->dumps, (std::vector<WorkerWithDpRank>{{11, 0}, {12, 0}}));
  publisher_->dumps.clear();

  // The node loses NATS for 30 liveness TTLs' worth of time; ticks keep running.
  send(selector_, nats_link_atom::value, false);
  for (int tick = 0; tick < 30; ++tick) {
    clock_->advance(1s);
    send(selector_, tick_atom::value);
  }
  ASSERT_TRUE(routes(selector_, "during"));
  EXPECT_EQ(metric("kvr_workers"), 2);
  EXPECT_EQ(metric("kvr_workers_expired_total"), 0);

  // Back: both workers' liveness had run out and were held; each now runs one TTL (1 s) from here.
  send(selector_, nats_link_atom::value, true);
  ASSERT_TRUE(routes(selector_, "reconnected"));
  EXPECT_EQ(metric("kvr_worker_expiries_suppressed_total"), 2);
  EXPECT_EQ(metric("kvr_worker_liveness_grants_total"), 2);
  // No dump asked yet: neither worker has been heard from since the reconnect.
  EXPECT_TRUE(publisher_->dumps.empty());

  // Worker 12 is alive: its heartbeat renews its liveness and brings its dump request.
  clock_->advance(600ms);
  send(selector_, heartbeat_atom::value, WorkerLiveness{12, 1});
  clock_->advance(399ms);
  send(selector_, tick_atom::value);
  ASSERT_TRUE(routes(selector_, "within-grace"));
  EXPECT_EQ(metric("kvr_workers"), 2);
  EXPECT_EQ(publisher_->dumps, (std::vector<WorkerWithDpRank>{{12, 0}}));

  // Worker 11 died during the outage: it expires one TTL after the reconnect, not before.
  clock_->advance(1ms);
  send(selector_, tick_atom::value);
  ASSERT_TRUE(routes(selector_, "after-grace"));
  EXPECT_EQ(metric("kvr_workers"), 1);
  EXPECT_EQ(metric("kvr_workers_expired_total"), 1);

  // The live worker stays as long as it heartbeats.
  for (int beat = 0; beat < 5; ++beat) {
    clock_->advance(500ms);
    send(selector_, heartbeat_atom::value, WorkerLiveness{12, 1});
    send(selector_, tick_atom::value);
  }
  ASSERT_TRUE(routes(selector_, "later"));
  EXPECT_EQ(metric("kvr_workers"), 1);
  EXPECT_EQ(metric("kvr_workers_expired_total"), 1);
  // Asked once: the dump was wanted for the reconnect only.
  EXPECT_EQ(publisher_->dumps.size(), 1U);
}

TEST_F(SelectorOutageTest, ResyncDumpsAreAskedForAFewPerTick) {
  SelectorActorConfig config = selector_config();
  config.resync_dumps_per_tick = 2;
  selector_ = system_.spawn(selector_behavior, config);
  scheduler_.run();
  const std::vector<WorkerId> fleet{21, 22, 23, 24, 25};
  for (WorkerId id : fleet) send(selector_, worker_up_atom::value, registration(id));
  // The new workers' dumps, paced the same way.
  EXPECT_EQ(publisher_->dumps.size(), 2U);
  for (int tick = 0; tick < 3; ++tick) send(selector_, tick_atom::value);
  EXPECT_EQ(publisher_->dumps.size(), 5U);
  publisher_->dumps.clear();
  send(selector_, nats_link_atom::value, false);
  clock_->advance(5s);
  send(selector_, nats_link_atom::value, true);
  // Every worker answers the node's call to register again at once.
  for (WorkerId id : fleet) send(selector_, worker_up_atom::value, registration(id));
  ASSERT_TRUE(routes(selector_, "registered"));
  EXPECT_EQ(publisher_->dumps.size(), 2U);
  send(selector_, tick_atom::value);
  ASSERT_TRUE(routes(selector_, "tick-1"));
  EXPECT_EQ(publisher_->dumps.size(), 4U);
  send(selector_, tick_atom::value);
  ASSERT_TRUE(routes(selector_, "tick-2"));
  EXPECT_EQ(publisher_->dumps.size(), 5U);
  send(selector_, tick_atom::value);
  ASSERT_TRUE(routes(selector_, "tick-3"));
  EXPECT_EQ(publisher_->dumps.size(), 5U);
  EXPECT_EQ(metric("kvr_workers"), 5);
  EXPECT_EQ(metric("kvr_workers_expired_total"), 0);
}

TEST_F(SelectorOutageTest, TheDiscoveryActorTellsEverySelectorAndAsksWorkersToRegisterAgain) {
  discovery_ = system_.spawn(discovery_behavior, DiscoveryActorConfig{selector_config(), {}});
  scheduler_.run();
  send(discovery_, worker_up_atom::value, registration(31));
  ASSERT_TRUE(routes(discovery_, "before"));
  const int asked_before = publisher_->reregistrations;
  EXPECT_EQ(publisher_->dumps, (std::vector<WorkerWithDpRank>{{31, 0}})) << "learnt of: asked once";
  publisher_->dumps.clear();

  send(discovery_, nats_link_atom::value, false);
  // A partition first seen during the outage (its selector spawned then) is told of the return.
  discovery::WorkerRegistration other = registration(32);
  other.model = "other";
  send(discovery_, worker_up_atom::value, other);
  EXPECT_EQ(metrics_->value("kvr_workers", {{"partition", "other/default"}}), 1);
  publisher_->dumps.clear();  // worker 32's, asked for while the link is down
  clock_->advance(2s);
  send(discovery_, nats_link_atom::value, true);
  EXPECT_EQ(metrics_->value("kvr_worker_liveness_grants_total", {{"partition", "other/default"}}),
            1);
  EXPECT_EQ(metric("kvr_worker_liveness_grants_total"), 1);
  EXPECT_EQ(publisher_->reregistrations, asked_before + 1);
  // The worker registers again in answer: its KV state is asked for.
  send(discovery_, worker_up_atom::value, registration(31));
  EXPECT_EQ(publisher_->dumps, (std::vector<WorkerWithDpRank>{{31, 0}}));
}

}  // namespace
}  // namespace kvr::actors
