// Small loopback helpers for integration tests: a free TCP port, a plain HTTP GET, and reading a
// Prometheus metric out of a /metrics page.
#pragma once

#include <cstdint>
#include <string>

namespace kvr::testing {

/// A TCP port on 127.0.0.1 that was free a moment ago, below the kernel's ephemeral range (0 when
/// none was found).
std::uint16_t free_port();

/// The raw HTTP/1.0 response of GET `path` on 127.0.0.1:`port` (empty when nothing answers).
std::string http_get(std::uint16_t port, const std::string& path);

/// Sum of every sample of a metric whose name and labels start with `prefix`.
double metric(const std::string& text, const std::string& prefix);

}  // namespace kvr::testing
