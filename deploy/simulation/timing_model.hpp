// The simulated engine's step-time model: polynomial prefill and decode costs, combined per step
// and divided by the time scale. Used by the engine (deploy/simulation/engine.hpp).
#pragma once

#include <cstdint>

#include "deploy/simulation/engine_config.hpp"

namespace kvr::simulation {

/// Computes how long an engine step takes from what the step computes (TimingConfig's formulas).
class TimingModel {
 public:
  /// Uses the given coefficients; the config must have passed EngineConfig::validate().
  explicit TimingModel(const TimingConfig& config) : config_(config) {}

  /// Unscaled prefill time for uncached_tokens prompt tokens computed in one step; 0 for none.
  double prefill_ms(std::uint64_t uncached_tokens) const;

  /// Unscaled time of one decode step at KV utilisation u (referenced blocks / total blocks).
  double decode_ms(double kv_utilisation) const;

  /// Scaled duration of a step computing prefill_tokens uncached prompt tokens and one token for
  /// each of decode_requests requests at KV utilisation u; 0 for an empty step.
  double step_ms(std::uint64_t prefill_tokens, std::uint64_t decode_requests,
                 double kv_utilisation) const;

  /// The coefficients in use.
  const TimingConfig& config() const { return config_; }

 private:
  TimingConfig config_;
};

}  // namespace kvr::simulation
