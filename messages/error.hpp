// The project-wide error codes: carried by caf::error between actors (actors/caf_error.hpp)
// and mapped onto the wire's RouteErrorCode for NATS clients.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "kvr/v1/routing.pb.h"

namespace kvr {

/// Why a request or message could not be served. Zero is reserved for "no error" by CAF.
enum class Error : std::uint8_t {
  invalid_request = 1,  ///< malformed or absurd request
  no_workers,           ///< no worker serves the request's partition and role
  all_filtered,         ///< every eligible worker was filtered out
  policy_failed,        ///< a selection component failed
  rejected,             ///< refused by admission control
  timeout,              ///< not served in time
  worker_failed,        ///< the chosen worker failed and no retry was possible
  unavailable,          ///< shutting down, or the partition moved to another node
  bad_message,          ///< a network message failed decoding or validation
  invalid_config,       ///< configuration rejected at startup
  unknown_booking,      ///< a lifecycle report names no open booking
  overloaded,           ///< refused by admission: too much work in flight or queued
  rate_limited,         ///< refused by admission: too many requests in a time window
  due_time_expired,     ///< refused by admission: the due time passed while deferred
  owner_lost,           ///< cluster: the node that owns the partition went away mid-request
};

/// The snake_case name of an error code, e.g. "all_filtered".
std::string_view as_str(Error error);

/// CAF renders error codes through an ADL-found to_string.
std::string to_string(Error error);

/// The wire code a NATS client receives for an error.
v1::RouteErrorCode to_route_error_code(Error error);

/// Whether a RouteDecision error with `code` is a refusal by admission control (overloaded, rate
/// limited, due time expired, rejected): an answer a client counts apart from route errors.
bool is_admission_rejection(v1::RouteErrorCode code);

}  // namespace kvr
