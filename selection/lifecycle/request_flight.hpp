// One request's whole flight from its first route to its end, as a plain, driven-time core: the
// lifecycle actor, the HTTP front door and `kvr replay` each keep one per request, feed it what
// happens (routing answers, the worker's chunks, failures, the client's cancel, the clock) and
// carry out the FlightStep each input returns. No CAF, no sockets, no NATS.
//
// It owns the rules that used to be written once per door:
//   - the client-facing attempt's lifecycle (RequestLifecycle: retry before the first token,
//     classifier events, release exactly once, an explicit end to every stream);
//   - the prefill hop of a disaggregated request (docs/disaggregation.md): one token and vLLM's
//     transfer request at a prefill worker; its answer's kv_transfer_params sent on to the decode
//     hop; a failed prefill planned again without that worker (max_retries times); a one-token
//     answer that ended the generation served as the whole request;
//   - the transfer's validity: a decode attempt that fails before its first token is routed again
//     on the same parameters while they are young enough and their prefill worker is alive;
//   - the deadlines: no first chunk within first_token_timeout of a dispatch fails the attempt
//     (the prefill hop: no answer), no chunk for stall_timeout once responding ends the stream;
//   - the cache outcome, once per request: predicted against delivered cached prompt tokens.
//
// Time comes in as an argument (any steady clock's time points: CAF's clock in the node, the
// engine's logical time in replay, a manual clock in tests); deadline() says when tick() is due.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <expected>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "selection/lifecycle/request_lifecycle.hpp"
#include "selection/partition/partition_messages.hpp"
#include "selection/partition/route_request.hpp"

namespace kvr {

/// The flight's time: a steady clock's time point (CAF's actor clock uses the same type).
using FlightTime = std::chrono::steady_clock::time_point;

/// Settings of a request's flight.
struct FlightOptions {
  /// Retries of an attempt whose worker failed before its first token, and of a failed prefill hop.
  std::uint32_t max_retries = 1;
  /// A dispatched attempt without a first chunk (a prefill hop: without its answer) after this
  /// long fails as its worker's fault.
  std::chrono::milliseconds first_token_timeout{30'000};
  /// A responding attempt without a chunk for this long ends with an explicit error.
  std::chrono::milliseconds stall_timeout{30'000};
};

/// Which hop a dispatch is.
enum class FlightHop : std::uint8_t {
  single,   ///< the whole request on one worker
  prefill,  ///< the prefill hop: one token, the KV kept for a decode worker
  decode,   ///< the decode hop, pulling the prefill's KV
};

/// A routing answer: the booked worker and what the router predicted there.
struct FlightRoute {
  WorkerWithDpRank worker;
  /// The partition core planned a prefill hop on this worker (RouteHop::plan of a disaggregated
  /// partition); the decode hop follows its answer.
  bool prefill_hop = false;
  /// Prompt tokens the router predicted cached on the worker (at most the prompt).
  std::uint64_t predicted_cached_tokens = 0;
  /// How long a prefill's answer may be pulled by a replacement decode worker (the model's
  /// transfer_valid_ms); taken from a plan's answer.
  std::optional<std::chrono::milliseconds> transfer_valid;
};

/// Send the request to a worker.
struct FlightDispatch {
  WorkerWithDpRank worker;
  FlightHop hop = FlightHop::single;
  /// Replaces the request's output token limit (the prefill hop: 1).
  std::optional<std::uint32_t> max_output_tokens;
  /// Replaces the request's kv_transfer_params (the prefill hop: the transfer request; the decode
  /// hop: the prefill's answer); empty: as the client sent them.
  std::string kv_transfer_params;
};

/// Route the request (again).
struct FlightRouteRequest {
  /// Workers that failed the request: every later route excludes them.
  std::vector<WorkerId> excluded;
  /// Route the decode hop on the transfer (RouteHop::decode_after_transfer, worker type decode);
  /// false: plan the request (RouteHop::plan).
  bool decode_after_transfer = false;
  /// A retry after a failure (counted), not the request's first route or its decode hop.
  bool retry = false;
};

/// `request` as the flight asks it routed: its exclusions, and the decode hop on the transfer or
/// a plan.
inline RouteRequest routed_as(RouteRequest request, const FlightRouteRequest& route) {
  request.selection.excluded_workers = route.excluded;
  if (route.decode_after_transfer) {
    request.worker_type = WorkerType::Decode;
    request.hop = RouteHop::decode_after_transfer;
  } else {
    request.hop = RouteHop::plan;
  }
  return request;
}

/// What the router predicted cached against what the worker's engine reported (docs/hit-rate.md).
struct CacheOutcome {
  std::uint64_t predicted_cached_tokens = 0;
  std::uint64_t delivered_cached_tokens = 0;
};

/// Why the clock ended an attempt.
enum class FlightTimeout : std::uint8_t { first_token, stall };

/// What the shell must do after an input, in this order: cancel_at_worker, bookings (first_token,
/// then release), classifier (context_tokens, classifier_events), cache_outcome, held chunks
/// (hold_chunk, relay_held, discard_held), forward_chunk, end_stream, dispatch, route. The rest are
/// observations for metrics and logs.
struct FlightStep {
  /// Tell this worker to stop the request (GenerateCancel).
  std::optional<WorkerWithDpRank> cancel_at_worker;
  /// The booking's prefill tokens are done (with its session-affinity action and a health
  /// success); its request_id is the flight's.
  std::optional<BookingChange> first_token;
  /// The booking ends (exactly once per booking).
  std::optional<BookingChange> release;
  /// The request's context grew to this many tokens: its classifier's RequestProgress.
  std::optional<std::uint64_t> context_tokens;
  /// RequestClassifier::on_event, in order.
  std::vector<plugins::request_classifier::ClassifyEvent> classifier_events;
  /// Record the request's cache outcome (once per request).
  std::optional<CacheOutcome> cache_outcome;
  /// Keep the chunk just received (a prefill hop's): relayed only if relay_held follows.
  bool hold_chunk = false;
  /// Relay the held chunks to the client, in order, and forget them (the prefill worker served
  /// the whole request).
  bool relay_held = false;
  /// Forget the held chunks (the prefill hop ended without serving the request).
  bool discard_held = false;
  /// Relay the chunk just received to the client.
  bool forward_chunk = false;
  /// Close the client's stream with this final chunk.
  std::optional<StreamEnd> end_stream;
  /// Send the request to a worker; the shell reports dispatch_failed() if it cannot.
  std::optional<FlightDispatch> dispatch;
  /// Route the request; the shell reports routed() or route_failed().
  std::optional<FlightRouteRequest> route;

  /// The clock ended an attempt.
  std::optional<FlightTimeout> timed_out;
  /// The request completed (its last chunk is forwarded by this step).
  bool completed = false;
  /// The prefill hop answered this long after it was routed (kvr_prefill_hop_seconds).
  std::optional<std::chrono::nanoseconds> prefill_hop_took;
  /// The decode hop is dispatched this long after the prefill answered (kvr_decode_handoff).
  std::optional<std::chrono::nanoseconds> handoff_took;
  /// Something the operator should see (a routing answer the flight could not use).
  std::optional<std::string> warning;
};

/// The outcome of one input; a refused input (LifecycleError) changes nothing.
using FlightResult = std::expected<FlightStep, LifecycleError>;

/// One request's flight (file comment).
class RequestFlight {
 public:
  /// `prompt_tokens` counts into the classifier's context sizes.
  RequestFlight(std::string request_id, std::size_t prompt_tokens, FlightOptions options = {});

  /// The request's first route: a plan.
  FlightStep start(FlightTime now);
  /// Routing booked `route.worker`.
  FlightResult routed(const FlightRoute& route, FlightTime now);
  /// Routing found no worker.
  FlightResult route_failed(Error code, std::string_view message, FlightTime now);
  /// The last dispatch could not be sent (it counts against the worker).
  FlightResult dispatch_failed(std::string_view reason, FlightTime now);
  /// The worker of the hop under way failed it as the shell saw it (its connection broke, it
  /// answered with an error): `cause` counts against the worker (none: not its fault).
  FlightResult attempt_failed(std::optional<FailureCause> cause, std::string_view reason,
                              FlightTime now);
  /// A chunk of the worker serving the current hop.
  FlightResult on_chunk(const StreamChunk& chunk, FlightTime now);
  /// `worker` left the fleet: the hop it serves fails, and a transfer it holds is no longer valid.
  FlightResult worker_left(WorkerId worker, std::string_view reason, FlightTime now);
  /// The client cancelled.
  FlightResult cancel(std::string_view reason);
  /// kvr gives up on the request (shutdown, NATS lost).
  FlightResult abort(Error code, std::string_view reason);
  /// The clock reached `now`: ends an attempt whose deadline passed (nothing to do otherwise).
  FlightStep tick(FlightTime now);

  /// When tick() is next due; empty when no deadline runs.
  std::optional<FlightTime> deadline() const;

  const std::string& request_id() const { return lifecycle_.request_id(); }
  /// The client-facing attempt's state (Routing while a prefill hop runs).
  RequestState state() const { return lifecycle_.state(); }
  bool ended() const { return lifecycle_.ended(); }
  /// The worker of the client-facing attempt (the current or last one); empty before one is routed.
  std::optional<WorkerWithDpRank> worker() const { return lifecycle_.worker(); }
  /// The prefill worker while the prefill hop runs.
  std::optional<WorkerWithDpRank> prefill_worker() const;
  /// Chunks relayed to the client so far (the index of the stream's next chunk).
  std::uint32_t forwarded() const { return forwarded_; }
  /// Retries made so far: the client-facing attempt's and the prefill hop's.
  std::uint32_t retries() const { return lifecycle_.retries() + prefill_retries_; }

 private:
  struct PrefillHop {
    WorkerWithDpRank worker;
    FlightTime routed_at{};
    std::uint64_t predicted_cached_tokens = 0;
    bool responded = false;
    std::vector<StreamChunk> held;
  };
  struct KvTransfer {
    std::string params;
    WorkerId source = 0;
    FlightTime valid_until{};
  };

  FlightResult prefill_chunk(const StreamChunk& chunk, FlightTime now);
  FlightStep fail_prefill(std::optional<FailureCause> cause, std::string_view reason,
                          bool tell_worker, FlightTime now);
  FlightStep serve_from_prefill(FlightTime now);
  /// The route request for the current exclusions and transfer (a transfer too old is dropped).
  FlightRouteRequest route_request(bool retry, FlightTime now);
  /// Turns the lifecycle's step into the flight's, `cause` naming what failed its worker.
  FlightStep translate(LifecycleStep step, std::optional<FailureCause> cause, FlightTime now);
  FlightResult translate(LifecycleResult result, std::optional<FailureCause> cause, FlightTime now);
  /// Appends `next` to `step` (a step made of several, in order).
  static void append(FlightStep& step, FlightStep next);
  BookingChange booking(bool release, discovery::BookingEnd end, AffinityAction affinity,
                        std::optional<WorkerHealthReport> health) const;

  RequestLifecycle lifecycle_;
  FlightOptions options_;
  std::optional<PrefillHop> prefill_;
  std::vector<WorkerId> failed_prefill_workers_;
  std::uint32_t prefill_retries_ = 0;
  std::optional<KvTransfer> transfer_;
  std::chrono::milliseconds transfer_valid_{30'000};
  std::optional<FlightTime> handoff_from_;
  /// The current attempt's dispatch, and its last chunk: the deadlines count from them.
  std::optional<FlightTime> dispatched_at_;
  FlightTime last_chunk_at_{};
  /// What the router predicted cached for the client-facing attempt.
  std::uint64_t predicted_cached_tokens_ = 0;
  bool cache_outcome_recorded_ = false;
  std::uint32_t forwarded_ = 0;
};

}  // namespace kvr
