// The policy-class queue's cost per request: one enqueue and one dequeue (next_dispatchable) in
// steady state, with the single class `default` and with 8 backlogged classes of different quanta.
//
// Each iteration dequeues the next request and enqueues a new one into the class it came from, so
// every class stays at its backlog. Request ids are 36 characters (a UUID's length), so each
// enqueue copies one id onto the heap, as the selector's own copy would.
#include <cstdint>
#include <string>
#include <vector>

#include <benchmark/benchmark.h>
#include <fmt/format.h>

#include "classifiers/queue/policy_class_queue.hpp"

namespace kvr::classifiers {
namespace {

// A unique 36-character id: a UUID-shaped prefix and the index in 12 hex digits. (A ring of
// precomputed ids would repeat the id of a request that wspt keeps waiting.)
std::string make_id(std::uint64_t index) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string id = "00000000-0000-4000-8000-000000000000";
  for (std::size_t position = id.size(); index != 0 && position > 24; index >>= 4) {
    id[--position] = kDigits[index & 0xF];
  }
  return id;
}

QueuedRequest make_request(std::size_t index, const std::string& policy_class) {
  QueuedRequest request;
  request.request_id = make_id(index);
  request.policy_class = policy_class;
  // Costs from 64 to 4,096 tokens, so that the order and the deficits have work to do.
  const std::uint64_t cost = 64 + (index * 2654435761U) % 4033;
  request.scheduling_cost_tokens = cost;
  request.uncached_tokens = cost;
  return request;
}

const auto kAlwaysDispatchable = [](const PolicyClassConfig&, const QueuedRequest&) {
  return true;
};

void run_steady_state(benchmark::State& state, std::vector<PolicyClassConfig> classes,
                      std::size_t backlog_per_class) {
  std::vector<std::string> names;
  for (const PolicyClassConfig& config : classes) names.push_back(config.name);
  PolicyClassQueue queue{std::move(classes)};
  std::size_t next_index = 0;
  for (const std::string& name : names) {
    for (std::size_t i = 0; i < backlog_per_class; ++i) {
      if (!queue.enqueue(make_request(next_index++, name), 8)) state.SkipWithError("enqueue");
    }
  }
  for (auto _ : state) {
    std::optional<QueuedRequest> served = queue.next_dispatchable(kAlwaysDispatchable);
    if (!served) {
      state.SkipWithError("nothing to dispatch");
      break;
    }
    if (!queue.enqueue(make_request(next_index++, served->policy_class), 8)) {
      state.SkipWithError("enqueue refused");
      break;
    }
    benchmark::DoNotOptimize(served);
  }
  state.SetItemsProcessed(state.iterations());
  state.counters["queued"] = static_cast<double>(queue.size());
}

// Enqueue + dequeue per request, class `default` only (backlog: state.range(0) requests).
void BM_DefaultClassEnqueueDequeue(benchmark::State& state) {
  run_steady_state(state, {default_policy_class()}, static_cast<std::size_t>(state.range(0)));
}
BENCHMARK(BM_DefaultClassEnqueueDequeue)->Arg(1)->Arg(64)->Arg(4096);

// Enqueue + dequeue per request, 8 classes (quanta 256 to 32,768, half wspt) each backlogged with
// state.range(0) requests.
void BM_EightBackloggedClassesEnqueueDequeue(benchmark::State& state) {
  std::vector<PolicyClassConfig> classes;
  for (std::uint64_t i = 0; i < 8; ++i) {
    PolicyClassConfig config;
    config.name = fmt::format("class-{}", i);
    config.quantum = std::uint64_t{256} << (i % 8);
    config.order = i % 2 == 0 ? QueueOrder::Fcfs : QueueOrder::Wspt;
    classes.push_back(std::move(config));
  }
  run_steady_state(state, std::move(classes), static_cast<std::size_t>(state.range(0)));
}
BENCHMARK(BM_EightBackloggedClassesEnqueueDequeue)->Arg(8)->Arg(512);

// Enqueue + dequeue per request, class `default` with state.range(0) pinned workers that are busy,
// each holding 4 pinned requests, beside a backlog of 64 unpinned requests: what the lanes cost.
void BM_DefaultClassBesideBusyPinnedLanes(benchmark::State& state) {
  const auto busy_workers = static_cast<WorkerId>(state.range(0));
  PolicyClassQueue queue{{default_policy_class()}};
  std::uint64_t next_index = 0;
  for (WorkerId worker = 1; worker <= busy_workers; ++worker) {
    for (int i = 0; i < 4; ++i) {
      QueuedRequest request = make_request(next_index++, "default");
      request.pinned_worker = WorkerWithDpRank{worker, 0};
      if (!queue.enqueue(std::move(request), 8)) state.SkipWithError("enqueue");
    }
  }
  for (int i = 0; i < 64; ++i) {
    if (!queue.enqueue(make_request(next_index++, "default"), 8)) state.SkipWithError("enqueue");
  }
  const auto unpinned_only = [](const PolicyClassConfig&, const QueuedRequest& request) {
    return !request.pinned_worker.has_value();
  };
  for (auto _ : state) {
    std::optional<QueuedRequest> served = queue.next_dispatchable(unpinned_only);
    if (!served || !queue.enqueue(make_request(next_index++, "default"), 8)) {
      state.SkipWithError("queue");
      break;
    }
    benchmark::DoNotOptimize(served);
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_DefaultClassBesideBusyPinnedLanes)->Arg(8)->Arg(64);

}  // namespace
}  // namespace kvr::classifiers

BENCHMARK_MAIN();
