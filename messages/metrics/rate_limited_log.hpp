// Rate limiting for warnings about bad network input: at most one log line per key (e.g. a NATS
// subject) per window, with the number of lines suppressed since. Used by the NATS bridge and the
// router node's actors. Plain C++, thread-safe.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>

namespace kvr::metrics {

/// Decides whether a warning may be logged now.
class RateLimitedLog {
 public:
  using Clock = std::chrono::steady_clock;

  explicit RateLimitedLog(std::chrono::milliseconds window = std::chrono::seconds(5))
      : window_(window) {}

  /// When the key may log at `now`: how many earlier calls were suppressed since it last
  /// logged; nullopt when this call is to be suppressed.
  std::optional<std::uint64_t> admit(std::string_view key, Clock::time_point now = Clock::now());

  /// Logs `message` with spdlog at warning level when `key` is admitted.
  void warn(std::string_view key, std::string_view message);

 private:
  struct KeyState {
    Clock::time_point last_logged;
    std::uint64_t suppressed = 0;
  };
  std::chrono::milliseconds window_;
  std::mutex mutex_;
  std::map<std::string, KeyState, std::less<>> keys_;
};

}  // namespace kvr::metrics
