// The delay `kvr bridge` adds between an engine's ZMQ KV event message and its kvr KvEventBatch on
// NATS, at a paced rate. A ZMQ PUB socket sends vLLM-format batches (array-like msgpack, one
// BlockStored of `blocks` new blocks each) on a fixed schedule; a real EngineBridge (with an HTTP
// stand-in for the engine's /health, /v1/models and /metrics) subscribes, translates and
// publishes to a real nats-server on loopback; a NATS subscriber in this process takes the time
// of each batch's arrival. The delay of batch i is its arrival minus the time just before its
// send() (both on this process's steady clock), so it includes ZMQ, the bridge's subscriber
// thread, run loop, translation and publish, and the NATS hop to the subscriber: an upper bound
// of the bridge's own share. Needs nats-server on PATH. Prints one Markdown table.
//
//   kvr_bridge_latency_bench [--seconds S]   (default 10 s per row)
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include <httplib.h>
#include <msgpack.hpp>
#include <zmq.hpp>
#include <zmq_addon.hpp>

#include "deploy/bridge/engine_bridge.hpp"
#include "deploy/worker/vllm_kv_frames.hpp"
#include "messages/subjects.hpp"
#include "tests/testing/nats_server.hpp"

namespace kvr::bridge {
namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

constexpr std::uint32_t kBlockSize = 16;
constexpr WorkerId kWorker = 77;
constexpr std::string_view kNamespace = "bridge-bench";

// [ts, [["BlockStored", hashes, nil, tokens, 16, nil, "GPU"]], 0] with `blocks` blocks that no
// other batch has (engine hashes from `first_hash`, tokens from `first_token`).
std::string stored_payload(std::uint32_t blocks, std::uint64_t first_hash,
                           std::uint32_t first_token) {
  msgpack::sbuffer buffer;
  msgpack::packer<msgpack::sbuffer> packer{buffer};
  packer.pack_array(3);
  packer.pack_double(1.0);
  packer.pack_array(1);
  packer.pack_array(7);
  packer.pack(std::string{"BlockStored"});
  packer.pack_array(blocks);
  for (std::uint32_t i = 0; i < blocks; ++i) packer.pack_uint64(first_hash + i);
  packer.pack_nil();
  packer.pack_array(blocks * kBlockSize);
  for (std::uint32_t i = 0; i < blocks * kBlockSize; ++i) packer.pack_uint32(first_token + i);
  packer.pack_uint32(kBlockSize);
  packer.pack_nil();
  packer.pack(std::string{"GPU"});
  packer.pack_uint32(0);
  return {buffer.data(), buffer.size()};
}

// The engine's HTTP side, as much of it as registration needs.
class EngineStandIn {
 public:
  EngineStandIn() {
    server_.Get("/health", [](const httplib::Request&, httplib::Response& r) { r.status = 200; });
    server_.Get("/v1/models", [](const httplib::Request&, httplib::Response& r) {
      r.set_content(R"({"object":"list","data":[{"id":"bench-model","object":"model"}]})",
                    "application/json");
    });
    server_.Get("/metrics", [](const httplib::Request&, httplib::Response& r) {
      r.set_content(
          "vllm:num_requests_running{engine=\"0\"} 0.0\n"
          "vllm:num_requests_waiting{engine=\"0\"} 0.0\n"
          "vllm:kv_cache_usage_perc{engine=\"0\"} 0.0\n"
          "vllm:cache_config_info{block_size=\"16\",engine=\"0\",num_gpu_blocks=\"4194304\"} 1.0\n",
          "text/plain; version=0.0.4");
    });
    port_ = server_.bind_to_any_port("127.0.0.1");
    thread_ = std::thread{[this] { server_.listen_after_bind(); }};
    while (!server_.is_running()) std::this_thread::yield();
  }
  ~EngineStandIn() {
    server_.stop();
    thread_.join();
  }
  std::string url() const { return "http://127.0.0.1:" + std::to_string(port_); }

 private:
  httplib::Server server_;
  int port_ = 0;
  std::thread thread_;
};

// Arrival times of the bridge's batches, in order.
struct Arrivals {
  explicit Arrivals(std::size_t capacity) : times(capacity) {}
  std::vector<Clock::time_point> times;
  std::atomic<std::size_t> count{0};
  void record() {
    const auto now = Clock::now();
    const std::size_t index = count.fetch_add(1);
    if (index < times.size()) times[index] = now;
  }
};

struct Row {
  std::uint32_t blocks = 0;
  std::uint32_t batches_per_second = 0;
  std::size_t sent = 0;
  std::size_t received = 0;
  double p50_us = 0, p99_us = 0, max_us = 0, mean_us = 0;
};

double percentile(const std::vector<double>& sorted, double q) {
  if (sorted.empty()) return 0;
  const auto index = static_cast<std::size_t>(q * static_cast<double>(sorted.size() - 1) + 0.5);
  return sorted[std::min(index, sorted.size() - 1)];
}

class Bench {
 public:
  bool start(std::string* error) {
    nats_ = testing::NatsServer::start(error);
    if (!nats_) return false;
    publisher_.set(zmq::sockopt::linger, 0);
    publisher_.set(zmq::sockopt::sndhwm, 100'000);
    publisher_.bind("tcp://127.0.0.1:*");
    const std::string endpoint = publisher_.get(zmq::sockopt::last_endpoint);
    auto client = nats::NatsClient::connect(nats::NatsOptions{.url = nats_->url()});
    if (!client) {
      *error = client.error();
      return false;
    }
    client_ = std::move(*client);
    auto subscription = client_->subscribe(subjects::every_kv_events(kNamespace),
                                           [this](nats::NatsMessage) { arrivals_->record(); });
    if (!subscription) {
      *error = subscription.error();
      return false;
    }
    subscription_.emplace(std::move(*subscription));
    BridgeOptions options;
    options.nats.url = nats_->url();
    options.ns = std::string{kNamespace};
    options.engine_url = engine_.url();
    options.kv_events = endpoint;
    options.worker_id = kWorker;
    options.health_interval = 1s;
    auto bridge = EngineBridge::create(std::move(options));
    if (!bridge) {
      *error = bridge.error();
      return false;
    }
    bridge_ = std::move(*bridge);
    thread_ = std::jthread{[this](std::stop_token stop) { bridge_->run(stop); }};
    // Until the bridge forwards: one-block batches every 10 ms (those sent before its SUB socket
    // joined are lost, the gap clears the rank once), then quiet.
    arrivals_ = std::make_unique<Arrivals>(1 << 16);
    const auto deadline = Clock::now() + 20s;
    while (arrivals_->count.load() == 0) {
      if (Clock::now() > deadline) {
        *error = "the bridge forwarded nothing within 20 s";
        return false;
      }
      send(stored_payload(1, next_hash_++, next_token_));
      next_token_ += kBlockSize;
      std::this_thread::sleep_for(10ms);
    }
    settle();
    return true;
  }

  Row run(std::uint32_t blocks, std::uint32_t batches_per_second, std::chrono::seconds duration) {
    const std::size_t batches = static_cast<std::size_t>(batches_per_second) * duration.count();
    std::vector<std::string> payloads;
    payloads.reserve(batches);
    for (std::size_t i = 0; i < batches; ++i) {
      payloads.push_back(stored_payload(blocks, next_hash_, next_token_));
      next_hash_ += blocks;
      next_token_ += blocks * kBlockSize;
    }
    arrivals_ = std::make_unique<Arrivals>(batches);
    std::vector<Clock::time_point> sent(batches);
    const auto period = std::chrono::nanoseconds(1'000'000'000LL / batches_per_second);
    const auto begin = Clock::now() + 10ms;
    for (std::size_t i = 0; i < batches; ++i) {
      std::this_thread::sleep_until(begin + period * static_cast<std::int64_t>(i));
      sent[i] = Clock::now();
      send(payloads[i]);
    }
    const auto deadline = Clock::now() + 10s;
    while (arrivals_->count.load() < batches && Clock::now() < deadline) {
      std::this_thread::sleep_for(1ms);
    }
    Row row{.blocks = blocks, .batches_per_second = batches_per_second, .sent = batches};
    row.received = std::min(arrivals_->count.load(), batches);
    std::vector<double> delays;
    delays.reserve(row.received);
    for (std::size_t i = 0; i < row.received; ++i) {
      delays.push_back(
          std::chrono::duration<double, std::micro>(arrivals_->times[i] - sent[i]).count());
    }
    std::ranges::sort(delays);
    if (!delays.empty()) {
      row.p50_us = percentile(delays, 0.50);
      row.p99_us = percentile(delays, 0.99);
      row.max_us = delays.back();
      double sum = 0;
      for (double d : delays) sum += d;
      row.mean_us = sum / static_cast<double>(delays.size());
    }
    settle();
    return row;
  }

  void stop() {
    thread_.request_stop();
    if (thread_.joinable()) thread_.join();
    bridge_.reset();
    subscription_.reset();
    client_.reset();
  }

 private:
  void send(const std::string& payload) {
    worker::send_kv_event(publisher_, "", next_sequence_++, payload);
  }
  // Waits until nothing has arrived for 300 ms.
  void settle() {
    std::size_t seen = arrivals_->count.load();
    while (true) {
      std::this_thread::sleep_for(300ms);
      const std::size_t now = arrivals_->count.load();
      if (now == seen) return;
      seen = now;
    }
  }

  std::unique_ptr<testing::NatsServer> nats_;
  EngineStandIn engine_;
  zmq::context_t context_{1};
  zmq::socket_t publisher_{context_, zmq::socket_type::pub};
  std::unique_ptr<nats::NatsClient> client_;
  std::optional<nats::NatsSubscription> subscription_;
  std::unique_ptr<Arrivals> arrivals_;
  std::unique_ptr<EngineBridge> bridge_;
  std::jthread thread_;
  std::uint64_t next_sequence_ = 0;
  std::uint64_t next_hash_ = 0x1000;
  std::uint32_t next_token_ = 0;
};

}  // namespace
}  // namespace kvr::bridge

int main(int argc, char** argv) {
  std::chrono::seconds duration{10};
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::strcmp(argv[i], "--seconds") == 0)
      duration = std::chrono::seconds(std::atoi(argv[i + 1]));
  }
  if (duration.count() < 1 || duration.count() > 600) {
    std::fprintf(stderr, "--seconds must be in [1, 600]\n");
    return 2;
  }
  kvr::bridge::Bench bench;
  std::string error;
  if (!bench.start(&error)) {
    std::fprintf(stderr, "kvr_bridge_latency_bench: %s\n", error.c_str());
    return 1;
  }
  std::printf(
      "| blocks/batch | batches/s | blocks/s | batches sent / received | delay p50 | p99 | "
      "max | mean |\n| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n");
  struct Config {
    std::uint32_t blocks;
    std::uint32_t batches_per_second;
  };
  for (const Config config : {Config{10, 1000}, Config{100, 100}, Config{1, 10'000}}) {
    const auto row = bench.run(config.blocks, config.batches_per_second, duration);
    std::printf("| %u | %u | %u | %zu / %zu | %.0f µs | %.0f µs | %.0f µs | %.0f µs |\n",
                row.blocks, row.batches_per_second, row.blocks * row.batches_per_second, row.sent,
                row.received, row.p50_us, row.p99_us, row.max_us, row.mean_us);
    std::fflush(stdout);
  }
  bench.stop();
  return 0;
}
