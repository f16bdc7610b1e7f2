// The classifier actor: one per node, in front of the reservation (route mode) and lifecycle
// (generate mode) actors when the node runs a request classifier (`request_classifier` in the
// router-policy YAML). It keeps one AdmissionState per routed model, created from the resolved
// factory when the model's first partition is created (its selector's first fleet message).
// Every route and generate request is classified; an admitted one is handed on (its response
// promise delegated) with the classifier's decisions applied: the worker-selection target as
// selection.affinity_target, the policy class, due time and scheduling cost in the
// RouteRequest's fields of the same names. A rejected one gets an explicit
// RouteDecision error with the classifier's reason (overloaded, rate_limited, due_time_expired,
// or rejected when the classifier failed), on the request's NATS reply subject or as the actor
// client's response, and for generate also the final error chunk of its stream. A request still
// waiting after ClassifierActorConfig::max_wait is refused the same way with `timeout`.
//
// State it owns: the AdmissionStates by model; the undecided requests (request id → model, the
// envelope and the response promise); the time its wake-up timer is armed for.
// Messages it handles (its typed interface, `classifier_actor`, in actors/actor_types.hpp):
//   route(RouteEnvelope) → RouteDecisionMessage       — from the NATS bridge and the ingress;
//   generate(GenerateEnvelope) → RouteDecisionMessage — likewise;
//   cancel(request id)               — an undecided generate request ends with a "cancelled"
//                                      chunk and its future is dropped; others go to the lifecycle
//                                      actor, which reports Aborted;
//   classify(ClassifierEvent)        — a lifecycle event of an admitted request (Sent, Responding,
//                                      Completed, Aborted) from the reservation or lifecycle actor;
//   targets(reservation, lifecycle)  — from the node, first: where admitted requests go;
//   kv_usage(model, group, used, total) — a selector's partition KV blocks after a load report
//                                      (of its ranks with a registered capacity; none without): the
//                                      model's fleet load (used over total blocks summed across
//                                      its partitions, i.e. weighted by their totals) goes to its
//                                      classifier's on_fleet_load (the model's state is created
//                                      if needed), and the Wakers it fires are polled at once;
//   an exit message (node shutdown)  — every undecided request ends with an explicit error;
//   a down message (actor client)    — the client's undecided requests are dropped;
//   wake                             — internal: one delayed_send at the earliest wake time, due
//                                      time or wait limit (re-armed when an earlier one appears),
//                                      and one message per batch of fired Wakers.
//   fleet(PartitionFleet)            — a selector's partition when it is created and after a
//                                      worker joined or left; creates the model's classifier (the
//                                      first) or updates its context.
//   classify(model, id, tokens)      — an admitted request's context grew (lifecycle actor's
//                                      chunks, reservation actor's reports): its progress.
// Undecided requests are re-polled only on a wake-up, never on a timer tick. A model's classifier
// is created when its first partition is created (or at its first request or load report, should
// one come first) with a context that describes the fleet its selectors described by then (the
// block size of its first partition that has one, and every worker rank of its partitions) and
// follows their later descriptions. A factory that fails is counted and logged once, then.
// Spawned by the router node only when a classifier is configured; otherwise the node wires the
// bridge and the ingress straight to the reservation and lifecycle actors, so pass-through costs
// nothing. It must never block or throw.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <variant>

#include <caf/actor_addr.hpp>
#include <caf/stateful_actor.hpp>
#include <caf/typed_response_promise.hpp>

#include "actors/actor_types.hpp"
#include "messages/clock.hpp"
#include "messages/metrics/metrics_registry.hpp"
#include "selection/admission/admission_state.hpp"
#include "selection/wire/nats_bridge.hpp"

namespace kvr::actors {

/// What the classifier actor is spawned with.
struct ClassifierActorConfig : NodeServices {
  /// Creates one classifier per model (RouterPlugins::request_classifier).
  plugins::request_classifier::RequestClassifierFactory factory;
  /// Where admitted requests go (also settable by a targets message, which the node sends first
  /// because these actors are spawned after this one).
  reservation_actor reservation;
  lifecycle_actor lifecycle;
  /// How long a request may wait for its admission decision: past it, it is refused with
  /// `timeout` (its client has most likely given up). The router node sets its first-token
  /// timeout (`--router-first-token-timeout-ms`, 30 s by default): a request the node would not
  /// wait that long for a worker's first token should not wait longer for admission. Positive.
  std::chrono::milliseconds max_wait{30'000};
};

/// The classifier actor's state.
struct ClassifierActorState {
  static inline const char* name = "kvr.classifier";
  ClassifierActorConfig config;

  /// A request waiting for its admission decision, and how to answer or hand it on.
  struct WaitingRoute {
    RouteEnvelope envelope;
    caf::typed_response_promise<RouteDecisionMessage> promise;
  };
  struct WaitingGenerate {
    GenerateEnvelope envelope;
    caf::typed_response_promise<RouteDecisionMessage> promise;
  };
  using Waiting = std::variant<WaitingRoute, WaitingGenerate>;

  struct Model {
    /// The model as discovery describes it, kept up to date and alive as long as the classifier
    /// (declared first: destroyed after it).
    std::unique_ptr<plugins::request_classifier::RequestClassifierContext> context;
    /// Null when the classifier could not be built: `failure` says why, and every request of the
    /// model is refused with it.
    std::unique_ptr<AdmissionState> admission;
    std::string failure;
    std::unordered_map<std::string, Waiting> waiting;
  };
  std::unordered_map<std::string, Model> models;
  /// Actor clients with generate requests waiting here, monitored so that a client's end drops
  /// its requests (the lifecycle actor does the same for admitted ones).
  std::map<caf::actor_addr, std::size_t> monitored_clients;
  /// KV blocks (used, total) by model and routing group, as the selectors last sent them.
  std::unordered_map<std::string, std::map<std::string, std::pair<std::uint64_t, std::uint64_t>>>
      fleet_blocks;
  /// Each model's partitions as their selectors last described them, by routing group.
  std::unordered_map<std::string, std::map<std::string, PartitionFleet>> fleets;
  /// The earliest time a delayed wake message is on its way for; empty: none.
  std::optional<std::chrono::steady_clock::time_point> armed_for;
};

/// The classifier actor's behaviour.
classifier_actor::behavior_type classifier_behavior(
    classifier_actor::stateful_pointer<ClassifierActorState> self, ClassifierActorConfig config);

}  // namespace kvr::actors
