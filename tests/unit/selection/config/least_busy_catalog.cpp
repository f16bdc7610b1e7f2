#include "tests/unit/selection/config/least_busy_catalog.hpp"

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

namespace kvr::examples::least_busy {
namespace {

using namespace plugins::worker_selection;

/// Keeps workers that already hold at least `min_blocks` of the prompt on the device tier.
class MinDeviceOverlapFilter final : public WorkerFilter {
 public:
  explicit MinDeviceOverlapFilter(std::uint32_t min_blocks) : min_blocks_(min_blocks) {}
  WorkerInputs required_worker_inputs() const override { return WorkerInputs::CACHE; }
  PolicyResult<bool> keep(const WorkerSelectionContext&, const WorkerCandidate& worker) override {
    return worker.cache()->device_overlap_blocks() >= min_blocks_;
  }

 private:
  std::uint32_t min_blocks_;
};

/// Costs each worker its number of active requests.
class ActiveRequestsScorer final : public WorkerScorer {
 public:
  WorkerInputs required_worker_inputs() const override { return WorkerInputs::LOAD; }
  PolicyResult<double> score(const WorkerSelectionContext&,
                             const WorkerCandidate& worker) override {
    return static_cast<double>(worker.load()->active_requests());
  }
};

/// Picks the lowest total cost.
class LowestCostPicker final : public WorkerPicker {
 public:
  PolicyResult<std::size_t> pick(const WorkerSelectionContext&,
                                 const WorkerInputView& view) override {
    const auto candidates = view.candidates();
    const auto lowest = std::ranges::min_element(candidates, {}, &ScoredWorkerCandidate::cost);
    return static_cast<std::size_t>(lowest - candidates.begin());
  }
};

std::expected<WorkerSelectionPolicyFactory, WorkerSelectionPolicyProviderError> provide(
    const WorkerSelectionPolicyParameters& parameters) {
  ParameterReader reader = parameters.reader();
  auto min_blocks = reader.optional<std::uint32_t>("min_device_overlap_blocks", 0);
  if (!min_blocks) return std::unexpected(min_blocks.error());
  if (auto finished = reader.finish(); !finished) return std::unexpected(finished.error());

  return [min_blocks = *min_blocks](const RouterConfig& config, WorkerType worker_type,
                                    const RoutingPartition&) {
    std::vector<std::unique_ptr<WorkerFilter>> filters;
    filters.push_back(std::make_unique<MinDeviceOverlapFilter>(min_blocks));
    std::vector<std::unique_ptr<WorkerScorer>> scorers;
    scorers.push_back(std::make_unique<ActiveRequestsScorer>());
    return WorkerSelectionPolicy(config, worker_type, std::move(filters), std::move(scorers),
                                 std::make_unique<LowestCostPicker>());
  };
}

}  // namespace

std::expected<void, plugins::RegistryError> register_catalog(
    plugins::RouterPluginRegistry& registry) {
  return registry.register_worker_selection("least-busy", provide);
}

}  // namespace kvr::examples::least_busy
