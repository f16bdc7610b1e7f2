#include "deploy/simulation/timing_model.hpp"

#include <algorithm>

namespace kvr::simulation {

double TimingModel::prefill_ms(std::uint64_t uncached_tokens) const {
  if (uncached_tokens == 0) return 0.0;
  const auto tokens = static_cast<double>(uncached_tokens);
  return config_.prefill_quadratic_ms * tokens * tokens + config_.prefill_linear_ms * tokens +
         config_.prefill_constant_ms;
}

double TimingModel::decode_ms(double kv_utilisation) const {
  const double u = kv_utilisation;
  const double polynomial = config_.decode_quadratic_ms * u * u + config_.decode_linear_ms * u +
                            config_.decode_constant_ms;
  return std::max(config_.decode_floor_ms, polynomial);
}

double TimingModel::step_ms(std::uint64_t prefill_tokens, std::uint64_t decode_requests,
                            double kv_utilisation) const {
  const double prefill = prefill_ms(prefill_tokens);
  const double decode = decode_requests > 0 ? decode_ms(kv_utilisation) : 0.0;
  const double unscaled =
      config_.mixed_step_cost == MixedStepCost::Sum ? prefill + decode : std::max(prefill, decode);
  return unscaled / config_.time_scale;
}

}  // namespace kvr::simulation
