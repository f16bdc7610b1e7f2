// How the built-in pickers read and compare worker signals: the least-loaded order and row, total
// cache overlap, and the load and cache groups of a picker's view. Used by least-loaded,
// power-of-two, two-tier, soft-affinity-load-guard and bounded-load-hash.
#pragma once

#include <compare>
#include <cstddef>
#include <span>

#include "selection/policies/common/plugin_api.hpp"
#include "selection/policies/common/policy_rng.hpp"

namespace kvr::selection::policies {

/// Active requests of a worker; a worker without a load observation counts as idle (0), so a
/// newly registered worker receives traffic instead of being starved until its first report.
inline std::size_t active_requests_of(const WorkerLoadInput& load) {
  return load.is_available() ? load.active_requests() : 0;
}

/// Prompt tokens waiting for prefill; 0 without a load observation.
inline std::size_t active_prefill_tokens_of(const WorkerLoadInput& load) {
  return load.is_available() ? load.active_prefill_tokens() : 0;
}

/// Projected decode blocks; 0 without a load observation.
inline double decode_cost_blocks_of(const WorkerLoadInput& load) {
  return load.is_available() ? load.decode_cost_blocks() : 0.0;
}

/// The least-loaded order: fewer active requests, then fewer active prefill tokens, then fewer
/// projected decode blocks. Less means `a` is lighter.
std::weak_ordering compare_load(const WorkerLoadInput& a, const WorkerLoadInput& b);

/// The least-loaded row by compare_load, ties broken uniformly at random. `loads` is non-empty.
std::size_t least_loaded_row(std::span<const WorkerLoadInput> loads, PolicyRng& rng);

/// Device + host + disk overlap blocks: how much of the prompt the worker holds on any tier.
inline double total_overlap_blocks(const WorkerCacheInput& cache) {
  return cache.device_overlap_blocks() + cache.host_overlap_blocks() + cache.disk_overlap_blocks();
}

}  // namespace kvr::selection::policies
