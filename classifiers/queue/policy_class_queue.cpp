#include "classifiers/queue/policy_class_queue.hpp"

#include <algorithm>
#include <limits>

#include <fmt/format.h>

#include "messages/check.hpp"

namespace kvr::classifiers {
namespace {

constexpr std::int64_t kNoDueRank = std::numeric_limits<std::int64_t>::max();

std::uint64_t saturating_multiply(std::uint64_t left, std::uint64_t right) {
  std::uint64_t product = 0;
  if (__builtin_mul_overflow(left, right, &product)) {
    return std::numeric_limits<std::uint64_t>::max();
  }
  return product;
}

std::uint64_t saturating_add(std::uint64_t left, std::uint64_t right) {
  std::uint64_t sum = 0;
  if (__builtin_add_overflow(left, right, &sum)) return std::numeric_limits<std::uint64_t>::max();
  return sum;
}

std::uint64_t deficit_cost(const QueuedRequest& request) {
  return std::max<std::uint64_t>(1, request.scheduling_cost_tokens);
}

}  // namespace

bool PolicyClassQueue::LaneOrder::operator()(const LaneKey& left, const LaneKey& right) const {
  if (left.priority != right.priority) return left.priority > right.priority;
  if (left.due_rank != right.due_rank) return left.due_rank < right.due_rank;
  if (left.order_rank != right.order_rank) return left.order_rank < right.order_rank;
  return left.sequence < right.sequence;
}

PolicyClassQueue::PolicyClassQueue(std::vector<PolicyClassConfig> classes) {
  KVR_CHECK(!classes.empty());
  KVR_CHECK(classes.size() < std::numeric_limits<std::uint32_t>::max());
  classes_.reserve(classes.size());
  for (PolicyClassConfig& config : classes) {
    KVR_CHECK(validate_policy_class(config).has_value());
    const auto index = static_cast<std::uint32_t>(classes_.size());
    KVR_CHECK(class_index_.emplace(config.name, index).second);
    classes_.push_back(ClassState{.config = std::move(config)});
  }
  candidates_.resize(classes_.size(), nullptr);
}

PolicyClassQueue::PolicyClassQueue(PolicyClassQueue&&) noexcept = default;
PolicyClassQueue& PolicyClassQueue::operator=(PolicyClassQueue&&) noexcept = default;
PolicyClassQueue::~PolicyClassQueue() = default;

const PolicyClassConfig* PolicyClassQueue::find_class(std::string_view policy_class) const {
  const auto found = class_index_.find(policy_class);
  return found == class_index_.end() ? nullptr : &classes_[found->second].config;
}

std::expected<void, QueueError> PolicyClassQueue::enqueue(QueuedRequest request,
                                                          std::size_t eligible_workers) {
  const auto found = class_index_.find(request.policy_class);
  if (found == class_index_.end()) {
    return std::unexpected(
        QueueError{QueueError::Kind::UnknownClass,
                   fmt::format("request '{}' names the unknown policy class '{}'",
                               request.request_id, request.policy_class)});
  }
  const std::uint32_t class_index = found->second;
  ClassState& state = classes_[class_index];
  const PolicyClassConfig& config = state.config;

  std::string id = request.request_id;
  auto [entry, inserted] = entries_.try_emplace(std::move(id));
  if (!inserted) {
    return std::unexpected(
        QueueError{QueueError::Kind::DuplicateRequest,
                   fmt::format("request '{}' is already queued", request.request_id)});
  }
  // Checked once the id is known to be new, so that a duplicate is reported as one; the entry is
  // taken back out when a limit refuses the request.
  std::optional<QueueError> refusal;
  if (const auto& limit = config.request_queue_limit_per_worker) {
    const std::uint64_t allowed = saturating_multiply(*limit, eligible_workers);
    if (state.requests + 1 > allowed) {
      refusal.emplace(
          QueueError::Kind::QueueFull,
          fmt::format("policy class '{}' is full: {} requests queued, limit {} ({} per worker, {} "
                      "eligible workers)",
                      config.name, state.requests, allowed, *limit, eligible_workers));
    }
  }
  if (const auto& limit = config.uncached_token_queue_limit_per_worker; limit && !refusal) {
    const std::uint64_t allowed = saturating_multiply(*limit, eligible_workers);
    if (saturating_add(state.uncached_tokens, request.uncached_tokens) > allowed) {
      refusal.emplace(
          QueueError::Kind::QueueFull,
          fmt::format("policy class '{}' is full: {} uncached tokens queued, {} more would exceed "
                      "the limit {} ({} per worker, {} eligible workers)",
                      config.name, state.uncached_tokens, request.uncached_tokens, allowed, *limit,
                      eligible_workers));
    }
  }
  if (refusal) {
    entries_.erase(entry);
    return std::unexpected(std::move(*refusal));
  }
  Stored& stored = entry->second;
  request.arrival_sequence = next_sequence_++;
  stored.request = std::move(request);
  stored.class_index = class_index;
  const QueuedRequest& queued = stored.request;

  stored.lane = queued.pinned_worker ? &state.pinned[*queued.pinned_worker] : &state.unpinned;
  const LaneKey key{
      .priority = queued.priority,
      .due_rank = queued.due_at ? queued.due_at->time_since_epoch().count() : kNoDueRank,
      .order_rank = config.order == QueueOrder::Wspt ? queued.scheduling_cost_tokens : 0,
      .sequence = queued.arrival_sequence,
      .stored = &stored,
  };
  stored.lane_position = stored.lane->insert(key).first;
  if (queued.due_at) stored.due_position = due_index_.emplace(*queued.due_at, &stored);
  ++state.requests;
  state.uncached_tokens = saturating_add(state.uncached_tokens, queued.uncached_tokens);
  return {};
}

QueuedRequest PolicyClassQueue::take(Entries::iterator entry) {
  Stored& stored = entry->second;
  ClassState& state = classes_[stored.class_index];
  stored.lane->erase(stored.lane_position);
  if (stored.lane->empty() && stored.request.pinned_worker) {
    state.pinned.erase(*stored.request.pinned_worker);
  }
  if (stored.due_position) due_index_.erase(*stored.due_position);
  --state.requests;
  state.uncached_tokens -= std::min(state.uncached_tokens, stored.request.uncached_tokens);
  if (state.requests == 0) {
    // As in deficit round robin: an emptied class keeps no credit and gives up its turn.
    state.deficit = 0;
    if (current_class_ == stored.class_index) end_turn();
  }
  QueuedRequest request = std::move(stored.request);
  entries_.erase(entry);
  return request;
}

void PolicyClassQueue::end_turn() {
  current_class_ = static_cast<std::uint32_t>((current_class_ + 1) % classes_.size());
  turn_started_ = false;
}

std::uint32_t PolicyClassQueue::pick_class(std::uint32_t priority) {
  const auto competes = [&](std::uint32_t index) {
    return candidates_[index] != nullptr && candidates_[index]->priority == priority;
  };
  const auto cost = [&](std::uint32_t index) {
    return deficit_cost(candidates_[index]->stored->request);
  };
  const std::size_t class_count = classes_.size();
  bool skipped_rounds = false;
  for (std::size_t step = 0;; ++step) {
    if (step == class_count && !skipped_rounds) {
      // A whole round served no one: every competing class's deficit is below its candidate's
      // cost. Grant at once the rounds in which still no one could be served, so that costs far
      // above the quanta take no more time than costs below them.
      std::uint64_t rounds = std::numeric_limits<std::uint64_t>::max();
      for (std::uint32_t index = 0; index < class_count; ++index) {
        if (!competes(index)) continue;
        const ClassState& state = classes_[index];
        const std::uint64_t missing = cost(index) - state.deficit;
        const std::uint64_t quantum = state.config.quantum;
        rounds = std::min(rounds, missing / quantum + (missing % quantum != 0 ? 1 : 0));
      }
      for (std::uint32_t index = 0; index < class_count; ++index) {
        if (!competes(index)) continue;
        ClassState& state = classes_[index];
        state.deficit =
            saturating_add(state.deficit, saturating_multiply(rounds - 1, state.config.quantum));
      }
      skipped_rounds = true;
    }
    const std::uint32_t index = current_class_;
    if (competes(index)) {
      ClassState& state = classes_[index];
      if (!turn_started_) {
        state.deficit = saturating_add(state.deficit, state.config.quantum);
        turn_started_ = true;
      }
      if (state.deficit >= cost(index)) {
        state.deficit -= cost(index);
        return index;
      }
    }
    end_turn();
  }
}

std::optional<QueuedRequest> PolicyClassQueue::next_dispatchable(DispatchCheck can_dispatch) {
  const LaneOrder before;
  bool any = false;
  std::uint32_t top_priority = 0;
  for (std::size_t index = 0; index < classes_.size(); ++index) {
    const ClassState& state = classes_[index];
    const LaneKey* candidate = nullptr;
    if (state.requests > 0) {
      const auto consider = [&](const Lane& lane) {
        if (lane.empty()) return;
        const LaneKey& head = *lane.begin();
        if (candidate != nullptr && !before(head, *candidate)) return;
        if (can_dispatch(state.config, head.stored->request)) candidate = &head;
      };
      consider(state.unpinned);
      for (const auto& [worker, lane] : state.pinned) consider(lane);
    }
    candidates_[index] = candidate;
    if (candidate != nullptr && (!any || candidate->priority > top_priority)) {
      top_priority = candidate->priority;
      any = true;
    }
  }
  if (!any) return std::nullopt;
  const std::uint32_t chosen = pick_class(top_priority);
  const auto entry =
      entries_.find(std::string_view{candidates_[chosen]->stored->request.request_id});
  KVR_CHECK(entry != entries_.end());
  return take(entry);
}

std::size_t PolicyClassQueue::drain(DispatchCheck can_dispatch, DispatchSink dispatch) {
  std::size_t dispatched = 0;
  while (auto request = next_dispatchable(can_dispatch)) {
    dispatch(std::move(*request));
    ++dispatched;
  }
  return dispatched;
}

std::vector<QueuedRequest> PolicyClassQueue::expire(QueueTimePoint now) {
  std::vector<QueuedRequest> expired;
  while (!due_index_.empty() && due_index_.begin()->first <= now) {
    const Stored* stored = due_index_.begin()->second;
    const auto entry = entries_.find(std::string_view{stored->request.request_id});
    KVR_CHECK(entry != entries_.end());
    expired.push_back(take(entry));
  }
  return expired;
}

std::optional<QueueTimePoint> PolicyClassQueue::earliest_due() const {
  if (due_index_.empty()) return std::nullopt;
  return due_index_.begin()->first;
}

std::optional<QueuedRequest> PolicyClassQueue::remove(std::string_view request_id) {
  const auto entry = entries_.find(request_id);
  if (entry == entries_.end()) return std::nullopt;
  return take(entry);
}

bool PolicyClassQueue::contains(std::string_view request_id) const {
  return entries_.find(request_id) != entries_.end();
}

std::vector<PolicyClassDepth> PolicyClassQueue::depths() const {
  std::vector<PolicyClassDepth> depths;
  depths.reserve(classes_.size());
  for (const ClassState& state : classes_) {
    depths.push_back({state.config.name, state.requests, state.uncached_tokens});
  }
  return depths;
}

std::optional<PolicyClassDepth> PolicyClassQueue::depth(std::string_view policy_class) const {
  const auto found = class_index_.find(policy_class);
  if (found == class_index_.end()) return std::nullopt;
  const ClassState& state = classes_[found->second];
  return PolicyClassDepth{state.config.name, state.requests, state.uncached_tokens};
}

}  // namespace kvr::classifiers
