// The ingress actor: the request API for actor clients, published through CAF's middleman
// (`kvr node --actor-port`). Its typed interface, `ingress_actor`, is declared with the other
// message types in actors/actor_types.hpp.
//
// State it owns: none (its configuration only).
// Messages it handles: route(RouteRequestMessage) → RouteDecisionMessage: validates and hashes
// the request (an invalid one gets an explicit error decision) and delegates it to the node's
// entry (RequestEntry), which answers the client (always: the reservation actor's own request to
// the selector carries the timeout); report(LifecycleReportMessage) → LifecycleAckMessage:
// validates and delegates it likewise; generate(GenerateRequestMessage) → RouteDecisionMessage:
// validates it and delegates it, answered with the first decision and the chunks streamed to the
// sender; cancel(GenerateCancelMessage): hands the request id to the entry.
// Spawned by the router node. It must never block, throw, or leave a client without an answer.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>

#include "actors/actor_types.hpp"
#include "messages/clock.hpp"
#include "messages/metrics/metrics_registry.hpp"

namespace kvr::actors {

/// What the ingress actor is spawned with.
struct IngressActorConfig : NodeServices {
  /// Where validated requests go. Cluster mode: the forwarder for the ingress actor clients use
  /// (it serves them here or at the node that owns their partition); this node's own stages for
  /// the ingress that peers forward to (no forwarding loops). Without a generate entry, generate
  /// requests are refused (unavailable).
  RequestEntry entry;
  RouteDecodeLimits limits;
};

/// The ingress actor's behaviour.
ingress_actor::behavior_type ingress_behavior(ingress_actor::pointer self,
                                              IngressActorConfig config);

}  // namespace kvr::actors
