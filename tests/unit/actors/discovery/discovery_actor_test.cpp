// The discovery actor on CAF's deterministic test coordinator (no actor runs until the test runs
// the scheduler, after every send) and an injected clock. Checked: a registration spawns its
// partition's selector, which then gets the worker's messages and serves the partition's routes; a
// route for a partition without a selector is refused; removal watchers and selector subscribers
// are told; in cluster mode a selector runs only for a partition this node owns or warms up, and a
// handover or lost ownership retires it.
#include "actors/discovery/discovery_actor.hpp"

#include <expected>
#include <memory>
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
#include "actors/selector/selector_actor.hpp"
#include "messages/clock.hpp"
#include "messages/metrics/node_metrics.hpp"
#include "selection/cluster/placement.hpp"
#include "selection/config/router_policy_config.hpp"
#include "selection/policies/builtin_policies.hpp"
#include "tests/testing/worker_registration.hpp"
#include "tests/unit/actors/coordinated_actors.hpp"

namespace kvr::actors {
namespace {

using namespace std::chrono_literals;

constexpr std::uint32_t kBlockSize = 4;

// A selector the discovery actor announced: an invalid handle when it retired one.
struct Announced {
  std::string model;
  std::string group;
  selector_actor selector;
};

// What the test's actors were told.
struct Seen {
  std::vector<std::expected<WorkerId, Error>> routes;
  std::vector<BookingUpdateReply> bookings;
  std::vector<bool> handovers;
  std::vector<Announced> selectors;
  /// The cluster actor's: partitions learnt of, partitions warmed up.
  std::vector<std::string> partitions;
  std::vector<std::string> ready;
};

// The test's actors are spawned with an argument: CAF 0.17's initialisation of an actor without
// one binds a null reference, which UBSan reports.
removal_watcher_actor::behavior_type removal_watcher(removal_watcher_actor::pointer,
                                                     std::vector<WorkerId>* removed) {
  return {[removed](removed_atom, const std::vector<WorkerId>& workers) {
    removed->insert(removed->end(), workers.begin(), workers.end());
  }};
}

selector_subscriber_actor::behavior_type selector_subscriber(selector_subscriber_actor::pointer,
                                                             Seen* seen) {
  return {[seen](selector_atom, std::string& model, std::string& group, selector_actor& selector) {
    seen->selectors.push_back({std::move(model), std::move(group), std::move(selector)});
  }};
}

// Stands in for the cluster actor: records what the discovery actor tells it.
cluster_actor::behavior_type cluster_recorder(cluster_actor::pointer, Seen* seen) {
  return {
      [seen](partition_atom, std::string& partition) {
        seen->partitions.push_back(std::move(partition));
      },
      [seen](ready_atom, std::string& partition) { seen->ready.push_back(std::move(partition)); },
      [](targets_atom, const discovery_actor&, const forwarder_actor&, const std::string&) {},
      [](step_atom) {},
  };
}

void route_client(caf::event_based_actor* self, const route_target_actor& target,
                  RouteRequest request, Seen* seen) {
  self->request(target, caf::infinite, route_atom::value, std::move(request))
      .then([seen](SelectorReply& reply) {
        if (reply.result) {
          seen->routes.emplace_back(reply.result->worker.worker_id);
        } else {
          seen->routes.emplace_back(std::unexpected(reply.result.error().code));
        }
      });
}

void booking_client(caf::event_based_actor* self, const discovery_actor& discovery,
                    BookingUpdate update, Seen* seen) {
  self->request(discovery, caf::infinite, booking_atom::value, std::move(update))
      .then([seen](BookingUpdateReply& reply) { seen->bookings.push_back(std::move(reply)); });
}

void handover_client(caf::event_based_actor* self, const discovery_actor& discovery,
                     std::vector<std::string> partitions, Seen* seen) {
  self->request(discovery, caf::infinite, handover_atom::value, std::move(partitions))
      .then([seen](bool done) { seen->handovers.push_back(done); });
}

discovery::WorkerRegistration registration(WorkerId id, const std::string& model) {
  return testing::worker_registration(id, model, kBlockSize, 1s);
}

class DiscoveryActorTest : public testing::CoordinatedActorsTest {
 protected:
  ~DiscoveryActorTest() override {
    // The selectors are linked to it: they go with it.
    if (discovery_) caf::anon_send_exit(discovery_, caf::exit_reason::user_shutdown);
    scheduler_.run();
  }

  // Selectors tick only when the test triggers their timer (an hour), liveness TTLs last 1 s.
  DiscoveryActorConfig config() {
    DiscoveryActorConfig config;
    config.selector.options.router.block_size = kBlockSize;
    config.selector.options.booking_ttl = 60s;
    static_cast<NodeServices&>(config.selector) = services();
    config.selector.plugins = &plugins_;
    config.selector.tick_interval = 1h;
    return config;
  }

  // Cluster mode, as the node runs it: fenced selectors, a cluster actor told of partitions.
  DiscoveryActorConfig cluster_config() {
    DiscoveryActorConfig result = config();
    result.selector.fenced = true;
    result.cluster = system_.spawn(cluster_recorder, &seen_);
    return result;
  }

  void spawn(DiscoveryActorConfig discovery_config) {
    discovery_ = system_.spawn(discovery_behavior, std::move(discovery_config));
    scheduler_.run();
  }

  void subscribe() {
    send(discovery_, watch_atom::value, system_.spawn(selector_subscriber, &seen_));
  }

  // Sends a message and handles it (and whatever it causes) at the clock's current time.
  template <class Target, class... Ts>
  void send(const Target& target, Ts&&... xs) {
    caf::anon_send(target, std::forward<Ts>(xs)...);
    scheduler_.run();
  }

  // Every selector's expiry tick.
  void tick() {
    EXPECT_GT(scheduler_.trigger_timeouts(), 0U);
    scheduler_.run();
  }

  // The answer `target` gives a route request for `model`'s default group now.
  std::expected<WorkerId, Error> route(const route_target_actor& target, const std::string& model) {
    RouteRequest request;
    request.partition.model = model;
    request.selection.request_id = "r" + std::to_string(next_request_++);
    request.selection.prompt_tokens = 2 * kBlockSize;
    request.selection.block_hashes = {1, 2};
    const std::size_t before = seen_.routes.size();
    system_.spawn(route_client, target, std::move(request), &seen_);
    scheduler_.run();
    if (seen_.routes.size() != before + 1) {
      ADD_FAILURE() << "the route for " << model << " got no answer";
      return std::unexpected(Error::timeout);
    }
    return seen_.routes.back();
  }

  std::expected<WorkerId, Error> route(const std::string& model) {
    return route(discovery_, model);
  }

  bool handover(std::vector<std::string> partitions) {
    system_.spawn(handover_client, discovery_, std::move(partitions), &seen_);
    scheduler_.run();
    return seen_.handovers.size() == 1 && seen_.handovers[0];
  }

  double workers(const std::string& model) const {
    return metrics_->value("kvr_workers", {{"partition", model + "/default"}});
  }

  discovery_actor discovery_;
  Seen seen_;
  int next_request_ = 0;
};

TEST_F(DiscoveryActorTest, ARegistrationSpawnsThePartitionsSelectorWhichGetsTheWorkersMessages) {
  spawn(config());
  send(discovery_, worker_up_atom::value, registration(1, "m"));
  send(discovery_, worker_up_atom::value, registration(2, "other"));
  EXPECT_EQ(workers("m"), 1);
  EXPECT_EQ(workers("other"), 1);
  // Each partition's routes go to its own selector.
  EXPECT_EQ(route("m"), 1U);
  EXPECT_EQ(route("other"), 2U);

  // Worker 1's heartbeat reaches its selector: its liveness outlives the silent worker 2's.
  clock_->advance(600ms);
  send(discovery_, heartbeat_atom::value, WorkerLiveness{1, 1});
  clock_->advance(600ms);
  tick();
  EXPECT_EQ(workers("m"), 1);
  EXPECT_EQ(workers("other"), 0);

  // So does its deregistration.
  send(discovery_, worker_down_atom::value, WorkerLiveness{1, 1});
  EXPECT_EQ(workers("m"), 0);
}

TEST_F(DiscoveryActorTest, ARouteOrBookingForAPartitionWithoutASelectorIsRefused) {
  spawn(config());
  send(discovery_, worker_up_atom::value, registration(1, "other"));
  EXPECT_EQ(route("m"), std::unexpected(Error::no_workers));

  system_.spawn(booking_client, discovery_, BookingUpdate{{"m", "default"}, {"r", true}}, &seen_);
  scheduler_.run();
  ASSERT_EQ(seen_.bookings.size(), 1U);
  EXPECT_FALSE(seen_.bookings[0].applied);
}

TEST_F(DiscoveryActorTest, RemovalWatchersGetTheWorkersThatLeftAndTheyAreForgotten) {
  spawn(config());
  std::vector<WorkerId> first;
  std::vector<WorkerId> second;
  send(discovery_, watch_atom::value, system_.spawn(removal_watcher, &first));
  send(discovery_, watch_atom::value, system_.spawn(removal_watcher, &second));
  send(discovery_, worker_up_atom::value, registration(1, "m"));
  send(discovery_, worker_up_atom::value, registration(2, "m"));
  // A known worker's heartbeat asks nothing of the fleet.
  send(discovery_, heartbeat_atom::value, WorkerLiveness{2, 1});
  EXPECT_EQ(publisher_->reregistrations, 0);

  send(discovery_, worker_down_atom::value, WorkerLiveness{1, 1});
  EXPECT_EQ(first, std::vector<WorkerId>{1});
  clock_->advance(2s);
  tick();
  EXPECT_EQ(first, (std::vector<WorkerId>{1, 2}));
  EXPECT_EQ(second, first);

  // Worker 2 expired and is no longer known: its next heartbeat asks the workers to register.
  send(discovery_, heartbeat_atom::value, WorkerLiveness{2, 1});
  EXPECT_EQ(publisher_->reregistrations, 1);
}

TEST_F(DiscoveryActorTest, SelectorSubscribersAreToldOfEverySelectorNowAndWhenOneIsSpawned) {
  spawn(config());
  send(discovery_, worker_up_atom::value, registration(1, "m"));
  subscribe();
  ASSERT_EQ(seen_.selectors.size(), 1U);
  EXPECT_EQ(seen_.selectors[0].model, "m");
  EXPECT_EQ(seen_.selectors[0].group, "default");
  EXPECT_TRUE(seen_.selectors[0].selector);

  send(discovery_, worker_up_atom::value, registration(2, "other"));
  // A second worker of a served partition spawns nothing.
  send(discovery_, worker_up_atom::value, registration(3, "m"));
  ASSERT_EQ(seen_.selectors.size(), 2U);
  EXPECT_EQ(seen_.selectors[1].model, "other");
  // The handle is that partition's selector: it routes to the partition's worker.
  EXPECT_EQ(route(seen_.selectors[1].selector, "other"), 2U);
}

TEST_F(DiscoveryActorTest, InClusterModeAPartitionNotOwnedGetsNoSelectorAndItsWorkersAreDropped) {
  spawn(cluster_config());
  subscribe();
  send(discovery_, worker_up_atom::value, registration(1, "m"));
  send(discovery_, worker_up_atom::value, registration(2, "m"));
  // The cluster actor learns of the partition once; no selector runs for it here.
  EXPECT_EQ(seen_.partitions, std::vector<std::string>{cluster::partition_key("m", "default")});
  EXPECT_TRUE(seen_.selectors.empty());
  EXPECT_EQ(workers("m"), 0);
  // Known but served elsewhere: retry, rather than "no workers".
  EXPECT_EQ(route("m"), std::unexpected(Error::unavailable));
  // Its workers' messages stop here, without asking them to register; an unknown worker's asks.
  send(discovery_, heartbeat_atom::value, WorkerLiveness{1, 1});
  EXPECT_EQ(publisher_->reregistrations, 0);
  send(discovery_, heartbeat_atom::value, WorkerLiveness{9, 1});
  EXPECT_EQ(publisher_->reregistrations, 1);
}

TEST_F(DiscoveryActorTest, InClusterModeOwnershipSpawnsAWarmSelectorAndAHandoverRetiresIt) {
  spawn(cluster_config());
  subscribe();
  send(discovery_, worker_up_atom::value, registration(1, "m"));
  const std::string partition = cluster::partition_key("m", "default");

  ClusterView view;
  view.owned.push_back({partition, 1, clock_->now() + 10s});
  send(discovery_, ownership_atom::value, view);
  ASSERT_EQ(seen_.selectors.size(), 1U);
  EXPECT_TRUE(seen_.selectors[0].selector);
  // Warm at once from the registration heard before, and the fleet is asked to register again.
  EXPECT_EQ(route("m"), 1U);
  EXPECT_EQ(publisher_->reregistrations, 1);

  ASSERT_TRUE(handover({partition}));
  ASSERT_EQ(seen_.selectors.size(), 2U);
  EXPECT_FALSE(seen_.selectors[1].selector);
  EXPECT_EQ(route("m"), std::unexpected(Error::unavailable));
  // The retired selector's gauges are zeroed; a registration now spawns nothing.
  EXPECT_EQ(workers("m"), 0);
  send(discovery_, worker_up_atom::value, registration(1, "m"));
  EXPECT_EQ(seen_.selectors.size(), 2U);
  EXPECT_EQ(workers("m"), 0);
}

TEST_F(DiscoveryActorTest, InClusterModeAWarmedUpPartitionIsReadyAndALostOneIsRetired) {
  spawn(cluster_config());
  subscribe();
  send(discovery_, worker_up_atom::value, registration(1, "m"));
  const std::string partition = cluster::partition_key("m", "default");

  ClusterView warming;
  warming.prepare.push_back(partition);
  send(discovery_, ownership_atom::value, warming);
  EXPECT_EQ(seen_.ready, std::vector<std::string>{partition});
  ASSERT_EQ(seen_.selectors.size(), 1U);
  const selector_actor warmed = seen_.selectors[0].selector;
  EXPECT_TRUE(warmed);

  // Owned: the warmed-up selector serves on.
  ClusterView owning;
  owning.owned.push_back({partition, 1, clock_->now() + 10s});
  send(discovery_, ownership_atom::value, owning);
  EXPECT_EQ(seen_.selectors.size(), 1U);
  EXPECT_EQ(route("m"), 1U);

  // Owned no longer, though warming up again: what it booked as owner is dropped with a new
  // selector.
  send(discovery_, ownership_atom::value, warming);
  ASSERT_EQ(seen_.selectors.size(), 3U);
  EXPECT_FALSE(seen_.selectors[1].selector);
  EXPECT_TRUE(seen_.selectors[2].selector);
  EXPECT_NE(seen_.selectors[2].selector, warmed);

  // Neither owned nor warming up: retired.
  send(discovery_, ownership_atom::value, ClusterView{});
  ASSERT_EQ(seen_.selectors.size(), 4U);
  EXPECT_FALSE(seen_.selectors[3].selector);
  EXPECT_EQ(route("m"), std::unexpected(Error::unavailable));
}

}  // namespace
}  // namespace kvr::actors
