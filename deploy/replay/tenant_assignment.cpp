#include "deploy/replay/tenant_assignment.hpp"

#include <algorithm>
#include <charconv>
#include <set>

#include <fmt/format.h>

namespace kvr::replay {
namespace {

// SplitMix64: a fixed, portable generator, so that an assignment is the same with every standard
// library (std::shuffle and the std distributions are not).
std::uint64_t split_mix(std::uint64_t& state) {
  std::uint64_t z = (state += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

}  // namespace

std::expected<std::vector<TenantWeight>, std::string> parse_tenant_weights(std::string_view text) {
  std::vector<TenantWeight> tenants;
  std::set<std::string, std::less<>> seen;
  std::size_t start = 0;
  while (start <= text.size()) {
    const std::size_t comma = text.find(',', start);
    const std::string_view entry = text.substr(
        start, comma == std::string_view::npos ? std::string_view::npos : comma - start);
    const std::size_t colon = entry.find(':');
    const std::string_view name = entry.substr(0, colon);
    if (name.empty()) {
      return std::unexpected(
          fmt::format("'{}': expected name:weight, e.g. heavy:5,light:1", entry));
    }
    TenantWeight tenant{std::string{name}, 1};
    if (colon != std::string_view::npos) {
      const std::string_view weight = entry.substr(colon + 1);
      std::uint64_t value = 0;
      const auto [end, error] =
          std::from_chars(weight.data(), weight.data() + weight.size(), value);
      if (error != std::errc{} || end != weight.data() + weight.size() || value < 1 ||
          value > kMaxTenantWeight) {
        return std::unexpected(fmt::format("'{}': the weight must be an integer from 1 to {}",
                                           entry, kMaxTenantWeight));
      }
      tenant.weight = static_cast<std::uint32_t>(value);
    }
    if (!seen.insert(tenant.name).second) {
      return std::unexpected(fmt::format("tenant '{}' is named twice", tenant.name));
    }
    tenants.push_back(std::move(tenant));
    if (comma == std::string_view::npos) break;
    start = comma + 1;
  }
  return tenants;
}

TenantAssignment assign_tenants(std::span<const TenantWeight> tenants, std::size_t requests,
                                std::uint64_t seed) {
  TenantAssignment assignment;
  if (tenants.empty()) return assignment;
  std::vector<std::uint32_t> round;
  for (std::size_t i = 0; i < tenants.size(); ++i) {
    assignment.names.push_back(tenants[i].name);
    round.insert(round.end(), tenants[i].weight, static_cast<std::uint32_t>(i));
  }
  assignment.of_request.reserve(requests);
  std::uint64_t state = seed;
  std::vector<std::uint32_t> shuffled;
  while (assignment.of_request.size() < requests) {
    // Fisher-Yates over one round; the modulo's bias is below 2^-40 for rounds this short.
    shuffled = round;
    for (std::size_t i = shuffled.size(); i > 1; --i) {
      const auto j = static_cast<std::size_t>(split_mix(state) % i);
      std::swap(shuffled[i - 1], shuffled[j]);
    }
    const std::size_t take = std::min(shuffled.size(), requests - assignment.of_request.size());
    assignment.of_request.insert(assignment.of_request.end(), shuffled.begin(),
                                 shuffled.begin() + static_cast<std::ptrdiff_t>(take));
  }
  return assignment;
}

}  // namespace kvr::replay
