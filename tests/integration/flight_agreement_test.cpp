// `kvr replay` and a real node carry out each request's flight alike (both keep the RequestFlight
// core per request): one small trace goes through `kvr replay` (the command for its report and
// decisions, its core in process for each request's flight, which the command prints nowhere)
// and, request by request, through a real `kvr node` in generate mode with `kvr mocker` workers
// on a real nats-server. Every request must end the same way in both: completed, with no retry,
// and on a disaggregated fleet with its prefill hop on a prefill worker and its stream from a
// decode worker, or decoded alone where conditional disaggregation skips the hop. The prompts
// share no block, so which requests take the hop depends on their length alone, never on how soon
// the node's index learnt the workers' KV.
#include <fstream>
#include <map>
#include <ostream>
#include <sstream>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "deploy/replay/trace_replay.hpp"
#include "deploy/simulation/mooncake_trace.hpp"
#include "kvr/v1/routing.pb.h"
#include "messages/subjects.hpp"
#include "selection/config/router_policy_config.hpp"
#include "selection/policies/builtin_policies.hpp"
#include "tests/testing/kvr_binary.hpp"
#include "tests/testing/kvr_cluster_test.hpp"
#include "tests/testing/loopback_http.hpp"
#include "tests/testing/nats_recorder.hpp"
#include "tests/testing/process_run.hpp"

namespace kvr {
namespace {

using namespace std::chrono_literals;
using testing::ChildProcess;
using testing::ChunkStream;
using testing::read_file;
using testing::wait_until;

constexpr std::string_view kNamespace = "flight";
constexpr std::uint32_t kBlockSize = 64;
constexpr std::uint64_t kGpuBlocks = 4096;
constexpr std::size_t kRequests = 6;
constexpr std::uint32_t kOutputTokens = 6;
// Even requests are long (they take the prefill hop), odd ones shorter than this many tokens
// (decoded alone).
constexpr std::uint32_t kMinUncachedTokens = 512;

// The workers, numbered as `kvr replay` numbers them: 1 .. prefill are prefill workers, the next
// `serving` decode workers (aggregated ones when there is no prefill worker).
struct Fleet {
  std::size_t prefill = 0;
  std::size_t serving = 0;

  std::size_t workers() const { return prefill + serving; }
  std::string role_of(WorkerId id) const {
    if (id >= 1 && id <= prefill) return "prefill";
    if (id > prefill && id <= workers()) return prefill > 0 ? "decode" : "aggregated";
    return fmt::format("unknown worker {}", id);
  }
};

// One request's flight as its outcome shows it.
struct FlightOutcome {
  bool completed = false;
  std::uint32_t retries = 0;
  /// The role of its prefill hop's worker ("none": no prefill hop), and of the worker that
  /// streamed its answer.
  std::string prefill_role = "none";
  std::string serving_role = "none";

  bool operator==(const FlightOutcome&) const = default;
};

std::ostream& operator<<(std::ostream& out, const FlightOutcome& flight) {
  return out << (flight.completed ? "completed" : "not completed") << ", " << flight.retries
             << " retries, prefill hop: " << flight.prefill_role
             << ", served by: " << flight.serving_role;
}

class FlightAgreementTest : public testing::KvrClusterTest {
 protected:
  FlightAgreementTest() : KvrClusterTest(kvr::testing::kvr_binary(), std::string{kNamespace}) {}

  void SetUp() override {
    KvrClusterTest::SetUp();
    if (HasFatalFailure()) return;
    std::ofstream trace{trace_path_};
    for (std::size_t i = 0; i < kRequests; ++i) {
      const bool long_prompt = i % 2 == 0;
      trace << "{\"timestamp\": " << i * 200
            << ", \"input_length\": " << (long_prompt ? 1400 : kMinUncachedTokens - 200)
            << ", \"output_length\": " << kOutputTokens << ", \"hash_ids\": [";
      for (std::size_t block = 0; block < (long_prompt ? 3U : 1U); ++block) {
        trace << (block == 0 ? "" : ", ") << i * 100 + block;
      }
      trace << "]}\n";
    }
    std::ofstream{policy_path_} << fmt::format(
        "worker_selection: {{aggregated: kv-cost, prefill: kv-cost, decode: kv-cost}}\n"
        "models:\n"
        "  replay: {{disaggregation: {{min_uncached_tokens: {0}}}}}\n"
        "  mock-model: {{disaggregation: {{min_uncached_tokens: {0}}}}}\n",
        kMinUncachedTokens);
  }

  void TearDown() override {
    if (HasFailure()) {
      if (node_) std::cerr << "---- node log\n" << node_->log();
      for (const ChildProcess& mocker : mockers_) std::cerr << "---- mocker\n" << mocker.log();
    }
  }

  // `kvr replay` of the trace on `fleet`: its report's completed and failed requests and
  // disaggregation decisions, and each completed request's worker from its decisions file.
  void replay_command(const Fleet& fleet) {
    const auto json_path = directory_.path() / "replay.json";
    const auto decisions_path = directory_.path() / "replay.tsv";
    const auto run = testing::run_process({kvr::testing::kvr_binary(),
                                           "replay",
                                           "--quiet",
                                           "--trace",
                                           trace_path_.string(),
                                           "--workers",
                                           std::to_string(fleet.workers()),
                                           "--prefill-workers",
                                           std::to_string(fleet.prefill),
                                           "--block-size",
                                           std::to_string(kBlockSize),
                                           "--num-gpu-blocks",
                                           std::to_string(kGpuBlocks),
                                           "--router-policy-config",
                                           policy_path_.string(),
                                           "--policies",
                                           "kv-cost",
                                           "--json",
                                           json_path.string(),
                                           "--decisions",
                                           decisions_path.string()},
                                          directory_.path() / "replay.log", 60s);
    ASSERT_EQ(run.exit_code, 0) << run.output;
    const auto report = nlohmann::json::parse(read_file(json_path), nullptr, false);
    ASSERT_FALSE(report.is_discarded()) << read_file(json_path);
    command_report_ = report["policies"][0];
    std::istringstream lines{read_file(decisions_path)};
    std::string label;
    std::size_t index = 0;
    WorkerId worker = 0;
    std::uint32_t rank = 0;
    while (lines >> label >> index >> worker >> rank) command_workers_[index] = worker;
  }

  // The same replay in process, for each request's flight.
  void replay_flights(const Fleet& fleet) {
    auto trace = simulation::load_mooncake_trace(trace_path_);
    ASSERT_TRUE(trace) << trace.error();
    plugins::RouterPluginRegistry registry;
    auto registered = selection::register_builtin_policies(registry);
    ASSERT_TRUE(registered) << registered.error().message();
    auto config = selection::load_router_policy_config(policy_path_);
    ASSERT_TRUE(config) << config.error();
    auto plugins = registry.resolve_plugins(*config);
    ASSERT_TRUE(plugins) << plugins.error().message();
    replay::ReplayOptions options;
    options.workers = fleet.workers();
    options.prefill_workers = fleet.prefill;
    options.engine.block_size = kBlockSize;
    options.engine.num_gpu_blocks = kGpuBlocks;
    const replay::TraceReplay replay{"flights", std::move(*trace), options};
    std::vector<simulation::ReplayRequestOutcome> outcomes;
    (void)replay.run("kv-cost", *plugins, 0, &outcomes);
    replayed_.assign(replay.size(), FlightOutcome{});
    for (const simulation::ReplayRequestOutcome& outcome : outcomes) {
      FlightOutcome& flight = replayed_.at(outcome.trace_index);
      flight.completed = true;
      flight.retries = outcome.retries;
      if (outcome.prefill_worker)
        flight.prefill_role = fleet.role_of(outcome.prefill_worker->worker_id);
      flight.serving_role = fleet.role_of(outcome.worker.worker_id);
      replayed_workers_[outcome.trace_index] = outcome.worker.worker_id;
    }
  }

  // Starts `fleet` as `kvr mocker` workers numbered as replay numbers them, and a node routing
  // them with the same policy YAML; returns once the node knows every worker.
  void start_cluster(const Fleet& fleet) {
    const auto start_mockers = [&](std::size_t count, WorkerId first, std::string_view role) {
      std::vector<std::string> extra;
      if (!role.empty()) extra = {"--role", std::string{role}};
      auto mocker = kvr_->start_mocker({.workers = static_cast<int>(count),
                                        .worker_id_base = first,
                                        .block_size = kBlockSize,
                                        .num_gpu_blocks = kGpuBlocks,
                                        .time_scale = "20",
                                        .load_interval_ms = 50,
                                        .extra = std::move(extra)},
                                       fmt::format("mocker-{}.log", first));
      ASSERT_TRUE(mocker);
      mockers_.push_back(std::move(*mocker));
    };
    if (fleet.prefill > 0) {
      start_mockers(fleet.prefill, 1, "prefill");
      start_mockers(fleet.serving, fleet.prefill + 1, "decode");
    } else {
      start_mockers(fleet.serving, 1, "");
    }
    if (HasFatalFailure()) return;
    metrics_port_ = testing::free_port();
    node_ = kvr_->start_node({.block_size = kBlockSize,
                              .metrics_port = metrics_port_,
                              .extra = {"--router-policy-config", policy_path_.string()}});
    ASSERT_TRUE(node_);
    ASSERT_TRUE(testing::wait_until_healthy(metrics_port_, 20s)) << node_->log();
    ASSERT_TRUE(wait_until(
        [&] { return node_metric("kvr_workers") == static_cast<double>(fleet.workers()); }, 20s));
  }

  // Sends the trace's requests to the node in generate mode, one at a time, each once the one
  // before has ended and released its bookings, and records each one's flight.
  void live_flights(const Fleet& fleet) {
    auto trace = simulation::load_mooncake_trace(trace_path_);
    ASSERT_TRUE(trace) << trace.error();
    live_.assign(trace->size(), FlightOutcome{});
    for (std::size_t i = 0; i < trace->size(); ++i) {
      const simulation::TraceRequest& request = (*trace)[i];
      const double retries_before = node_metric("kvr_generate_retries_total");
      ChunkStream stream;
      ASSERT_TRUE(stream.open(*client_));
      v1::GenerateRequest generate;
      auto* route = generate.mutable_route();
      route->set_request_id(fmt::format("flight-{}", i));
      route->set_model("mock-model");
      route->set_expected_output_tokens(request.output_length);
      auto* hashes = route->mutable_block_hashes();
      hashes->set_prompt_tokens(request.input_length);
      for (const BlockHash hash : simulation::expand_to_block_hashes(request, kBlockSize)) {
        hashes->add_hashes(hash);
      }
      generate.set_max_output_tokens(request.output_length);
      generate.set_stream_subject(stream.subject());
      auto reply =
          client_->request(subjects::router_generate(kNamespace), generate.SerializeAsString(), 5s);
      ASSERT_TRUE(reply) << "request " << i << ": " << reply.error();
      v1::RouteDecision decision;
      ASSERT_TRUE(decision.ParseFromString(reply->data)) << "request " << i;
      ASSERT_TRUE(decision.has_success()) << "request " << i << ": " << decision.DebugString();
      ASSERT_TRUE(wait_until([&] { return stream.finished(); }, 20s))
          << "request " << i << " got " << stream.size() << " chunks";
      ASSERT_TRUE(wait_until([&] { return node_metric("kvr_bookings_open") == 0; }, 10s))
          << "request " << i << " left a booking open";

      const std::vector<v1::GenerateChunk> chunks = stream.chunks();
      ASSERT_EQ(chunks.size(), kOutputTokens) << "request " << i;
      for (std::size_t c = 0; c < chunks.size(); ++c) {
        EXPECT_EQ(chunks[c].index(), c) << "request " << i;
        EXPECT_EQ(chunks[c].worker_id(), chunks.front().worker_id()) << "request " << i;
      }
      FlightOutcome& flight = live_[i];
      // Completed: the worker ended the stream itself, at its output limit.
      flight.completed = !chunks.back().has_error() && chunks.back().finish_reason() == "length";
      flight.retries =
          static_cast<std::uint32_t>(node_metric("kvr_generate_retries_total") - retries_before);
      // The client's decision names the worker that started the request: its prefill worker
      // when it took the prefill hop.
      if (fleet.role_of(decision.success().worker_id()) == "prefill")
        flight.prefill_role = "prefill";
      flight.serving_role = fleet.role_of(chunks.front().worker_id());
    }
  }

  double node_metric(const std::string& prefix) {
    return testing::metric(testing::http_get(metrics_port_, "/metrics"), prefix);
  }

  // Replay's and the node's flights of every request, which must be equal.
  void expect_same_flights() {
    ASSERT_EQ(live_.size(), kRequests);
    ASSERT_EQ(replayed_.size(), kRequests);
    for (std::size_t i = 0; i < kRequests; ++i) {
      EXPECT_EQ(live_[i], replayed_[i]) << "request " << i << " of the trace: live vs replay";
    }
    // The command ran the same core: the same workers served the same requests.
    EXPECT_EQ(command_workers_, replayed_workers_);
    EXPECT_EQ(command_report_["completed"], kRequests) << command_report_.dump(2);
    EXPECT_EQ(command_report_["failed"], 0) << command_report_.dump(2);
    EXPECT_EQ(node_metric("kvr_generate_outcomes_total{outcome=\"completed\""),
              static_cast<double>(kRequests));
  }

  std::filesystem::path trace_path_ = directory_.path() / "trace.jsonl";
  std::filesystem::path policy_path_ = directory_.path() / "policy.yaml";
  std::vector<ChildProcess> mockers_;
  std::optional<ChildProcess> node_;
  std::uint16_t metrics_port_ = 0;
  nlohmann::json command_report_;
  std::map<std::size_t, WorkerId> command_workers_;
  std::map<std::size_t, WorkerId> replayed_workers_;
  std::vector<FlightOutcome> replayed_;
  std::vector<FlightOutcome> live_;
};

TEST_F(FlightAgreementTest, AnAggregatedFleetCompletesEveryRequestWithoutRetryInReplayAndANode) {
  const Fleet fleet{.prefill = 0, .serving = 2};
  ASSERT_NO_FATAL_FAILURE(replay_command(fleet));
  ASSERT_NO_FATAL_FAILURE(replay_flights(fleet));
  ASSERT_NO_FATAL_FAILURE(start_cluster(fleet));
  ASSERT_NO_FATAL_FAILURE(live_flights(fleet));
  expect_same_flights();
  for (const FlightOutcome& flight : replayed_) {
    EXPECT_EQ(flight, (FlightOutcome{true, 0, "none", "aggregated"}));
  }
}

TEST_F(FlightAgreementTest, ADisaggregatedFleetTakesTheSameHopsInReplayAndANode) {
  const Fleet fleet{.prefill = 2, .serving = 2};
  ASSERT_NO_FATAL_FAILURE(replay_command(fleet));
  ASSERT_NO_FATAL_FAILURE(replay_flights(fleet));
  ASSERT_NO_FATAL_FAILURE(start_cluster(fleet));
  ASSERT_NO_FATAL_FAILURE(live_flights(fleet));
  expect_same_flights();
  // Not a degenerate trace: the long prompts take the prefill hop, the short ones skip it.
  for (std::size_t i = 0; i < kRequests; ++i) {
    EXPECT_EQ(replayed_[i], (FlightOutcome{true, 0, i % 2 == 0 ? "prefill" : "none", "decode"}))
        << "request " << i;
  }
  // Both counted the same disaggregation decisions.
  const std::size_t half = kRequests / 2;
  EXPECT_EQ(command_report_["disaggregation"]["disaggregated"], half) << command_report_.dump(2);
  EXPECT_EQ(command_report_["disaggregation"]["short_prompt"], half) << command_report_.dump(2);
  for (const std::string_view reason : {"disaggregated", "short_prompt"}) {
    EXPECT_EQ(node_metric(fmt::format("kvr_disaggregation_decisions_total{{partition=\"mock-model/"
                                      "default\",reason=\"{}\"}}",
                                      reason)),
              static_cast<double>(half))
        << reason;
  }
}

}  // namespace
}  // namespace kvr
