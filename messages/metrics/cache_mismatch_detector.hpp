// Tells when a model's router and engines disagree about its KV cache: over a sliding window,
// the router predicts almost nothing cached while the engines report cached tokens, or the
// reverse. Either means the router's picture of the cache is wrong for a reason a person must fix
// (docs/hit-rate.md); the warning names the model and the likely causes, at most once a minute.
// The node's doors feed it each request's cache outcome (record_cache_outcome below). Plain C++,
// thread-safe.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "messages/clock.hpp"
#include "messages/metrics/hit_rate_ladder.hpp"

namespace kvr::metrics {

class NodeMetrics;     // messages/metrics/node_metrics.hpp
class RateLimitedLog;  // messages/metrics/rate_limited_log.hpp

/// When the detector warns.
struct CacheMismatchOptions {
  /// The requests of this long before now are judged together.
  std::chrono::seconds window{300};
  /// At most one warning per model per this long.
  std::chrono::seconds warn_interval{60};
  /// Fewer requests than this in the window: too few to judge.
  std::uint64_t min_requests = 20;
  /// A hit rate at or below this is near zero.
  double near_zero = 0.02;
  /// The other side's hit rate must reach this for the disagreement to matter.
  double substantial = 0.10;
};

/// Which side sees no cache.
enum class CacheMismatch : std::uint8_t {
  /// The router predicts almost nothing cached while the engines report cached tokens: the
  /// router's block hashes do not meet the engines'.
  router_sees_no_cache,
  /// The router predicts cached tokens while the engines report almost none.
  engines_report_no_cache,
};

/// A disagreement found in one model's window.
struct CacheMismatchWarning {
  std::string model;
  CacheMismatch kind = CacheMismatch::router_sees_no_cache;
  /// The window's counters.
  CacheTotals window;
  std::chrono::seconds window_length{0};
  /// What to check, most likely first.
  std::span<const std::string_view> likely_causes;

  /// One log line: the model, both hit rates over the window, the likely causes.
  std::string message() const;
};

/// The causes to check for `kind`, most likely first.
std::span<const std::string_view> likely_causes(CacheMismatch kind);

/// Judges each model's predicted and delivered hit rates over a sliding window (kept as ten
/// slots, so the window's start moves a tenth of it at a time). Thread-safe: the node's doors
/// share one.
class CacheMismatchDetector {
 public:
  /// `clock` stamps each observation (tests inject a ManualClock).
  explicit CacheMismatchDetector(std::shared_ptr<const Clock> clock = Clock::steady(),
                                 CacheMismatchOptions options = {});

  /// Counts one request of `model` and judges its window: a warning when one side's hit rate is
  /// near zero while the other's is substantial, the window holds enough requests and the model
  /// has not been warned about within the warn interval; otherwise nullopt.
  std::optional<CacheMismatchWarning> observe(std::string_view model, const CacheOutcome& outcome);

  /// The model's counters over the window now; empty for a model never observed.
  CacheTotals window(std::string_view model) const;

  const CacheMismatchOptions& options() const { return options_; }

 private:
  struct Slot {
    Clock::time_point start;
    CacheTotals totals;
  };
  struct ModelWindow {
    std::deque<Slot> slots;  // oldest first
    CacheTotals sum;         // over `slots`
    std::optional<Clock::time_point> last_warned;
  };

  /// Drops the slots that ended before the window that ends at `now`.
  void prune(ModelWindow& window, Clock::time_point now) const;
  std::optional<CacheMismatch> judge(const CacheTotals& totals) const;

  std::shared_ptr<const Clock> clock_;
  CacheMismatchOptions options_;
  Clock::duration slot_length_;
  mutable std::mutex mutex_;
  std::map<std::string, ModelWindow, std::less<>> models_;
};

/// What each door of a node calls for a request whose engine reported its cached prompt tokens:
/// counts it in the node's metrics (NodeMetrics::record_cache_outcome), feeds `detector`, and logs
/// the detector's warning through `log` (key "hit-rate:<model>").
void record_cache_outcome(const NodeMetrics& metrics, CacheMismatchDetector& detector,
                          RateLimitedLog& log, std::string_view model, std::uint64_t prompt_tokens,
                          std::uint64_t predicted_cached_tokens,
                          std::uint64_t engine_cached_tokens);

}  // namespace kvr::metrics
