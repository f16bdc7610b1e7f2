// What admission adds to one request in a node's hot path: the classifier's classify and first
// poll (AdmissionState::admit), its Sent and Completed events, and the policy-class queue's
// enqueue and dequeue. With the pass-through classifier (admits at once, as a classifier that
// only sets a class does) over the class `default`, and over 8 backlogged classes of different
// quanta, where each dequeue also runs deficit round robin.
//
// Each iteration admits a request, enqueues it into its class, dequeues the next request in
// dispatch order (the lane heads all dispatchable, as when a worker frees) and ends it, so every
// class stays at its backlog. Request ids are 36 characters, as a UUID's.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <benchmark/benchmark.h>
#include <fmt/format.h>

#include "classifiers/queue/policy_class_queue.hpp"
#include "selection/admission/admission_state.hpp"

namespace kvr::actors {
namespace {

namespace rc = plugins::request_classifier;
using classifiers::PolicyClassConfig;
using classifiers::PolicyClassQueue;
using classifiers::QueuedRequest;

// Admits every request at once in the class its tenant names: the cheapest useful classifier.
class TenantClassClassifier final : public rc::RequestClassifier {
 public:
  rc::AdmissionFuture classify(rc::ClassifyRequest request) override {
    if (request.tenant()) request.set_policy_class(std::string{*request.tenant()});
    return rc::AdmissionFuture::ready(std::move(request));
  }
};

std::string make_id(std::uint64_t index) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string id = "00000000-0000-4000-8000-000000000000";
  for (std::size_t position = id.size(); index != 0 && position > 24; index >>= 4) {
    id[--position] = kDigits[index & 0xF];
  }
  return id;
}

RouteRequest make_route(std::uint64_t index, const std::string& tenant) {
  RouteRequest request;
  request.selection.request_id = make_id(index);
  request.selection.prompt_tokens = 64 + (index * 2654435761U) % 4033;
  request.tenant = tenant;
  return request;
}

void run(benchmark::State& state, std::vector<PolicyClassConfig> classes,
         std::size_t backlog_per_class) {
  std::vector<std::string> names;
  for (const PolicyClassConfig& config : classes) names.push_back(config.name);
  PolicyClassQueue queue{std::move(classes)};
  AdmissionState admission{std::make_unique<TenantClassClassifier>()};
  const rc::TimePoint now{};
  std::uint64_t next_index = 0;
  // Admits one request of `tenant` and queues it; false when either refused it.
  const auto admit_and_enqueue = [&](const std::string& tenant) {
    RouteRequest route = make_route(next_index++, tenant);
    auto outcome = admission.admit(route.id(), classify_request(route, now), now);
    if (!outcome || !outcome->admitted()) return false;
    apply_admission(route, outcome->request());
    return queue
        .enqueue(QueuedRequest{.request_id = route.id(),
                               .policy_class = route.policy_class,
                               .priority = route.selection.strict_priority,
                               .due_at = route.due_at,
                               .scheduling_cost_tokens = route.selection.prompt_tokens,
                               .uncached_tokens = route.selection.prompt_tokens},
                 8)
        .has_value();
  };
  for (const std::string& name : names) {
    for (std::size_t i = 0; i < backlog_per_class; ++i) {
      if (!admit_and_enqueue(name)) state.SkipWithError("admit");
    }
  }
  const auto dispatchable = [](const PolicyClassConfig&, const QueuedRequest&) { return true; };
  for (auto _ : state) {
    std::optional<QueuedRequest> served = queue.next_dispatchable(dispatchable);
    if (!served) {
      state.SkipWithError("nothing to dispatch");
      break;
    }
    const WorkerWithDpRank worker{1, 0};
    admission.on_event(rc::Sent{served->request_id, worker});
    admission.on_event(rc::Completed{served->request_id, worker, std::nullopt});
    if (!admit_and_enqueue(served->policy_class)) {
      state.SkipWithError("admit");
      break;
    }
    benchmark::DoNotOptimize(served);
  }
  state.SetItemsProcessed(state.iterations());
}

void BM_AdmitEnqueueDequeueDefaultClass(benchmark::State& state) {
  run(state, {classifiers::default_policy_class(0.5)}, static_cast<std::size_t>(state.range(0)));
}
BENCHMARK(BM_AdmitEnqueueDequeueDefaultClass)->Arg(1)->Arg(64);

void BM_AdmitEnqueueDequeueEightClasses(benchmark::State& state) {
  std::vector<PolicyClassConfig> classes;
  for (std::uint64_t i = 0; i < 8; ++i) {
    PolicyClassConfig config;
    config.name = fmt::format("tenant{}", i);
    config.quantum = 512 << (i % 4);
    config.prefill_busy_threshold_frac = 0.5;
    classes.push_back(std::move(config));
  }
  run(state, std::move(classes), static_cast<std::size_t>(state.range(0)));
}
BENCHMARK(BM_AdmitEnqueueDequeueEightClasses)->Arg(8)->Arg(512);

}  // namespace
}  // namespace kvr::actors

BENCHMARK_MAIN();
