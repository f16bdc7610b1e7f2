#include "messages/metrics/node_metrics.hpp"

#include <set>
#include <string>

#include <fmt/format.h>
#include <gtest/gtest.h>

namespace kvr::metrics {
namespace {

TEST(NodeMetricsTest, DescribesEveryFamilyOnceWithItsHelpAndType) {
  MetricsRegistry registry;
  NodeMetrics::describe(registry);
  const std::string text = registry.render();
  std::set<std::string_view> names;
  for (const NodeMetricFamily& family : NodeMetrics::families()) {
    EXPECT_TRUE(names.insert(family.name).second) << family.name;
    EXPECT_TRUE(family.name.starts_with("kvr_")) << family.name;
    EXPECT_FALSE(family.help.empty()) << family.name;
    EXPECT_EQ(family.type == MetricType::Histogram, !family.buckets.empty()) << family.name;
    EXPECT_NE(text.find(fmt::format("# HELP {} {}\n", family.name, family.help)), std::string::npos)
        << family.name;
    EXPECT_NE(text.find(fmt::format("# TYPE {} {}\n", family.name, as_str(family.type))),
              std::string::npos)
        << family.name;
  }
}

TEST(NodeMetricsTest, RouteBookingsOpenAndNatsReconnectsShowFromTheStart) {
  MetricsRegistry registry;
  NodeMetrics::describe(registry);
  const std::string text = registry.render();
  EXPECT_NE(text.find("\nkvr_route_bookings_open 0\n"), std::string::npos);
  EXPECT_NE(text.find("\nkvr_nats_reconnects_total 0\n"), std::string::npos);
}

TEST(NodeMetricsTest, RouteErrorsAreLabelledWithTheErrorsShortName) {
  MetricsRegistry registry;
  NodeMetrics::describe(registry);
  const NodeMetrics metrics{registry};
  metrics.route_errors(Error::no_workers).add();
  metrics.route_errors(Error::timeout).add();
  EXPECT_EQ(registry.value(NodeMetrics::kRouteErrors, {{"code", "no_workers"}}), 1);
  EXPECT_EQ(registry.value(NodeMetrics::kRouteErrors, {{"code", "timeout"}}), 1);
  EXPECT_EQ(registry.total(NodeMetrics::kRouteErrors), 2);
}

TEST(NodeMetricsTest, SeriesCarryTheLabelsTheDocsName) {
  MetricsRegistry registry;
  NodeMetrics::describe(registry);
  const NodeMetrics metrics{registry};
  metrics.route_decisions(17).add();
  metrics.worker_messages_refused("m/default", "heartbeat").add(2);
  metrics.lifecycle_reports("completed", true).add();
  metrics.bookings_open("m/default").set(3);
  EXPECT_EQ(registry.value("kvr_route_decisions_total", {{"worker", "17"}}), 1);
  EXPECT_EQ(registry.value("kvr_worker_messages_refused_total",
                           {{"partition", "m/default"}, {"kind", "heartbeat"}}),
            2);
  EXPECT_EQ(
      registry.value("kvr_lifecycle_reports_total", {{"event", "completed"}, {"accepted", "true"}}),
      1);
  EXPECT_EQ(registry.value("kvr_bookings_open", {{"partition", "m/default"}}), 3);
}

TEST(NodeMetricsTest, CacheOutcomesCountTokensAndTheSignedDifferencePerModel) {
  MetricsRegistry registry;
  NodeMetrics::describe(registry);
  const NodeMetrics metrics{registry};
  // The overlap reaches past the 100-token prompt: it counts as 100.
  metrics.record_cache_outcome("a", 100, 128, 40);
  metrics.record_cache_outcome("a", 50, 0, 16);
  metrics.record_cache_outcome("b", 10, 0, 0);
  EXPECT_EQ(registry.value("kvr_prompt_tokens_total", {{"model", "a"}}), 150);
  EXPECT_EQ(registry.value("kvr_predicted_cached_tokens_total", {{"model", "a"}}), 100);
  EXPECT_EQ(registry.value("kvr_engine_cached_tokens_total", {{"model", "a"}}), 56);
  EXPECT_EQ(registry.value("kvr_prompt_tokens_total", {{"model", "b"}}), 10);
  const std::string text = registry.render();
  // a: -60 and +16; b: 0.
  for (const std::string_view line : {
           "kvr_cached_tokens_difference_bucket{model=\"a\",le=\"-64\"} 0\n",
           "kvr_cached_tokens_difference_bucket{model=\"a\",le=\"-1\"} 1\n",
           "kvr_cached_tokens_difference_bucket{model=\"a\",le=\"0\"} 1\n",
           "kvr_cached_tokens_difference_bucket{model=\"a\",le=\"64\"} 2\n",
           "kvr_cached_tokens_difference_sum{model=\"a\"} -44\n",
           "kvr_cached_tokens_difference_bucket{model=\"b\",le=\"0\"} 1\n",
       }) {
    EXPECT_NE(text.find(line), std::string::npos) << line << " not in:\n" << text;
  }
}

}  // namespace
}  // namespace kvr::metrics
