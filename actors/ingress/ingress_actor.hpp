// The ingress actor: the request API for actor clients, published through CAF's middleman
// (`kvr node --actor-port`). Its typed interface, `ingress_actor`, is declared with the other
// message types in actors/actor_types.hpp.
//
// State it owns: none (its configuration only).
// Messages it handles: route(RouteRequestMessage) → RouteDecisionMessage: validates and hashes
// the request (an invalid one gets an explicit error decision) and delegates it to the reservation
// actor, which answers the client (always: its own request to the selector carries the timeout);
// report(LifecycleReportMessage) → LifecycleAckMessage: validates and delegates it likewise;
// generate(GenerateRequestMessage) → RouteDecisionMessage: validates it and delegates it to the
// lifecycle actor, which answers with the first decision and streams the chunks to the sender;
// cancel(GenerateCancelMessage): hands the request id to the lifecycle actor. With a classifier
// actor configured, route, generate and cancel go through it first.
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
struct IngressActorConfig {
  reservation_actor reservation;
  /// Serves generate requests; without it they are refused (unavailable).
  lifecycle_actor lifecycle;
  /// When the node runs a request classifier: route and generate requests and cancels go to it
  /// instead (it hands admitted ones to the reservation and lifecycle actors). Null: direct.
  classifier_actor classifier;
  /// Cluster mode, for the ingress actor clients use: route, report, generate and cancel go to
  /// the forwarder, which serves them here or at the node that owns their partition. The ingress
  /// that peers forward to has none (it serves its own node's partitions: no forwarding loops).
  forwarder_actor forwarder;
  RouteDecodeLimits limits;
  std::shared_ptr<metrics::MetricsRegistry> metrics;
  /// Stamps each request's arrival (the reservation actor measures route latency from it).
  std::shared_ptr<const Clock> clock = Clock::steady();
};

/// The ingress actor's behaviour.
ingress_actor::behavior_type ingress_behavior(ingress_actor::pointer self,
                                              IngressActorConfig config);

}  // namespace kvr::actors
