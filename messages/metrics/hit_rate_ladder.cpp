#include "messages/metrics/hit_rate_ladder.hpp"

#include <algorithm>

namespace kvr::metrics {

CacheOutcome CacheOutcome::of(std::uint64_t prompt_tokens, std::uint64_t predicted_cached_tokens,
                              std::uint64_t engine_cached_tokens) {
  return CacheOutcome{.prompt_tokens = prompt_tokens,
                      .predicted_cached_tokens = std::min(predicted_cached_tokens, prompt_tokens),
                      .engine_cached_tokens = std::min(engine_cached_tokens, prompt_tokens)};
}

void CacheTotals::add(const CacheOutcome& outcome) {
  ++requests;
  prompt_tokens += outcome.prompt_tokens;
  predicted_cached_tokens += outcome.predicted_cached_tokens;
  engine_cached_tokens += outcome.engine_cached_tokens;
}

void CacheTotals::add(const CacheTotals& other) {
  requests += other.requests;
  prompt_tokens += other.prompt_tokens;
  predicted_cached_tokens += other.predicted_cached_tokens;
  engine_cached_tokens += other.engine_cached_tokens;
}

void CacheTotals::subtract(const CacheTotals& other) {
  requests -= std::min(requests, other.requests);
  prompt_tokens -= std::min(prompt_tokens, other.prompt_tokens);
  predicted_cached_tokens -= std::min(predicted_cached_tokens, other.predicted_cached_tokens);
  engine_cached_tokens -= std::min(engine_cached_tokens, other.engine_cached_tokens);
}

double CacheTotals::predicted_hit_rate() const {
  return prompt_tokens == 0
             ? 0
             : static_cast<double>(predicted_cached_tokens) / static_cast<double>(prompt_tokens);
}

double CacheTotals::delivered_hit_rate() const {
  return prompt_tokens == 0
             ? 0
             : static_cast<double>(engine_cached_tokens) / static_cast<double>(prompt_tokens);
}

std::size_t difference_bucket(std::int64_t difference) {
  const auto value = static_cast<double>(difference);
  return static_cast<std::size_t>(std::ranges::lower_bound(kCachedTokensDifferenceBuckets, value) -
                                  kCachedTokensDifferenceBuckets.begin());
}

void HitRateLadder::record(std::string_view model, const CacheOutcome& outcome) {
  auto it = models_.find(model);
  if (it == models_.end()) it = models_.emplace(std::string{model}, ModelCacheOutcomes{}).first;
  ModelCacheOutcomes& outcomes = it->second;
  outcomes.totals.add(outcome);
  const std::int64_t difference = outcome.difference();
  ++outcomes.difference_buckets[difference_bucket(difference)];
  if (difference < 0) {
    ++outcomes.engine_below_predicted;
  } else if (difference == 0) {
    ++outcomes.engine_as_predicted;
  } else {
    ++outcomes.engine_above_predicted;
  }
}

ModelCacheOutcomes HitRateLadder::model(std::string_view name) const {
  const auto it = models_.find(name);
  return it == models_.end() ? ModelCacheOutcomes{} : it->second;
}

}  // namespace kvr::metrics
