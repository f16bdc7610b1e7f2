// The router's plain request and reply forms: a validated RouteRequest, a validated
// LifecycleReport, and the RouteDecision / LifecycleAck builders. Used by the NATS bridge (decode
// in the callback), the ingress actor and the reservation actor; unit-tested without CAF.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <expected>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "kvr/v1/routing.pb.h"
#include "messages/error.hpp"
#include "messages/ids.hpp"
#include "selection/partition/route_request.hpp"
#include "selection/partition/route_result.hpp"

namespace kvr {

/// Bounds above which a request is refused as absurd.
struct RouteDecodeLimits {
  std::size_t max_prompt_tokens = std::size_t{1} << 21;
  std::size_t max_id_length = 256;  ///< request id, model, group, session ids, taints
  std::size_t max_allowed_workers = 4096;
  std::size_t max_taints = 64;  ///< required and preferred taints, each
};

/// Validates a wire request. Block hashes are used as given; token ids are kept for the
/// partition's selector, which hashes them at the partition's block size. The failure's code is
/// Error::invalid_request and its message names the field.
std::expected<RouteRequest, RouteFailure> decode_route_request(
    const v1::RouteRequest& wire, const RouteDecodeLimits& limits = {});

/// The wire form of a client's request as decode_route_request read it: what a node forwards to
/// the partition's owner in a cluster. decode_route_request(encode_route_request(r)) gives `r`
/// back (its client fields: admission and retry state are not part of the wire request). It
/// carries the client's own id (client_id()); the forwarder sends the client's scope alongside.
v1::RouteRequest encode_route_request(const RouteRequest& request);

/// A decision that reports `error` for `request_id` (with when to retry, if known).
v1::RouteDecision encode_route_error(
    std::string_view request_id, Error error, std::string_view message,
    std::optional<std::chrono::milliseconds> retry_after = std::nullopt);

/// What the caller needs besides the selector's outcome to answer a routed request.
struct RouteSuccessInfo {
  std::string booking_id;
  std::chrono::milliseconds booking_ttl{0};
  std::string policy;            ///< the policy instance that chose
  std::string generate_subject;  ///< the chosen worker's generate subject
  std::string http_url;          ///< the chosen worker's HTTP base URL (empty: none)
};

/// A successful decision.
v1::RouteDecision encode_route_success(std::string_view request_id, const RouteOutcome& outcome,
                                       const RouteSuccessInfo& info);

/// What a lifecycle report asks for.
enum class LifecycleEventKind : std::uint8_t { FirstToken, Completed, Aborted };

/// Why a request was aborted (kvr.v1.AbortCause): the causes after client_cancelled blame the
/// worker (passive health counts them against it).
enum class AbortCause : std::uint8_t {
  unspecified,
  client_cancelled,
  worker_failed,
  first_token_timeout,
  stream_timeout,
};

/// A validated lifecycle report.
struct LifecycleReportData {
  std::string booking_id;
  LifecycleEventKind event = LifecycleEventKind::Completed;
  std::string error;  ///< reason, for Aborted
  /// For Aborted; an unknown wire value reads as unspecified (blames nobody).
  AbortCause abort_cause = AbortCause::unspecified;
  /// The request's context (prompt plus generated tokens) when the client said it.
  std::optional<std::uint64_t> context_tokens;
};

/// The wire value of an abort cause.
v1::AbortCause to_wire(AbortCause cause);

/// Validates a wire report: a non-empty, bounded booking id and a known event.
std::expected<LifecycleReportData, std::string> decode_lifecycle_report(
    const v1::LifecycleReport& wire, const RouteDecodeLimits& limits = {});

/// An acknowledgement.
v1::LifecycleAck encode_lifecycle_ack(bool accepted, std::string_view message);

/// "first_token", "completed" or "aborted".
std::string_view as_str(LifecycleEventKind kind);

}  // namespace kvr
