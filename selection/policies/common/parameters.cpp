#include "selection/policies/common/parameters.hpp"

#include <cmath>

#include <fmt/format.h>

namespace kvr::selection::policies {

ProviderResult<std::optional<std::uint64_t>> read_seed(ParameterReader& reader) {
  return reader.optional<std::uint64_t>("seed");
}

ProviderResult<void> check_range(std::string_view policy, std::string_view key, double value,
                                 double min, double max) {
  if (std::isfinite(value) && value >= min && value <= max) return {};
  return std::unexpected(WorkerSelectionPolicyProviderError{
      fmt::format("{}: parameter '{}' must be in [{}, {}], got {}", policy, key, min, max, value)});
}

ProviderResult<void> check_at_least(std::string_view policy, std::string_view key, double value,
                                    double min) {
  if (std::isfinite(value) && value >= min) return {};
  return std::unexpected(WorkerSelectionPolicyProviderError{
      fmt::format("{}: parameter '{}' must be finite and >= {}, got {}", policy, key, min, value)});
}

ProviderResult<void> check_integer_range(std::string_view policy, std::string_view key,
                                         std::int64_t value, std::int64_t min, std::int64_t max) {
  if (value >= min && value <= max) return {};
  return std::unexpected(WorkerSelectionPolicyProviderError{fmt::format(
      "{}: parameter '{}' must be an integer in [{}, {}], got {}", policy, key, min, max, value)});
}

ProviderResult<void> check_integer_at_least(std::string_view policy, std::string_view key,
                                            std::int64_t value, std::int64_t min) {
  if (value >= min) return {};
  return std::unexpected(WorkerSelectionPolicyProviderError{
      fmt::format("{}: parameter '{}' must be an integer >= {}, got {}", policy, key, min, value)});
}

ProviderResult<void> first_failure(std::initializer_list<ProviderResult<void>> checks) {
  for (const ProviderResult<void>& check : checks) {
    if (!check) return check;
  }
  return {};
}

ProviderResult<SeedParameters> SeedParameters::read(ParameterReader& reader) {
  auto seed = read_seed(reader);
  if (!seed) return std::unexpected(seed.error());
  return SeedParameters{.seed = *seed};
}

}  // namespace kvr::selection::policies
