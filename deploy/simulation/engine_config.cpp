#include "deploy/simulation/engine_config.hpp"

#include <cmath>
#include <limits>
#include <string>
#include <utility>

namespace kvr::simulation {
namespace {

std::unexpected<EngineConfigError> bad(std::string field, std::string reason) {
  return std::unexpected(EngineConfigError{std::move(field), std::move(reason)});
}

std::expected<void, EngineConfigError> validate_timing(const TimingConfig& timing) {
  const struct {
    const char* field;
    double value;
  } coefficients[] = {
      {"timing.prefill_quadratic_ms", timing.prefill_quadratic_ms},
      {"timing.prefill_linear_ms", timing.prefill_linear_ms},
      {"timing.prefill_constant_ms", timing.prefill_constant_ms},
      {"timing.decode_quadratic_ms", timing.decode_quadratic_ms},
      {"timing.decode_linear_ms", timing.decode_linear_ms},
      {"timing.decode_constant_ms", timing.decode_constant_ms},
      {"timing.decode_floor_ms", timing.decode_floor_ms},
  };
  for (const auto& coefficient : coefficients) {
    if (!std::isfinite(coefficient.value)) return bad(coefficient.field, "must be a finite number");
  }
  // Non-negative prefill coefficients keep prefill_ms monotonic in T and never negative.
  if (timing.prefill_quadratic_ms < 0.0) return bad("timing.prefill_quadratic_ms", "must be >= 0");
  if (timing.prefill_linear_ms < 0.0) return bad("timing.prefill_linear_ms", "must be >= 0");
  if (timing.prefill_constant_ms < 0.0) return bad("timing.prefill_constant_ms", "must be >= 0");
  if (timing.prefill_quadratic_ms + timing.prefill_linear_ms + timing.prefill_constant_ms <= 0.0) {
    return bad("timing.prefill_constant_ms",
               "must make prefill_ms(1) > 0 together with the other prefill coefficients");
  }
  if (timing.decode_floor_ms <= 0.0) return bad("timing.decode_floor_ms", "must be > 0");
  if (timing.mixed_step_cost != MixedStepCost::Sum &&
      timing.mixed_step_cost != MixedStepCost::Max) {
    return bad("timing.mixed_step_cost", "must be sum or max");
  }
  if (!std::isfinite(timing.time_scale) || timing.time_scale <= 0.0) {
    return bad("timing.time_scale", "must be a finite number > 0");
  }
  return {};
}

std::expected<void, EngineConfigError> validate_transfer(const TransferConfig& transfer) {
  if (!std::isfinite(transfer.latency_ms) || transfer.latency_ms < 0.0) {
    return bad("transfer.latency_ms", "must be a finite number >= 0");
  }
  if (!std::isfinite(transfer.ms_per_block) || transfer.ms_per_block < 0.0) {
    return bad("transfer.ms_per_block", "must be a finite number >= 0");
  }
  return {};
}

}  // namespace

std::string EngineConfigError::message() const { return "engine config: " + field + " " + reason; }

std::expected<void, EngineConfigError> EngineConfig::validate() const {
  if (block_size == 0) return bad("block_size", "must be > 0");
  if (num_gpu_blocks == 0) return bad("num_gpu_blocks", "must be > 0");
  // Block indices are 32-bit with one value reserved as "none".
  if (num_gpu_blocks == std::numeric_limits<std::uint32_t>::max()) {
    return bad("num_gpu_blocks", "must be < 4294967295");
  }
  if (max_num_batched_tokens == 0) return bad("max_num_batched_tokens", "must be > 0");
  if (max_num_seqs == 0) return bad("max_num_seqs", "must be > 0");
  if (auto valid = validate_timing(timing); !valid) return valid;
  return validate_transfer(transfer);
}

}  // namespace kvr::simulation
