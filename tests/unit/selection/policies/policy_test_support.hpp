// Shared pieces of the built-in policy tests: fake workers with given load and cache, and
// selections run through the real selection host over kvr::testing::FakeWorkerSignals.
#pragma once

#include <cstddef>
#include <map>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "selection/policies/common/plugin_api.hpp"
#include "selection/selection_host.hpp"
#include "tests/testing/fake_worker_signals.hpp"

namespace kvr::selection::policies {

/// A worker (rank `rank`) with a load observation.
inline testing::FakeWorker loaded_worker(WorkerId id, std::size_t active_requests,
                                         std::size_t active_prefill_tokens = 0,
                                         double decode_cost_blocks = 0, DpRank rank = 0) {
  testing::FakeWorker fake;
  fake.worker = {id, rank};
  fake.load = WorkerLoadInput::Values{.active_requests = active_requests,
                                      .active_prefill_tokens = active_prefill_tokens,
                                      .decode_cost_blocks = decode_cost_blocks};
  return fake;
}

/// An idle worker holding `cache` overlap.
inline testing::FakeWorker cached_worker(WorkerId id, WorkerCacheInput cache,
                                         std::size_t active_requests = 0) {
  testing::FakeWorker fake = loaded_worker(id, active_requests);
  fake.cache = cache;
  return fake;
}

/// Runs selections of one policy over a fake fleet.
class PolicyTest : public ::testing::Test {
 protected:
  std::expected<SelectionResult, WorkerSelectionPolicyError> select(WorkerSelectionPolicy& policy) {
    return select_worker(policy, request_, partition_, signals_);
  }

  /// The chosen worker id; a failed selection fails the test and returns 0.
  WorkerId pick(WorkerSelectionPolicy& policy) {
    auto result = select(policy);
    EXPECT_TRUE(result) << result.error().message();
    return result ? result->worker.worker_id : 0;
  }

  /// The chosen worker ids of `count` consecutive selections.
  std::vector<WorkerId> picks(WorkerSelectionPolicy& policy, int count) {
    std::vector<WorkerId> chosen;
    for (int i = 0; i < count; ++i) chosen.push_back(pick(policy));
    return chosen;
  }

  /// How often each worker id was chosen in `count` consecutive selections.
  std::map<WorkerId, int> pick_counts(WorkerSelectionPolicy& policy, int count) {
    std::map<WorkerId, int> counts;
    for (int i = 0; i < count; ++i) ++counts[pick(policy)];
    return counts;
  }

  RouterConfig config_;
  RoutingPartition partition_{.model = "m"};
  SelectionRequest request_{.request_id = "r", .prompt_tokens = 64};
  testing::FakeWorkerSignals signals_;
};

}  // namespace kvr::selection::policies
