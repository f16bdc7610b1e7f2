// The public plugin API names the built-in policies are written against, brought into
// kvr::selection::policies once so that each policy header need not repeat them.
#pragma once

#include <expected>
#include <memory>
#include <utility>
#include <vector>

#include "selection/worker_selection.hpp"

namespace kvr::selection::policies {

using plugins::worker_selection::ParameterReader;
using plugins::worker_selection::PolicyResult;
using plugins::worker_selection::RouterConfig;
using plugins::worker_selection::RoutingPartition;
using plugins::worker_selection::ScoredWorkerCandidate;
using plugins::worker_selection::WorkerAffinityTarget;
using plugins::worker_selection::WorkerCacheInput;
using plugins::worker_selection::WorkerCandidate;
using plugins::worker_selection::WorkerFilter;
using plugins::worker_selection::WorkerInputs;
using plugins::worker_selection::WorkerInputView;
using plugins::worker_selection::WorkerLoadInput;
using plugins::worker_selection::WorkerPicker;
using plugins::worker_selection::WorkerScorer;
using plugins::worker_selection::WorkerSelectionContext;
using plugins::worker_selection::WorkerSelectionPolicy;
using plugins::worker_selection::WorkerSelectionPolicyError;
using plugins::worker_selection::WorkerSelectionPolicyFactory;
using plugins::worker_selection::WorkerSelectionPolicyParameters;
using plugins::worker_selection::WorkerSelectionPolicyProviderError;

/// What a provider step returns: a value or an operator-facing startup diagnostic.
template <class T>
using ProviderResult = std::expected<T, WorkerSelectionPolicyProviderError>;

/// A policy of one picker and no filters or scorers: every candidate's cost is 0.
inline WorkerSelectionPolicy picker_only_policy(const RouterConfig& config, WorkerType worker_type,
                                                std::unique_ptr<WorkerPicker> picker) {
  return WorkerSelectionPolicy{config, worker_type, std::vector<std::unique_ptr<WorkerScorer>>{},
                               std::move(picker)};
}

}  // namespace kvr::selection::policies
