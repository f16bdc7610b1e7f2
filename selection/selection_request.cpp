#include "selection/selection_request.hpp"

#include <algorithm>

#include <fmt/format.h>

namespace kvr::selection {

std::optional<RestrictionViolation> violated_restriction(const SelectionRequest& request,
                                                         WorkerWithDpRank worker, bool available,
                                                         std::span<const std::string> taints) {
  using Kind = RestrictionViolation::Kind;
  if (!available) return RestrictionViolation{Kind::unavailable};
  if (request.pinned_worker && !request.pinned_worker->matches(worker)) {
    return RestrictionViolation{Kind::pinned_elsewhere};
  }
  if (!request.allowed_workers.empty() &&
      std::ranges::find(request.allowed_workers, worker.worker_id) ==
          request.allowed_workers.end()) {
    return RestrictionViolation{Kind::not_allowed};
  }
  if (std::ranges::find(request.excluded_workers, worker.worker_id) !=
      request.excluded_workers.end()) {
    return RestrictionViolation{Kind::excluded};
  }
  for (const std::string& taint : request.required_taints) {
    if (std::ranges::find(taints, taint) == taints.end()) {
      return RestrictionViolation{Kind::missing_taint, taint};
    }
  }
  return std::nullopt;
}

std::string describe(const RestrictionViolation& violation, const SelectionRequest& request) {
  using Kind = RestrictionViolation::Kind;
  switch (violation.kind) {
    case Kind::unavailable:
      return "it is not available";
    case Kind::pinned_elsewhere:
      return fmt::format("the request is pinned to worker {}", request.pinned_worker->worker_id);
    case Kind::not_allowed:
      return "it is not in the request's allow-list";
    case Kind::excluded:
      return "the request excludes it";
    case Kind::missing_taint:
      return fmt::format("it lacks the required taint '{}'", violation.taint);
  }
  return "it is not eligible";
}

}  // namespace kvr::selection
