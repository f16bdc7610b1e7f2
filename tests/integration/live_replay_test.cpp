// `kvr replay-live` against a real cluster on loopback: a nats-server, a `kvr mocker` fleet and a
// `kvr node`. Every trace request is routed, streamed from its worker and reported; the run ends
// with the common report, and it stops with an explicit error when no router answers. Requests a
// node's admission control refuses are counted as rejected by admission, not as failed.
#include <fstream>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "tests/testing/kvr_binary.hpp"
#include "tests/testing/kvr_processes.hpp"
#include "tests/testing/loopback_http.hpp"
#include "tests/testing/nats_server.hpp"

namespace kvr {
namespace {

using namespace std::chrono_literals;
using testing::ChildProcess;
using testing::KvrProcesses;
using testing::NatsServer;
using testing::read_file;
using testing::TemporaryDirectory;

constexpr std::string_view kNamespace = "live";

class LiveReplayTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string error;
    server_ = NatsServer::start(&error);
    ASSERT_TRUE(server_) << error;
    kvr_.emplace(kvr::testing::kvr_binary(), server_->url(), std::string{kNamespace},
                 directory_.path());
  }

  void TearDown() override {
    if (HasFailure()) {
      if (node_) std::cerr << "---- node log\n" << node_->log();
      if (mocker_) std::cerr << "---- mocker log\n" << mocker_->log();
    }
  }

  void start_mocker() {
    mocker_ = kvr_->start_mocker({.workers = 4, .block_size = 64, .time_scale = "50"});
    ASSERT_TRUE(mocker_);
  }

  void start_node(std::vector<std::string> extra = {}) {
    metrics_port_ = testing::free_port();
    node_ = kvr_->start_node(
        {.block_size = 64, .metrics_port = metrics_port_, .extra = std::move(extra)});
    ASSERT_TRUE(node_);
  }

  // Runs `kvr replay-live <arguments>` to completion; its exit code (nullopt: it did not end).
  std::optional<int> replay_live(std::vector<std::string> arguments) {
    arguments.insert(arguments.begin(), "--quiet");
    auto process = kvr_->start({"replay-live"}, arguments, "replay.log");
    if (!process) {
      ADD_FAILURE() << "cannot start " << kvr::testing::kvr_binary();
      return std::nullopt;
    }
    const auto status = process->wait(150s);
    EXPECT_TRUE(status.has_value()) << "kvr replay-live did not finish:\n" << process->log();
    return status;
  }

  std::filesystem::path replay_log() const { return kvr_->log_path("replay.log"); }

  TemporaryDirectory directory_;
  std::unique_ptr<NatsServer> server_;
  std::optional<KvrProcesses> kvr_;
  std::optional<ChildProcess> mocker_;
  std::optional<ChildProcess> node_;
  std::uint16_t metrics_port_ = 0;
};

TEST_F(LiveReplayTest, RoutesStreamsAndReportsEveryTraceRequest) {
  start_mocker();
  start_node();
  const auto json_path = directory_.path() / "live.json";
  // One ask per request: a request asked again (a decision later than 150 ms on a loaded
  // machine) is routed twice, and the node's ceilings below would count its prompt twice.
  const auto status = replay_live({"--limit", "60", "--speedup", "20", "--timeout", "60",
                                   "--route-attempts", "1", "--json", json_path.string()});
  ASSERT_EQ(status, 0) << read_file(replay_log());

  const auto report = nlohmann::json::parse(read_file(json_path), nullptr, false);
  ASSERT_FALSE(report.is_discarded()) << read_file(json_path);
  EXPECT_EQ(report["requests"], 60);
  EXPECT_EQ(report["block_size"], 64);
  EXPECT_EQ(report["workers"], 4);
  ASSERT_EQ(report["policies"].size(), 1U);
  const auto& policy = report["policies"][0];
  EXPECT_EQ(policy["completed"], 60) << policy.dump(2);
  EXPECT_EQ(policy["failed"], 0) << policy.dump(2);
  // The trace's conversations share prefixes: a KV-aware router serves some from cache.
  EXPECT_GT(policy["hit_rate"].get<double>(), 0.0);
  EXPECT_GT(policy["ttft_ms"]["p50"].get<double>(), 0.0);
  // Labelled with the policy instance the node's decisions named.
  EXPECT_EQ(policy["policy"].get<std::string>().rfind("live:", 0), 0U) << policy["policy"];
  EXPECT_GT(policy["policy"].get<std::string>().size(), 5U) << policy["policy"];
  // The hit-rate ladder: the fleet's KV from the registrations (4 workers of the mocker's default
  // 16384 blocks), the router's predictions from its decisions, the first chunks' cached tokens.
  EXPECT_EQ(report["model"], "mock-model");
  EXPECT_EQ(report["fleet_kv_blocks"], 4 * 16384);
  EXPECT_TRUE(report["capacity_bound_hit_rate"].is_number()) << report.dump(2);
  const auto& ladder = policy["hit_rate_ladder"];
  EXPECT_GT(ladder["predicted"].get<double>(), 0.0) << ladder.dump(2);
  EXPECT_EQ(ladder["delivered"], policy["hit_rate"]) << ladder.dump(2);

  // The node measures both ceilings itself, over what it routed (the trace in arrival order, and
  // the readiness probes); its workload cache is far larger than this trace's blocks.
  const std::string metrics = testing::http_get(metrics_port_, "/metrics");
  const std::string model = "{model=\"mock-model\"";
  const double prompt = testing::metric(metrics, "kvr_routed_prompt_tokens_total" + model);
  const double workload =
      testing::metric(metrics, "kvr_ceiling_cached_tokens_total" + model + ",ceiling=\"workload\"");
  const double capacity =
      testing::metric(metrics, "kvr_ceiling_cached_tokens_total" + model + ",ceiling=\"capacity\"");
  ASSERT_GT(prompt, 0.0) << metrics;
  EXPECT_NEAR(workload / prompt, report["infinite_cache_hit_rate"].get<double>(), 0.02) << metrics;
  EXPECT_NEAR(capacity / prompt, report["capacity_bound_hit_rate"].get<double>(), 0.02) << metrics;

  const auto& live = report["live"];
  std::size_t decisions = 0;
  for (const auto& [worker, count] : live["decisions_per_worker"].items()) {
    decisions += count.get<std::size_t>();
  }
  EXPECT_EQ(decisions, 60U);
  EXPECT_EQ(live["timed_out"], 0);
  EXPECT_EQ(live["reports_refused"], 0);
  EXPECT_EQ(live["reports_unacknowledged"], 0);
}

TEST_F(LiveReplayTest, StopsWithAnExplicitErrorWhenNoRouterAnswers) {
  start_mocker();
  const auto status = replay_live({"--limit", "5", "--ready-timeout", "2"});
  EXPECT_EQ(status, 2);
  EXPECT_NE(read_file(replay_log()).find("no router routed a probe request"), std::string::npos)
      << read_file(replay_log());
}

TEST_F(LiveReplayTest, CountsAdmissionRejectionsApartFromFailures) {
  // A bucket of 1000 tokens per tenant that (practically) never refills: every prompt of the trace
  // is longer, so each tenant's first request is admitted (a request larger than the bucket
  // needs it full) and every later one is rejected as rate limited, however slow the machine.
  // The readiness probe names no tenant and costs 1 token of its own bucket.
  const auto config = directory_.path() / "router.yaml";
  {
    std::ofstream yaml{config};
    yaml << "request_classifier:\n"
            "  type: token-bucket\n"
            "  parameters: {rate_tokens_per_s: 0.001, burst_tokens: 1000}\n";
  }
  start_mocker();
  start_node({"--router-policy-config", config.string()});

  const auto run = [&](std::vector<std::string> tenant_options, int admitted) {
    const auto json_path = directory_.path() / "live.json";
    std::vector<std::string> arguments{"--limit",   "6",  "--speedup", "20",
                                       "--timeout", "60", "--json",    json_path.string()};
    arguments.insert(arguments.end(), tenant_options.begin(), tenant_options.end());
    const auto status = replay_live(arguments);
    // Refusals are answers, not failures: the run succeeds.
    ASSERT_EQ(status, 0) << read_file(replay_log());
    const auto report = nlohmann::json::parse(read_file(json_path), nullptr, false);
    ASSERT_FALSE(report.is_discarded()) << read_file(json_path);
    const auto& policy = report["policies"][0];
    EXPECT_EQ(policy["completed"], admitted) << policy.dump(2);
    EXPECT_EQ(policy["failed"], 0) << policy.dump(2);
    const auto& live = report["live"];
    EXPECT_EQ(live["rejected_by_admission"], 6 - admitted) << live.dump(2);
    EXPECT_EQ(live["rejected_by_admission_codes"]["ROUTE_ERROR_RATE_LIMITED"], 6 - admitted)
        << live.dump(2);
    EXPECT_EQ(live["route_errors"], 0) << live.dump(2);
    EXPECT_NE(read_file(replay_log())
                  .find("rejected by admission: " + std::to_string(6 - admitted) +
                        " (ROUTE_ERROR_RATE_LIMITED " + std::to_string(6 - admitted) + ")"),
              std::string::npos)
        << read_file(replay_log());
  };
  // One tenant: its first request only.
  run({"--tenant", "heavy"}, 1);
  // Three new tenants t0, t1, t2 (request i names t<i mod 3>): the first request of each.
  run({"--tenants", "3"}, 3);
}

}  // namespace
}  // namespace kvr
