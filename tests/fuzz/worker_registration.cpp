// WorkerRegistration as the node's register subscription reads it (decode_worker_registration).
// A decoded registration is within the limits, and validating it again changes nothing.
#include "selection/wire/worker_messages.hpp"
#include "tests/fuzz/harness.hpp"

namespace kvr::fuzz {

void worker_registration(Input input) {
  const WorkerMessageLimits limits;
  auto registration = decode_worker_registration(as_text(input), limits);
  if (!registration) {
    KVR_FUZZ_CHECK(!registration.error().empty());
    return;
  }
  const discovery::RegistrationLimits& bounds = limits.registration;
  KVR_FUZZ_CHECK(registration->worker_id != 0);
  KVR_FUZZ_CHECK(!registration->model.empty());
  KVR_FUZZ_CHECK(!registration->routing_group.empty());
  KVR_FUZZ_CHECK(registration->model.size() <= bounds.max_string_length);
  KVR_FUZZ_CHECK(registration->block_size > 0);
  // No capacity (the wire's 0) is allowed; a capacity is positive and within the bound.
  KVR_FUZZ_CHECK(!registration->total_kv_blocks ||
                 (*registration->total_kv_blocks > 0 &&
                  *registration->total_kv_blocks <= bounds.max_kv_blocks_per_rank));
  KVR_FUZZ_CHECK(registration->data_parallel_size >= 1 &&
                 registration->data_parallel_size <= bounds.max_data_parallel_size);
  KVR_FUZZ_CHECK(registration->taints.size() <= bounds.max_taints);
  KVR_FUZZ_CHECK(registration->liveness_ttl >= bounds.min_liveness_ttl &&
                 registration->liveness_ttl <= bounds.max_liveness_ttl);
  auto again = discovery::validate_registration(*registration, bounds);
  KVR_FUZZ_CHECK(again.has_value() && *again == *registration);
}

}  // namespace kvr::fuzz
