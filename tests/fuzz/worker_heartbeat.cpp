// WorkerHeartbeat and WorkerDeregistration as the node's subscriptions read them: a decoded
// liveness names a worker and keeps the ids as sent.
#include "kvr/v1/worker.pb.h"
#include "selection/wire/worker_messages.hpp"
#include "tests/fuzz/harness.hpp"

namespace kvr::fuzz {
namespace {

template <class Proto>
void check(std::string_view bytes, const std::expected<WorkerLiveness, std::string>& liveness) {
  if (!liveness) {
    KVR_FUZZ_CHECK(!liveness.error().empty());
    return;
  }
  Proto wire;
  KVR_FUZZ_CHECK(wire.ParseFromArray(bytes.data(), static_cast<int>(bytes.size())));
  KVR_FUZZ_CHECK(liveness->worker_id != 0 && liveness->worker_id == wire.worker_id());
  KVR_FUZZ_CHECK(liveness->incarnation == wire.incarnation());
}

}  // namespace

void worker_heartbeat(Input input) {
  const std::string_view bytes = as_text(input);
  check<v1::WorkerHeartbeat>(bytes, decode_worker_heartbeat(bytes));
  check<v1::WorkerDeregistration>(bytes, decode_worker_deregistration(bytes));
}

}  // namespace kvr::fuzz
