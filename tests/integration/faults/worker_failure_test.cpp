// Fault injection: one of three `kvr mocker` workers is killed (SIGKILL) or hung (SIGSTOP) under a
// bounded steady load through a real `kvr node` and nats-server, in generate mode (an in-test
// client streaming through the node) and in route mode (`kvr replay-live`, which reports the
// failed requests ABORTED with a cause that blames the worker). The node's passive health must
// eject the worker within a second of the first failures it hears of, long before its liveness
// (3 s) would expire; no route goes to it after the ejection; and every request is answered or
// explicitly failed, none later than its timeout.
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <signal.h>

#include "kvr/v1/routing.pb.h"
#include "messages/subjects.hpp"
#include "tests/testing/kvr_binary.hpp"
#include "tests/testing/kvr_cluster_test.hpp"
#include "tests/testing/loopback_http.hpp"
#include "tests/testing/nats_recorder.hpp"

namespace kvr {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using testing::ChildProcess;
using testing::ChunkStream;
using testing::free_port;
using testing::http_get;
using testing::metric;

constexpr std::string_view kNamespace = "faults";
constexpr std::uint32_t kBlockSize = 16;
constexpr int kRequests = 200;
constexpr auto kInterval = 25ms;  // 40 requests per second
constexpr int kKillAfter = 40;    // about one second into the load
// Tokens per response: at real engine speed (--time-scale 1) a request lasts a few hundred ms,
// so every worker carries several at once, as under real load.
constexpr std::uint32_t kOutputTokens = 16;
constexpr WorkerId kVictim = 200;
// The node's (generate mode) and the client's (route mode) patience for a first token.
constexpr auto kFirstTokenTimeout = 500ms;
constexpr auto kClientTimeout = 1500ms;

// Passive health as the test configures it: failures in a row eject a worker for 10 s. Route
// mode uses the default of three. Generate mode uses two: there each failure surfaces only one
// first-token timeout after its dispatch, and the kv-cost policy already steers away from a dead
// worker whose bookings pile up (it reports no load any more), so the third request it is sent
// may come more than a second after the first failed.
constexpr std::string_view kHealthPolicy =
    "worker_health:\n"
    "  base_ejection_time_ms: 10000\n"
    "  max_ejection_time_ms: 60000\n"
    "  max_ejection_percent: 50\n";

enum class Mode { generate, route };
struct Fault {
  Mode mode;
  int signal;
};

std::string fault_name(const ::testing::TestParamInfo<Fault>& info) {
  return fmt::format("{}_{}", info.param.mode == Mode::generate ? "Generate" : "Route",
                     info.param.signal == SIGKILL ? "Kill" : "Stop");
}

double ms_since(Clock::time_point from, Clock::time_point to) {
  return std::chrono::duration<double, std::milli>(to - from).count();
}

class WorkerFailureTest : public testing::KvrClusterTest,
                          public ::testing::WithParamInterface<Fault> {
 protected:
  WorkerFailureTest() : KvrClusterTest(kvr::testing::kvr_binary(), std::string{kNamespace}) {}

  void TearDown() override {
    // A stopped worker cannot end on SIGTERM: end it now.
    if (auto it = mockers_.find(kVictim); it != mockers_.end()) it->second.signal(SIGKILL);
    if (HasFailure() && node_) std::cerr << "---- node log\n" << node_->log();
  }

  void start_fleet(Mode mode) {
    for (const WorkerId base : {WorkerId{100}, kVictim, WorkerId{300}}) {
      auto mocker = kvr_->start_mocker({.workers = 1,
                                        .worker_id_base = base,
                                        .block_size = kBlockSize,
                                        .num_gpu_blocks = 4096,
                                        .time_scale = "1",
                                        .liveness_ttl_ms = 3000,
                                        .load_interval_ms = 100},
                                       fmt::format("mocker-{}.log", base));
      ASSERT_TRUE(mocker);
      mockers_.emplace(base, std::move(*mocker));
    }
    const auto policy = directory_.path() / "health.yaml";
    std::ofstream{policy} << kHealthPolicy
                          << "  consecutive_failures: " << (mode == Mode::generate ? 2 : 3) << "\n";
    metrics_port_ = free_port();
    std::vector<std::string> extra{"--router-policy-config", policy.string()};
    if (mode == Mode::generate) {
      extra.insert(extra.end(),
                   {"--router-first-token-timeout-ms", std::to_string(kFirstTokenTimeout.count())});
    }
    node_ = kvr_->start_node(
        {.block_size = kBlockSize, .metrics_port = metrics_port_, .extra = std::move(extra)});
    ASSERT_TRUE(node_);
    ASSERT_TRUE(testing::wait_until_healthy(metrics_port_, 20s)) << node_->log();
    int probes = 0;
    for (const WorkerId worker : {WorkerId{100}, kVictim, WorkerId{300}}) {
      ASSERT_TRUE(testing::wait_until_routable(
          *client_, kNamespace, worker, [&] { return fmt::format("probe-{}", ++probes); }, 20s));
    }
  }

  // What the test watches on the node's /metrics while the load runs.
  struct Watch {
    Clock::time_point fault_at{};
    std::optional<Clock::time_point> first_failure_at;
    std::optional<Clock::time_point> ejected_at;
    double victim_routes_at_fault = 0;
    double victim_routes_at_ejection = 0;
  };

  double victim_routes(const std::string& page) const {
    return metric(page, fmt::format("kvr_route_decisions_total{{worker=\"{}\"", kVictim));
  }

  // Reads /metrics once: notes the first failure and the ejection as they appear.
  void poll(Watch& watch) {
    const std::string page = http_get(metrics_port_, "/metrics");
    const auto now = Clock::now();
    if (!watch.first_failure_at && metric(page, "kvr_worker_failures_total") > 0) {
      watch.first_failure_at = now;
    }
    if (!watch.ejected_at && metric(page, "kvr_worker_ejections_total") > 0) {
      watch.ejected_at = now;
      watch.victim_routes_at_ejection = victim_routes(page);
    }
  }

  void inject(Watch& watch) {
    watch.victim_routes_at_fault = victim_routes(http_get(metrics_port_, "/metrics"));
    watch.fault_at = Clock::now();
    mockers_.at(kVictim).signal(GetParam().signal);
  }

  // The common checks once the load has ended.
  void check_ejection(const Watch& watch) {
    const std::string page = http_get(metrics_port_, "/metrics");
    ASSERT_TRUE(watch.first_failure_at) << "no failure reached the node";
    ASSERT_TRUE(watch.ejected_at) << "the worker was never ejected";
    const double delay_ms = ms_since(*watch.first_failure_at, *watch.ejected_at);
    const double since_fault_ms = ms_since(watch.fault_at, *watch.ejected_at);
    const double routes_after_fault = victim_routes(page) - watch.victim_routes_at_fault;
    const double routes_after_ejection = victim_routes(page) - watch.victim_routes_at_ejection;
    std::cout << fmt::format(
        "[faults] ejected {:.0f} ms after the first failure ({:.0f} ms after the fault); {} routes "
        "to the worker after the fault, {} after the ejection; failures by cause: {}\n",
        delay_ms, since_fault_ms, routes_after_fault, routes_after_ejection,
        metric(page, "kvr_worker_failures_total"));
    EXPECT_LE(delay_ms, 1000);
    // Ejected long before the liveness TTL (3 s) would have expired it.
    EXPECT_LT(since_fault_ms, 2900);
    EXPECT_EQ(metric(page, "kvr_worker_ejections_total"), 1) << "the cap: one of three at most";
    // A decision the selector made before the ejection may be counted a moment after it.
    EXPECT_LE(routes_after_ejection, 2);
  }

  // Generate mode: the node dispatches, so it sees the first-token timeouts itself; a request whose
  // worker failed is retried once elsewhere, so nearly every request completes.
  void run_generate(Watch& watch) {
    std::vector<std::unique_ptr<ChunkStream>> streams;
    const auto start = Clock::now();
    for (int i = 0; i < kRequests; ++i) {
      const auto due = start + i * kInterval;
      while (Clock::now() < due) poll(watch);  // paced by the metric polls, each a loopback GET
      if (i == kKillAfter) inject(watch);
      streams.push_back(std::make_unique<ChunkStream>());
      ASSERT_TRUE(streams.back()->open(*client_));
      v1::GenerateRequest request;
      auto* route = request.mutable_route();
      route->set_request_id(fmt::format("fault-{}", i));
      route->set_model("mock-model");
      for (std::uint32_t token : testing::prompt(64, 100'000 + i * 1000)) {
        route->mutable_tokens()->add_ids(token);
      }
      request.set_max_output_tokens(kOutputTokens);
      request.set_stream_subject(streams.back()->subject());
      ASSERT_TRUE(
          client_->publish(subjects::router_generate(kNamespace), request.SerializeAsString()));
    }
    // Every stream ends, completed or with an explicit error: a failed attempt waits one
    // first-token timeout, its retry another at most.
    const auto deadline = Clock::now() + 2 * kFirstTokenTimeout + 3s;
    const auto all_ended = [&] {
      for (const auto& stream : streams) {
        if (!stream->finished()) return false;
      }
      return true;
    };
    while (!all_ended() && Clock::now() < deadline) poll(watch);
    int completed = 0;
    int failed = 0;
    int unanswered = 0;
    for (const auto& stream : streams) {
      if (!stream->finished()) {
        ++unanswered;
      } else if (stream->chunks().back().finish_reason() == "length") {
        ++completed;
      } else {
        ++failed;
        EXPECT_EQ(stream->chunks().back().finish_reason(), "error");
      }
    }
    std::cout << fmt::format(
        "[faults] generate: {} completed, {} failed explicitly, {} unanswered\n", completed, failed,
        unanswered);
    EXPECT_EQ(unanswered, 0);
    EXPECT_EQ(completed + failed, kRequests);
  }

  std::map<WorkerId, ChildProcess> mockers_;
  std::optional<ChildProcess> node_;
  std::uint16_t metrics_port_ = 0;
};

TEST_P(WorkerFailureTest, TheFailedWorkerIsEjectedAndEveryRequestIsAnswered) {
  const Fault fault = GetParam();
  start_fleet(fault.mode);
  if (HasFatalFailure()) return;
  Watch watch;
  if (fault.mode == Mode::generate) {
    run_generate(watch);
  } else {
    // A trace of kRequests requests, one every kInterval, with prompts that share nothing.
    const auto trace = directory_.path() / "trace.jsonl";
    {
      std::ofstream out{trace};
      for (int i = 0; i < kRequests; ++i) {
        out << fmt::format(
            R"({{"timestamp": {}, "input_length": 1024, "output_length": {}, "hash_ids": [{}, {}]}})"
            "\n",
            i * kInterval.count(), kOutputTokens, 2 * i, 2 * i + 1);
      }
    }
    const auto json_path = directory_.path() / "live.json";
    auto replay =
        kvr_->start({"replay-live"},
                    {"--quiet", "--trace", trace.string(), "--timeout",
                     fmt::format("{}", std::chrono::duration<double>(kClientTimeout).count()),
                     "--json", json_path.string()},
                    "replay.log");
    ASSERT_TRUE(replay);
    // The fault comes once the client has had about kKillAfter decisions.
    const auto started = Clock::now();
    const auto routed = [&] {
      return metric(http_get(metrics_port_, "/metrics"), "kvr_route_decisions_total");
    };
    const double before = routed();
    while (routed() - before < kKillAfter && Clock::now() < started + 30s) poll(watch);
    inject(watch);
    // The run lasts the trace (5 s) and, for the last requests, one client timeout at most.
    const auto deadline = Clock::now() + kRequests * kInterval + kClientTimeout + 10s;
    while (replay->running() && Clock::now() < deadline) poll(watch);
    const auto status = replay->wait(1s);
    ASSERT_TRUE(status.has_value()) << "kvr replay-live hung:\n" << replay->log();
    const auto report = nlohmann::json::parse(testing::read_file(json_path), nullptr, false);
    ASSERT_FALSE(report.is_discarded()) << replay->log();
    const auto& policy = report["policies"][0];
    const auto& live = report["live"];
    std::cout << fmt::format("[faults] route: {} completed, {} failed ({} timed out)\n",
                             policy["completed"].get<int>(), policy["failed"].get<int>(),
                             live["timed_out"].get<int>());
    EXPECT_EQ(policy["completed"].get<int>() + policy["failed"].get<int>(), kRequests)
        << policy.dump(2);
    EXPECT_EQ(live["reports_unacknowledged"], 0);
  }
  check_ejection(watch);
}

INSTANTIATE_TEST_SUITE_P(Faults, WorkerFailureTest,
                         ::testing::Values(Fault{Mode::generate, SIGKILL},
                                           Fault{Mode::generate, SIGSTOP},
                                           Fault{Mode::route, SIGKILL},
                                           Fault{Mode::route, SIGSTOP}),
                         fault_name);

}  // namespace
}  // namespace kvr
