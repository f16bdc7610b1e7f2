// The gateway actor: how the HTTP front door (selection/front_door, plain C++ on Asio threads)
// reaches the node's actors. It sends the front door's route requests and lifecycle reports to the
// ingress actor, as any actor client does (so they are validated, scoped, admitted and, in cluster
// mode, forwarded to the partition's owner), and hands each decision to the front door's callback;
// so do the generate streams of workers the front door cannot forward to.
//
// State it owns: the routes and reports in flight, each with its deadline (one sweep timer
// answers a route whose answer never came, so that no request waits on a CAF timeout of its own).
// Messages it handles (its typed interface, `gateway_actor`, in actors/actor_types.hpp):
//   route(RouteRequestMessage, DecisionCallback) — the decision goes to the callback, an ingress
//                                                  failure (timeout, shutdown) as an explicit
//                                                  error;
//   report(LifecycleReportMessage)               — a refused report is logged (rate-limited);
//   generate(GenerateRelayStart)                 — spawns, linked, the stream's relay: an actor
//                                                  client of the ingress that hands the first
//                                                  decision and the chunks to the callbacks and
//                                                  passes a cancel on.
//   tick                                         — the sweep: overdue routes get a timeout
//                                                  error, overdue reports a warning.
// Spawned by the router node when it serves HTTP. It must never block or drop a callback.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>

#include <caf/stateful_actor.hpp>

#include "actors/actor_types.hpp"
#include "messages/clock.hpp"
#include "selection/front_door/routing_gateway.hpp"

namespace caf {
class actor_system;
}

namespace kvr::actors {

struct GatewayActorConfig : NodeServices {
  ingress_actor ingress;
  /// How long a route request may take before the front door gets a timeout error (the entry's
  /// own deadlines come first).
  std::chrono::milliseconds route_timeout{35'000};
  /// How often the deadlines are checked while requests are in flight.
  std::chrono::milliseconds sweep_interval{1'000};
};

struct GatewayState {
  struct PendingRoute {
    std::string request_id;
    std::function<void(v1::RouteDecision)> done;
  };
  GatewayState() = default;
  GatewayState(const GatewayState&) = delete;
  GatewayState& operator=(const GatewayState&) = delete;
  ~GatewayState();

  GatewayActorConfig config;
  std::unordered_map<std::uint64_t, PendingRoute> routes;
  /// Reports in flight: their booking ids.
  std::unordered_map<std::uint64_t, std::string> reports;
  /// (deadline, id) in the order sent: one timeout for all, so the oldest is first.
  std::deque<std::pair<TimePoint, std::uint64_t>> deadlines;
  std::uint64_t next_id = 0;
  bool sweep_armed = false;
};

gateway_actor::behavior_type gateway_behavior(gateway_actor::stateful_pointer<GatewayState> self,
                                              GatewayActorConfig config);

/// The front door's RoutingGateway over a gateway actor.
std::shared_ptr<front_door::RoutingGateway> make_actor_gateway(gateway_actor actor);

}  // namespace kvr::actors
