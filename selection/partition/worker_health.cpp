#include "selection/partition/worker_health.hpp"

#include <algorithm>
#include <cmath>

namespace kvr {

std::string_view as_str(FailureCause cause) {
  switch (cause) {
    case FailureCause::dispatch_failed:
      return "dispatch_failed";
    case FailureCause::first_token_timeout:
      return "first_token_timeout";
    case FailureCause::stream_timeout:
      return "stream_timeout";
    case FailureCause::worker_failed:
      return "worker_failed";
  }
  return "worker_failed";
}

WorkerHealth::WorkerHealth(selection::WorkerHealthConfig config) : config_(config) {}

bool WorkerHealth::joined(WorkerId worker, TimePoint now) {
  left(worker);
  bool warm_peer = false;
  if (config_.slow_start_window.count() > 0) {
    for (const auto& [id, peer] : records_) {
      if (now - peer.joined_at >= config_.slow_start_window) {
        warm_peer = true;
        break;
      }
    }
  }
  Record& record = records_[worker];
  record.joined_at = now;
  record.healthy_since = now;
  if (!warm_peer) return false;
  record.ramp_started = now;
  ++ramping_;
  return true;
}

void WorkerHealth::left(WorkerId worker) {
  const auto it = records_.find(worker);
  if (it == records_.end()) return;
  if (it->second.is_ejected) --ejected_;
  if (it->second.ramp_started) --ramping_;
  records_.erase(it);
  // next_return_ may now be early; return_ejected() recomputes it then.
}

std::size_t WorkerHealth::max_ejected(std::size_t workers) const {
  if (workers < 2 || config_.max_ejection_percent <= 0) return 0;
  const auto share =
      static_cast<std::size_t>(std::floor(config_.max_ejection_percent / 100.0 * workers));
  return std::clamp<std::size_t>(share, 1, workers - 1);
}

FailureVerdict WorkerHealth::failure(WorkerId worker, TimePoint now,
                                     std::size_t partition_workers) {
  if (config_.consecutive_failures == 0) return {};
  Record& record = records_[worker];
  if (record.is_ejected) return {};
  if (record.consecutive_failures < config_.consecutive_failures) ++record.consecutive_failures;
  if (record.consecutive_failures < config_.consecutive_failures) return {};
  if (ejected_ >= max_ejected(partition_workers)) return FailureVerdict{.capped = true};
  // Each base_ejection_time spent in routing since the last return forgets one past ejection.
  const auto healthy = now - record.healthy_since;
  const auto forgiven = static_cast<std::uint64_t>(healthy / config_.base_ejection_time);
  record.ejections =
      forgiven >= record.ejections ? 0 : record.ejections - static_cast<std::uint32_t>(forgiven);
  ++record.ejections;
  const auto backoff =
      std::min(config_.base_ejection_time * record.ejections, config_.max_ejection_time);
  record.is_ejected = true;
  record.consecutive_failures = 0;
  record.return_at = now + backoff;
  ++ejected_;
  next_return_ = std::min(next_return_, record.return_at);
  return FailureVerdict{.ejected = true, .backoff = backoff};
}

void WorkerHealth::success(WorkerId worker) {
  const auto it = records_.find(worker);
  if (it == records_.end()) return;
  it->second.consecutive_failures = 0;
}

void WorkerHealth::return_ejected(TimePoint now, std::vector<WorkerId>& returned) {
  next_return_ = TimePoint::max();
  for (auto& [id, record] : records_) {
    if (!record.is_ejected) continue;
    if (record.return_at <= now) {
      record.is_ejected = false;
      record.healthy_since = now;
      --ejected_;
      returned.push_back(id);
    } else {
      next_return_ = std::min(next_return_, record.return_at);
    }
  }
}

bool WorkerHealth::is_ejected(WorkerId worker) const {
  if (ejected_ == 0) return false;
  const auto it = records_.find(worker);
  return it != records_.end() && it->second.is_ejected;
}

std::uint32_t WorkerHealth::consecutive_failures(WorkerId worker) const {
  const auto it = records_.find(worker);
  return it == records_.end() ? 0 : it->second.consecutive_failures;
}

bool WorkerHealth::end_ramps(TimePoint now) {
  for (auto& [id, record] : records_) {
    if (record.ramp_started && now - *record.ramp_started >= config_.slow_start_window) {
      record.ramp_started.reset();
      --ramping_;
    }
  }
  return ramping_ > 0;
}

double WorkerHealth::weight(WorkerId worker, TimePoint now) const {
  if (ramping_ == 0) return 1;
  const auto it = records_.find(worker);
  if (it == records_.end() || !it->second.ramp_started) return 1;
  const std::chrono::duration<double> elapsed = now - *it->second.ramp_started;
  const std::chrono::duration<double> window = config_.slow_start_window;
  if (elapsed >= window) return 1;
  const double share = std::max(0.0, elapsed / window);
  return config_.slow_start_min_weight + (1 - config_.slow_start_min_weight) * share;
}

bool WorkerHealth::offer(WorkerId worker, TimePoint now) {
  const auto it = records_.find(worker);
  if (it == records_.end() || !it->second.ramp_started) return true;
  Record& record = it->second;
  record.credit += weight(worker, now);
  record.offered_last = record.credit >= 1.0 - 1e-9;
  if (record.offered_last) record.credit -= 1.0;
  // Less than one selection's worth banked, so a spell of hidden selections buys no burst.
  record.credit = std::min(record.credit, 1.0 - 1e-9);
  return record.offered_last;
}

void WorkerHealth::refund(WorkerId worker) {
  const auto it = records_.find(worker);
  if (it == records_.end() || !it->second.ramp_started || it->second.offered_last) return;
  // Hidden, then offered after all: it took the selection, so the credit it earned is spent.
  it->second.credit = 0;
}

}  // namespace kvr
