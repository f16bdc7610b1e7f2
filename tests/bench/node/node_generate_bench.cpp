// Generate (proxy) mode through one router node: C connections keep W generate requests each in
// flight (closed loop); the node routes each, dispatches it to the chosen worker and relays the
// worker's chunks to the client's stream subject. The fleet's 64 workers answer from one
// connection: every dispatched request at once with T chunks, written together, as an engine's
// step emits a chunk for each sequence it runs. Counters: streams/s, relayed chunks/s, the
// client's time from request to final chunk, CPU per relayed chunk (this process: node, clients
// and fleet; and nats-server). Bounded by a request count and a duration.
#include <atomic>
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <optional>

#include <benchmark/benchmark.h>

#include "kvr/v1/routing.pb.h"
#include "messages/subjects.hpp"
#include "tests/bench/node/node_bench_environment.hpp"

namespace kvr::bench {
namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

[[noreturn]] void die(const std::string& message) {
  std::fprintf(stderr, "kvr_node_bench: %s\n", message.c_str());
  std::abort();
}

std::atomic<std::uint64_t> g_next_stream_sequence{1ULL << 40};  // apart from the route runs

// Protobuf's base-128 varint.
void append_varint(std::string& out, std::uint64_t value) {
  for (; value >= 0x80; value >>= 7) out += static_cast<char>((value & 0x7f) | 0x80);
  out += static_cast<char>(value);
}

// The fleet's generate side: answers every dispatched request with `tokens` chunks at once.
class ChunkingFleet {
 public:
  ChunkingFleet(const std::string& url, std::uint32_t tokens) : tokens_(tokens) {
    nats::NatsOptions options;
    options.url = url;
    options.name = "kvr-bench-generate-fleet";
    options.deferred_publish = true;
    auto client = nats::NatsClient::connect(options);
    if (!client) die(client.error());
    client_ = std::move(*client);
    // kvr.<ns>.worker.<id>.generate; its ".cancel" has one token more and does not match.
    std::string pattern = subjects::worker_generate("bench", 0);
    pattern.replace(pattern.rfind(".0."), 3, ".*.");
    auto subscription =
        client_->subscribe(pattern, [this](nats::NatsMessage message) { answer(message); });
    if (!subscription) die(subscription.error());
    subscription_ = std::move(*subscription);
    (void)client_->flush(5s);
  }
  ~ChunkingFleet() { subscription_.reset(); }

 private:
  void answer(const nats::NatsMessage& message) {
    v1::GenerateRequest request;
    if (!request.ParseFromString(message.data)) return;
    // kvr.<ns>.worker.<id>.generate
    const std::size_t start = message.subject.find(".worker.") + 8;
    WorkerId worker = 0;
    std::from_chars(message.subject.data() + start, message.subject.data() + message.subject.size(),
                    worker);
    v1::GenerateChunk chunk;
    chunk.set_request_id(request.route().request_id());
    chunk.set_worker_id(worker);
    chunk.set_dp_rank(request.dp_rank());
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
  std::unique_ptr<nats::NatsClient> client_;
  std::optional<nats::NatsSubscription> subscription_;
};

struct StreamConnection {
  std::unique_ptr<nats::NatsClient> client;
  std::string inbox;
  std::vector<std::string> stream_subjects;  // <inbox>.s<slot>
  std::vector<std::string> reply_subjects;   // <inbox>.d<slot>: the first RouteDecision
  std::vector<Clock::time_point> sent;
  std::vector<std::string> buffers;  // per slot: the delivery thread sends while others do
  std::mutex mutex;                  // guards what follows
  std::vector<double> stream_us;
  std::size_t chunks = 0;
  std::size_t errors = 0;
  std::optional<nats::NatsSubscription> subscription;
};

struct StreamResult {
  double seconds = 0;
  double cpu_seconds = 0;
  double server_cpu_seconds = 0;
  std::size_t streams = 0;
  std::size_t chunks = 0;
  std::size_t errors = 0;
  std::vector<double> stream_us;
};

// A closed loop: a slot's final chunk sends its next request from the delivery thread.
class StreamLoad {
 public:
  StreamLoad(NodeEnvironment& environment, int connections, int outstanding, std::uint32_t tokens)
      : environment_(environment), tokens_(tokens) {
    for (int c = 0; c < connections; ++c) {
      nats::NatsOptions options;
      options.url = environment.url();
      options.name = "kvr-bench-generate-client";
      auto client = nats::NatsClient::connect(options);
      if (!client) die(client.error());
      auto connection = std::make_unique<StreamConnection>();
      connection->client = std::move(*client);
      connection->inbox = connection->client->new_inbox();
      for (int s = 0; s < outstanding; ++s) {
        connection->stream_subjects.push_back(connection->inbox + ".s" + std::to_string(s));
        connection->reply_subjects.push_back(connection->inbox + ".d" + std::to_string(s));
      }
      connection->sent.resize(static_cast<std::size_t>(outstanding));
      connection->buffers.resize(static_cast<std::size_t>(outstanding));
      StreamConnection* raw = connection.get();
      auto subscription = connection->client->subscribe(
          connection->inbox + ".*",
          [this, raw](nats::NatsMessage message) { on_message(*raw, message); });
      if (!subscription) die(subscription.error());
      connection->subscription = std::move(*subscription);
      (void)connection->client->flush(5s);
      connections_.push_back(std::move(connection));
    }
  }

  ~StreamLoad() {
    for (auto& connection : connections_) connection->subscription.reset();
  }

  StreamResult run(std::size_t requests, std::chrono::milliseconds max_duration) {
    base_sequence_ = g_next_stream_sequence.fetch_add(requests + 1024);
    std::size_t slots = 0;
    for (auto& connection : connections_) {
      std::lock_guard lock{connection->mutex};
      connection->stream_us.clear();
      connection->chunks = 0;
      connection->errors = 0;
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
    StreamResult result;
    result.cpu_seconds = process_cpu_seconds() - cpu_before;
    result.server_cpu_seconds = process_cpu_seconds(environment_.server_pid()) - server_cpu_before;
    result.seconds =
        std::max(0.0, std::chrono::duration<double>(last_final_.load() - start).count());
    for (auto& connection : connections_) {
      std::lock_guard lock{connection->mutex};
      result.streams += connection->stream_us.size();
      result.chunks += connection->chunks;
      result.errors += connection->errors;
      result.stream_us.insert(result.stream_us.end(), connection->stream_us.begin(),
                              connection->stream_us.end());
    }
    result.errors += unfinished;  // streams that never ended
    return result;
  }

 private:
  void send_next(StreamConnection& connection, std::size_t slot) {
    const std::optional<std::uint64_t> n = loop_.next_request();
    if (!n) return;  // the run is complete or out of time
    // A GenerateRequest: its own fields, then the route request as field 1 (protobuf merges
    // fields in any order), so the route template's patched bytes are used as they are.
    v1::GenerateRequest head;
    head.set_max_output_tokens(tokens_);
    head.set_stream_subject(connection.stream_subjects[slot]);
    std::string route;
    environment_.templates().render(base_sequence_ + *n, route);
    std::string& buffer = connection.buffers[slot];
    buffer = head.SerializeAsString();
    buffer += '\x0a';  // field 1, length-delimited
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

  void on_message(StreamConnection& connection, const nats::NatsMessage& message) {
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
        ++connection.errors;
      }
      return;  // an error decision is followed by an error chunk that ends the stream
    }
    v1::GenerateChunk chunk;
    const bool parsed = chunk.ParseFromString(message.data);
    if (parsed && !chunk.finished()) {
      std::lock_guard lock{connection.mutex};
      ++connection.chunks;
      return;
    }
    const Clock::time_point now = Clock::now();
    {
      std::lock_guard lock{connection.mutex};
      ++connection.chunks;
      if (!parsed || chunk.finish_reason() != "length") ++connection.errors;
      connection.stream_us.push_back(
          std::chrono::duration<double, std::micro>(now - connection.sent[slot]).count());
    }
    last_final_.store(now);
    send_next(connection, slot);
  }

  NodeEnvironment& environment_;
  std::uint32_t tokens_;
  std::vector<std::unique_ptr<StreamConnection>> connections_;
  const std::string generate_subject_ = subjects::router_generate("bench");
  std::uint64_t base_sequence_ = 0;
  ClosedLoop loop_;
  std::atomic<Clock::time_point> last_final_{};
};

void BM_NatsGenerateStreams(benchmark::State& state) {
  NodeEnvironment& environment = NodeEnvironment::get();
  const int connections = static_cast<int>(state.range(0));
  const int outstanding = static_cast<int>(state.range(1));
  const auto tokens = static_cast<std::uint32_t>(state.range(2));
  ChunkingFleet fleet{environment.url(), tokens};
  StreamLoad load{environment, connections, outstanding, tokens};
  environment.heartbeat();
  (void)load.run(500, 5s);  // warm-up
  StreamResult result;
  for (auto _ : state) {
    environment.heartbeat();
    result = load.run(10'000, 8s);
    state.SetIterationTime(result.seconds);
  }
  const LatencyPercentiles stream = percentiles(result.stream_us);
  const double seconds = std::max(result.seconds, 1e-9);
  const double chunks = std::max<double>(1, static_cast<double>(result.chunks));
  state.counters["streams_per_s"] = static_cast<double>(result.streams) / seconds;
  state.counters["chunks_per_s"] = static_cast<double>(result.chunks) / seconds;
  state.counters["stream_p50_us"] = stream.p50_us;
  state.counters["stream_p99_us"] = stream.p99_us;
  state.counters["errors"] = static_cast<double>(result.errors);
  state.counters["cpu_us_per_chunk"] = result.cpu_seconds * 1e6 / chunks;
  state.counters["server_cpu_us_per_chunk"] = result.server_cpu_seconds * 1e6 / chunks;
}

// (connections, requests in flight per connection, chunks per request)
BENCHMARK(BM_NatsGenerateStreams)
    ->ArgNames({"conns", "per_conn", "tokens"})
    ->Args({4, 4, 16})
    ->Args({8, 8, 16})
    ->Args({8, 8, 64})
    ->UseManualTime()
    ->Iterations(1)
    ->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace kvr::bench
