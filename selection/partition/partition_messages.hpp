// What goes in and out of a partition core besides its inputs' own types: the answer to a route
// request, a booking change and what it says of a worker's health, the classifier's view of the
// fleet, a KV dump to ask for. Values only: the actors exchange them, so their interface
// (actors/actor_types.hpp) includes this header and not the core's.
#pragma once

#include <cstddef>
#include <cstdint>
#include <expected>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "classifiers/request_classifier.hpp"
#include "discovery/load/predicted_load.hpp"
#include "messages/ids.hpp"
#include "selection/partition/disaggregation.hpp"
#include "selection/partition/route_result.hpp"

namespace kvr {

/// Why a request failed at its worker (the metric's `cause` label).
enum class FailureCause : std::uint8_t {
  dispatch_failed,      ///< generate mode: the request could not be sent to the worker
  first_token_timeout,  ///< no first token in time (the node's deadline, or the client's)
  stream_timeout,       ///< the client gave up after the first token (the stream stalled)
  worker_failed,        ///< the client saw the worker fail (an error chunk, no responder)
};
inline constexpr std::size_t kFailureCauses = 4;

/// "dispatch_failed", "first_token_timeout", "stream_timeout" or "worker_failed".
std::string_view as_str(FailureCause cause);

/// What a booking update tells about its worker's health: a success, or a failure and its cause.
struct WorkerHealthReport {
  WorkerId worker = 0;
  /// Empty: the worker served the request (first token or completion).
  std::optional<FailureCause> failure;
};

/// The answer to one route request: the booked outcome or why there is none.
struct RouteReply {
  std::expected<RouteOutcome, RouteFailure> result;
  std::string policy;            ///< the instance name serving the request's worker type
  std::string generate_subject;  ///< the chosen worker's generate subject
  std::string http_url;          ///< the chosen worker's HTTP base URL (empty: none)
  /// A RouteHop::plan request of a disaggregated partition: whether the worker is a prefill
  /// worker (the decode hop follows) or a decode worker serving the request alone, and why.
  std::optional<DisaggregationDecision> disaggregation;
};

/// What a booking change does to the request's session-affinity proposal (SessionAffinity).
enum class AffinityAction : std::uint8_t {
  none,
  commit,   ///< the response stream started (first token)
  abandon,  ///< the attempt ended before its first token
  finish,   ///< the request ended; before a commit this is abandon, unless it completed (a
            ///< completion commits first: a route-mode client may report no first token)
};

/// A booking change (first token or release) of one request, with what it means for its session
/// affinity (applied even when the booking is already gone) and its worker's health.
struct BookingChange {
  std::string request_id;
  bool release = true;  ///< false: first token (prefill tokens only)
  discovery::BookingEnd end = discovery::BookingEnd::completed;
  AffinityAction affinity = AffinityAction::none;
  /// What the request's outcome says about its worker's health (passive health); empty: nothing
  /// (a client's own cancellation, an abort with no cause).
  std::optional<WorkerHealthReport> health;
};

/// A partition's fleet as its classifier is created with (RequestClassifierContext).
struct PartitionFleet {
  std::string model;
  std::string routing_group;
  /// The partition's block size; 0 while it has no worker.
  std::uint32_t block_size = 0;
  std::vector<plugins::request_classifier::ClassifierWorker> workers;
};

/// The partition's KV blocks, used over total across its ranks (the classifier's fleet load).
struct PartitionKvUsage {
  std::uint64_t used = 0;
  std::uint64_t total = 0;
};

/// A KV dump to ask a worker rank for, on the worker's dump subject.
struct DumpRequest {
  std::string dump_subject;
  WorkerWithDpRank worker;
};

}  // namespace kvr
