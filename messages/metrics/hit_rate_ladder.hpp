// The measured rungs of the hit-rate ladder (docs/hit-rate.md), per model: the prompt tokens, the
// cached tokens the router predicted (its overlap at routing time) and those the engines
// delivered (their reported cached prompt tokens), with the per-request difference. The node's
// metrics (NodeMetrics::record_cache_outcome), the mismatch detector and the replays' reports use
// it. Plain C++, no CAF.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <string_view>

namespace kvr::metrics {

/// Upper bounds of the buckets of engine − predicted cached tokens per request: below 0 the
/// engine reused fewer tokens than the router predicted, (−1, 0] exactly as many, above 0 more.
/// kvr_cached_tokens_difference and HitRateLadder share them.
inline constexpr std::array<double, 12> kCachedTokensDifferenceBuckets = {
    -16384, -4096, -1024, -256, -64, -1, 0, 64, 256, 1024, 4096, 16384};

/// One request's cache outcome, in prompt tokens.
struct CacheOutcome {
  std::uint64_t prompt_tokens = 0;
  /// The router's overlap at routing time in tokens, at most prompt_tokens.
  std::uint64_t predicted_cached_tokens = 0;
  /// The prompt tokens the engine reported served from its cache, at most prompt_tokens.
  std::uint64_t engine_cached_tokens = 0;

  /// The outcome with both cached counts capped at the prompt: an overlap can reach into the
  /// prompt's last partial block, and an engine's count beyond the prompt is a bad report.
  static CacheOutcome of(std::uint64_t prompt_tokens, std::uint64_t predicted_cached_tokens,
                         std::uint64_t engine_cached_tokens);

  /// engine_cached_tokens − predicted_cached_tokens.
  std::int64_t difference() const {
    return static_cast<std::int64_t>(engine_cached_tokens) -
           static_cast<std::int64_t>(predicted_cached_tokens);
  }
};

/// The token counters of many requests.
struct CacheTotals {
  std::uint64_t requests = 0;
  std::uint64_t prompt_tokens = 0;
  std::uint64_t predicted_cached_tokens = 0;
  std::uint64_t engine_cached_tokens = 0;

  /// Counts one request.
  void add(const CacheOutcome& outcome);
  /// Adds `other`'s counts.
  void add(const CacheTotals& other);
  /// Takes away counts that were added before (a sliding window dropping its oldest part).
  void subtract(const CacheTotals& other);
  /// predicted_cached_tokens / prompt_tokens; 0 without prompt tokens.
  double predicted_hit_rate() const;
  /// engine_cached_tokens / prompt_tokens; 0 without prompt tokens.
  double delivered_hit_rate() const;
};

/// One model's measured rungs: its counters and how engine − predicted was distributed.
struct ModelCacheOutcomes {
  CacheTotals totals;
  /// Requests per bucket of kCachedTokensDifferenceBuckets, the last one above 16384; not
  /// cumulative.
  std::array<std::uint64_t, kCachedTokensDifferenceBuckets.size() + 1> difference_buckets{};
  /// Requests whose engine reused fewer, exactly as many, or more tokens than predicted.
  std::uint64_t engine_below_predicted = 0;
  std::uint64_t engine_as_predicted = 0;
  std::uint64_t engine_above_predicted = 0;
};

/// The bucket of kCachedTokensDifferenceBuckets that `difference` falls in (the size of the array
/// for one above the last bound), as a Prometheus histogram counts it.
std::size_t difference_bucket(std::int64_t difference);

/// Accumulates cache outcomes per model. Single-threaded (a replay's driver owns one).
class HitRateLadder {
 public:
  /// Counts one request of `model`.
  void record(std::string_view model, const CacheOutcome& outcome);

  /// Every model recorded, by name.
  const std::map<std::string, ModelCacheOutcomes, std::less<>>& models() const { return models_; }
  /// The model's outcomes; empty when it recorded none.
  ModelCacheOutcomes model(std::string_view name) const;

 private:
  std::map<std::string, ModelCacheOutcomes, std::less<>> models_;
};

}  // namespace kvr::metrics
