// The gateway actor: how the HTTP front door (selection/front_door, plain C++ on Asio threads)
// reaches the node's actors. It sends the front door's route requests and lifecycle reports to the
// ingress actor, as any actor client does (so they are validated, scoped, admitted and, in cluster
// mode, forwarded to the partition's owner), and hands each decision to the front door's callback;
// so do the generate streams of workers the front door cannot forward to.
//
// State it owns: none (its configuration only).
// Messages it handles (its typed interface, `gateway_actor`, in actors/actor_types.hpp):
//   route(RouteRequestMessage, DecisionCallback) — the decision goes to the callback, an ingress
//                                                  failure (timeout, shutdown) as an explicit
//                                                  error;
//   report(LifecycleReportMessage)               — a refused report is logged (rate-limited);
//   generate(GenerateRelayStart)                 — spawns, linked, the stream's relay: an actor
//                                                  client of the ingress that hands the first
//                                                  decision and the chunks to the callbacks and
//                                                  passes a cancel on.
// Spawned by the router node when it serves HTTP. It must never block or drop a callback.
#pragma once

#include <chrono>
#include <memory>

#include "actors/actor_types.hpp"
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
};

gateway_actor::behavior_type gateway_behavior(gateway_actor::pointer self,
                                              GatewayActorConfig config);

/// The front door's RoutingGateway over a gateway actor.
std::shared_ptr<front_door::RoutingGateway> make_actor_gateway(gateway_actor actor);

}  // namespace kvr::actors
