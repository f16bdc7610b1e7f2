// The hit-rate ladder's measured rungs: cached counts capped at the prompt, per-model counters,
// rates, and engine − predicted counted in the buckets a Prometheus histogram would use.
#include "messages/metrics/hit_rate_ladder.hpp"

#include <gtest/gtest.h>

namespace kvr::metrics {
namespace {

TEST(CacheOutcomeTest, CapsBothCachedCountsAtThePrompt) {
  const CacheOutcome outcome = CacheOutcome::of(100, 128, 140);
  EXPECT_EQ(outcome.prompt_tokens, 100U);
  EXPECT_EQ(outcome.predicted_cached_tokens, 100U);
  EXPECT_EQ(outcome.engine_cached_tokens, 100U);
  EXPECT_EQ(CacheOutcome::of(100, 64, 32).difference(), -32);
  EXPECT_EQ(CacheOutcome::of(100, 32, 64).difference(), 32);
}

TEST(CacheTotalsTest, RatesAreOverPromptTokensAndZeroWithoutAny) {
  CacheTotals totals;
  EXPECT_DOUBLE_EQ(totals.predicted_hit_rate(), 0.0);
  EXPECT_DOUBLE_EQ(totals.delivered_hit_rate(), 0.0);
  totals.add(CacheOutcome::of(100, 50, 25));
  totals.add(CacheOutcome::of(300, 150, 75));
  EXPECT_EQ(totals.requests, 2U);
  EXPECT_DOUBLE_EQ(totals.predicted_hit_rate(), 0.5);
  EXPECT_DOUBLE_EQ(totals.delivered_hit_rate(), 0.25);
  CacheTotals first;
  first.add(CacheOutcome::of(100, 50, 25));
  totals.subtract(first);
  EXPECT_EQ(totals.requests, 1U);
  EXPECT_EQ(totals.prompt_tokens, 300U);
  EXPECT_EQ(totals.engine_cached_tokens, 75U);
}

TEST(HitRateLadderTest, DifferenceBucketsAreUpperBoundsAsInAPrometheusHistogram) {
  EXPECT_EQ(difference_bucket(-20000), 0U);
  EXPECT_EQ(difference_bucket(-16384), 0U);
  EXPECT_EQ(difference_bucket(-16383), 1U);
  EXPECT_EQ(difference_bucket(-1), 5U);
  EXPECT_EQ(difference_bucket(0), 6U);
  EXPECT_EQ(difference_bucket(1), 7U);
  EXPECT_EQ(difference_bucket(64), 7U);
  EXPECT_EQ(difference_bucket(65), 8U);
  EXPECT_EQ(difference_bucket(16384), 11U);
  EXPECT_EQ(difference_bucket(16385), kCachedTokensDifferenceBuckets.size());
}

TEST(HitRateLadderTest, CountsTokensAndDifferencesPerModel) {
  HitRateLadder ladder;
  ladder.record("a", CacheOutcome::of(1000, 512, 512));  // as predicted
  ladder.record("a", CacheOutcome::of(1000, 512, 0));    // below: -512
  ladder.record("a", CacheOutcome::of(1000, 0, 256));    // above: +256
  ladder.record("b", CacheOutcome::of(10, 0, 0));

  const ModelCacheOutcomes a = ladder.model("a");
  EXPECT_EQ(a.totals.requests, 3U);
  EXPECT_EQ(a.totals.prompt_tokens, 3000U);
  EXPECT_EQ(a.totals.predicted_cached_tokens, 1024U);
  EXPECT_EQ(a.totals.engine_cached_tokens, 768U);
  EXPECT_EQ(a.engine_below_predicted, 1U);
  EXPECT_EQ(a.engine_as_predicted, 1U);
  EXPECT_EQ(a.engine_above_predicted, 1U);
  EXPECT_EQ(a.difference_buckets[difference_bucket(-512)], 1U);
  EXPECT_EQ(a.difference_buckets[difference_bucket(0)], 1U);
  EXPECT_EQ(a.difference_buckets[difference_bucket(256)], 1U);

  EXPECT_EQ(ladder.model("b").totals.requests, 1U);
  EXPECT_EQ(ladder.model("b").engine_as_predicted, 1U);
  EXPECT_EQ(ladder.model("never").totals.requests, 0U);
  ASSERT_EQ(ladder.models().size(), 2U);
  EXPECT_EQ(ladder.models().begin()->first, "a");
}

}  // namespace
}  // namespace kvr::metrics
