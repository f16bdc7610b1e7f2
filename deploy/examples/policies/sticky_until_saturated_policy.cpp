#include "sticky_until_saturated_policy.hpp"

#include <memory>
#include <span>
#include <tuple>
#include <utility>
#include <vector>

namespace kvr::examples {

using plugins::worker_selection::ParameterReader;
using plugins::worker_selection::RouterConfig;
using plugins::worker_selection::RoutingPartition;
using plugins::worker_selection::WorkerLoadInput;
using plugins::worker_selection::WorkerSelectionPolicy;
using plugins::worker_selection::WorkerSelectionPolicyError;

namespace {

// What saturation is measured in; a worker that has not reported counts nothing queued.
double queued_prefill_tokens(const WorkerLoadInput& load) {
  return load.is_available() ? static_cast<double>(load.active_prefill_tokens()) : 0;
}

}  // namespace

PolicyResult<double> UncachedWorkScorer::score(const WorkerSelectionContext& context,
                                               const WorkerCandidate& worker) {
  const WorkerLoadInput& load = *worker.load();  // never null: the scorer declared LOAD
  const double queued = load.is_available() ? static_cast<double>(load.active_prefill_tokens()) : 0;
  return new_prefill_tokens(context, *worker.cache()) + queued;
}

PolicyResult<std::size_t> StickyUntilSaturatedPicker::pick(const WorkerSelectionContext& context,
                                                           const WorkerInputView& view) {
  const auto rows = view.candidates();
  if (rows.empty()) return std::unexpected(WorkerSelectionPolicyError::failed("no candidates"));
  // Declared: always present, aligned with the rows.
  const std::span<const WorkerCacheInput> cache = *view.cache();
  const std::span<const WorkerLoadInput> load = *view.load();
  const double wanted = sticky_fraction_ * static_cast<double>(context.request_blocks());
  const auto saturation = static_cast<double>(saturation_tokens_);
  const auto sticky = [&](std::size_t row) {
    const double held = held_blocks(cache[row]);
    return held > 0 && held >= wanted && queued_prefill_tokens(load[row]) < saturation;
  };
  // Lower is better: any sticky row before every other one, so that without a sticky row the
  // lowest cost over all rows wins; then the cost; then fewer active requests, so that a burst of
  // new prompts (equal work on idle workers) is spread instead of piling onto one worker; then
  // (worker id, rank), so that the choice never depends on the order the host lists candidates.
  const auto active = [&](std::size_t row) {
    return load[row].is_available() ? load[row].active_requests() : std::size_t{0};
  };
  const auto key = [&](std::size_t row) {
    return std::tuple{!sticky(row), rows[row].cost(), active(row), rows[row].worker()};
  };
  std::size_t best = 0;
  auto best_key = key(0);
  for (std::size_t row = 1; row < rows.size(); ++row) {
    if (auto row_key = key(row); row_key < best_key) {
      best = row;
      best_key = row_key;
    }
  }
  return best;
}

std::expected<WorkerSelectionPolicyFactory, WorkerSelectionPolicyProviderError>
sticky_until_saturated_provider(const WorkerSelectionPolicyParameters& parameters) {
  // Read every parameter, then finish(): a misspelled key stops startup instead of being ignored.
  ParameterReader reader = parameters.reader();
  auto sticky_fraction = reader.optional<double>("sticky_fraction", 0.8);
  if (!sticky_fraction) return std::unexpected(sticky_fraction.error());
  auto saturation_tokens = reader.optional<std::uint64_t>("saturation_tokens", 16384);
  if (!saturation_tokens) return std::unexpected(saturation_tokens.error());
  if (auto finished = reader.finish(); !finished) return std::unexpected(finished.error());
  // A fraction of 0 would make a worker holding a single block as sticky as one holding the whole
  // prompt; written as a negation so that NaN fails too.
  if (!(*sticky_fraction > 0 && *sticky_fraction <= 1)) {
    return std::unexpected(
        WorkerSelectionPolicyProviderError{"sticky_fraction: must be in (0, 1]"});
  }
  if (*saturation_tokens == 0) {
    return std::unexpected(
        WorkerSelectionPolicyProviderError{"saturation_tokens: must be at least 1"});
  }

  // The factory runs once per partition and role; fresh components keep state partition-local.
  return [fraction = *sticky_fraction, saturation = *saturation_tokens](
             const RouterConfig& config, WorkerType worker_type, const RoutingPartition&) {
    std::vector<std::unique_ptr<WorkerScorer>> scorers;
    scorers.push_back(std::make_unique<UncachedWorkScorer>());
    return WorkerSelectionPolicy(
        config, worker_type, std::move(scorers),
        std::make_unique<StickyUntilSaturatedPicker>(fraction, saturation));
  };
}

}  // namespace kvr::examples
