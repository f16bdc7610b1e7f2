// Route decisions per second through one router node over NATS request/reply, and the latency a
// client sees: C connections (SendAsap, one reply subscription each) keep W requests each in
// flight (closed loop), against one in-process RouterNode with 64 workers registered over NATS.
// Each run is bounded by a request count and a duration. Counters: decisions/s, the client's
// round-trip percentiles, and the node's own route latency (NATS callback to published decision)
// and selection latency from its /metrics histograms (interpolated within buckets).
//
// BM_NatsEchoFloor runs the same clients against a responder that answers every request at once
// from its NATS callback with a fixed decision of the node's size: what NATS request/reply alone
// costs on this machine (client library, nats-server, loopback TCP), the floor under the node.
//
// Unreported decisions keep their bookings until the one-second booking expires; the `report`
// variant publishes a COMPLETED lifecycle report for every decision, as a real client does.
#include <atomic>
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <optional>

#include <benchmark/benchmark.h>
#include <fmt/format.h>

#include "kvr/v1/kv_events.pb.h"
#include "messages/subjects.hpp"
#include "selection/config/router_policy_config.hpp"
#include "selection/policies/builtin_policies.hpp"
#include "selection/wire/kv_event_codec.hpp"
#include "tests/bench/node/node_bench_environment.hpp"
#include "tests/testing/loopback_http.hpp"

namespace kvr::bench {
namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

constexpr std::string_view kNamespace = "bench";

[[noreturn]] void die(const std::string& message) {
  std::fprintf(stderr, "kvr_node_bench: %s\n", message.c_str());
  std::abort();
}

std::unique_ptr<NodeEnvironment>& environment() {
  static std::unique_ptr<NodeEnvironment> instance;
  return instance;
}

// Request ids stay unique over the whole process, so no run collides with open bookings.
std::atomic<std::uint64_t> g_next_sequence{1};

}  // namespace

NodeEnvironment& NodeEnvironment::get() {
  auto& instance = environment();
  if (!instance) instance.reset(new NodeEnvironment());
  return *instance;
}

void NodeEnvironment::shutdown() { environment().reset(); }

double NodeEnvironment::total(std::string_view name, const metrics::Labels& labels) const {
  double sum = 0;
  for (const auto& node : nodes_) sum += node->metrics().value(name, labels);
  return sum;
}

NodeEnvironment::NodeEnvironment() {
  const char* cluster_nodes = std::getenv("KVR_BENCH_CLUSTER_NODES");
  const int nodes = cluster_nodes != nullptr ? std::max(1, std::atoi(cluster_nodes)) : 0;
  std::string error;
  server_ = testing::NatsServer::start(
      &error, std::nullopt,
      nodes > 0 ? std::vector<std::string>{"-js"} : std::vector<std::string>{});
  if (!server_) die(error);
  plugins::RouterPluginRegistry registry;
  if (!selection::register_builtin_policies(registry)) die("cannot register the policies");
  auto plugins = registry.resolve_plugins(selection::RouterPolicyConfig{});
  if (!plugins) die(std::string{plugins.error().message()});

  actors::NodeOptions options;
  options.nats.url = server_->url();
  options.nats.name = "kvr-bench-node";
  options.ns = std::string{kNamespace};
  options.router.block_size = kBlockSize;
  options.booking_ttl = 1s;
  options.actor_port = testing::free_port();
  options.peers.plaintext = true;  // loopback only
  for (int n = 0; n < std::max(1, nodes); ++n) {
    if (nodes > 0) {
      options.cluster.enabled = true;
      options.cluster.node_id = fmt::format("bench-{}", n);
    }
    auto node = actors::RouterNode::start(options, *plugins);
    if (!node) die(node.error());
    nodes_.push_back(std::move(*node));
    options.actor_port = 0;  // the first node's only
  }

  nats::NatsOptions fleet_options;
  fleet_options.url = server_->url();
  fleet_options.name = "kvr-bench-fleet";
  auto fleet = nats::NatsClient::connect(fleet_options);
  if (!fleet) die(fleet.error());
  fleet_ = std::move(*fleet);
  // Registrations first: the node refuses load and KV events of workers it does not know, and
  // its subscriptions deliver on separate threads, so order across subjects is not kept.
  const metrics::Labels partition{{"partition", std::string{kModel} + "/default"}};
  for (std::size_t w = 0; w < kWorkers; ++w) {
    (void)fleet_->publish(subjects::worker_register(kNamespace),
                          to_wire(workload_.registration(w)).SerializeAsString());
  }
  (void)fleet_->flush(5s);
  if (!testing::wait_until(
          [&] {
            return total("kvr_workers", partition) == kWorkers &&
                   (nodes == 0 || total("kvr_cluster_owned_partitions", {}) == 1);
          },
          20s)) {
    die("the node did not register the fleet:\n" + metrics_text());
  }
  for (std::size_t w = 0; w < kWorkers; ++w) {
    const auto registration = workload_.registration(w);
    const std::string key = registration.model + "/" + registration.routing_group;
    (void)fleet_->publish(subjects::partition_load(kNamespace, key, registration.worker_id),
                          idle_load_wire(registration).SerializeAsString());
    (void)fleet_->publish(subjects::partition_kv_events(kNamespace, key, registration.worker_id),
                          encode_kv_event_batch(workload_.kv_events(w)).SerializeAsString());
  }
  (void)fleet_->flush(5s);
  const bool ready = testing::wait_until(
      [&] {
        return total("kvr_index_blocks", partition) ==
               static_cast<double>(workload_.distinct_blocks());
      },
      20s);
  if (!ready) die("the node did not learn the fleet:\n" + metrics_text());
}

NodeEnvironment::~NodeEnvironment() {
  fleet_.reset();
  nodes_.clear();
  server_.reset();
}

void NodeEnvironment::heartbeat() {
  for (std::size_t w = 0; w < kWorkers; ++w) {
    v1::WorkerHeartbeat heartbeat;
    heartbeat.set_worker_id(kFirstWorker + w);
    heartbeat.set_incarnation(1);
    (void)fleet_->publish(subjects::worker_heartbeat(kNamespace), heartbeat.SerializeAsString());
  }
  (void)fleet_->flush(5s);
}

namespace {

// One client connection with its reply subscription and W request slots.
struct ClientConnection {
  std::unique_ptr<nats::NatsClient> client;
  std::vector<std::string> reply_subjects;  // <inbox>.<slot>
  std::vector<Clock::time_point> sent;
  // Written by the delivery thread; read by the benchmark thread after a run.
  std::mutex mutex;
  std::vector<double> latencies_us;
  std::size_t errors = 0;
  std::string first_error;  // what the first failed decision said
  // One request buffer per slot: the benchmark thread sends every slot's first request while the
  // delivery thread already sends the next ones of slots that got their reply.
  std::vector<std::string> buffers;
  std::optional<nats::NatsSubscription> subscription;
};

struct LoadResult {
  double seconds = 0;
  double cpu_seconds = 0;         ///< this process (node and clients), during the run
  double server_cpu_seconds = 0;  ///< the nats-server, during the run
  std::size_t completed = 0;
  std::size_t errors = 0;
  std::vector<double> latencies_us;
};

// A closed-loop load: every reply sends the slot's next request from the delivery thread.
class NatsLoad {
 public:
  NatsLoad(NodeEnvironment& environment, int connections, int outstanding, bool report,
           std::string route_subject = subjects::router_route(kNamespace))
      : environment_(environment),
        report_(report),
        route_subject_(std::move(route_subject)),
        report_subject_(subjects::router_report(kNamespace)) {
    for (int c = 0; c < connections; ++c) {
      nats::NatsOptions options;
      options.url = environment.url();
      options.name = "kvr-bench-client";
      auto client = nats::NatsClient::connect(options);
      if (!client) die(client.error());
      auto connection = std::make_unique<ClientConnection>();
      connection->client = std::move(*client);
      const std::string inbox = connection->client->new_inbox();
      for (int s = 0; s < outstanding; ++s) {
        connection->reply_subjects.push_back(inbox + "." + std::to_string(s));
      }
      connection->sent.resize(static_cast<std::size_t>(outstanding));
      connection->buffers.resize(static_cast<std::size_t>(outstanding));
      ClientConnection* raw = connection.get();
      auto subscription = connection->client->subscribe(
          inbox + ".*", [this, raw](nats::NatsMessage message) { on_reply(*raw, message); });
      if (!subscription) die(subscription.error());
      connection->subscription = std::move(*subscription);
      (void)connection->client->flush(5s);
      connections_.push_back(std::move(connection));
    }
  }

  ~NatsLoad() {
    // Unsubscribe (waiting for running callbacks) before the connections close.
    for (auto& connection : connections_) connection->subscription.reset();
  }

  LoadResult run(std::size_t requests, std::chrono::milliseconds max_duration) {
    sent_.store(0);
    base_sequence_ = g_next_sequence.fetch_add(requests + 1024);
    std::size_t slots = 0;
    for (auto& connection : connections_) {
      std::lock_guard lock{connection->mutex};
      connection->latencies_us.clear();
      connection->latencies_us.reserve(requests);
      connection->errors = 0;
      slots += connection->reply_subjects.size();
    }
    loop_.begin(requests, slots, max_duration);
    const double cpu_before = process_cpu_seconds();
    const double server_cpu_before = process_cpu_seconds(environment_.server_pid());
    const Clock::time_point start = Clock::now();
    for (auto& connection : connections_) {
      for (std::size_t s = 0; s < connection->reply_subjects.size(); ++s) send_next(*connection, s);
    }
    (void)loop_.wait(2s);
    LoadResult result;
    result.cpu_seconds = process_cpu_seconds() - cpu_before;
    result.server_cpu_seconds = process_cpu_seconds(environment_.server_pid()) - server_cpu_before;
    result.seconds =
        std::max(0.0, std::chrono::duration<double>(last_reply_.load() - start).count());
    for (auto& connection : connections_) {
      std::lock_guard lock{connection->mutex};
      result.completed += connection->latencies_us.size();
      result.errors += connection->errors;
      if (!connection->first_error.empty()) {
        std::fprintf(stderr, "kvr_node_bench: a failed decision: %s\n",
                     connection->first_error.c_str());
        connection->first_error.clear();
      }
      result.latencies_us.insert(result.latencies_us.end(), connection->latencies_us.begin(),
                                 connection->latencies_us.end());
    }
    // Requests sent whose decision never came.
    const std::size_t sent = sent_.load();
    result.errors += sent > result.completed ? sent - result.completed : 0;
    return result;
  }

 private:
  void send_next(ClientConnection& connection, std::size_t slot) {
    const std::optional<std::uint64_t> n = loop_.next_request();
    if (!n) return;  // the run is complete or out of time
    std::string& buffer = connection.buffers[slot];
    environment_.templates().render(base_sequence_ + *n, buffer);
    connection.sent[slot] = Clock::now();
    if (connection.client->publish_request(route_subject_, connection.reply_subjects[slot],
                                           buffer)) {
      sent_.fetch_add(1);
      return;
    }
    {
      std::lock_guard lock{connection.mutex};
      ++connection.errors;
    }
    loop_.finish_slot();
  }

  void on_reply(ClientConnection& connection, const nats::NatsMessage& message) {
    const Clock::time_point now = Clock::now();
    std::size_t slot = 0;
    const std::size_t dot = message.subject.rfind('.');
    std::from_chars(message.subject.data() + dot + 1,
                    message.subject.data() + message.subject.size(), slot);
    if (slot >= connection.sent.size()) return;
    v1::RouteDecision decision;
    const bool routed = decision.ParseFromString(message.data) && decision.has_success();
    {
      std::lock_guard lock{connection.mutex};
      connection.latencies_us.push_back(
          std::chrono::duration<double, std::micro>(now - connection.sent[slot]).count());
      if (!routed) {
        if (connection.first_error.empty()) {
          connection.first_error = decision.has_error()
                                       ? v1::RouteErrorCode_Name(decision.error().code()) + ": " +
                                             decision.error().message()
                                       : std::string{"not a RouteDecision"};
        }
        ++connection.errors;
      }
    }
    last_reply_.store(now);
    if (routed && report_) {
      v1::LifecycleReport report;
      report.set_booking_id(decision.success().booking_id());
      report.set_event(v1::LIFECYCLE_EVENT_COMPLETED);
      (void)connection.client->publish(report_subject_, report.SerializeAsString());
    }
    send_next(connection, slot);
  }

  NodeEnvironment& environment_;
  bool report_;
  std::string route_subject_;
  std::string report_subject_;
  std::vector<std::unique_ptr<ClientConnection>> connections_;
  std::atomic<std::uint64_t> sent_{0};
  std::uint64_t base_sequence_ = 0;
  ClosedLoop loop_;
  std::atomic<Clock::time_point> last_reply_{};
};

void BM_NatsRouteDecisions(benchmark::State& state) {
  NodeEnvironment& environment = NodeEnvironment::get();
  const int connections = static_cast<int>(state.range(0));
  const int outstanding = static_cast<int>(state.range(1));
  const bool report = state.range(2) != 0;
  NatsLoad load{environment, connections, outstanding, report};
  // Warm-up: connections, the node's allocations and the index's hot paths.
  environment.heartbeat();
  (void)load.run(2'000, 5s);
  LoadResult result;
  LatencyPercentiles node_route;
  LatencyPercentiles node_selection;
  LatencyPercentiles forward_hop;
  for (auto _ : state) {
    environment.heartbeat();
    const std::string before = environment.metrics_text();
    result = load.run(60'000, 8s);
    const std::string after = environment.metrics_text();
    state.SetIterationTime(result.seconds);
    node_route = histogram_delta(read_histogram(before, "kvr_route_latency_seconds"),
                                 read_histogram(after, "kvr_route_latency_seconds"));
    node_selection = histogram_delta(read_histogram(before, "kvr_selection_latency_seconds"),
                                     read_histogram(after, "kvr_selection_latency_seconds"));
    forward_hop = histogram_delta(read_histogram(before, "kvr_cluster_forward_latency_seconds"),
                                  read_histogram(after, "kvr_cluster_forward_latency_seconds"));
  }
  const LatencyPercentiles client = percentiles(result.latencies_us);
  if (std::getenv("KVR_BENCH_CLUSTER_NODES") != nullptr) {
    // Cluster mode: from a forwarding node's send to the owner's answer, forwarded requests only.
    state.counters["forward_p50_us"] = forward_hop.p50_us;
    state.counters["forward_p99_us"] = forward_hop.p99_us;
  }
  state.counters["decisions_per_s"] =
      result.seconds > 0 ? static_cast<double>(result.completed) / result.seconds : 0;
  state.counters["in_flight"] = connections * outstanding;
  state.counters["rtt_p50_us"] = client.p50_us;
  state.counters["rtt_p99_us"] = client.p99_us;
  state.counters["node_route_p50_us"] = node_route.p50_us;
  state.counters["node_route_p99_us"] = node_route.p99_us;
  state.counters["node_select_mean_us"] = node_selection.mean_us;
  state.counters["node_select_p99_us"] = node_selection.p99_us;
  state.counters["errors"] = static_cast<double>(result.errors);
  // CPU per decision: robust to other load on the machine, unlike the rate.
  const double completed = std::max<double>(1, static_cast<double>(result.completed));
  state.counters["cpu_us_per_decision"] = result.cpu_seconds * 1e6 / completed;
  state.counters["server_cpu_us_per_decision"] = result.server_cpu_seconds * 1e6 / completed;
}

// Answers every request on `subject` with the same serialised decision, from the callback.
class EchoResponder {
 public:
  EchoResponder(const std::string& url, const std::string& subject) {
    nats::NatsOptions options;
    options.url = url;
    options.name = "kvr-bench-echo";
    auto client = nats::NatsClient::connect(options);
    if (!client) die(client.error());
    client_ = std::move(*client);
    v1::RouteDecision decision;
    auto* success = decision.mutable_success();
    success->set_worker_id(kFirstWorker);
    success->set_booking_id("booking-0123456789abcdef-1");
    success->set_policy("kv-cost");
    success->set_booking_ttl_ms(1000);
    success->set_total_cost(42.5);
    success->set_generate_subject("kvr.bench.worker.1000.generate");
    auto* cost = success->add_costs();
    cost->set_scorer("kv-cost");
    cost->set_cost(42.5);
    decision.set_request_id(std::string(RequestTemplates::kIdWidth, '0'));
    reply_ = decision.SerializeAsString();
    auto subscription = client_->subscribe(subject, [this](nats::NatsMessage message) {
      if (!message.reply.empty()) (void)client_->publish(message.reply, reply_);
    });
    if (!subscription) die(subscription.error());
    subscription_ = std::move(*subscription);
    (void)client_->flush(5s);
  }
  ~EchoResponder() { subscription_.reset(); }

 private:
  std::unique_ptr<nats::NatsClient> client_;
  std::string reply_;
  std::optional<nats::NatsSubscription> subscription_;
};

void BM_NatsEchoFloor(benchmark::State& state) {
  NodeEnvironment& environment = NodeEnvironment::get();
  const int connections = static_cast<int>(state.range(0));
  const int outstanding = static_cast<int>(state.range(1));
  const std::string subject = "kvr-bench.echo";
  EchoResponder responder{environment.url(), subject};
  NatsLoad load{environment, connections, outstanding, false, subject};
  (void)load.run(2'000, 5s);
  LoadResult result;
  for (auto _ : state) {
    result = load.run(60'000, 8s);
    state.SetIterationTime(result.seconds);
  }
  const LatencyPercentiles client = percentiles(result.latencies_us);
  const double completed = std::max<double>(1, static_cast<double>(result.completed));
  state.counters["replies_per_s"] = result.seconds > 0 ? completed / result.seconds : 0;
  state.counters["in_flight"] = connections * outstanding;
  state.counters["rtt_p50_us"] = client.p50_us;
  state.counters["rtt_p99_us"] = client.p99_us;
  state.counters["errors"] = static_cast<double>(result.errors);
  state.counters["cpu_us_per_reply"] = result.cpu_seconds * 1e6 / completed;
  state.counters["server_cpu_us_per_reply"] = result.server_cpu_seconds * 1e6 / completed;
}

BENCHMARK(BM_NatsEchoFloor)
    ->ArgNames({"conns", "per_conn"})
    ->Args({1, 1})
    ->Args({4, 2})
    ->Args({4, 4})
    ->Args({8, 8})
    ->UseManualTime()
    ->Iterations(1)
    ->Unit(benchmark::kMillisecond);

// (connections, requests in flight per connection, report each decision)
BENCHMARK(BM_NatsRouteDecisions)
    ->ArgNames({"conns", "per_conn", "report"})
    ->Args({1, 1, 0})
    ->Args({4, 2, 0})
    ->Args({4, 4, 0})
    ->Args({8, 4, 0})
    ->Args({8, 8, 0})
    ->Args({8, 32, 0})
    ->Args({4, 4, 1})
    ->Args({8, 8, 1})
    ->UseManualTime()
    ->Iterations(1)
    ->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace kvr::bench

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  // The node, its actor system and the nats-server stop before static destruction begins.
  kvr::bench::NodeEnvironment::shutdown();
  benchmark::Shutdown();
  return 0;
}
