#include "messages/metrics/metrics_registry.hpp"

#include <chrono>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "messages/metrics/rate_limited_log.hpp"

namespace kvr::metrics {
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

TEST(MetricsRegistryTest, HandlesWriteTheSameSeriesAsNamedCalls) {
  MetricsRegistry registry;
  registry.describe("lat_seconds", MetricType::Histogram, "latency", {0.1, 1});
  const ValueHandle requests = registry.counter("requests_total", {{"worker", "7"}});
  const ValueHandle open = registry.gauge("open");
  const HistogramHandle latency = registry.histogram("lat_seconds");
  requests.add();
  registry.add("requests_total", {{"worker", "7"}}, 2);
  open.set(5);
  open.set(4);
  latency.observe(0.05);
  registry.observe("lat_seconds", {}, 0.5);
  EXPECT_EQ(registry.value("requests_total", {{"worker", "7"}}), 3);
  EXPECT_EQ(registry.value("open"), 4);
  const std::string text = registry.render();
  EXPECT_NE(text.find("lat_seconds_bucket{le=\"0.1\"} 1\n"), std::string::npos) << text;
  EXPECT_NE(text.find("lat_seconds_bucket{le=\"1\"} 2\n"), std::string::npos) << text;
  EXPECT_NE(text.find("lat_seconds_count 2\n"), std::string::npos) << text;
  // A histogram handle of a family that is not a described histogram does nothing.
  registry.histogram("requests_total").observe(1);
  registry.histogram("never_described").observe(1);
  EXPECT_EQ(registry.value("requests_total", {{"worker", "7"}}), 3);
  EXPECT_EQ(registry.render().find("never_described"), std::string::npos);
}

TEST(MetricsRegistryTest, HandlesCountExactlyFromManyThreads) {
  MetricsRegistry registry;
  registry.describe("lat_seconds", MetricType::Histogram, "latency", {1});
  const ValueHandle counter = registry.counter("hits_total");
  const HistogramHandle latency = registry.histogram("lat_seconds");
  constexpr int kThreads = 4;
  constexpr int kPerThread = 20'000;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < kPerThread; ++i) {
        counter.add();
        latency.observe(0.5);
      }
    });
  }
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(registry.value("hits_total"), kThreads * kPerThread);
  const std::string text = registry.render();
  EXPECT_NE(text.find(fmt::format("lat_seconds_count {}\n", kThreads * kPerThread)),
            std::string::npos)
      << text;
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
}  // namespace kvr::metrics
