// The seeded random generator of the built-in pickers (tie-breaks, sampling) and the rule that
// chooses its seed. A given seed gives the same sequence on every platform.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>

#include "selection/policies/common/plugin_api.hpp"

namespace kvr::selection::policies {

/// xoshiro256** seeded through splitmix64: 32 bytes of state, no allocation, and, unlike the
/// std:: distributions, the same draws on every standard library.
class PolicyRng {
 public:
  using result_type = std::uint64_t;

  explicit PolicyRng(std::uint64_t seed);

  static constexpr result_type min() { return 0; }
  static constexpr result_type max() { return std::numeric_limits<result_type>::max(); }
  /// The next 64 random bits.
  result_type operator()();
  /// Uniform in [0, count), without modulo bias; `count` must be positive.
  std::size_t uniform_index(std::size_t count);
  /// Uniform in [0, 1), with 53 random bits.
  double uniform_unit();

 private:
  std::array<std::uint64_t, 4> state_{};
};

/// The seed of one policy instance: its own `seed` parameter, else RouterConfig::seed, else a
/// stable hash of the partition's model and routing group and the worker type, so that each
/// partition and role draws its own sequence and a rerun draws the same one.
std::uint64_t resolve_seed(std::optional<std::uint64_t> policy_seed, const RouterConfig& config,
                           WorkerType worker_type, const RoutingPartition& partition);

}  // namespace kvr::selection::policies
