#include "selection/router_config.hpp"

#include <cmath>

namespace kvr::plugins::worker_selection {
namespace {

bool is_finite_non_negative(double value) { return std::isfinite(value) && value >= 0; }

}  // namespace

std::expected<void, std::string> RouterConfig::validate() const {
  if (block_size == 0) return std::unexpected("block_size must be positive");
  if (!is_finite_non_negative(device_overlap_credit) || device_overlap_credit > 1) {
    return std::unexpected("device_overlap_credit must be in [0, 1]");
  }
  if (!is_finite_non_negative(host_overlap_credit) || host_overlap_credit > 1) {
    return std::unexpected("host_overlap_credit must be in [0, 1]");
  }
  if (!is_finite_non_negative(disk_overlap_credit) || disk_overlap_credit > 1) {
    return std::unexpected("disk_overlap_credit must be in [0, 1]");
  }
  if (!is_finite_non_negative(prefill_load_scale)) {
    return std::unexpected("prefill_load_scale must be finite and non-negative");
  }
  if (!is_finite_non_negative(active_request_weight)) {
    return std::unexpected("active_request_weight must be finite and non-negative");
  }
  if (!is_finite_non_negative(temperature)) {
    return std::unexpected("temperature must be finite and non-negative");
  }
  if (busy_kv_usage_threshold && !(*busy_kv_usage_threshold > 0 && *busy_kv_usage_threshold <= 1)) {
    return std::unexpected("busy_kv_usage_threshold must be in (0, 1]");
  }
  return {};
}

}  // namespace kvr::plugins::worker_selection
