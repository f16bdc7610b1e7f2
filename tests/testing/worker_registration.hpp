// A worker registration for unit tests of the router's plain state: one rank, its first
// incarnation, 1,000 KV blocks. Header-only, so suites that link the discovery core use it without
// kvr_testing depending on it.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

#include "discovery/catalog/worker_registration.hpp"

namespace kvr::testing {

inline discovery::WorkerRegistration worker_registration(WorkerId id, std::string model,
                                                         std::uint32_t block_size,
                                                         std::chrono::milliseconds liveness_ttl) {
  discovery::WorkerRegistration worker;
  worker.worker_id = id;
  worker.incarnation = 1;
  worker.model = std::move(model);
  worker.block_size = block_size;
  worker.total_kv_blocks = 1000;
  worker.liveness_ttl = liveness_ttl;
  return worker;
}

}  // namespace kvr::testing
