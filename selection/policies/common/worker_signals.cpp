#include "selection/policies/common/worker_signals.hpp"

#include "selection/policies/common/best_row.hpp"

namespace kvr::selection::policies {

std::weak_ordering compare_load(const WorkerLoadInput& a, const WorkerLoadInput& b) {
  if (const auto order = active_requests_of(a) <=> active_requests_of(b); order != 0) {
    return order;
  }
  if (const auto order = active_prefill_tokens_of(a) <=> active_prefill_tokens_of(b); order != 0) {
    return order;
  }
  return lower_is_better(decode_cost_blocks_of(a), decode_cost_blocks_of(b));
}

std::size_t least_loaded_row(std::span<const WorkerLoadInput> loads, PolicyRng& rng) {
  return best_row(
      loads.size(),
      [loads](std::size_t a, std::size_t b) { return compare_load(loads[a], loads[b]); }, rng);
}

}  // namespace kvr::selection::policies
