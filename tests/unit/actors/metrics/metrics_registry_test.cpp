#include "actors/metrics/metrics_registry.hpp"

#include <chrono>

#include <gtest/gtest.h>

#include "actors/metrics/rate_limited_log.hpp"

namespace kvr::actors::metrics {
namespace {

TEST(MetricsRegistryTest, RendersCountersWithHelpTypeAndLabels) {
  MetricsRegistry registry;
  registry.describe("kvr_requests_total", MetricType::Counter, "Requests.");
  registry.add("kvr_requests_total", {{"worker", "7"}});
  registry.add("kvr_requests_total", {{"worker", "7"}}, 2);
  registry.add("kvr_requests_total", {{"worker", "9"}});
  EXPECT_EQ(registry.render(),
            "# HELP kvr_requests_total Requests.\n"
            "# TYPE kvr_requests_total counter\n"
            "kvr_requests_total{worker=\"7\"} 3\n"
            "kvr_requests_total{worker=\"9\"} 1\n");
  EXPECT_EQ(registry.value("kvr_requests_total", {{"worker", "7"}}), 3);
  EXPECT_EQ(registry.total("kvr_requests_total"), 4);
}

TEST(MetricsRegistryTest, GaugeIsOverwrittenNotAdded) {
  MetricsRegistry registry;
  registry.set("kvr_open", {}, 5);
  registry.set("kvr_open", {}, 2);
  EXPECT_EQ(registry.render(), "# TYPE kvr_open gauge\nkvr_open 2\n");
}

TEST(MetricsRegistryTest, HistogramBucketsAreCumulativeWithSumAndCount) {
  MetricsRegistry registry;
  registry.describe("kvr_latency_seconds", MetricType::Histogram, "Latency.", {0.1, 1});
  registry.observe("kvr_latency_seconds", {}, 0.05);
  registry.observe("kvr_latency_seconds", {}, 0.5);
  registry.observe("kvr_latency_seconds", {}, 5);
  EXPECT_EQ(registry.render(),
            "# HELP kvr_latency_seconds Latency.\n"
            "# TYPE kvr_latency_seconds histogram\n"
            "kvr_latency_seconds_bucket{le=\"0.1\"} 1\n"
            "kvr_latency_seconds_bucket{le=\"1\"} 2\n"
            "kvr_latency_seconds_bucket{le=\"+Inf\"} 3\n"
            "kvr_latency_seconds_sum 5.55\n"
            "kvr_latency_seconds_count 3\n");
}

TEST(MetricsRegistryTest, ObservingAnUndeclaredHistogramIsIgnored) {
  MetricsRegistry registry;
  registry.observe("kvr_unknown", {}, 1);
  EXPECT_EQ(registry.render(), "");
}

TEST(MetricsRegistryTest, EscapesLabelValues) {
  MetricsRegistry registry;
  registry.add("kvr_bad_total", {{"subject", "a\"b\\c\nd"}});
  EXPECT_EQ(registry.render(),
            "# TYPE kvr_bad_total counter\nkvr_bad_total{subject=\"a\\\"b\\\\c\\nd\"} 1\n");
}

TEST(RateLimitedLogTest, AdmitsOncePerWindowAndCountsSuppressed) {
  RateLimitedLog log{std::chrono::seconds(1)};
  const auto start = RateLimitedLog::Clock::time_point{} + std::chrono::hours(1);
  EXPECT_EQ(log.admit("s", start), 0U);
  EXPECT_FALSE(log.admit("s", start + std::chrono::milliseconds(10)));
  EXPECT_FALSE(log.admit("s", start + std::chrono::milliseconds(20)));
  EXPECT_EQ(log.admit("other", start), 0U);
  EXPECT_EQ(log.admit("s", start + std::chrono::seconds(2)), 2U);
}

}  // namespace
}  // namespace kvr::actors::metrics
