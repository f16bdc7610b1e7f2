#include "deploy/simulation/engine_config.hpp"

#include <limits>

#include <gtest/gtest.h>

namespace kvr::simulation {
namespace {

std::string bad_field(const EngineConfig& config) {
  const auto valid = config.validate();
  return valid ? std::string("<valid>") : valid.error().field;
}

TEST(EngineConfigTest, DefaultsAreValidAndDocumentedValues) {
  const EngineConfig config;
  EXPECT_TRUE(config.validate().has_value());
  EXPECT_EQ(config.block_size, 64U);
  EXPECT_EQ(config.num_gpu_blocks, 16'384U);
  EXPECT_EQ(config.max_num_batched_tokens, 8'192U);
  EXPECT_EQ(config.max_num_seqs, 256U);
  EXPECT_EQ(config.timing.time_scale, 1.0);
  EXPECT_EQ(config.timing.mixed_step_cost, MixedStepCost::Sum);
  EXPECT_EQ(config.transfer.latency_ms, 2.0);
  EXPECT_EQ(config.transfer.ms_per_block, 0.34);
}

TEST(EngineConfigTest, RejectsZeroSizesNamingTheField) {
  EngineConfig config;
  config.block_size = 0;
  EXPECT_EQ(bad_field(config), "block_size");
  config = EngineConfig{};
  config.num_gpu_blocks = 0;
  EXPECT_EQ(bad_field(config), "num_gpu_blocks");
  config = EngineConfig{};
  config.max_num_batched_tokens = 0;
  EXPECT_EQ(bad_field(config), "max_num_batched_tokens");
  config = EngineConfig{};
  config.max_num_seqs = 0;
  EXPECT_EQ(bad_field(config), "max_num_seqs");
}

TEST(EngineConfigTest, RejectsBadTimingNamingTheField) {
  EngineConfig config;
  config.timing.time_scale = 0.0;
  EXPECT_EQ(bad_field(config), "timing.time_scale");
  config.timing.time_scale = std::numeric_limits<double>::infinity();
  EXPECT_EQ(bad_field(config), "timing.time_scale");
  config = EngineConfig{};
  config.timing.decode_linear_ms = std::numeric_limits<double>::quiet_NaN();
  EXPECT_EQ(bad_field(config), "timing.decode_linear_ms");
  config = EngineConfig{};
  config.timing.prefill_linear_ms = -1.0;
  EXPECT_EQ(bad_field(config), "timing.prefill_linear_ms");
  config = EngineConfig{};
  config.timing.decode_floor_ms = 0.0;
  EXPECT_EQ(bad_field(config), "timing.decode_floor_ms");
}

TEST(EngineConfigTest, RejectsBadTransferNamingTheField) {
  EngineConfig config;
  config.transfer.latency_ms = -1.0;
  EXPECT_EQ(bad_field(config), "transfer.latency_ms");
  config.transfer.latency_ms = std::numeric_limits<double>::quiet_NaN();
  EXPECT_EQ(bad_field(config), "transfer.latency_ms");
  config = EngineConfig{};
  config.transfer.ms_per_block = std::numeric_limits<double>::infinity();
  EXPECT_EQ(bad_field(config), "transfer.ms_per_block");
  config.transfer.ms_per_block = -0.5;
  EXPECT_EQ(bad_field(config), "transfer.ms_per_block");
  // Free transfers are allowed: they end at once.
  config = EngineConfig{};
  config.transfer.latency_ms = 0.0;
  config.transfer.ms_per_block = 0.0;
  EXPECT_TRUE(config.validate().has_value());
}

TEST(EngineConfigTest, ErrorMessageNamesFieldAndRule) {
  EngineConfig config;
  config.max_num_seqs = 0;
  const auto valid = config.validate();
  ASSERT_FALSE(valid.has_value());
  EXPECT_EQ(valid.error().message(), "engine config: max_num_seqs must be > 0");
}

}  // namespace
}  // namespace kvr::simulation
