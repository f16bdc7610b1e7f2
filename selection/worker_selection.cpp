#include "selection/worker_selection.hpp"

#include <cmath>

#include "selection/selection_host.hpp"

namespace kvr::plugins::worker_selection {

WorkerSelectionContext::WorkerSelectionContext(const selection::SelectionRequest& request,
                                               std::uint32_t block_size, WorkerType worker_type,
                                               const RoutingPartition& partition)
    : request_(&request),
      prompt_tokens_(request.prompt_tokens),
      request_blocks_(block_size == 0 ? 0 : (request.prompt_tokens + block_size - 1) / block_size),
      block_size_(block_size),
      worker_type_(worker_type),
      partition_(&partition) {}

std::span<const std::uint64_t> WorkerSelectionContext::block_hashes() const {
  return request_->block_hashes;
}

std::optional<std::uint32_t> WorkerSelectionContext::expected_output_tokens() const {
  return request_->expected_output_tokens;
}

const SessionContext* WorkerSelectionContext::session_context() const {
  return request_->session ? &*request_->session : nullptr;
}

std::optional<WorkerAffinityTarget> WorkerSelectionContext::affinity_target() const {
  return request_->affinity_target;
}

std::optional<WorkerWithDpRank> WorkerSelectionContext::pinned_worker() const {
  if (!request_->pinned_worker) return std::nullopt;
  return WorkerWithDpRank{request_->pinned_worker->worker_id,
                          request_->pinned_worker->dp_rank.value_or(0)};
}

std::uint32_t WorkerSelectionContext::strict_priority() const { return request_->strict_priority; }

std::chrono::steady_clock::time_point WorkerSelectionContext::now() const { return request_->now; }

PolicyResult<void> WorkerScorer::score_all(const WorkerSelectionContext& context,
                                           std::span<const WorkerCandidate> candidates,
                                           std::span<double> costs) {
  for (std::size_t i = 0; i < candidates.size(); ++i) {
    auto cost = score(context, candidates[i]);
    if (!cost) return std::unexpected(std::move(cost.error()));
    costs[i] = *cost;
  }
  return {};
}

WorkerSelectionPolicy::WorkerSelectionPolicy(const RouterConfig& config, WorkerType worker_type,
                                             std::vector<std::unique_ptr<WorkerScorer>> scorers,
                                             std::unique_ptr<WorkerPicker> picker)
    : WorkerSelectionPolicy(config, worker_type, {}, std::move(scorers), std::move(picker)) {}

WorkerSelectionPolicy::WorkerSelectionPolicy(const RouterConfig& config, WorkerType worker_type,
                                             std::vector<std::unique_ptr<WorkerFilter>> filters,
                                             std::vector<std::unique_ptr<WorkerScorer>> scorers,
                                             std::unique_ptr<WorkerPicker> picker)
    : WorkerSelectionPolicy(config, worker_type, std::move(filters), std::move(scorers),
                            std::move(picker), {}) {}

WorkerSelectionPolicy::WorkerSelectionPolicy(
    const RouterConfig& config, WorkerType worker_type,
    std::vector<std::unique_ptr<WorkerFilter>> filters,
    std::vector<std::unique_ptr<WorkerScorer>> scorers, std::unique_ptr<WorkerPicker> picker,
    std::vector<std::shared_ptr<WorkerSelectionObserver>> observers)
    : host_(std::make_unique<selection::SelectionHost>(config, worker_type, std::move(filters),
                                                       std::move(scorers), std::move(picker),
                                                       std::move(observers))) {}

WorkerSelectionPolicy::WorkerSelectionPolicy(WorkerSelectionPolicy&&) noexcept = default;
WorkerSelectionPolicy& WorkerSelectionPolicy::operator=(WorkerSelectionPolicy&&) noexcept = default;
WorkerSelectionPolicy::~WorkerSelectionPolicy() = default;

WorkerType WorkerSelectionPolicy::worker_type() const { return host_->worker_type(); }

}  // namespace kvr::plugins::worker_selection
