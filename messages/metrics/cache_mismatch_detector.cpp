#include "messages/metrics/cache_mismatch_detector.hpp"

#include <algorithm>
#include <array>

#include <fmt/format.h>

#include "messages/metrics/node_metrics.hpp"
#include "messages/metrics/rate_limited_log.hpp"

namespace kvr::metrics {
namespace {

// The window is kept as this many slots: memory stays bounded whatever the request rate.
constexpr int kSlotsPerWindow = 10;

constexpr auto kRouterSeesNoCacheCauses = std::to_array<std::string_view>({
    "tokenizer mismatch: the router's token ids are not the engine's (front door: "
    "--tokenizer-mode engine; NATS clients: the served model's own tokenizer)",
    "chat template not applied: the router hashes the raw messages, the engine caches the "
    "rendered prompt",
    "different block size or hash seed: kvr bridge's --block-size is not the engine's, or a "
    "client hashes blocks otherwise than docs/protocol.md says",
    "LoRA namespace: adapter requests reach the router without the adapter as cache namespace "
    "(or under another name than the bridge gives the engine's blocks)",
    "no KV events: the engine's events do not reach the router (kvr bridge not running or not "
    "subscribed; kvr_index_blocks stays 0)",
});

constexpr auto kEnginesReportNoCacheCauses = std::to_array<std::string_view>({
    "engine prefix caching disabled (vLLM: --no-enable-prefix-caching)",
    "the engine does not report cached tokens (vLLM: --enable-prompt-tokens-details)",
    "LoRA namespace: adapter requests matched against the base model's blocks, which the engine "
    "keys apart",
    "stale index: the engine evicts blocks without the Removed events reaching the router "
    "(kvr_kv_event_gaps_total)",
});

std::string_view describe(CacheMismatch kind) {
  switch (kind) {
    case CacheMismatch::router_sees_no_cache:
      return "the router's block hashes do not meet the engines'";
    case CacheMismatch::engines_report_no_cache:
      return "the engines do not reuse what the router expects";
  }
  return "";
}

}  // namespace

std::span<const std::string_view> likely_causes(CacheMismatch kind) {
  switch (kind) {
    case CacheMismatch::router_sees_no_cache:
      return kRouterSeesNoCacheCauses;
    case CacheMismatch::engines_report_no_cache:
      return kEnginesReportNoCacheCauses;
  }
  return {};
}

std::string CacheMismatchWarning::message() const {
  std::string causes;
  for (std::size_t i = 0; i < likely_causes.size(); ++i) {
    causes += fmt::format("{}({}) {}", i == 0 ? "" : "; ", i + 1, likely_causes[i]);
  }
  return fmt::format(
      "kvr node: model '{}': the router predicted {:.1f}% of prompt tokens cached, its engines "
      "report {:.1f}% (last {} s, {} requests): {}. Likely causes: {}. See docs/hit-rate.md",
      model, 100 * window.predicted_hit_rate(), 100 * window.delivered_hit_rate(),
      window_length.count(), window.requests, describe(kind), causes);
}

CacheMismatchDetector::CacheMismatchDetector(std::shared_ptr<const Clock> clock,
                                             CacheMismatchOptions options)
    : clock_(std::move(clock)),
      options_(options),
      slot_length_(std::max<Clock::duration>(
          std::chrono::duration_cast<Clock::duration>(options.window) / kSlotsPerWindow,
          Clock::duration{1})) {}

void CacheMismatchDetector::prune(ModelWindow& window, Clock::time_point now) const {
  const auto window_start = now - options_.window;
  while (!window.slots.empty() && window.slots.front().start + slot_length_ <= window_start) {
    window.sum.subtract(window.slots.front().totals);
    window.slots.pop_front();
  }
}

std::optional<CacheMismatch> CacheMismatchDetector::judge(const CacheTotals& totals) const {
  if (totals.requests < options_.min_requests || totals.prompt_tokens == 0) return std::nullopt;
  const double predicted = totals.predicted_hit_rate();
  const double delivered = totals.delivered_hit_rate();
  if (predicted <= options_.near_zero && delivered >= options_.substantial) {
    return CacheMismatch::router_sees_no_cache;
  }
  if (delivered <= options_.near_zero && predicted >= options_.substantial) {
    return CacheMismatch::engines_report_no_cache;
  }
  return std::nullopt;
}

std::optional<CacheMismatchWarning> CacheMismatchDetector::observe(std::string_view model,
                                                                   const CacheOutcome& outcome) {
  const Clock::time_point now = clock_->now();
  std::lock_guard lock{mutex_};
  auto it = models_.find(model);
  if (it == models_.end()) it = models_.emplace(std::string{model}, ModelWindow{}).first;
  ModelWindow& window = it->second;
  prune(window, now);
  if (window.slots.empty() || now >= window.slots.back().start + slot_length_) {
    window.slots.push_back(Slot{now, {}});
  }
  window.slots.back().totals.add(outcome);
  window.sum.add(outcome);
  const auto kind = judge(window.sum);
  if (!kind) return std::nullopt;
  if (window.last_warned && now - *window.last_warned < options_.warn_interval) {
    return std::nullopt;
  }
  window.last_warned = now;
  return CacheMismatchWarning{.model = std::string{model},
                              .kind = *kind,
                              .window = window.sum,
                              .window_length = options_.window,
                              .likely_causes = likely_causes(*kind)};
}

CacheTotals CacheMismatchDetector::window(std::string_view model) const {
  const Clock::time_point now = clock_->now();
  std::lock_guard lock{mutex_};
  const auto it = models_.find(model);
  if (it == models_.end()) return {};
  // Counted without pruning (this is const): the slots that ended before the window are left out.
  CacheTotals totals;
  const auto window_start = now - options_.window;
  for (const Slot& slot : it->second.slots) {
    if (slot.start + slot_length_ > window_start) totals.add(slot.totals);
  }
  return totals;
}

void record_cache_outcome(const NodeMetrics& metrics, CacheMismatchDetector& detector,
                          RateLimitedLog& log, std::string_view model, std::uint64_t prompt_tokens,
                          std::uint64_t predicted_cached_tokens,
                          std::uint64_t engine_cached_tokens) {
  metrics.record_cache_outcome(model, prompt_tokens, predicted_cached_tokens, engine_cached_tokens);
  const auto warning = detector.observe(
      model, CacheOutcome::of(prompt_tokens, predicted_cached_tokens, engine_cached_tokens));
  if (warning) log.warn(fmt::format("hit-rate:{}", model), warning->message());
}

}  // namespace kvr::metrics
