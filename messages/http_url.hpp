// A worker's HTTP base URL: where a router (or a gateway it answers) reaches the worker's
// OpenAI-compatible HTTP API. Carried in WorkerRegistration.http_url and
// RouteSuccess.worker_http_url.
#pragma once

#include <optional>
#include <string>
#include <string_view>

namespace kvr {

/// Why `url` cannot be a worker's HTTP base URL, or empty when it can: "http://" or "https://",
/// then a host (a name, an IPv4 address or a bracketed IPv6 one) with an optional port 1..65535,
/// then an optional path; no user info, query or fragment, no whitespace or control characters.
/// The router appends the API's own paths ("/v1/chat/completions") to it.
std::string invalid_http_url(std::string_view url);

/// A valid URL's parts, as a client connects to it.
struct HttpUrlParts {
  bool https = false;
  /// Without the brackets of an IPv6 address.
  std::string host;
  /// The given port, else 80 or 443.
  std::string port;
  /// The path, without a trailing '/' ("" for none).
  std::string path;
};

/// The parts of `url`; nullopt when invalid_http_url(url) names a fault.
std::optional<HttpUrlParts> split_http_url(std::string_view url);

/// `url` without a trailing '/' (a base URL joins its paths with one).
std::string_view trim_trailing_slash(std::string_view url);

}  // namespace kvr
