// The lifecycle actor: one per node; serves generate (proxy) mode. For each generate request it
// keeps a RequestFlight (selection/lifecycle/request_flight.hpp), the plain core that decides the
// request's whole flight: routing through the partition's selector (via the discovery actor),
// retries before the first token, the prefill hop of a disaggregated request, deadlines, and each
// booking's release exactly once. The actor only carries out the core's steps: it publishes the
// GenerateRequest on the chosen worker's generate subject with the node's own stream subject,
// relays the worker's chunks to the client (its stream subject, or its actor), sends booking
// changes to the selector and classifier events to the classifier, keeps one timer per request
// for the core's deadline, and records metrics (cache outcome, retries, timeouts, hop times).
//
// State it owns: the requests in flight (stream id → RequestFlight, the decoded request, the
// client's stream and reply subjects, the workers' generate subjects), request id → stream id,
// and the next stream id.
// Messages it handles (its typed interface, `lifecycle_actor`, in actors/actor_types.hpp):
//   generate(GenerateEnvelope)       — a client's request (from the NATS bridge, or from the
//                                      ingress for an actor client: then it responds with the
//                                      first RouteDecision and streams chunks to that actor);
//   cancel(std::string request_id)   — the client's GenerateCancel (ignored when not served here);
//   chunk(ChunkEnvelope)             — a worker's chunk on the node's stream inbox;
//   removed(std::vector<WorkerId>)   — from the discovery actor (it is a watcher): workers left;
//   selector(model, group, selector) — from the discovery actor: that partition's route and
//                                       booking requests go to `selector` directly;
//   deadline(stream id, timer)       — internal, its own timer: the request's flight is ticked at
//                                      its deadline (first token, stall);
//   nats_link(bool connected)        — the node's NATS connection went down: chunks sent meanwhile
//                                      are lost, so every request in flight ends with an explicit
//                                      error at once, its booking released;
//   flush                            — internal: writes the decisions and chunks relayed to NATS
//                                      clients since the last write (burst_writer.hpp);
//   an exit message (node shutdown)  — every request in flight ends with an explicit error;
//   a down message (actor client)    — the client's requests in flight are cancelled.
// It registers itself with the discovery actor (watch: removals and selectors) when spawned.
// Spawned by the router node. Every request it makes carries a finite timeout; it must never block,
// throw, share its state, or call NATS request().
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include <caf/actor_addr.hpp>
#include <caf/actor_clock.hpp>
#include <caf/stateful_actor.hpp>
#include <caf/typed_response_promise.hpp>

#include "actors/actor_types.hpp"
#include "actors/support/burst_writer.hpp"
#include "actors/support/partition_routes.hpp"
#include "messages/metrics/cache_mismatch_detector.hpp"
#include "messages/metrics/metrics_registry.hpp"
#include "messages/metrics/rate_limited_log.hpp"
#include "selection/lifecycle/request_flight.hpp"
#include "selection/wire/generate_messages.hpp"
#include "selection/wire/nats_bridge.hpp"

namespace kvr::actors {

/// What the lifecycle actor is spawned with.
struct LifecycleActorConfig : NodeServices {
  /// Routes (route) and books (booking) through the partition selectors; told of removals.
  discovery_actor discovery;
  /// Workers publish chunks on `<stream_inbox_prefix>.<stream id>` (NatsBridge).
  std::string stream_inbox_prefix;
  /// How long a selector may take to answer.
  std::chrono::milliseconds selector_timeout{2'000};
  /// A dispatched attempt without a first chunk after this long counts as a worker failure.
  std::chrono::milliseconds first_token_timeout{30'000};
  /// A responding attempt without a chunk for this long ends with an explicit error (and counts
  /// as a stream timeout against its worker).
  std::chrono::milliseconds stream_stall_timeout{30'000};
  /// Retries of a request whose worker failed before its first token (and of a prefill hop).
  std::uint32_t max_retries = 1;
  /// When the node runs a request classifier: told each request's classifier events (Sent per
  /// dispatch, Responding at the first chunk, Completed at the final chunk, Aborted on an error,
  /// cancel or timeout). Null: no messages.
  classifier_actor classifier;
  /// Judges each model's predicted against delivered cached tokens (docs/hit-rate.md); the node
  /// shares one with its HTTP front door. Null: the actor makes its own on the node's clock.
  std::shared_ptr<metrics::CacheMismatchDetector> cache_mismatch;
};

/// One generate request in flight.
struct GenerateFlight {
  GenerateFlight(GenerateRequestData request_data, FlightOptions options)
      : flight(request_data.route.id(), request_data.route.selection.prompt_tokens, options),
        request(std::move(request_data)) {}

  RequestFlight flight;
  GenerateRequestData request;
  /// Where the first RouteDecision goes; cleared once sent.
  std::string reply_subject;
  /// An actor client's stream (instead of the NATS subjects), and the response to its generate
  /// request, which carries the first RouteDecision (delivered once).
  stream_client_actor stream_actor;
  caf::typed_response_promise<RouteDecisionMessage> decision_promise;
  /// The generate subjects of the client-facing attempt's worker and of the prefill hop's.
  std::string generate_subject;
  std::string prefill_subject;
  /// A route request to the selector is in flight (its booking must be undone if it arrives late).
  bool route_pending = false;
  /// The prefill hop's chunks, relayed only if its one token ended the generation.
  std::vector<v1::GenerateChunk> held;
  /// When the pending timer fires, and its number (a timer superseded by an earlier one is
  /// ignored).
  std::optional<caf::actor_clock::time_point> timer_at;
  std::uint32_t timer = 0;
};

/// The lifecycle actor's state.
struct LifecycleActorState {
  static inline const char* name = "kvr.lifecycle";
  LifecycleActorConfig config;
  /// By stream id (node-local; names the stream inbox subject). Node-based: references stay valid.
  std::unordered_map<std::uint64_t, GenerateFlight> flights;
  std::unordered_map<std::string, std::uint64_t> by_request_id;
  std::uint64_t next_stream_id = 1;
  /// Actor clients with requests in flight, monitored so that a client's end cancels them.
  std::map<caf::actor_addr, std::size_t> monitored_clients;
  /// Decisions and relayed chunks for NATS clients leave together, one write per burst.
  BurstWriter relays;
  /// Each partition's selector, as the discovery actor announced it.
  PartitionRoutes routes;
};

/// The lifecycle actor's behaviour.
lifecycle_actor::behavior_type lifecycle_behavior(
    lifecycle_actor::stateful_pointer<LifecycleActorState> self, LifecycleActorConfig config);

}  // namespace kvr::actors
