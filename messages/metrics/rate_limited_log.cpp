#include "messages/metrics/rate_limited_log.hpp"

#include <spdlog/spdlog.h>

namespace kvr::metrics {

std::optional<std::uint64_t> RateLimitedLog::admit(std::string_view key, Clock::time_point now) {
  std::lock_guard lock{mutex_};
  auto it = keys_.find(key);
  if (it == keys_.end()) {
    keys_.emplace(std::string{key}, KeyState{now, 0});
    return 0;
  }
  KeyState& state = it->second;
  if (now - state.last_logged < window_) {
    ++state.suppressed;
    return std::nullopt;
  }
  const std::uint64_t suppressed = state.suppressed;
  state.last_logged = now;
  state.suppressed = 0;
  return suppressed;
}

void RateLimitedLog::warn(std::string_view key, std::string_view message) {
  const auto suppressed = admit(key);
  if (!suppressed) return;
  if (*suppressed == 0) {
    spdlog::warn("{}", message);
  } else {
    spdlog::warn("{} ({} similar messages suppressed)", message, *suppressed);
  }
}

}  // namespace kvr::metrics
