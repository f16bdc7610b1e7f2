// Disaggregated generate mode through one router node (docs/disaggregation.md): C connections
// keep W generate requests each in flight (closed loop) for a model served by 8 prefill and 8
// decode workers; the node routes each to a prefill worker with one output token and the remote
// decode transfer request, takes the transfer parameters of that worker's answer, routes a decode
// worker and relays its T chunks to the client. The fleet answers from one connection, at once.
// Counters: streams/s, the client's time from request to final chunk, the node's handoff (the
// prefill's answer to the decode dispatch, kvr_decode_handoff_seconds, interpolated within its
// buckets), prefill hop and selection times, CPU per stream (this process: node, clients and
// fleet; and nats-server); then the same load against 16 aggregated workers of another model
// (agg_*): the cost of the second hop by difference. `wrong_hops` counts requests that reached a
// worker of the wrong role or without the expected transfer parameters. Bounded by a request
// count and a duration.
#include <atomic>
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <optional>
#include <sstream>

#include <benchmark/benchmark.h>
#include <fmt/format.h>

#include "kvr/v1/routing.pb.h"
#include "messages/subjects.hpp"
#include "tests/bench/node/node_bench_environment.hpp"
#include "tests/testing/child_process.hpp"

namespace kvr::bench {
namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

constexpr std::string_view kNamespace = "bench";
/// The disaggregated model: prefill workers kFirstPrefillWorker.., then decode workers.
constexpr std::string_view kPdModel = "bench-pd-model";
constexpr std::size_t kPrefillWorkers = 8;
constexpr std::size_t kDecodeWorkers = 8;
constexpr WorkerId kFirstPrefillWorker = 2000;
constexpr WorkerId kFirstDecodeWorker = kFirstPrefillWorker + kPrefillWorkers;
/// The aggregated model the same load runs against for comparison: as many workers, one hop.
constexpr std::string_view kAggModel = "bench-pd-baseline-model";
constexpr std::size_t kAggWorkers = kPrefillWorkers + kDecodeWorkers;
constexpr WorkerId kFirstAggWorker = 3000;
/// What the node asks of a prefill worker; the answer holds "do_remote_decode":false.
constexpr std::string_view kRemoteDecodeRequest = R"("do_remote_decode":true)";

[[noreturn]] void die(const std::string& message) {
  std::fprintf(stderr, "kvr_node_bench: %s\n", message.c_str());
  std::abort();
}

std::atomic<std::uint64_t> g_next_pd_sequence{2ULL << 40};  // apart from the other runs

void append_varint(std::string& out, std::uint64_t value) {
  for (; value >= 0x80; value >>= 7) out += static_cast<char>((value & 0x7f) | 0x80);
  out += static_cast<char>(value);
}

bool is_prefill(WorkerId worker) {
  return worker >= kFirstPrefillWorker && worker < kFirstDecodeWorker;
}
bool is_decode(WorkerId worker) {
  return worker >= kFirstDecodeWorker && worker < kFirstDecodeWorker + kDecodeWorkers;
}
bool is_agg(WorkerId worker) {
  return worker >= kFirstAggWorker && worker < kFirstAggWorker + kAggWorkers;
}

// The registrations of this file's workers: the environment's worker 0 with another id, model
// and role.
std::vector<v1::WorkerRegistration> registrations(const Workload& workload) {
  std::vector<v1::WorkerRegistration> all;
  const auto add = [&](WorkerId id, std::string_view model, v1::WorkerRole role) {
    discovery::WorkerRegistration registration = workload.registration(0);
    registration.worker_id = id;
    registration.model = std::string{model};
    registration.generate_subject = subjects::worker_generate(kNamespace, id);
    registration.dump_subject = subjects::worker_dump(kNamespace, id);
    v1::WorkerRegistration wire = to_wire(registration);
    wire.set_role(role);
    all.push_back(std::move(wire));
  };
  for (std::size_t w = 0; w < kPrefillWorkers; ++w) {
    add(kFirstPrefillWorker + w, kPdModel, v1::WORKER_ROLE_PREFILL);
  }
  for (std::size_t w = 0; w < kDecodeWorkers; ++w) {
    add(kFirstDecodeWorker + w, kPdModel, v1::WORKER_ROLE_DECODE);
  }
  for (std::size_t w = 0; w < kAggWorkers; ++w) {
    add(kFirstAggWorker + w, kAggModel, v1::WORKER_ROLE_AGGREGATED);
  }
  return all;
}

// The sum of a gauge's series with exactly `labels` over the (joined) Prometheus pages.
double gauge_value(std::string_view text, std::string_view name, std::string_view labels) {
  const std::string prefix = fmt::format("{}{{{}}} ", name, labels);
  std::istringstream lines{std::string{text}};
  std::string line;
  double sum = 0;
  while (std::getline(lines, line)) {
    if (line.rfind(prefix, 0) == 0) sum += std::stod(line.substr(prefix.size()));
  }
  return sum;
}

// Histogram `name`'s series labelled only `label` (`model="m"`), as read_histogram reads an
// unlabelled one.
HistogramSnapshot read_labelled_histogram(std::string_view text, std::string_view name,
                                          std::string_view label) {
  std::istringstream lines{std::string{text}};
  std::string line;
  std::string unlabelled;
  const std::string alone = fmt::format("{{{}}}", label);  // _sum and _count
  const std::string first = fmt::format("{{{},", label);   // _bucket{label,le="..."}
  while (std::getline(lines, line)) {
    if (line.rfind(name, 0) != 0) continue;
    if (auto at = line.find(alone); at != std::string::npos) {
      line.erase(at, alone.size());
    } else if (auto at_first = line.find(first); at_first != std::string::npos) {
      line.erase(at_first + 1, first.size() - 1);  // keeps the brace
    } else {
      continue;
    }
    unlabelled += line;
    unlabelled += '\n';
  }
  return read_histogram(unlabelled, name);
}

// Registers this file's workers once per process and waits until the node knows them.
void register_fleet(NodeEnvironment& environment, nats::NatsClient& client) {
  static bool registered = false;
  if (registered) return;
  const auto all = registrations(environment.workload());
  for (const auto& registration : all) {
    (void)client.publish(subjects::worker_register(kNamespace), registration.SerializeAsString());
  }
  (void)client.flush(5s);
  const std::string pd_partition = fmt::format("partition=\"{}/default\"", kPdModel);
  const std::string agg_partition = fmt::format("partition=\"{}/default\"", kAggModel);
  const bool known = testing::wait_until(
      [&] {
        const std::string text = environment.metrics_text();
        return gauge_value(text, "kvr_workers", pd_partition) ==
                   static_cast<double>(kPrefillWorkers + kDecodeWorkers) &&
               gauge_value(text, "kvr_workers", agg_partition) == static_cast<double>(kAggWorkers);
      },
      20s);
  if (!known) {
    die("the node did not register the disaggregated fleet:\n" + environment.metrics_text());
  }
  // The node refuses load reports of workers it does not know: registrations first.
  for (const auto& registration : all) {
    v1::LoadMetrics load;
    load.set_worker_id(registration.worker_id());
    load.set_incarnation(registration.incarnation());
    load.add_ranks()->set_dp_rank(0);
    const std::string partition =
        registration.model() + "/" +
        (registration.routing_group().empty() ? std::string{"default"}
                                              : registration.routing_group());
    (void)client.publish(subjects::partition_load(kNamespace, partition, registration.worker_id()),
                         load.SerializeAsString());
  }
  (void)client.flush(5s);
  registered = true;
}

// This file's workers' generate side, on one connection: a prefill request (its transfer
// parameters ask for a remote decode) is answered with one finished token and the parameters a
// decode worker pulls with; any other request with `tokens` chunks at once. Requests that reach
// the wrong role, or a decode request without a prefill's parameters, are counted.
class DisaggregatedFleet {
 public:
  DisaggregatedFleet(NodeEnvironment& environment, std::uint32_t tokens) : tokens_(tokens) {
    nats::NatsOptions options;
    options.url = environment.url();
    options.name = "kvr-bench-pd-fleet";
    options.deferred_publish = true;
    auto client = nats::NatsClient::connect(options);
    if (!client) die(client.error());
    client_ = std::move(*client);
    register_fleet(environment, *client_);
    // kvr.<ns>.worker.<id>.generate; its ".cancel" has one token more and does not match.
    std::string pattern = subjects::worker_generate(kNamespace, 0);
    pattern.replace(pattern.rfind(".0."), 3, ".*.");
    auto subscription =
        client_->subscribe(pattern, [this](nats::NatsMessage message) { answer(message); });
    if (!subscription) die(subscription.error());
    subscription_ = std::move(*subscription);
    (void)client_->flush(5s);
  }
  ~DisaggregatedFleet() { subscription_.reset(); }

  /// Renews every worker's liveness; call before a measured run.
  void heartbeat() {
    const auto renew = [&](WorkerId first, std::size_t count) {
      for (std::size_t w = 0; w < count; ++w) {
        v1::WorkerHeartbeat heartbeat;
        heartbeat.set_worker_id(first + w);
        heartbeat.set_incarnation(1);
        (void)client_->publish(subjects::worker_heartbeat(kNamespace),
                               heartbeat.SerializeAsString());
      }
    };
    renew(kFirstPrefillWorker, kPrefillWorkers + kDecodeWorkers);
    renew(kFirstAggWorker, kAggWorkers);
    (void)client_->flush(5s);
  }

  /// Requests that reached a worker of the wrong role or without the expected parameters.
  std::size_t mismatches() const { return mismatches_.load(); }
  std::size_t prefill_requests() const { return prefill_requests_.load(); }

 private:
  void answer(const nats::NatsMessage& message) {
    // kvr.<ns>.worker.<id>.generate
    const std::size_t start = message.subject.find(".worker.") + 8;
    WorkerId worker = 0;
    std::from_chars(message.subject.data() + start, message.subject.data() + message.subject.size(),
                    worker);
    if (!is_prefill(worker) && !is_decode(worker) && !is_agg(worker)) return;  // not ours
    v1::GenerateRequest request;
    if (!request.ParseFromString(message.data)) {
      mismatches_.fetch_add(1);
      return;
    }
    v1::GenerateChunk chunk;
    chunk.set_request_id(request.route().request_id());
    chunk.set_worker_id(worker);
    chunk.set_dp_rank(request.dp_rank());
    const std::string& params = request.kv_transfer_params();
    if (params.find(kRemoteDecodeRequest) != std::string::npos) {
      prefill_requests_.fetch_add(1);
      if (!is_prefill(worker) || request.max_output_tokens() != 1) mismatches_.fetch_add(1);
      // vLLM's answer: where the KV is, one block id per prompt block.
      std::string answer =
          R"({"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[)";
      const int blocks = request.route().block_hashes().hashes_size();
      for (int b = 0; b < blocks; ++b) {
        if (b > 0) answer += ',';
        answer += std::to_string(b + 1);
      }
      answer +=
          fmt::format(R"(],"remote_engine_id":"w{}","remote_host":"127.0.0.1","remote_port":5600,)"
                      R"("tp_size":1}})",
                      worker);
      chunk.set_index(0);
      chunk.add_token_ids(0);
      chunk.set_finished(true);
      chunk.set_finish_reason("length");
      chunk.set_kv_transfer_params(std::move(answer));
      (void)client_->publish_deferred(request.stream_subject(), chunk.SerializeAsString());
      client_->flush_deferred();
      return;
    }
    // A decode hop carries a prefill worker's answer; an aggregated request carries nothing.
    const bool expected = is_decode(worker)
                              ? params.find(R"("do_remote_prefill":true)") != std::string::npos
                              : is_agg(worker) && params.empty();
    if (!expected) mismatches_.fetch_add(1);
    for (std::uint32_t i = 0; i < tokens_; ++i) {
      chunk.set_index(i);
      chunk.clear_token_ids();
      chunk.add_token_ids(i);
      if (i + 1 == tokens_) {
        chunk.set_finished(true);
        chunk.set_finish_reason("length");
      }
      (void)client_->publish_deferred(request.stream_subject(), chunk.SerializeAsString());
    }
    client_->flush_deferred();
  }

  std::uint32_t tokens_;
  std::atomic<std::size_t> mismatches_{0};
  std::atomic<std::size_t> prefill_requests_{0};
  std::unique_ptr<nats::NatsClient> client_;
  std::optional<nats::NatsSubscription> subscription_;
};

// Serialised route requests of the Workload's pool for `model`, with ids patched in place as
// RequestTemplates does (the id is the first field, serialised at a fixed width).
class ModelRequestTemplates {
 public:
  static constexpr std::size_t kIdWidth = 16;
  ModelRequestTemplates(const Workload& workload, std::string_view model) {
    const std::string placeholder(kIdWidth, '0');
    templates_.reserve(workload.pool_size());
    for (std::size_t i = 0; i < workload.pool_size(); ++i) {
      v1::RouteRequest request = workload.route_request(i, placeholder);
      request.set_model(std::string{model});
      templates_.push_back(request.SerializeAsString());
    }
  }
  void render(std::uint64_t sequence, std::string& out) const {
    out = templates_[sequence % templates_.size()];
    out.replace(2, kIdWidth, fmt::format("{:016x}", sequence));
  }

 private:
  std::vector<std::string> templates_;
};

struct PdConnection {
  std::unique_ptr<nats::NatsClient> client;
  std::vector<std::string> stream_subjects;  // <inbox>.s<slot>
  std::vector<std::string> reply_subjects;   // <inbox>.d<slot>: the first RouteDecision
  std::vector<Clock::time_point> sent;
  std::vector<std::string> buffers;  // per slot: the delivery thread sends while others do
  std::mutex mutex;                  // guards what follows
  std::vector<double> stream_us;
  std::size_t errors = 0;
  std::size_t misrouted = 0;  // streams whose chunks came from a worker of the wrong kind
  std::string first_error;
  std::optional<nats::NatsSubscription> subscription;
};

struct PdResult {
  double seconds = 0;
  double cpu_seconds = 0;
  double server_cpu_seconds = 0;
  std::size_t streams = 0;
  std::size_t errors = 0;
  std::size_t misrouted = 0;
  std::string first_error;
  std::vector<double> stream_us;
};

// StreamLoad's closed loop, for a model of this file: a slot's final chunk sends its next request
// from the delivery thread. `streams_from` says which workers may stream to the client.
class PdStreamLoad {
 public:
  PdStreamLoad(NodeEnvironment& environment, std::string_view model, bool (*streams_from)(WorkerId),
               int connections, int outstanding, std::uint32_t tokens)
      : environment_(environment),
        templates_(environment.workload(), model),
        streams_from_(streams_from),
        tokens_(tokens) {
    for (int c = 0; c < connections; ++c) {
      nats::NatsOptions options;
      options.url = environment.url();
      options.name = "kvr-bench-pd-client";
      auto client = nats::NatsClient::connect(options);
      if (!client) die(client.error());
      auto connection = std::make_unique<PdConnection>();
      connection->client = std::move(*client);
      const std::string inbox = connection->client->new_inbox();
      for (int s = 0; s < outstanding; ++s) {
        connection->stream_subjects.push_back(inbox + ".s" + std::to_string(s));
        connection->reply_subjects.push_back(inbox + ".d" + std::to_string(s));
      }
      connection->sent.resize(static_cast<std::size_t>(outstanding));
      connection->buffers.resize(static_cast<std::size_t>(outstanding));
      PdConnection* raw = connection.get();
      auto subscription = connection->client->subscribe(
          inbox + ".*", [this, raw](nats::NatsMessage message) { on_message(*raw, message); });
      if (!subscription) die(subscription.error());
      connection->subscription = std::move(*subscription);
      (void)connection->client->flush(5s);
      connections_.push_back(std::move(connection));
    }
  }

  ~PdStreamLoad() {
    for (auto& connection : connections_) connection->subscription.reset();
  }

  PdResult run(std::size_t requests, std::chrono::milliseconds max_duration) {
    base_sequence_ = g_next_pd_sequence.fetch_add(requests + 1024);
    std::size_t slots = 0;
    for (auto& connection : connections_) {
      std::lock_guard lock{connection->mutex};
      connection->stream_us.clear();
      connection->errors = 0;
      connection->misrouted = 0;
      connection->first_error.clear();
      slots += connection->stream_subjects.size();
    }
    loop_.begin(requests, slots, max_duration);
    const double cpu_before = process_cpu_seconds();
    const double server_cpu_before = process_cpu_seconds(environment_.server_pid());
    const Clock::time_point start = Clock::now();
    for (auto& connection : connections_) {
      for (std::size_t s = 0; s < connection->stream_subjects.size(); ++s) {
        send_next(*connection, s);
      }
    }
    const std::size_t unfinished = loop_.wait(5s);
    PdResult result;
    result.cpu_seconds = process_cpu_seconds() - cpu_before;
    result.server_cpu_seconds = process_cpu_seconds(environment_.server_pid()) - server_cpu_before;
    result.seconds =
        std::max(0.0, std::chrono::duration<double>(last_final_.load() - start).count());
    for (auto& connection : connections_) {
      std::lock_guard lock{connection->mutex};
      result.streams += connection->stream_us.size();
      result.errors += connection->errors;
      result.misrouted += connection->misrouted;
      if (result.first_error.empty()) result.first_error = connection->first_error;
      result.stream_us.insert(result.stream_us.end(), connection->stream_us.begin(),
                              connection->stream_us.end());
    }
    result.errors += unfinished;  // streams that never ended
    if (unfinished > 0 && result.first_error.empty()) {
      result.first_error = fmt::format("{} streams never ended", unfinished);
    }
    return result;
  }

 private:
  void send_next(PdConnection& connection, std::size_t slot) {
    const std::optional<std::uint64_t> n = loop_.next_request();
    if (!n) return;
    v1::GenerateRequest head;
    head.set_max_output_tokens(tokens_);
    head.set_stream_subject(connection.stream_subjects[slot]);
    std::string route;
    templates_.render(base_sequence_ + *n, route);
    std::string& buffer = connection.buffers[slot];
    buffer = head.SerializeAsString();
    buffer += '\x0a';  // field 1 (route), length-delimited
    append_varint(buffer, route.size());
    buffer += route;
    connection.sent[slot] = Clock::now();
    if (connection.client->publish_request(generate_subject_, connection.reply_subjects[slot],
                                           buffer)) {
      return;
    }
    {
      std::lock_guard lock{connection.mutex};
      ++connection.errors;
    }
    loop_.finish_slot();
  }

  static void note_error(PdConnection& connection, std::string what) {
    ++connection.errors;
    if (connection.first_error.empty()) connection.first_error = std::move(what);
  }

  void on_message(PdConnection& connection, const nats::NatsMessage& message) {
    const std::size_t dot = message.subject.rfind('.');
    if (dot + 1 >= message.subject.size()) return;
    const char kind = message.subject[dot + 1];
    std::size_t slot = 0;
    std::from_chars(message.subject.data() + dot + 2,
                    message.subject.data() + message.subject.size(), slot);
    if (slot >= connection.sent.size()) return;
    if (kind == 'd') {
      v1::RouteDecision decision;
      if (!decision.ParseFromString(message.data) || !decision.has_success()) {
        std::lock_guard lock{connection.mutex};
        note_error(connection, "decision: " + decision.error().message());
      }
      return;  // an error decision is followed by an error chunk that ends the stream
    }
    v1::GenerateChunk chunk;
    const bool parsed = chunk.ParseFromString(message.data);
    if (parsed && !chunk.finished()) return;
    const Clock::time_point now = Clock::now();
    {
      std::lock_guard lock{connection.mutex};
      if (!parsed || chunk.finish_reason() != "length") {
        note_error(connection, fmt::format("final chunk: {} {}", chunk.finish_reason(),
                                           chunk.error().message()));
      } else if (!streams_from_(chunk.worker_id())) {
        ++connection.misrouted;
      }
      connection.stream_us.push_back(
          std::chrono::duration<double, std::micro>(now - connection.sent[slot]).count());
    }
    last_final_.store(now);
    send_next(connection, slot);
  }

  NodeEnvironment& environment_;
  ModelRequestTemplates templates_;
  bool (*streams_from_)(WorkerId);
  std::uint32_t tokens_;
  std::vector<std::unique_ptr<PdConnection>> connections_;
  const std::string generate_subject_ = subjects::router_generate(kNamespace);
  std::uint64_t base_sequence_ = 0;
  ClosedLoop loop_;
  std::atomic<Clock::time_point> last_final_{};
};

void BM_NatsDisaggregatedGenerateStreams(benchmark::State& state) {
  NodeEnvironment& environment = NodeEnvironment::get();
  const int connections = static_cast<int>(state.range(0));
  const int outstanding = static_cast<int>(state.range(1));
  const auto tokens = static_cast<std::uint32_t>(state.range(2));
  DisaggregatedFleet fleet{environment, tokens};
  PdStreamLoad load{environment, kPdModel, is_decode, connections, outstanding, tokens};
  PdStreamLoad baseline{environment, kAggModel, is_agg, connections, outstanding, tokens};
  const auto renew = [&] {
    environment.heartbeat();
    fleet.heartbeat();
  };
  renew();
  (void)load.run(500, 5s);  // warm-up
  (void)baseline.run(500, 5s);
  const std::string model_label = fmt::format("model=\"{}\"", kPdModel);
  PdResult result;
  LatencyPercentiles handoff;
  LatencyPercentiles prefill_hop;
  LatencyPercentiles selection;
  double handoffs = 0;
  const std::size_t mismatches_before = fleet.mismatches();
  const std::size_t prefills_before = fleet.prefill_requests();
  for (auto _ : state) {
    renew();
    const std::string before = environment.metrics_text();
    result = load.run(10'000, 8s);
    const std::string after = environment.metrics_text();
    state.SetIterationTime(result.seconds);
    const HistogramSnapshot handoff_before = read_histogram(before, "kvr_decode_handoff_seconds");
    const HistogramSnapshot handoff_after = read_histogram(after, "kvr_decode_handoff_seconds");
    handoff = histogram_delta(handoff_before, handoff_after);
    handoffs = handoff_after.count - handoff_before.count;
    prefill_hop =
        histogram_delta(read_labelled_histogram(before, "kvr_prefill_hop_seconds", model_label),
                        read_labelled_histogram(after, "kvr_prefill_hop_seconds", model_label));
    selection = histogram_delta(read_histogram(before, "kvr_selection_latency_seconds"),
                                read_histogram(after, "kvr_selection_latency_seconds"));
  }
  const std::size_t prefills = fleet.prefill_requests() - prefills_before;
  // The same clients, prompts and fleet against aggregated workers: one hop.
  renew();
  const PdResult aggregated = baseline.run(10'000, 8s);
  const std::size_t mismatches = fleet.mismatches() - mismatches_before;

  if (!result.first_error.empty() || !aggregated.first_error.empty()) {
    std::fprintf(stderr,
                 "kvr_node_bench: disaggregated: %zu errors (first: %s); aggregated: %zu "
                 "(first: %s)\n",
                 result.errors, result.first_error.c_str(), aggregated.errors,
                 aggregated.first_error.c_str());
  }
  const LatencyPercentiles stream = percentiles(result.stream_us);
  const LatencyPercentiles agg_stream = percentiles(aggregated.stream_us);
  const double seconds = std::max(result.seconds, 1e-9);
  const double streams = std::max<double>(1, static_cast<double>(result.streams));
  const double agg_streams = std::max<double>(1, static_cast<double>(aggregated.streams));
  state.counters["streams_per_s"] = static_cast<double>(result.streams) / seconds;
  state.counters["stream_p50_us"] = stream.p50_us;
  state.counters["stream_p99_us"] = stream.p99_us;
  state.counters["errors"] = static_cast<double>(result.errors);
  // Requests the fleet saw at the wrong role or without the expected transfer parameters (both
  // runs), and disaggregated streams not streamed by a decode worker.
  state.counters["wrong_hops"] = static_cast<double>(result.misrouted + mismatches);
  state.counters["handoffs"] = handoffs;
  state.counters["prefills"] = static_cast<double>(prefills);
  state.counters["handoff_p50_us"] = handoff.p50_us;
  state.counters["handoff_p99_us"] = handoff.p99_us;
  state.counters["handoff_mean_us"] = handoff.mean_us;
  // The prefill hop's buckets start at 5 ms: only its mean (sum over count) says anything here.
  state.counters["prefill_hop_mean_us"] = prefill_hop.mean_us;
  // Every selection of the run (the plan with the prefill booking, then the decode booking):
  // what of the handoff the selector itself spends.
  state.counters["selection_p50_us"] = selection.p50_us;
  state.counters["selection_mean_us"] = selection.mean_us;
  state.counters["cpu_us_per_stream"] = result.cpu_seconds * 1e6 / streams;
  state.counters["server_cpu_us_per_stream"] = result.server_cpu_seconds * 1e6 / streams;
  state.counters["agg_streams_per_s"] =
      static_cast<double>(aggregated.streams) / std::max(aggregated.seconds, 1e-9);
  state.counters["agg_stream_p50_us"] = agg_stream.p50_us;
  state.counters["agg_stream_p99_us"] = agg_stream.p99_us;
  state.counters["agg_errors"] = static_cast<double>(aggregated.errors + aggregated.misrouted);
  state.counters["agg_cpu_us_per_stream"] = aggregated.cpu_seconds * 1e6 / agg_streams;
}

// (connections, requests in flight per connection, chunks per decode stream)
BENCHMARK(BM_NatsDisaggregatedGenerateStreams)
    ->ArgNames({"conns", "per_conn", "tokens"})
    ->Args({1, 1, 16})
    ->Args({4, 4, 16})
    ->Args({8, 8, 16})
    ->UseManualTime()
    ->Iterations(1)
    ->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace kvr::bench
