// Which tenant each request of a trace belongs to, for replays with several tenants
// (`kvr replay --tenants heavy:5,light:1`): the `name:weight,...` syntax and a seeded,
// deterministic assignment in proportion to the weights. Plain C++; used by `kvr replay` and its
// tests.
#pragma once

#include <cstddef>
#include <cstdint>
#include <expected>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace kvr::replay {

/// One tenant and its share of the trace's requests.
struct TenantWeight {
  std::string name;
  /// Relative share, at least 1.
  std::uint32_t weight = 1;

  friend bool operator==(const TenantWeight&, const TenantWeight&) = default;
};

/// The largest weight `--tenants` accepts (a larger ratio is a typo rather than a workload).
inline constexpr std::uint32_t kMaxTenantWeight = 10'000;

/// Parses `name:weight,...` (e.g. "heavy:5,light:1"; a name alone has weight 1). Fails naming the
/// offending entry: an empty or repeated name, a weight that is not an integer in
/// [1, kMaxTenantWeight], or no tenant at all.
std::expected<std::vector<TenantWeight>, std::string> parse_tenant_weights(std::string_view text);

/// The tenants of a trace's requests: names, and per request (in trace order) an index into them.
struct TenantAssignment {
  std::vector<std::string> names;
  std::vector<std::uint32_t> of_request;

  bool empty() const { return names.empty(); }
};

/// Assigns `requests` requests to `tenants`: in every run of W consecutive requests (W the sum of
/// the weights) tenant i gets exactly weight_i of them, in an order drawn from `seed`. The same
/// weights and seed give the same assignment, and request i's tenant does not depend on how many
/// requests follow it (a --limit keeps the assignment of the requests it keeps).
TenantAssignment assign_tenants(std::span<const TenantWeight> tenants, std::size_t requests,
                                std::uint64_t seed);

}  // namespace kvr::replay
