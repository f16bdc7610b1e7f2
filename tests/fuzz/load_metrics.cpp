// LoadMetrics as the node's load subscription reads it (decode_worker_load).
#include <algorithm>

#include "selection/wire/worker_messages.hpp"
#include "tests/fuzz/harness.hpp"

namespace kvr::fuzz {

void load_metrics(Input input) {
  const WorkerMessageLimits limits;
  auto report = decode_worker_load(as_text(input), limits);
  if (!report) {
    KVR_FUZZ_CHECK(!report.error().empty());
    return;
  }
  KVR_FUZZ_CHECK(report->worker_id != 0);
  KVR_FUZZ_CHECK(report->ranks.size() <= limits.max_ranks);
  for (std::size_t i = 0; i < report->ranks.size(); ++i) {
    const auto& [rank, load] = report->ranks[i];
    KVR_FUZZ_CHECK(rank < limits.max_ranks);
    KVR_FUZZ_CHECK(load.waiting_requests <= load.active_requests);
    KVR_FUZZ_CHECK(load.kv_blocks_used <= limits.registration.max_kv_blocks_per_rank);
    KVR_FUZZ_CHECK(load.active_decode_blocks <= limits.registration.max_kv_blocks_per_rank);
    // Each rank once.
    KVR_FUZZ_CHECK(std::none_of(report->ranks.begin() + static_cast<std::ptrdiff_t>(i) + 1,
                                report->ranks.end(),
                                [&](const auto& other) { return other.first == rank; }));
  }
}

}  // namespace kvr::fuzz
