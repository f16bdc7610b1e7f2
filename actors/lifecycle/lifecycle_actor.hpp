// The lifecycle actor: one per node; serves generate (proxy) mode. For each generate request it
// keeps a RequestLifecycle (Sent → Responding → Completed | Aborted), routes it through the
// partition's selector (via the discovery actor), dispatches a GenerateRequest to the chosen
// worker's generate subject with the node's own stream subject, relays every chunk to the
// client's stream subject, and carries out each LifecycleStep: bookings are released exactly once
// (first token: first_token; final, error or cancel: release) together with the session-affinity
// commit / abandon / finish, a worker that fails before the first token (it left the fleet, it
// sent an error chunk, or no chunk came within the first-token timeout) gets the request retried
// once on another worker (excluding it), and after that the client gets an explicit error chunk.
// Booking updates carry what the node saw of the worker's health: the first token is a success,
// a dispatch failure or first-token timeout a failure (the selector may eject the worker).
// At each request's first chunk it records the cache outcome (the route's predicted cached tokens
// against the chunk's cached_prompt_tokens) in the node's metrics and the cache-mismatch
// detector, which warns through the rate-limited log (docs/hit-rate.md).
// Disaggregated serving (docs/disaggregation.md): a request's first route is planned by the
// partition core; when it books a prefill worker, the actor runs the prefill hop itself (one
// token, vLLM's do_remote_decode; its own booking, retried once without a failed worker, never
// told to the classifier), then routes the decode hop with the transfer parameters the prefill
// answered and hands it to the RequestLifecycle as an ordinary attempt. A decode attempt that
// fails before its first token is retried on the same parameters while they are valid.
//
// State it owns: the requests in flight (stream id → RequestLifecycle, the decoded request, the
// client's stream and reply subjects, the current worker's generate subject), request id →
// stream id, and the next stream id.
// Messages it handles (its typed interface, `lifecycle_actor`, in actors/actor_types.hpp):
//   generate(GenerateEnvelope)       — a client's request (from the NATS bridge, or from the
//                                      ingress for an actor client: then it responds with the
//                                      first RouteDecision and streams chunks to that actor);
//   cancel(std::string request_id)   — the client's GenerateCancel (ignored when not served here);
//   chunk(ChunkEnvelope)             — a worker's chunk on the node's stream inbox;
//   removed(std::vector<WorkerId>)   — from the discovery actor (it is a watcher): workers left;
//   selector(model, group, selector) — from the discovery actor: that partition's route and
//                                       booking requests go to `selector` directly;
//   deadline(stream id, attempt)     — internal, its own timer: the attempt's first-token timeout;
//   stall(stream id, attempt)        — internal, its own timer: a responding attempt with no chunk
//                                      for the stall timeout ends with an explicit error;
//   nats_link(bool connected)        — the node's NATS connection went down: chunks sent meanwhile
//                                      are lost, so every request in flight ends with an explicit
//                                      error at once, its booking released;
//   flush                            — internal: writes the decisions and chunks relayed to NATS
//                                      clients since the last write (burst_writer.hpp);
//   an exit message (node shutdown)  — every request in flight ends with an explicit error;
//   a down message (actor client)    — the client's requests in flight are cancelled.
// It registers itself with the discovery actor (watch: removals and selectors) when spawned.
// Spawned by the router node. Every request it makes carries a finite timeout; it must never block,
// throw, share its state, or call NATS request(). The classifier events of the steps go to the
// classifier actor when the node runs one.
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
#include "selection/lifecycle/request_lifecycle.hpp"
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
  LifecycleOptions lifecycle;
  /// When the node runs a request classifier: told each request's classifier events (Sent per
  /// dispatch, Responding at the first chunk, Completed at the final chunk, Aborted on an error,
  /// cancel or timeout). Null: no messages.
  classifier_actor classifier;
  /// Judges each model's predicted against delivered cached tokens (docs/hit-rate.md); the node
  /// shares one with its HTTP front door. Null: the actor makes its own on the node's clock.
  std::shared_ptr<metrics::CacheMismatchDetector> cache_mismatch;
};

/// The prefill hop of a disaggregated request in flight (docs/disaggregation.md): a prefill
/// worker computes the prompt's KV and answers with where a decode worker can pull it.
struct PrefillHop {
  WorkerWithDpRank worker;
  std::string generate_subject;
  /// When it was routed (CAF's clock), for kvr_prefill_hop_seconds.
  caf::actor_clock::time_point routed_at{};
  /// The prompt tokens the router predicted cached on the prefill worker.
  std::uint64_t predicted_cached_tokens = 0;
  /// The worker's first chunk came (its prefill tokens are released once).
  bool responded = false;
  /// Its chunks, kept until its answer: relayed only when its one token ended the generation
  /// (then the prefill worker served the whole request).
  std::vector<v1::GenerateChunk> chunks;
};

/// The prefill hop's answer: what the decode hop sends its worker, and while it may be reused.
struct KvTransfer {
  std::string params;
  WorkerId source = 0;
  caf::actor_clock::time_point valid_until{};
};

/// One generate request in flight.
struct GenerateFlight {
  GenerateFlight(GenerateRequestData request_data, LifecycleOptions options)
      : lifecycle(request_data.route.id(), request_data.route.selection.prompt_tokens, options),
        request(std::move(request_data)) {}

  RequestLifecycle lifecycle;
  GenerateRequestData request;
  /// Where the first RouteDecision goes; cleared once sent.
  std::string reply_subject;
  /// An actor client's stream (instead of the NATS subjects), and the response to its generate
  /// request, which carries the first RouteDecision (delivered once).
  stream_client_actor stream_actor;
  caf::typed_response_promise<RouteDecisionMessage> decision_promise;
  /// The current (or last) attempt's worker generate subject.
  std::string generate_subject;
  /// Numbers the dispatches; a first-token deadline names the attempt it guards.
  std::uint32_t attempt = 0;
  /// Chunks sent to the client so far.
  std::uint32_t relayed = 0;
  /// When the current attempt's last chunk arrived (CAF's clock), and whether a stall check is
  /// pending for it.
  caf::actor_clock::time_point last_chunk_at{};
  bool stall_check_pending = false;
  /// A route request to the selector is in flight (its booking must be undone if it arrives late).
  bool route_pending = false;
  /// Why the current attempt is failing, when the node saw the worker fail it (dispatch failure,
  /// first-token timeout): the attempt's release reports it against the worker (passive health).
  std::optional<FailureCause> failure_cause;
  /// The current attempt's route overlap in tokens (at most the prompt): what the router
  /// predicted cached, set against what the first chunk reports.
  std::uint64_t predicted_cached_tokens = 0;

  // ---- disaggregated serving ----
  /// The prefill hop while it runs.
  std::optional<PrefillHop> prefill;
  /// Prefill workers that failed this request (every later route excludes them), and the retries
  /// of the prefill hop.
  std::vector<WorkerId> failed_prefill_workers;
  std::uint32_t prefill_retries = 0;
  /// The prefill hop's answer, while the decode hop runs on it.
  std::optional<KvTransfer> transfer;
  /// The model's transfer validity, from the core's decision.
  std::chrono::milliseconds transfer_valid{30'000};
  /// When the prefill answered and the decode hop is yet to be dispatched (kvr_decode_handoff).
  std::optional<caf::actor_clock::time_point> handoff_from;
  /// The request's cache outcome is recorded (once: at the first chunk of its first hop that
  /// responded; a decode hop's cached tokens count the transferred KV).
  bool cache_outcome_recorded = false;
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
