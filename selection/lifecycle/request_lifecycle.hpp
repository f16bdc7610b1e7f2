// The lifecycle of one routed request in generate (proxy) mode, as a plain state machine: the
// lifecycle actor keeps one per request, feeds it what happens (routed, stream chunks, worker
// failures, cancellation) and carries out the LifecycleStep each event returns. No CAF, no NATS.
//
//   Routing ──routed──▶ Sent ──first chunk──▶ Responding ──finished chunk──▶ Completed
//      ▲                  │                        │
//      └──── retry ◀──────┤ failure before the     │ failure after the first token,
//        (once, excluding │ first token            │ cancel or abort
//         the failed      ▼                        ▼
//         worker)      Aborted ◀───────────────────┘   (also: route failure, cancel, abort)
//
// Rules:
//   - The response stream starts with the worker's first chunk that is not an error: that is
//     Responding (the worker finished prefill and produced its first token).
//   - A worker that fails before the first token (it is removed from the fleet, the connection is
//     lost, or it sends an error chunk) gets the request retried on another worker, at most
//     max_retries times (1: once), excluding every worker that failed it; after that the client
//     gets an explicit error. A failure after the first token is never retried (tokens already
//     reached the client): Aborted with an error chunk.
//   - Bookings: each attempt's booking is released exactly once: its prefill tokens at the first
//     token (first_token), the rest when the attempt ends (release: completed, cancelled or
//     failed). A failed attempt is released before the retry is routed (the selector refuses a
//     request id whose booking is open). A worker removed from the fleet takes its bookings with
//     it; releasing such a booking reports unknown_booking, which the node ignores.
//   - Session affinity: commit at the first token, abandon when an attempt ends before it, finish
//     when a request that responded ends (SessionAffinity).
//   - Classifier events, per request in this order: Sent (again, naming the new worker, for each
//     retry), Responding, then exactly one of Completed or Aborted. A request whose routing failed
//     before it reached any worker gets only Aborted, with no worker.
//   - A gap in the chunk indexes (chunks lost on the way) fails the attempt as a worker failure
//     does, the worker told to stop: retried before the first token, else Aborted.
//   - An event that makes no sense in the current state (a chunk after completion, a second
//     completion, a chunk from a worker that is not serving the request, a chunk seen before)
//     is returned as a LifecycleError and changes nothing; nothing here aborts the process.
#pragma once

#include <cstddef>
#include <cstdint>
#include <expected>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "classifiers/request_classifier.hpp"
#include "discovery/load/predicted_load.hpp"
#include "messages/error.hpp"
#include "messages/ids.hpp"
#include "selection/lifecycle/stream_events.hpp"

namespace kvr {

/// Where a routed request is.
enum class RequestState : std::uint8_t {
  Routing,     ///< waiting for a worker: the first route, or the retry after a failure
  Sent,        ///< dispatched to a worker; no token yet
  Responding,  ///< the worker's response stream started
  Completed,   ///< the worker finished the response (final)
  Aborted,     ///< ended without completing: failed, cancelled, or never routed (final)
};

/// "routing", "sent", "responding", "completed" or "aborted".
std::string_view as_str(RequestState state);

/// Settings of the lifecycle.
struct LifecycleOptions {
  /// Retries of a request whose worker failed before its first token.
  std::uint32_t max_retries = 1;
};

/// What the node must do after an event, in this order: cancel_at_worker, first_token,
/// commit_affinity, release, abandon_affinity / finish_affinity, classifier_events, forward_chunk,
/// end_stream, dispatch, reroute. An empty step means: nothing to do.
struct LifecycleStep {
  /// Publish GenerateCancel to the worker that held the request (the lifecycle's last worker).
  bool cancel_at_worker = false;
  /// SelectorState::first_token(request_id): the booking's prefill tokens are done.
  bool first_token = false;
  /// SessionAffinity::commit(request_id): the response stream started.
  bool commit_affinity = false;
  /// SelectorState::release(request_id, *release): the attempt's booking ends.
  std::optional<discovery::BookingEnd> release;
  /// SessionAffinity::abandon(request_id): the attempt ended before its first token.
  bool abandon_affinity = false;
  /// SessionAffinity::finish(request_id): the request ended after its first token.
  bool finish_affinity = false;
  /// The request's context grew to this many tokens (prompt plus generated): its classifier's
  /// RequestProgress, raised before classifier_events.
  std::optional<std::uint64_t> context_tokens;
  /// RequestClassifier::on_event, in order.
  std::vector<plugins::request_classifier::ClassifyEvent> classifier_events;
  /// Relay the chunk just received to the client.
  bool forward_chunk = false;
  /// Close the client's stream with this final chunk.
  std::optional<StreamEnd> end_stream;
  /// Send the GenerateRequest to the worker just routed (worker()).
  bool dispatch = false;
  /// Route the request again with these workers excluded (SelectionRequest::excluded_workers),
  /// then report routed() or route_failed().
  std::optional<std::vector<WorkerId>> reroute;

  /// True when the step asks for nothing.
  bool empty() const;
};

/// An event refused in the current state; the state is unchanged.
struct LifecycleError {
  enum class Kind : std::uint8_t {
    after_end,      ///< the request already completed or was aborted
    stale_worker,   ///< the chunk came from a worker that is not serving the request
    out_of_order,   ///< the chunk's index was seen before
    invalid_state,  ///< the event cannot happen in this state (a bug in the caller)
  };
  Kind kind = Kind::invalid_state;
  std::string message;
};

/// The outcome of feeding one event.
using LifecycleResult = std::expected<LifecycleStep, LifecycleError>;

/// One routed request's lifecycle (file comment). Starts in Routing.
class RequestLifecycle {
 public:
  /// `prompt_tokens` counts into the Completed event's context size.
  RequestLifecycle(std::string request_id, std::size_t prompt_tokens,
                   LifecycleOptions options = {});

  /// The request is booked on `worker`: Sent (dispatch). If the request was already aborted
  /// (cancelled while it was being routed), the late booking is released instead.
  LifecycleResult routed(WorkerWithDpRank worker);
  /// Routing found no worker: Aborted with an explicit error (for a retry, worker_failed).
  LifecycleResult route_failed(Error code, std::string_view message);
  /// A chunk of the current worker's response stream.
  LifecycleResult on_chunk(const StreamChunk& chunk);
  /// `worker` failed: removed from the fleet (any request may be told), the connection to it was
  /// lost, or the dispatch failed. Nothing happens unless it holds this request.
  LifecycleResult worker_failed(WorkerId worker, std::string_view reason);
  /// The client cancelled: Aborted, the worker is told to stop.
  LifecycleResult cancel(std::string_view reason);
  /// kvr gives up on the request (timeout, shutdown, partition moved): Aborted with `code`.
  LifecycleResult abort(Error code, std::string_view reason);

  const std::string& request_id() const { return request_id_; }
  RequestState state() const { return state_; }
  /// True once Completed or Aborted.
  bool ended() const {
    return state_ == RequestState::Completed || state_ == RequestState::Aborted;
  }
  /// The worker of the current (or last) attempt; empty before the first routing.
  std::optional<WorkerWithDpRank> worker() const { return worker_; }
  /// Workers that failed this request, in order; a retry excludes them.
  std::span<const WorkerId> excluded_workers() const { return excluded_; }
  /// Retries made so far.
  std::uint32_t retries() const { return retries_; }
  /// Output tokens of the current attempt.
  std::size_t output_tokens() const { return output_tokens_; }

 private:
  /// The current attempt failed (`failed_by_worker`: the worker ended it itself, so no cancel).
  LifecycleStep fail_attempt(std::string_view reason, bool failed_by_worker);
  /// Ends the request as Aborted from any non-final state (`tell_worker`: cancel at the worker).
  LifecycleStep end_aborted(discovery::BookingEnd end, StreamEnd stream_end, bool tell_worker);
  std::expected<void, LifecycleError> check_chunk(const StreamChunk& chunk) const;
  LifecycleError refuse(LifecycleError::Kind kind, std::string message) const;

  std::string request_id_;
  std::size_t prompt_tokens_;
  LifecycleOptions options_;
  RequestState state_ = RequestState::Routing;
  std::optional<WorkerWithDpRank> worker_;
  std::vector<WorkerId> excluded_;
  std::uint32_t retries_ = 0;
  std::uint32_t next_index_ = 0;
  std::size_t output_tokens_ = 0;
  /// Why the last attempt failed, for the message of a failed retry.
  std::string last_failure_;
};

}  // namespace kvr
