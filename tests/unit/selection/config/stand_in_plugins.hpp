// Stand-in plugins for registry and configuration tests: a worker-selection provider that counts
// its runs and records its parameters, and a classifier provider that reads `max_in_flight`. The
// real built-ins (selection/policies/) are tested on their own.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "selection/plugin_registry.hpp"

namespace kvr::selection::testing {

/// What a stand-in provider saw, across all its runs.
struct ProviderRuns {
  int runs = 0;
  /// The keys of each run's parameters, in run order.
  std::vector<std::vector<std::string>> parameter_keys;
};

/// Picks the first candidate.
class FirstCandidatePicker final : public plugins::worker_selection::WorkerPicker {
 public:
  plugins::worker_selection::PolicyResult<std::size_t> pick(
      const plugins::worker_selection::WorkerSelectionContext& /*context*/,
      const plugins::worker_selection::WorkerInputView& /*view*/) override {
    return 0;
  }
};

/// A provider taking the optional parameters `a`, `b` and `min_device_overlap_blocks` (read as
/// text; any other key fails it, naming the key) and counting its runs in `runs`.
inline plugins::worker_selection::WorkerSelectionPolicyProvider stand_in_policy(
    std::shared_ptr<ProviderRuns> runs) {
  using namespace plugins::worker_selection;
  return [runs = std::move(runs)](const WorkerSelectionPolicyParameters& parameters)
             -> std::expected<WorkerSelectionPolicyFactory, WorkerSelectionPolicyProviderError> {
    ++runs->runs;
    std::vector<std::string> keys;
    ParameterReader reader = parameters.reader();
    for (const char* key : {"a", "b", "min_device_overlap_blocks"}) {
      if (auto value = reader.optional<std::string>(key); value && *value) keys.emplace_back(key);
    }
    if (auto finished = reader.finish(); !finished) return std::unexpected(finished.error());
    runs->parameter_keys.push_back(std::move(keys));
    return [](const RouterConfig& config, WorkerType worker_type, const RoutingPartition&) {
      return WorkerSelectionPolicy(config, worker_type, {},
                                   std::make_unique<FirstCandidatePicker>());
    };
  };
}

/// A `max-in-flight`-like classifier provider: requires a positive `max_in_flight`.
inline plugins::request_classifier::RequestClassifierProvider stand_in_classifier(
    std::shared_ptr<std::uint32_t> max_in_flight_seen) {
  using namespace plugins::request_classifier;
  return [seen = std::move(max_in_flight_seen)](const RequestClassifierParameters& parameters)
             -> std::expected<RequestClassifierFactory, RequestClassifierProviderError> {
    ParameterReader reader = parameters.reader();
    auto max_in_flight = reader.required<std::uint32_t>("max_in_flight");
    if (!max_in_flight) return std::unexpected(max_in_flight.error());
    if (auto finished = reader.finish(); !finished) return std::unexpected(finished.error());
    *seen = *max_in_flight;
    return [](const RequestClassifierContext&) { return std::make_unique<RequestClassifier>(); };
  };
}

}  // namespace kvr::selection::testing
