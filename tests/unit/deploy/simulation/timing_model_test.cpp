#include "deploy/simulation/timing_model.hpp"

#include <gtest/gtest.h>

namespace kvr::simulation {
namespace {

constexpr double kTolerance = 1e-9;

TEST(TimingModelTest, PrefillTimeMatchesHandComputedPolynomial) {
  const TimingModel model{TimingConfig{}};
  // 4.209989e-7 * 1000^2 + 0.01518344 * 1000 + 16.50142 = 0.4209989 + 15.18344 + 16.50142
  EXPECT_NEAR(model.prefill_ms(1000), 32.1058589, kTolerance);
  // 4.209989e-7 * 100^2 + 0.01518344 * 100 + 16.50142 = 0.004209989 + 1.518344 + 16.50142
  EXPECT_NEAR(model.prefill_ms(100), 18.023973989, kTolerance);
}

TEST(TimingModelTest, PrefillOfNoTokensCostsNothing) {
  const TimingModel model{TimingConfig{}};
  EXPECT_EQ(model.prefill_ms(0), 0.0);
}

TEST(TimingModelTest, DecodeTimeMatchesHandComputedPolynomial) {
  const TimingModel model{TimingConfig{}};
  // -25.74 * 0.25 + 54.01 * 0.5 + 5.74 = -6.435 + 27.005 + 5.74
  EXPECT_NEAR(model.decode_ms(0.5), 26.31, kTolerance);
  EXPECT_NEAR(model.decode_ms(0.0), 5.74, kTolerance);
  // -25.74 + 54.01 + 5.74
  EXPECT_NEAR(model.decode_ms(1.0), 34.01, kTolerance);
}

TEST(TimingModelTest, DecodeTimeNeverFallsBelowFloor) {
  const TimingModel model{TimingConfig{}};
  // -25.74 * 6.25 + 54.01 * 2.5 + 5.74 = -20.11, clamped to the 1 ms floor.
  EXPECT_EQ(model.decode_ms(2.5), 1.0);
}

TEST(TimingModelTest, MixedStepSumsPrefillAndDecodeByDefault) {
  const TimingModel model{TimingConfig{}};
  EXPECT_NEAR(model.step_ms(1000, 3, 0.5), 32.1058589 + 26.31, kTolerance);
  EXPECT_NEAR(model.step_ms(1000, 0, 0.5), 32.1058589, kTolerance);
  EXPECT_NEAR(model.step_ms(0, 3, 0.5), 26.31, kTolerance);
  EXPECT_EQ(model.step_ms(0, 0, 0.5), 0.0);
}

TEST(TimingModelTest, MixedStepTakesLongerPartWhenConfiguredMax) {
  TimingConfig config;
  config.mixed_step_cost = MixedStepCost::Max;
  const TimingModel model{config};
  EXPECT_NEAR(model.step_ms(1000, 3, 0.5), 32.1058589, kTolerance);
  EXPECT_NEAR(model.step_ms(1, 3, 0.5), 26.31, kTolerance);
}

TEST(TimingModelTest, TimeScaleDividesStepTimeOnly) {
  TimingConfig config;
  config.time_scale = 4.0;
  const TimingModel model{config};
  EXPECT_NEAR(model.step_ms(1000, 3, 0.5), (32.1058589 + 26.31) / 4.0, kTolerance);
  // The component formulas stay in unscaled GPU milliseconds.
  EXPECT_NEAR(model.prefill_ms(1000), 32.1058589, kTolerance);
}

}  // namespace
}  // namespace kvr::simulation
