#include "selection/config/worker_health_config.hpp"

#include <cmath>

#include <fmt/format.h>

namespace kvr::selection {

std::expected<void, WorkerHealthConfigError> WorkerHealthConfig::validate() const {
  // A day bounds every duration, so that sums and products of them cannot overflow.
  constexpr std::chrono::milliseconds kMaxDuration = std::chrono::hours(24);
  const auto duration_error =
      [&](std::string key, std::chrono::milliseconds value,
          bool zero_allowed) -> std::expected<void, WorkerHealthConfigError> {
    if (value.count() < 0 || (!zero_allowed && value.count() == 0) || value > kMaxDuration) {
      return std::unexpected(WorkerHealthConfigError{
          std::move(key), fmt::format("must be in [{}, {}] ms, got {}", zero_allowed ? 0 : 1,
                                      kMaxDuration.count(), value.count())});
    }
    return {};
  };
  if (consecutive_failures > 1'000'000) {
    return std::unexpected(WorkerHealthConfigError{
        "consecutive_failures",
        fmt::format("must be at most 1000000 (0: never eject), got {}", consecutive_failures)});
  }
  if (auto valid = duration_error("base_ejection_time_ms", base_ejection_time, false); !valid) {
    return valid;
  }
  if (auto valid = duration_error("max_ejection_time_ms", max_ejection_time, false); !valid) {
    return valid;
  }
  if (max_ejection_time < base_ejection_time) {
    return std::unexpected(WorkerHealthConfigError{
        "max_ejection_time_ms",
        fmt::format("must not be below base_ejection_time_ms ({} ms), got {}",
                    base_ejection_time.count(), max_ejection_time.count())});
  }
  if (!std::isfinite(max_ejection_percent) || max_ejection_percent < 0 ||
      max_ejection_percent > 100) {
    return std::unexpected(WorkerHealthConfigError{
        "max_ejection_percent", fmt::format("must be in [0, 100], got {}", max_ejection_percent)});
  }
  if (auto valid = duration_error("slow_start_window_ms", slow_start_window, true); !valid) {
    return valid;
  }
  if (!std::isfinite(slow_start_min_weight) || slow_start_min_weight <= 0 ||
      slow_start_min_weight > 1) {
    return std::unexpected(WorkerHealthConfigError{
        "slow_start_min_weight", fmt::format("must be in (0, 1], got {}", slow_start_min_weight)});
  }
  return {};
}

}  // namespace kvr::selection
