#include "selection/partition/partition_queue.hpp"

#include <algorithm>
#include <limits>
#include <utility>

#include <fmt/format.h>

#include "messages/check.hpp"

namespace kvr {
namespace {

using classifiers::PolicyClassConfig;
using classifiers::QueuedRequest;
using classifiers::QueueError;

// A pin without a rank waits in one lane per worker: every rank of it may serve the request.
constexpr DpRank kAnyRank = std::numeric_limits<DpRank>::max();

RouteFailure refusal(const QueueError& error, const RouteRequest& request) {
  switch (error.kind()) {
    case QueueError::Kind::QueueFull:
      return {Error::overloaded, fmt::format("queue_full: {}", error.message())};
    case QueueError::Kind::UnknownClass:
      return {Error::invalid_request,
              fmt::format("request '{}': {}", request.id(), error.message())};
    case QueueError::Kind::DuplicateRequest:
      return {Error::invalid_request,
              fmt::format("request id '{}' is already waiting in the queue", request.id())};
  }
  return {Error::invalid_request, std::string{error.message()}};
}

}  // namespace

bool queues_requests(const std::vector<PolicyClassConfig>& classes) {
  return std::ranges::any_of(classes, [](const PolicyClassConfig& config) {
    return config.prefill_busy_threshold || config.prefill_busy_threshold_frac ||
           config.kv_busy_threshold;
  });
}

PartitionQueue::PartitionQueue(PartitionQueueOptions options)
    : queue_(std::move(options.classes)), max_wait_(options.max_wait) {
  KVR_CHECK(max_wait_ > std::chrono::milliseconds(0));
}

std::expected<PartitionQueue::Admission, RouteFailure> PartitionQueue::offer(
    SelectorState& selector, RouteRequest& request, QueueTicket ticket, TimePoint now) {
  const PolicyClassConfig* config = queue_.find_class(request.policy_class);
  if (config == nullptr) {
    return std::unexpected(RouteFailure{
        Error::invalid_request, fmt::format("request '{}' names the unknown policy class '{}'",
                                            request.id(), request.policy_class)});
  }
  selector.eligible_prefill_loads(request, loads_);
  // Without an eligible worker, selection answers at once (no_workers) rather than the queue
  // holding a request nothing can serve.
  if (loads_.empty() || (queue_.empty() && !classifiers::should_queue(*config, loads_))) {
    return Admission::route_now;
  }
  const std::uint64_t uncached = selector.fewest_uncached_tokens(request);
  QueuedRequest queued{
      .request_id = request.id(),
      .policy_class = request.policy_class,
      .priority = request.selection.strict_priority,
      .due_at = request.due_at,
      .scheduling_cost_tokens =
          request.scheduling_cost_tokens.value_or(std::max<std::uint64_t>(1, uncached)),
      .uncached_tokens = uncached,
  };
  if (const auto& pin = request.selection.pinned_worker) {
    queued.pinned_worker = WorkerWithDpRank{pin->worker_id, pin->dp_rank.value_or(kAnyRank)};
  }
  if (auto enqueued = queue_.enqueue(std::move(queued), loads_.size()); !enqueued) {
    return std::unexpected(refusal(enqueued.error(), request));
  }
  const std::uint64_t sequence = next_sequence_++;
  wait_deadlines_.push_back(WaitDeadline{now + max_wait_, request.id(), sequence});
  std::string id = request.id();
  waiting_.emplace(std::move(id), Waiting{WaitingRoute{ticket, std::move(request), now}, sequence});
  return Admission::queued;
}

WaitingRoute PartitionQueue::take(std::string_view request_id) {
  auto entry = waiting_.find(std::string{request_id});
  KVR_CHECK(entry != waiting_.end());
  WaitingRoute route = std::move(entry->second.route);
  waiting_.erase(entry);
  return route;
}

std::size_t PartitionQueue::drain(SelectorState& selector,
                                  classifiers::FunctionRef<void(WaitingRoute&&)> dispatch) {
  if (queue_.empty()) return 0;
  const std::size_t dispatched = queue_.drain(
      [&](const PolicyClassConfig& config, const QueuedRequest& head) {
        const auto entry = waiting_.find(head.request_id);
        KVR_CHECK(entry != waiting_.end());
        selector.eligible_prefill_loads(entry->second.route.request, loads_);
        // A worker that left takes its waiting requests' last eligible rank with it: they go to
        // selection, which answers them (no_workers), instead of waiting out max_wait.
        return loads_.empty() || !classifiers::should_queue(config, loads_);
      },
      [&](QueuedRequest&& head) { dispatch(take(head.request_id)); });
  prune_deadlines();
  return dispatched;
}

std::vector<RefusedRoute> PartitionQueue::expire(TimePoint now) {
  std::vector<RefusedRoute> refused;
  for (QueuedRequest& expired : queue_.expire(now)) {
    WaitingRoute route = take(expired.request_id);
    RouteFailure failure{Error::due_time_expired,
                         fmt::format("request '{}' was still queued (policy class '{}') when its "
                                     "due time passed",
                                     route.request.id(), route.request.policy_class)};
    refused.push_back(RefusedRoute{std::move(route), std::move(failure)});
  }
  prune_deadlines();
  while (!wait_deadlines_.empty() && wait_deadlines_.front().at <= now) {
    const std::string request_id = std::move(wait_deadlines_.front().request_id);
    wait_deadlines_.pop_front();
    (void)queue_.remove(request_id);
    WaitingRoute route = take(request_id);
    RouteFailure failure{
        Error::timeout,
        fmt::format("request '{}' waited {} ms in the queue (policy class '{}'), every eligible "
                    "worker busy",
                    route.request.id(), max_wait_.count(), route.request.policy_class)};
    refused.push_back(RefusedRoute{std::move(route), std::move(failure)});
    prune_deadlines();
  }
  return refused;
}

std::optional<TimePoint> PartitionQueue::next_expiry() {
  prune_deadlines();
  std::optional<TimePoint> next = queue_.earliest_due();
  if (!wait_deadlines_.empty() && (!next || wait_deadlines_.front().at < *next)) {
    next = wait_deadlines_.front().at;
  }
  return next;
}

std::optional<WaitingRoute> PartitionQueue::cancel(std::string_view request_id) {
  if (!queue_.remove(request_id)) return std::nullopt;
  WaitingRoute route = take(request_id);
  prune_deadlines();
  return route;
}

void PartitionQueue::prune_deadlines() {
  while (!wait_deadlines_.empty()) {
    const WaitDeadline& front = wait_deadlines_.front();
    const auto entry = waiting_.find(front.request_id);
    if (entry != waiting_.end() && entry->second.sequence == front.sequence) return;
    wait_deadlines_.pop_front();
  }
}

}  // namespace kvr
