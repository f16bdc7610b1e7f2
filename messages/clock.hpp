// Where the router reads the time. Production code uses the process's steady clock; tests inject
// a ManualClock and advance it, so liveness expiry, deadlines and (later) admission due times are
// exercised without sleeping. Plain C++; thread-safe.
#pragma once

#include <atomic>
#include <chrono>
#include <memory>

namespace kvr {

/// A source of steady time points.
class Clock {
 public:
  using time_point = std::chrono::steady_clock::time_point;
  using duration = std::chrono::steady_clock::duration;

  virtual ~Clock() = default;
  virtual time_point now() const = 0;

  /// The process's steady clock (one shared instance).
  static std::shared_ptr<const Clock> steady();
};

/// A clock that moves only when told to; starts at `start`.
class ManualClock final : public Clock {
 public:
  explicit ManualClock(time_point start = time_point{std::chrono::hours(1)})
      : ticks_(start.time_since_epoch().count()) {}

  time_point now() const override { return time_point{duration{ticks_.load()}}; }
  void advance(duration by) { ticks_.fetch_add(by.count()); }

 private:
  std::atomic<duration::rep> ticks_;
};

}  // namespace kvr
