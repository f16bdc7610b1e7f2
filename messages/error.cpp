#include "messages/error.hpp"

namespace kvr {

std::string_view as_str(Error error) {
  switch (error) {
    case Error::invalid_request:
      return "invalid_request";
    case Error::no_workers:
      return "no_workers";
    case Error::all_filtered:
      return "all_filtered";
    case Error::policy_failed:
      return "policy_failed";
    case Error::rejected:
      return "rejected";
    case Error::timeout:
      return "timeout";
    case Error::worker_failed:
      return "worker_failed";
    case Error::unavailable:
      return "unavailable";
    case Error::bad_message:
      return "bad_message";
    case Error::invalid_config:
      return "invalid_config";
    case Error::unknown_booking:
      return "unknown_booking";
    case Error::overloaded:
      return "overloaded";
    case Error::rate_limited:
      return "rate_limited";
    case Error::due_time_expired:
      return "due_time_expired";
    case Error::owner_lost:
      return "owner_lost";
  }
  return "unknown_error";
}

std::string to_string(Error error) { return std::string{as_str(error)}; }

v1::RouteErrorCode to_route_error_code(Error error) {
  switch (error) {
    case Error::invalid_request:
    case Error::bad_message:
      return v1::ROUTE_ERROR_INVALID_REQUEST;
    case Error::no_workers:
      return v1::ROUTE_ERROR_NO_WORKERS;
    case Error::all_filtered:
      return v1::ROUTE_ERROR_ALL_FILTERED;
    case Error::policy_failed:
    case Error::invalid_config:
      return v1::ROUTE_ERROR_POLICY_FAILED;
    case Error::rejected:
      return v1::ROUTE_ERROR_REJECTED;
    case Error::timeout:
      return v1::ROUTE_ERROR_TIMEOUT;
    case Error::worker_failed:
      return v1::ROUTE_ERROR_WORKER_FAILED;
    case Error::unavailable:
    case Error::unknown_booking:
      return v1::ROUTE_ERROR_UNAVAILABLE;
    case Error::overloaded:
      return v1::ROUTE_ERROR_OVERLOADED;
    case Error::rate_limited:
      return v1::ROUTE_ERROR_RATE_LIMITED;
    case Error::due_time_expired:
      return v1::ROUTE_ERROR_DUE_TIME_EXPIRED;
    case Error::owner_lost:
      return v1::ROUTE_ERROR_OWNER_LOST;
  }
  return v1::ROUTE_ERROR_UNSPECIFIED;
}

bool is_admission_rejection(v1::RouteErrorCode code) {
  return code == v1::ROUTE_ERROR_REJECTED || code == v1::ROUTE_ERROR_OVERLOADED ||
         code == v1::ROUTE_ERROR_RATE_LIMITED || code == v1::ROUTE_ERROR_DUE_TIME_EXPIRED;
}

}  // namespace kvr
