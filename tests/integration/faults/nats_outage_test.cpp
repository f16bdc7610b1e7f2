// Fault injection: the node's own NATS outage. A real nats-server, a `kvr node` and three
// `kvr mocker` processes (one worker each, 1 s liveness TTLs) serve a steady stream of route
// requests whose prompts share a few prefixes; each routed request is generated on its worker and
// reported completed, as a route-mode client does. The server is killed (SIGKILL) for 1 s, 5 s or
// 30 s and restarted on the same port while the stream goes on. Nothing may crash, the node must
// expire no worker for heartbeats it could not receive, and routing must be as cache-aware as
// before the outage (the overlap its decisions report) within 2 s of the server's return. Each case
// prints how long after the return the first route and the first cache-aware route came.
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <mutex>
#include <numeric>
#include <optional>
#include <set>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "kvr/v1/routing.pb.h"
#include "messages/nats/nats_client.hpp"
#include "messages/subjects.hpp"
#include "tests/testing/kvr_binary.hpp"
#include "tests/testing/kvr_cluster_test.hpp"
#include "tests/testing/loopback_http.hpp"

namespace kvr {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using testing::ChildProcess;
using testing::free_port;
using testing::http_get;
using testing::metric;
using testing::prompt;
using testing::wait_until;

constexpr std::string_view kNamespace = "outage";
constexpr std::uint32_t kBlockSize = 16;
constexpr int kWorkers = 3;
constexpr int kPrefixGroups = 6;
constexpr std::size_t kPrefixBlocks = 8;  // shared by every prompt of a group
constexpr std::size_t kSuffixBlocks = 2;  // new in every prompt
constexpr double kPromptBlocks = kPrefixBlocks + kSuffixBlocks;
// A route request the node does not answer in this time is counted as failed (during the outage).
constexpr auto kRouteTimeout = 200ms;
// The simulated workers answer a 10-block prompt in a few milliseconds.
constexpr auto kGenerateTimeout = 300ms;
// Routing counts as cache-aware again once this many decisions in a row reach the pre-outage
// overlap (within 10 %).
constexpr std::size_t kAwareWindow = 6;

/// One route request of the stream: when its answer came and, if it was routed, the fraction of
/// its prompt blocks the node found cached on the chosen worker.
struct Sample {
  Clock::time_point at;
  std::optional<double> overlap;
};

/// What one outage measured.
struct OutageResult {
  double pre_outage_overlap = 0;
  std::optional<std::chrono::milliseconds> first_route;  ///< after the server's return
  std::optional<std::chrono::milliseconds> cache_aware;  ///< after the server's return
  double post_outage_overlap = 0;                        ///< over the aware window
  std::size_t routed_during_outage = 0;
};

class NatsOutageTest : public testing::KvrClusterTest {
 protected:
  NatsOutageTest()
      : KvrClusterTest(kvr::testing::kvr_binary(), std::string{kNamespace},
                       testing::reconnecting_client()) {}

  void SetUp() override {
    KvrClusterTest::SetUp();
    if (HasFatalFailure()) return;
    // Every generate stream of the test ends on one subscription: a finished chunk names its
    // request.
    stream_prefix_ = client_->new_inbox();
    auto subscribed = client_->subscribe(stream_prefix_ + ".*", [this](nats::NatsMessage message) {
      v1::GenerateChunk chunk;
      if (!chunk.ParseFromString(message.data) || !chunk.finished()) return;
      {
        std::lock_guard lock{streams_mutex_};
        finished_.insert(chunk.request_id());
      }
      streams_signal_.notify_all();
    });
    ASSERT_TRUE(subscribed) << subscribed.error();
    streams_.emplace(std::move(*subscribed));
    ASSERT_TRUE(client_->flush(5s));

    for (int i = 0; i < kWorkers; ++i) {
      auto mocker = kvr_->start_mocker({.workers = 1,
                                        .worker_id_base = 100 * (i + 1),
                                        .block_size = kBlockSize,
                                        .num_gpu_blocks = 8192,
                                        .time_scale = "50",
                                        .liveness_ttl_ms = 1000,
                                        .load_interval_ms = 50,
                                        .nats_reconnect_wait_ms = 50},
                                       "mocker-" + std::to_string(i) + ".log");
      ASSERT_TRUE(mocker);
      mockers_.push_back(std::move(*mocker));
    }
    metrics_port_ = free_port();
    node_ = kvr_->start_node(
        {.block_size = kBlockSize, .metrics_port = metrics_port_, .nats_reconnect_wait_ms = 50});
    ASSERT_TRUE(node_);
    ASSERT_TRUE(testing::wait_until_healthy(metrics_port_, 20s)) << node_->log();
    ASSERT_TRUE(wait_until([&] { return metric(metrics_text(), "kvr_workers") == kWorkers; }, 20s))
        << node_->log();
  }

  void TearDown() override {
    streams_.reset();  // before the client closes
    if (HasFailure()) {
      if (node_) std::cerr << "---- node log\n" << node_->log();
      for (const auto& mocker : mockers_) std::cerr << "---- mocker log\n" << mocker.log();
      if (server_) std::cerr << "---- nats-server log\n" << server_->process().log();
    }
  }

  std::string metrics_text() { return http_get(metrics_port_, "/metrics"); }

  // Routes one prompt of the stream; a routed one is generated on its worker and reported
  // completed (fire and forget: nobody waits for the ack), as a route-mode client does.
  Sample route_once() {
    const int n = next_request_++;
    const std::string id = "r" + std::to_string(n);
    const auto group = static_cast<std::uint32_t>(n % kPrefixGroups);
    std::vector<std::uint32_t> tokens = prompt(kPrefixBlocks * kBlockSize, 1 + group * 10'000);
    const auto suffix =
        prompt(kSuffixBlocks * kBlockSize, 1'000'000 + static_cast<std::uint32_t>(n) * 64);
    tokens.insert(tokens.end(), suffix.begin(), suffix.end());

    v1::RouteRequest request;
    request.set_request_id(id);
    request.set_model("mock-model");
    for (std::uint32_t token : tokens) request.mutable_tokens()->add_ids(token);
    auto reply = client_->request(subjects::router_route(kNamespace), request.SerializeAsString(),
                                  kRouteTimeout);
    const auto answered = Clock::now();
    v1::RouteDecision decision;
    if (!reply || !decision.ParseFromString(reply->data) || !decision.has_success()) {
      return {answered, std::nullopt};
    }
    const auto& success = decision.success();
    v1::GenerateRequest generate;
    *generate.mutable_route() = request;
    generate.set_max_output_tokens(2);
    generate.set_dp_rank(success.dp_rank());
    generate.set_stream_subject(stream_prefix_ + "." + std::to_string(n));
    if (client_->publish(success.generate_subject(), generate.SerializeAsString())) {
      std::unique_lock lock{streams_mutex_};
      // Bounded: a generate lost to the outage (its worker not reconnected yet) is not waited
      // for any longer, and holds up the stream no more than a slow answer would.
      streams_signal_.wait_for(lock, kGenerateTimeout, [&] { return finished_.contains(id); });
    }
    v1::LifecycleReport report;
    report.set_booking_id(success.booking_id());
    report.set_event(v1::LIFECYCLE_EVENT_COMPLETED);
    (void)client_->publish(subjects::router_report(kNamespace), report.SerializeAsString());
    return {answered, success.device_overlap_blocks() / kPromptBlocks};
  }

  // Kills the server for `outage` under the stream and measures the return to cache-aware routing.
  OutageResult run_outage(std::chrono::milliseconds outage) {
    OutageResult result;
    // Warm up: every prefix is cached somewhere and the node knows it.
    std::vector<Sample> warm;
    const bool warmed = wait_until(
        [&] {
          warm.push_back(route_once());
          if (warm.size() < 10 * kPrefixGroups) return false;
          return std::all_of(warm.end() - 2 * kPrefixGroups, warm.end(), [](const Sample& s) {
            return s.overlap && *s.overlap >= kPrefixBlocks / kPromptBlocks - 1e-9;
          });
        },
        30s);
    EXPECT_TRUE(warmed) << "routing never became cache-aware before the outage";
    if (!warmed) return result;
    // The pre-outage level: the last 30 decisions.
    double sum = 0;
    for (auto it = warm.end() - 30; it != warm.end(); ++it) sum += it->overlap.value_or(0);
    result.pre_outage_overlap = sum / 30;

    const std::string before = metrics_text();
    const double expired_before = metric(before, "kvr_workers_expired_total");
    const double grants_before = metric(before, "kvr_worker_liveness_grants_total");
    const double dumps_before = metric(before, "kvr_kv_dump_requests_total");

    // The stream goes on through the outage, on its own thread.
    std::mutex samples_mutex;
    std::vector<Sample> samples;
    std::atomic<bool> stop{false};
    std::thread driver{[&] {
      // Bounded in count and time: at most ~60 s of requests.
      const auto deadline = Clock::now() + outage + 30s;
      for (int i = 0; i < 200'000 && !stop.load() && Clock::now() < deadline; ++i) {
        Sample sample = route_once();
        std::lock_guard lock{samples_mutex};
        samples.push_back(sample);
      }
    }};
    server_->kill();
    // The injected fault itself: the server stays down for the outage's length.
    std::this_thread::sleep_for(outage);
    const bool node_alive_during = node_->running();
    std::string error;
    const bool restarted = server_->restart(&error);
    const auto returned = Clock::now();
    EXPECT_TRUE(restarted) << error;

    // Cache-aware again: kAwareWindow routed decisions in a row at the pre-outage overlap.
    const double level = result.pre_outage_overlap * 0.9;
    const auto find_aware = [&]() -> bool {
      std::lock_guard lock{samples_mutex};
      std::size_t run = 0;
      for (std::size_t i = 0; i < samples.size(); ++i) {
        const Sample& sample = samples[i];
        if (sample.at < returned) continue;
        if (sample.overlap && !result.first_route) {
          result.first_route =
              std::chrono::duration_cast<std::chrono::milliseconds>(sample.at - returned);
        }
        if (!sample.overlap) continue;  // unanswered: neither counts for nor against
        if (*sample.overlap < level) {
          run = 0;
          continue;
        }
        if (++run == kAwareWindow) {
          const Sample& first = samples[i + 1 - kAwareWindow];
          result.cache_aware =
              std::chrono::duration_cast<std::chrono::milliseconds>(first.at - returned);
          double window = 0;
          std::size_t counted = 0;
          for (std::size_t j = i + 1 - kAwareWindow; j <= i; ++j) {
            if (samples[j].overlap) {
              window += *samples[j].overlap;
              ++counted;
            }
          }
          result.post_outage_overlap = window / static_cast<double>(counted);
          return true;
        }
      }
      return false;
    };
    result.first_route.reset();
    const bool aware = restarted && wait_until(find_aware, 15s);
    stop.store(true);
    driver.join();
    {
      std::lock_guard lock{samples_mutex};
      for (const Sample& sample : samples) {
        if (sample.overlap && sample.at < returned) ++result.routed_during_outage;
      }
    }

    // Every worker was asked for its KV state once it was heard from again.
    EXPECT_TRUE(wait_until(
        [&] {
          return metric(metrics_text(), "kvr_kv_dump_requests_total") >= dumps_before + kWorkers;
        },
        5s));
    EXPECT_TRUE(node_alive_during);
    EXPECT_TRUE(aware) << "routing was not cache-aware again within 15 s of the return";
    // No crash: every process still runs.
    EXPECT_TRUE(node_->running()) << node_->log();
    for (auto& mocker : mockers_) EXPECT_TRUE(mocker.running()) << mocker.log();
    // The node told its own outage from its workers': none expired, each got a grace period.
    const std::string after = metrics_text();
    EXPECT_EQ(metric(after, "kvr_workers_expired_total"), expired_before) << after;
    EXPECT_EQ(metric(after, "kvr_workers"), kWorkers) << after;
    EXPECT_GE(metric(after, "kvr_worker_liveness_grants_total"), grants_before + kWorkers) << after;
    EXPECT_EQ(metric(after, "kvr_nats_connected"), 1);
    if (result.cache_aware) {
      EXPECT_LE(*result.cache_aware, 2000ms);
    }

    const auto ms = [](const std::optional<std::chrono::milliseconds>& value) {
      return value ? std::to_string(value->count()) + " ms" : std::string{"never"};
    };
    std::printf(
        "nats outage %lld ms: first route %s and cache-aware %s after the server's return; "
        "overlap %.2f before, %.2f after; %zu routes answered while it was down; %s\n",
        static_cast<long long>(outage.count()), ms(result.first_route).c_str(),
        ms(result.cache_aware).c_str(), result.pre_outage_overlap, result.post_outage_overlap,
        result.routed_during_outage,
        metric(after, "kvr_worker_expiries_suppressed_total") > 0
            ? "liveness TTLs held through it"
            : "no liveness ran out during it");
    RecordProperty("cache_aware_after_return_ms",
                   result.cache_aware ? static_cast<int>(result.cache_aware->count()) : -1);
    return result;
  }

  std::optional<ChildProcess> node_;
  std::vector<ChildProcess> mockers_;
  std::uint16_t metrics_port_ = 0;
  std::string stream_prefix_;
  std::optional<nats::NatsSubscription> streams_;
  std::mutex streams_mutex_;
  std::condition_variable streams_signal_;
  std::set<std::string> finished_;
  int next_request_ = 0;
};

TEST_F(NatsOutageTest, OneSecondOutageKeepsEveryWorkerAndTheCacheView) { run_outage(1000ms); }

TEST_F(NatsOutageTest, FiveSecondOutageKeepsEveryWorkerAndTheCacheView) {
  const OutageResult result = run_outage(5000ms);
  // Five liveness TTLs' worth of silence: without the hold every worker would have expired.
  EXPECT_GT(metric(metrics_text(), "kvr_worker_expiries_suppressed_total"), 0);
  EXPECT_GT(result.pre_outage_overlap, 0.5);
}

TEST_F(NatsOutageTest, ThirtySecondOutageKeepsEveryWorkerAndTheCacheView) {
  const OutageResult result = run_outage(30'000ms);
  EXPECT_GE(metric(metrics_text(), "kvr_worker_expiries_suppressed_total"), kWorkers);
  EXPECT_GT(result.pre_outage_overlap, 0.5);
}

}  // namespace
}  // namespace kvr
