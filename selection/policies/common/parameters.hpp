// Reading and range-checking the built-in policies' YAML `parameters`, and the provider body they
// share (read strictly, reject unknown keys, validate, return a factory of fresh components).
#pragma once

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string_view>
#include <utility>

#include "selection/policies/common/plugin_api.hpp"

namespace kvr::selection::policies {

/// The optional `seed` parameter every randomised built-in accepts.
ProviderResult<std::optional<std::uint64_t>> read_seed(ParameterReader& reader);

/// Fails unless `value` is finite and in [min, max]; the message names policy, key and range.
ProviderResult<void> check_range(std::string_view policy, std::string_view key, double value,
                                 double min, double max);
/// Fails unless `value` is finite and at least `min`.
ProviderResult<void> check_at_least(std::string_view policy, std::string_view key, double value,
                                    double min);
/// Fails unless `value` is in [min, max].
ProviderResult<void> check_integer_range(std::string_view policy, std::string_view key,
                                         std::int64_t value, std::int64_t min, std::int64_t max);
/// Fails unless `value` is at least `min`.
ProviderResult<void> check_integer_at_least(std::string_view policy, std::string_view key,
                                            std::int64_t value, std::int64_t min);
/// The first failed check, or success when all passed.
ProviderResult<void> first_failure(std::initializer_list<ProviderResult<void>> checks);

/// Parameters of a policy whose only setting is its random seed (least-loaded, random,
/// power-of-two).
struct SeedParameters {
  /// Seed of the picker's random draws; absent: RouterConfig::seed, else derived from the
  /// partition (resolve_seed).
  std::optional<std::uint64_t> seed;

  /// Reads `seed`; the caller rejects any other key.
  static ProviderResult<SeedParameters> read(ParameterReader& reader);
  /// Any seed is valid.
  ProviderResult<void> validate() const { return {}; }
};

/// The provider body of every built-in: reads the typed parameters (Parameters::read), fails
/// naming any key it did not read (ParameterReader::finish), checks ranges
/// (Parameters::validate), and returns a factory that calls `make` for each partition and role,
/// so that every call builds fresh components and policy state stays partition-local.
template <class Parameters, class Make>
ProviderResult<WorkerSelectionPolicyFactory> provide(
    const WorkerSelectionPolicyParameters& parameters, Make make) {
  ParameterReader reader = parameters.reader();
  ProviderResult<Parameters> parsed = Parameters::read(reader);
  if (!parsed) return std::unexpected(parsed.error());
  if (auto finished = reader.finish(); !finished) return std::unexpected(finished.error());
  if (auto valid = parsed->validate(); !valid) return std::unexpected(valid.error());
  return WorkerSelectionPolicyFactory{
      [checked = *std::move(parsed), make](const RouterConfig& config, WorkerType worker_type,
                                           const RoutingPartition& partition) {
        return make(checked, config, worker_type, partition);
      }};
}

}  // namespace kvr::selection::policies
