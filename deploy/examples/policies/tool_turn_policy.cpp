#include "tool_turn_policy.hpp"

#include <cmath>
#include <memory>
#include <tuple>
#include <utility>
#include <vector>

namespace kvr::examples {

using plugins::worker_selection::InputTrigger;
using plugins::worker_selection::ParameterReader;
using plugins::worker_selection::RouterConfig;
using plugins::worker_selection::RoutingPartition;
using plugins::worker_selection::WorkerSelectionPolicy;
using plugins::worker_selection::WorkerSelectionPolicyError;

namespace {

bool is_tool_result(const WorkerSelectionContext& context) {
  const auto* session = context.session_context();
  return session != nullptr && session->input_trigger() == InputTrigger::ToolResult;
}

}  // namespace

PolicyResult<std::size_t> ToolTurnLocalPicker::pick(const WorkerSelectionContext& context,
                                                    const WorkerInputView& view) {
  const auto rows = view.candidates();
  if (rows.empty()) return std::unexpected(WorkerSelectionPolicyError::failed("no candidates"));
  const auto cache = *view.cache();  // declared: always present, aligned with the rows
  const bool local = is_tool_result(context);
  // Lower is better: for a tool-result turn the negated overlap comes first.
  const auto key = [&](std::size_t row) {
    return std::tuple{local ? -cache[row].device_overlap_blocks() : 0.0, rows[row].cost(),
                      rows[row].worker()};
  };
  std::size_t best = 0;
  for (std::size_t row = 1; row < rows.size(); ++row) {
    if (key(row) < key(best)) best = row;
  }
  return best;
}

std::expected<WorkerSelectionPolicyFactory, WorkerSelectionPolicyProviderError>
tool_turn_local_provider(const WorkerSelectionPolicyParameters& parameters) {
  ParameterReader reader = parameters.reader();
  auto queue_weight = reader.optional<double>("queue_weight", 1.0);
  if (!queue_weight) return std::unexpected(queue_weight.error());
  if (auto finished = reader.finish(); !finished) return std::unexpected(finished.error());
  if (!std::isfinite(*queue_weight) || *queue_weight < 0) {
    return std::unexpected(
        WorkerSelectionPolicyProviderError{"queue_weight: must be finite and not negative"});
  }
  return [weight = *queue_weight](const RouterConfig& config, WorkerType worker_type,
                                  const RoutingPartition&) {
    std::vector<std::unique_ptr<WorkerScorer>> scorers;
    scorers.push_back(std::make_unique<UncachedBlocksScorer>());
    scorers.push_back(std::make_unique<QueueScorer>(weight));
    return WorkerSelectionPolicy(config, worker_type, std::move(scorers),
                                 std::make_unique<ToolTurnLocalPicker>());
  };
}

}  // namespace kvr::examples
