// Route decisions per second through the router node's actor API (the ingress actor's typed
// interface, `route(RouteRequestMessage) → RouteDecisionMessage`), two ways:
//  - local: the node's actors (ingress → reservation → the selector the discovery actor spawned)
//    in this process's actor system, with 64 workers fed to the discovery actor as decoded
//    messages and client actors on the same scheduler (2 threads) — the pipeline without network;
//  - published: a client actor system connected over CAF's middleman (loopback TCP) to the
//    ingress actor a RouterNode publishes on --actor-port, as a remote actor client uses it.
// C client actors keep W requests each in flight (closed loop); each run is bounded by a request
// count and a duration. A booking TTL of one second releases the bookings of unreported decisions.
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <mutex>

#include <benchmark/benchmark.h>
#include <caf/actor_system.hpp>
#include <caf/actor_system_config.hpp>
#include <caf/event_based_actor.hpp>
#include <caf/io/middleman.hpp>
#include <caf/send.hpp>
#include <caf/stateful_actor.hpp>
#include <caf/typed_event_based_actor.hpp>
#include <fmt/format.h>

#include "actors/actor_types.hpp"
#include "actors/discovery/discovery_actor.hpp"
#include "actors/ingress/ingress_actor.hpp"
#include "actors/node/router_node.hpp"
#include "actors/reservation/reservation_actor.hpp"
#include "messages/metrics/node_metrics.hpp"
#include "selection/config/router_policy_config.hpp"
#include "selection/policies/builtin_policies.hpp"
#include "tests/bench/node/node_bench_environment.hpp"

namespace kvr::bench {
namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

[[noreturn]] void die(const std::string& message) {
  std::fprintf(stderr, "kvr_node_bench: %s\n", message.c_str());
  std::abort();
}

std::atomic<std::uint64_t> g_next_actor_sequence{1};

// A publisher for actors without NATS: decisions to actor clients publish nothing.
class NullPublisher final : public RouterPublisher {
 public:
  bool publish(std::string_view, std::string_view) override { return true; }
  bool request_dump(std::string_view, WorkerWithDpRank) override { return true; }
  bool request_reregistration() override { return true; }
};

// What every client actor of one run shares.
struct RunShared {
  actors::ingress_actor ingress;
  std::vector<v1::RouteRequest> prototypes;
  std::uint64_t base_sequence = 0;
  std::size_t total = 0;
  Clock::time_point deadline;
  bool report = false;
  std::atomic<std::uint64_t> issued{0};

  std::mutex mutex;
  std::condition_variable done;
  std::size_t clients = 0;
  std::size_t finished = 0;
  Clock::time_point last_finish;
  std::vector<double> latencies_us;
  std::size_t errors = 0;
};

struct ClientState {
  static inline const char* name = "kvr.bench.client";
  std::shared_ptr<RunShared> shared;
  std::size_t outstanding = 0;
  std::vector<double> latencies_us;
  std::size_t errors = 0;
};
using Client = caf::stateful_actor<ClientState>*;

void finish(Client self) {
  auto& shared = *self->state.shared;
  {
    std::lock_guard lock{shared.mutex};
    shared.latencies_us.insert(shared.latencies_us.end(), self->state.latencies_us.begin(),
                               self->state.latencies_us.end());
    shared.errors += self->state.errors;
    shared.last_finish = Clock::now();
    if (++shared.finished == shared.clients) shared.done.notify_all();
  }
  self->quit();
}

void issue(Client self) {
  auto& shared = *self->state.shared;
  const std::uint64_t n = shared.issued.fetch_add(1);
  if (n >= shared.total || Clock::now() >= shared.deadline) {
    if (self->state.outstanding == 0) finish(self);
    return;
  }
  ++self->state.outstanding;
  actors::RouteRequestMessage message{shared.prototypes[n % shared.prototypes.size()]};
  message.value.set_request_id(fmt::format("{:016x}", shared.base_sequence + n));
  const Clock::time_point sent = Clock::now();
  // No per-request timer: the node answers every request within its selector timeout, and a
  // CAF request timeout would cost the clock thread a wake-up per request (the clients share the
  // node's two cores). The run as a whole stays bounded by run_clients' deadline.
  self->request(shared.ingress, caf::infinite, actors::route_atom::value, std::move(message))
      .then(
          [self, sent](actors::RouteDecisionMessage& decision) {
            auto& state = self->state;
            --state.outstanding;
            state.latencies_us.push_back(
                std::chrono::duration<double, std::micro>(Clock::now() - sent).count());
            if (!decision.value.has_success()) {
              ++state.errors;
            } else if (state.shared->report) {
              v1::LifecycleReport report;
              report.set_booking_id(decision.value.success().booking_id());
              report.set_event(v1::LIFECYCLE_EVENT_COMPLETED);
              self->request(state.shared->ingress, caf::infinite, actors::report_atom::value,
                            actors::LifecycleReportMessage{std::move(report)})
                  .then([](actors::LifecycleAckMessage&) {}, [](caf::error&) {});
            }
            issue(self);
          },
          [self](caf::error&) {
            --self->state.outstanding;
            ++self->state.errors;
            issue(self);
          });
}

caf::behavior route_client(Client self, std::shared_ptr<RunShared> shared, int window) {
  self->state.shared = std::move(shared);
  for (int i = 0; i < window; ++i) issue(self);
  return {[](actors::wake_atom) {}};  // never sent: the client lives for its responses
}

struct ActorRunResult {
  double seconds = 0;
  double cpu_seconds = 0;  ///< this process, during the run
  std::size_t completed = 0;
  std::size_t errors = 0;
  std::vector<double> latencies_us;
};

ActorRunResult run_clients(caf::actor_system& system, const actors::ingress_actor& ingress,
                           const Workload& workload, int clients, int window, bool report,
                           std::size_t requests, std::chrono::milliseconds max_duration) {
  auto shared = std::make_shared<RunShared>();
  shared->ingress = ingress;
  shared->prototypes.reserve(workload.pool_size());
  for (std::size_t i = 0; i < workload.pool_size(); ++i) {
    shared->prototypes.push_back(workload.route_request(i, ""));
  }
  shared->base_sequence = g_next_actor_sequence.fetch_add(requests + 1024);
  shared->total = requests;
  shared->report = report;
  shared->clients = static_cast<std::size_t>(clients);
  const double cpu_before = process_cpu_seconds();
  const Clock::time_point start = Clock::now();
  shared->deadline = start + max_duration;
  for (int c = 0; c < clients; ++c) system.spawn(route_client, shared, window);
  ActorRunResult result;
  std::unique_lock lock{shared->mutex};
  // The node answers every request (its selector timeout), so every client finishes; a lost
  // answer ends the run here instead of hanging it.
  shared->done.wait_until(lock, shared->deadline + 10s,
                          [&] { return shared->finished == shared->clients; });
  if (shared->finished != shared->clients) die("client actors did not finish");
  result.cpu_seconds = process_cpu_seconds() - cpu_before;
  result.seconds = std::chrono::duration<double>(shared->last_finish - start).count();
  result.completed = shared->latencies_us.size();
  result.errors = shared->errors;
  result.latencies_us = std::move(shared->latencies_us);
  return result;
}

void set_counters(benchmark::State& state, const ActorRunResult& result, int in_flight) {
  const LatencyPercentiles latency = percentiles(result.latencies_us);
  state.counters["decisions_per_s"] =
      result.seconds > 0 ? static_cast<double>(result.completed) / result.seconds : 0;
  state.counters["in_flight"] = in_flight;
  state.counters["rtt_p50_us"] = latency.p50_us;
  state.counters["rtt_p99_us"] = latency.p99_us;
  state.counters["errors"] = static_cast<double>(result.errors);
  // CPU per decision (clients included): robust to other load on the machine, unlike the rate.
  state.counters["cpu_us_per_decision"] =
      result.completed > 0 ? result.cpu_seconds * 1e6 / static_cast<double>(result.completed) : 0;
}

// The node's actors in one local actor system, as RouterNode wires them, without NATS.
class LocalNode {
 public:
  LocalNode() {
    config_.set("scheduler.max-threads", 2);
    config_.add_message_types<caf::id_block::kvr_actors>();
    system_ = std::make_unique<caf::actor_system>(config_);
    plugins::RouterPluginRegistry registry;
    if (!selection::register_builtin_policies(registry)) die("cannot register the policies");
    auto resolved = registry.resolve_plugins(selection::RouterPolicyConfig{});
    if (!resolved) die(std::string{resolved.error().message()});
    plugins_ = std::move(*resolved);
    metrics::NodeMetrics::describe(*metrics_);

    actors::SelectorActorConfig selector;
    selector.options.router.block_size = kBlockSize;
    selector.options.booking_ttl = 1s;
    // As a node runs: the default caps, their totals shared by the selectors.
    selector.options.node_totals = std::make_shared<NodeBookingTotals>(
        BookingCaps{actors::kDefaultMaxOpenBookings, actors::kDefaultMaxBookedBlocks});
    selector.plugins = &plugins_;
    selector.publisher = publisher_;
    selector.metrics = metrics_;
    selector.log = log_;
    discovery_ =
        system_->spawn(actors::discovery_behavior, actors::DiscoveryActorConfig{selector, {}});
    actors::ReservationActorConfig reservation;
    reservation.discovery = discovery_;
    reservation.publisher = publisher_;
    reservation.metrics = metrics_;
    reservation.log = log_;
    reservation.booking_ttl = 1s;
    reservation_ = system_->spawn(actors::reservation_behavior, std::move(reservation));
    actors::IngressActorConfig ingress;
    ingress.metrics = metrics_;
    ingress.entry = actors::RequestEntry::local({}, reservation_, {});
    ingress_ = system_->spawn(actors::ingress_behavior, std::move(ingress));
    for (std::size_t w = 0; w < kWorkers; ++w) {
      const auto registration = workload_.registration(w);
      caf::anon_send(discovery_, actors::worker_up_atom::value, registration);
      caf::anon_send(
          discovery_, actors::load_atom::value,
          WorkerLoadReport{registration.worker_id, 1, {{0, discovery::ConfirmedLoad{}}}});
      caf::anon_send(discovery_, actors::kv_events_atom::value, workload_.kv_events(w));
    }
    const metrics::Labels partition{{"partition", std::string{kModel} + "/default"}};
    const bool ready = testing::wait_until(
        [&] {
          return metrics_->value("kvr_workers", partition) == kWorkers &&
                 metrics_->value("kvr_index_blocks", partition) ==
                     static_cast<double>(workload_.distinct_blocks());
        },
        20s);
    if (!ready) die("the local actors did not learn the fleet");
  }

  ~LocalNode() {
    caf::anon_send_exit(discovery_, caf::exit_reason::user_shutdown);
    caf::anon_send_exit(reservation_, caf::exit_reason::user_shutdown);
    caf::anon_send_exit(ingress_, caf::exit_reason::user_shutdown);
    discovery_ = nullptr;
    reservation_ = nullptr;
    ingress_ = nullptr;
    system_->await_all_actors_done();
  }

  caf::actor_system& system() { return *system_; }
  const actors::ingress_actor& ingress() const { return ingress_; }
  const Workload& workload() const { return workload_; }
  const metrics::MetricsRegistry& metrics() const { return *metrics_; }

 private:
  Workload workload_;
  plugins::RouterPlugins plugins_;
  std::shared_ptr<metrics::MetricsRegistry> metrics_ = std::make_shared<metrics::MetricsRegistry>();
  std::shared_ptr<metrics::RateLimitedLog> log_ = std::make_shared<metrics::RateLimitedLog>();
  std::shared_ptr<NullPublisher> publisher_ = std::make_shared<NullPublisher>();
  caf::actor_system_config config_;
  std::unique_ptr<caf::actor_system> system_;
  actors::discovery_actor discovery_;
  actors::reservation_actor reservation_;
  actors::ingress_actor ingress_;
};

void BM_ActorRouteDecisionsLocal(benchmark::State& state) {
  const int clients = static_cast<int>(state.range(0));
  const int window = static_cast<int>(state.range(1));
  const bool report = state.range(2) != 0;
  LocalNode node;
  (void)run_clients(node.system(), node.ingress(), node.workload(), clients, window, report, 5'000,
                    5s);
  ActorRunResult result;
  LatencyPercentiles selection;
  for (auto _ : state) {
    const std::string before = node.metrics().render();
    result = run_clients(node.system(), node.ingress(), node.workload(), clients, window, report,
                         200'000, 8s);
    state.SetIterationTime(result.seconds);
    selection =
        histogram_delta(read_histogram(before, "kvr_selection_latency_seconds"),
                        read_histogram(node.metrics().render(), "kvr_selection_latency_seconds"));
  }
  set_counters(state, result, clients * window);
  state.counters["node_select_mean_us"] = selection.mean_us;
  state.counters["node_select_p99_us"] = selection.p99_us;
}

// (client actors, requests in flight per client, report each decision)
BENCHMARK(BM_ActorRouteDecisionsLocal)
    ->ArgNames({"clients", "per_client", "report"})
    ->Args({1, 1, 0})
    ->Args({4, 16, 0})
    ->Args({8, 32, 0})
    ->Args({4, 16, 1})
    ->UseManualTime()
    ->Iterations(1)
    ->Unit(benchmark::kMillisecond);

void BM_ActorRouteDecisionsPublished(benchmark::State& state) {
  const int clients = static_cast<int>(state.range(0));
  const int window = static_cast<int>(state.range(1));
  NodeEnvironment& environment = NodeEnvironment::get();
  caf::actor_system_config config;
  config.set("scheduler.max-threads", 2);
  config.load<caf::io::middleman>();
  config.add_message_types<caf::id_block::kvr_actors>();
  {
    caf::actor_system system{config};
    auto ingress = system.middleman().remote_actor<actors::ingress_actor>("127.0.0.1",
                                                                          environment.actor_port());
    if (!ingress)
      die("cannot connect to the published ingress actor: " + system.render(ingress.error()));
    environment.heartbeat();
    (void)run_clients(system, *ingress, environment.workload(), clients, window, false, 2'000, 5s);
    ActorRunResult result;
    for (auto _ : state) {
      environment.heartbeat();
      result =
          run_clients(system, *ingress, environment.workload(), clients, window, false, 60'000, 8s);
      state.SetIterationTime(result.seconds);
    }
    set_counters(state, result, clients * window);
    // Drop the proxy before the system stops, so that nothing stays pinned to the node.
    ingress = caf::sec::cannot_connect_to_node;
  }
}

BENCHMARK(BM_ActorRouteDecisionsPublished)
    ->ArgNames({"clients", "per_client"})
    ->Args({1, 1})
    ->Args({4, 16})
    ->Args({8, 32})
    ->UseManualTime()
    ->Iterations(1)
    ->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace kvr::bench
