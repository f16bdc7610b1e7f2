#include "deploy/bridge/engine_metrics.hpp"

#include <cmath>

#include <gtest/gtest.h>

namespace kvr::bridge {
namespace {

constexpr std::string_view kVllmText =
    "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
    "# TYPE vllm:num_requests_running gauge\n"
    "vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 4.0\n"
    "vllm:num_requests_running{engine=\"1\",model_name=\"m\"} 1.0\n"
    "vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 2.0\n"
    "vllm:num_requests_waiting{engine=\"1\",model_name=\"m\"} 0.0\n"
    "vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.5\n"
    "vllm:gpu_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.9\n"
    "vllm:gpu_cache_usage_perc{engine=\"1\",model_name=\"m\"} 0.125\n"
    "vllm:num_requests_running{engine=\"7\",model_name=\"m\"} 99.0\n"
    "vllm:cache_config_info{block_size=\"16\",engine=\"0\",num_gpu_blocks=\"2048\"} 1.0\n"
    "not a sample line\n"
    "\n";

TEST(EngineMetricsTest, ParsesSamplesWithLabelsAndSkipsTheRest) {
  const auto samples = parse_prometheus_text(
      "# comment\nplain 3\nwith_labels{a=\"x\",b=\"q\\\"uote\"} 1.5e2 1700000000\nbad{a=\"x\" 1\n"
      "inf +Inf\n");
  ASSERT_EQ(samples.size(), 3U);
  EXPECT_EQ(samples[0].name, "plain");
  EXPECT_EQ(samples[0].value, 3);
  EXPECT_EQ(samples[1].label("b"), "q\"uote");
  EXPECT_EQ(samples[1].value, 150);
  EXPECT_FALSE(samples[1].label("c"));
  EXPECT_TRUE(std::isinf(samples[2].value));
}

TEST(EngineMetricsTest, ReadsVllmLoadPerRank) {
  const auto load = engine_load(parse_prometheus_text(kVllmText), EngineKind::vllm, 2);
  ASSERT_EQ(load.size(), 2U);
  // The newer usage gauge wins over the older one; a rank with only the older one uses it.
  EXPECT_EQ(load[0], (EngineRankLoad{.running = 4, .waiting = 2, .kv_usage = 0.5}));
  EXPECT_EQ(load[1], (EngineRankLoad{.running = 1, .waiting = 0, .kv_usage = 0.125}));
}

TEST(EngineMetricsTest, ReadsSglangLoadWithAndWithoutARankLabel) {
  const auto samples = parse_prometheus_text(
      "sglang:num_running_reqs{model_name=\"m\"} 3\n"
      "sglang:num_queue_reqs{model_name=\"m\"} 6\n"
      "sglang:token_usage{model_name=\"m\"} 0.28\n"
      "sglang:num_running_reqs{dp_rank=\"1\",model_name=\"m\"} 2\n"
      "vllm:num_requests_running{engine=\"0\"} 50\n");
  const auto load = engine_load(samples, EngineKind::sglang, 2);
  EXPECT_EQ(load[0], (EngineRankLoad{.running = 3, .waiting = 6, .kv_usage = 0.28}));
  EXPECT_EQ(load[1], (EngineRankLoad{.running = 2, .waiting = 0, .kv_usage = std::nullopt}));
}

TEST(EngineMetricsTest, ReadsVllmCacheConfig) {
  const auto config = engine_cache_config(parse_prometheus_text(kVllmText));
  EXPECT_EQ(config.block_size, 16U);
  EXPECT_EQ(config.num_gpu_blocks, 2048U);
  EXPECT_FALSE(engine_cache_config(parse_prometheus_text("x 1\n")).block_size);
}

TEST(EngineMetricsTest, ReadsTheProcessStartTime) {
  // As prometheus_client formats it.
  const auto start = engine_start_time(parse_prometheus_text(
      "# HELP process_start_time_seconds Start time of the process since unix epoch in seconds.\n"
      "# TYPE process_start_time_seconds gauge\n"
      "process_start_time_seconds 1.71234567891e+09\n"));
  ASSERT_TRUE(start);
  EXPECT_DOUBLE_EQ(*start, 1.71234567891e+09);
  EXPECT_FALSE(engine_start_time(parse_prometheus_text(kVllmText)));
  EXPECT_FALSE(engine_start_time(parse_prometheus_text("process_start_time_seconds NaN\n")));
}

TEST(EngineMetricsTest, NamesEngineKinds) {
  EXPECT_EQ(parse_engine_kind("vllm"), EngineKind::vllm);
  EXPECT_EQ(parse_engine_kind("sglang"), EngineKind::sglang);
  EXPECT_FALSE(parse_engine_kind("trt"));
  EXPECT_EQ(as_str(EngineKind::sglang), "sglang");
}

}  // namespace
}  // namespace kvr::bridge
