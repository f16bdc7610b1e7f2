// kvr's command line as a real process: every option value that cannot work stops the subcommand
// with exit code 2 and a message naming the option; --help lists only the options that apply
// (replay against replay-live) and `kvr route`'s exit codes; `kvr route` exits 4 when no node
// answers and 1 when one answers with a route error; a --metrics-port in use stops a second node;
// SIGTERM stops a node and a mocker promptly, during startup too.
#include <filesystem>
#include <fstream>
#include <regex>

#include <gtest/gtest.h>
#include <signal.h>

#include "tests/testing/kvr_binary.hpp"
#include "tests/testing/loopback_http.hpp"
#include "tests/testing/nats_server.hpp"
#include "tests/testing/process_run.hpp"

namespace kvr {
namespace {

using namespace std::chrono_literals;
using testing::ChildProcess;
using testing::NatsServer;
using testing::ProcessRun;
using testing::run_process;
using testing::TemporaryDirectory;
using testing::wait_until;

// The exit code of every configuration or usage error.
constexpr int kUsageError = 2;

// True when `help` lists `option` as an option of its own ("--timeout" is not "--ready-timeout").
bool lists_option(const std::string& help, const std::string& option) {
  return std::regex_search(help, std::regex("(^|[\\s,])" + option + "([\\s,={]|$)"));
}

// ---- every bad option exits 2, naming the option --------------------------------------------

struct BadOption {
  const char* name;               // the test's name
  std::vector<std::string> argv;  // after the binary
  std::string named;              // the message names this
};

void PrintTo(const BadOption& bad, std::ostream* out) { *out << bad.name; }

class BadOptionTest : public ::testing::TestWithParam<BadOption> {
 protected:
  TemporaryDirectory directory_;
};

TEST_P(BadOptionTest, ExitsWithTwoNamingTheOption) {
  const BadOption& bad = GetParam();
  std::vector<std::string> argv{kvr::testing::kvr_binary()};
  argv.insert(argv.end(), bad.argv.begin(), bad.argv.end());
  // Nothing here is a reachable NATS server: a value the command line lets through would show up
  // as a connection error instead.
  const ProcessRun run = run_process(argv, directory_.path() / "kvr.log", 60s);
  ASSERT_TRUE(run.exit_code.has_value()) << "did not exit:\n" << run.output;
  EXPECT_EQ(*run.exit_code, kUsageError) << run.output;
  EXPECT_NE(run.output.find(bad.named), std::string::npos)
      << "the message does not name " << bad.named << ":\n"
      << run.output;
}

// A NATS URL nobody listens on, for commands that connect once their options pass.
const std::string kNoNats = "nats://127.0.0.1:1";

const BadOption kBadOptions[] = {
    // kvr itself
    {"NoSubcommand", {}, "subcommand"},
    {"UnknownSubcommand", {"no-such-command"}, "'no-such-command' is not a subcommand"},
    // node
    {"NodeUnknownFlag", {"node", "--no-such-flag"}, "--no-such-flag"},
    {"NodeMissingPolicyConfig",
     {"node", "--router-policy-config", "/nonexistent/policy.yaml"},
     "--router-policy-config"},
    {"NodeZeroBlockSize", {"node", "--block-size", "0"}, "--block-size"},
    {"NodeZeroEngineIdleMs", {"node", "--http-engine-idle-ms", "0"}, "--http-engine-idle-ms"},
    {"NodeHugeEngineIdleConnections",
     {"node", "--http-engine-idle-connections", "1000000"},
     "--http-engine-idle-connections"},
    {"NodeHugeBlockSize", {"node", "--block-size", "100000"}, "--block-size"},
    {"NodeMetricsPortOutOfRange", {"node", "--metrics-port", "70000"}, "--metrics-port"},
    {"NodeMetricsPortZero", {"node", "--metrics-port", "0"}, "--metrics-port"},
    {"NodeActorPortOutOfRange", {"node", "--actor-port", "70000"}, "--actor-port"},
    {"NodeActorPortWithoutPeerTls", {"node", "--actor-port", "7000"}, "--actor-port: the peer"},
    {"NodeClusterWithoutPeerTls", {"node", "--cluster"}, "--cluster: the peer ports need"},
    {"NodePlaintextActorPortOffLoopback",
     {"node", "--actor-port", "7000", "--plaintext-peers", "--actor-address", "0.0.0.0"},
     "--plaintext-peers: only on loopback addresses; --actor-address"},
    {"NodePlaintextClusterOffLoopback",
     {"node", "--cluster", "--plaintext-peers", "--cluster-address", "10.1.2.3"},
     "--plaintext-peers: only on loopback addresses; --cluster-address"},
    {"NodePeerTlsWithoutItsCa",
     {"node", "--cluster", "--peer-tls-cert", KVR_SOURCE_DIR "/tests/data/tls/node-a.pem",
      "--peer-tls-key", KVR_SOURCE_DIR "/tests/data/tls/node-a.key"},
     "--peer-tls-ca: missing"},
    {"NodePeerTlsKeyOfAnotherCertificate",
     {"node", "--actor-port", "7000", "--peer-tls-cert",
      KVR_SOURCE_DIR "/tests/data/tls/node-a.pem", "--peer-tls-key",
      KVR_SOURCE_DIR "/tests/data/tls/node-b.key", "--peer-tls-ca",
      KVR_SOURCE_DIR "/tests/data/tls/cluster-ca.pem"},
     "--peer-tls-key:"},
    {"NodeTooManySchedulerThreads",
     {"node", "--scheduler-threads", "100000"},
     "--scheduler-threads"},
    {"NodeZeroBookingTtl", {"node", "--router-booking-ttl-secs", "0"}, "--router-booking-ttl-secs"},
    {"NodeNanBookingTtl",
     {"node", "--router-booking-ttl-secs", "nan"},
     "--router-booking-ttl-secs"},
    {"NodeZeroMaxOpenBookings",
     {"node", "--router-max-open-bookings", "0"},
     "--router-max-open-bookings"},
    {"NodeHugeMaxBookedBlocks",
     {"node", "--router-max-booked-blocks", "99999999999"},
     "--router-max-booked-blocks"},
    {"NodeNegativePartitionMaxOpenBookings",
     {"node", "--router-partition-max-open-bookings", "-1"},
     "--router-partition-max-open-bookings"},
    {"NodeWordPartitionMaxBookedBlocks",
     {"node", "--router-partition-max-booked-blocks", "many"},
     "--router-partition-max-booked-blocks"},
    {"NodeShardsWithoutCluster",
     {"node", "--partition-shards", "m=4"},
     "--partition-shards: needs --cluster"},
    {"NodeShardsWithoutCount",
     {"node", "--cluster", "--partition-shards", "m"},
     "'m' is not MODEL=SHARDS"},
    {"NodeZeroShards", {"node", "--cluster", "--partition-shards", "m=0"}, "shards: 0"},
    {"NodeZeroFirstTokenTimeout",
     {"node", "--router-first-token-timeout-ms", "0"},
     "--router-first-token-timeout-ms"},
    {"NodeTooManyRetries", {"node", "--router-max-retries", "9"}, "--router-max-retries"},
    {"NodeAbsurdSessionAffinityTtl",
     {"node", "--router-session-affinity-ttl-secs", "99999999999"},
     "--router-session-affinity-ttl-secs"},
    {"NodeUnknownSessionAffinityMode",
     {"node", "--router-session-affinity-mode", "sometimes"},
     "--router-session-affinity-mode"},
    {"NodeNegativeTemperature", {"node", "--temperature", "-1"}, "--temperature"},
    {"NodeInfiniteTemperature", {"node", "--temperature", "inf"}, "--temperature"},
    {"NodeBadNamespace", {"node", "--namespace", "a.b"}, "--namespace"},
    {"NodeAbsurdHitRateWorkload",
     {"node", "--hit-rate-workload-tokens", "1e30"},
     "--hit-rate-workload-tokens"},
    {"NodeEppAddressNotAnIp",
     {"node", "--epp-port", "9002", "--epp-address", "localhost"},
     "--epp-address"},
    {"NodeZeroEppRequestTimeout",
     {"node", "--epp-port", "9002", "--epp-request-timeout-ms", "0"},
     "--epp-request-timeout-ms"},
    {"NodeEppResponseTimeoutBelowTheRequestTimeout",
     {"node", "--epp-port", "9002", "--epp-request-timeout-ms", "60000",
      "--epp-response-timeout-ms", "1000"},
     "--epp-response-timeout-ms"},
    {"NodeZeroEppStreamsPerConnection",
     {"node", "--epp-port", "9002", "--epp-max-streams-per-connection", "0"},
     "--epp-max-streams-per-connection"},
    {"NodeHugeEppOpenStreams",
     {"node", "--epp-port", "9002", "--epp-max-open-streams", "99999999999"},
     "--epp-max-open-streams"},
    {"NodeEppBufferedBodiesBelowOneBody",
     {"node", "--epp-port", "9002", "--epp-max-buffered-body-bytes", "4096"},
     "--epp-max-buffered-body-bytes"},
    {"NodeEppGrpcMemoryBelowTwoBodies",
     {"node", "--epp-port", "9002", "--epp-grpc-memory-bytes", "8388608"},
     "--epp-grpc-memory-bytes"},
    {"NodeZeroHttpHeaderTimeout",
     {"node", "--http-port", "9001", "--http-header-timeout-ms", "0"},
     "--http-header-timeout-ms"},
    {"NodeZeroHttpMinBodyRate",
     {"node", "--http-port", "9001", "--http-min-body-rate", "0"},
     "--http-min-body-rate"},
    {"NodeTinyHttpPendingStreamBytes",
     {"node", "--http-port", "9001", "--http-max-pending-stream-bytes", "100"},
     "--http-max-pending-stream-bytes"},
    {"NodeZeroMaxJsonDepth",
     {"node", "--http-port", "9001", "--max-json-depth", "0"},
     "--max-json-depth"},
    {"NodeMaxJsonDepthAboveTheCeiling",
     {"node", "--epp-port", "9002", "--max-json-depth", "513"},
     "--max-json-depth"},
    {"NodeTooManyRenderThreads",
     {"node", "--http-port", "9001", "--render-threads", "1000"},
     "--render-threads"},
    {"NodeZeroRenderQueue",
     {"node", "--http-port", "9001", "--render-queue", "0"},
     "--render-queue"},
    {"NodeRenderQueuePerClientAboveTheQueue",
     {"node", "--http-port", "9001", "--render-queue", "4", "--render-queue-per-client", "5"},
     "--render-queue-per-client"},
    {"NodeZeroReconnectWait",
     {"node", "--nats-reconnect-wait-ms", "0"},
     "--nats-reconnect-wait-ms"},
    {"NodeEmptyNatsUrl", {"node", "--nats", ""}, "--nats"},
    {"NodeUnknownPolicy",
     {"node", "--nats", kNoNats, "--block-size", "16", "--router-aggregated-policy",
      "no-such-policy"},
     "--router-aggregated-policy"},
    // mocker
    {"MockerUnknownFlag", {"mocker", "--no-such-flag"}, "--no-such-flag"},
    {"MockerZeroWorkers", {"mocker", "--workers", "0"}, "--workers"},
    {"MockerTooManyWorkers", {"mocker", "--workers", "100000"}, "--workers"},
    {"MockerZeroBlockSize", {"mocker", "--block-size", "0"}, "--block-size"},
    {"MockerZeroGpuBlocks", {"mocker", "--num-gpu-blocks", "0"}, "--num-gpu-blocks"},
    {"MockerFleetOfAbsurdSize",
     {"mocker", "--nats", kNoNats, "--workers", "4096", "--num-gpu-blocks", "1000000"},
     "--num-gpu-blocks"},
    {"MockerZeroBatchedTokens",
     {"mocker", "--max-num-batched-tokens", "0"},
     "--max-num-batched-tokens"},
    {"MockerZeroSeqs", {"mocker", "--max-num-seqs", "0"}, "--max-num-seqs"},
    {"MockerZeroDataParallel", {"mocker", "--data-parallel-size", "0"}, "--data-parallel-size"},
    {"MockerShortLivenessTtl", {"mocker", "--liveness-ttl-ms", "0"}, "--liveness-ttl-ms"},
    {"MockerZeroLoadInterval", {"mocker", "--load-interval-ms", "0"}, "--load-interval-ms"},
    {"MockerZeroTimeScale", {"mocker", "--time-scale", "0"}, "--time-scale"},
    {"MockerNanDecodeFloor", {"mocker", "--decode-floor-ms", "nan"}, "--decode-floor-ms"},
    {"MockerNegativePrefill", {"mocker", "--prefill-linear-ms", "-1"}, "--prefill-linear-ms"},
    {"MockerNegativeDuration", {"mocker", "--duration", "-1"}, "--duration"},
    {"MockerEmptyModel", {"mocker", "--model", ""}, "--model"},
    {"MockerUnknownRole", {"mocker", "--role", "chef"}, "--role"},
    {"MockerBadNamespace", {"mocker", "--namespace", "a b"}, "--namespace"},
    // bridge
    {"BridgeEngineUrlWithoutScheme",
     {"bridge", "--nats", kNoNats, "--engine-url", "127.0.0.1:8000"},
     "--engine-url"},
    {"BridgeAdvertiseUrlWithQuery",
     {"bridge", "--nats", kNoNats, "--advertise-url", "http://10.0.0.7:8000/?x=1"},
     "--advertise-url"},
    // route
    {"RouteZeroTimeout", {"route", "--text", "hello", "--timeout-ms", "0"}, "--timeout-ms"},
    {"RouteNoPrompt", {"route", "--nats", kNoNats}, "--text"},
    {"RouteTokensAndText", {"route", "--tokens", "1,2", "--text", "hello"}, "--text"},
    {"RouteBadToken", {"route", "--tokens", "one"}, "--tokens"},
    {"RouteEmptyModel", {"route", "--text", "hello", "--model", ""}, "--model"},
    // replay
    {"ReplayZeroWorkers", {"replay", "--workers", "0"}, "--workers"},
    {"ReplayZeroShards", {"replay", "--partition-shards", "0"}, "--partition-shards"},
    {"ReplayZeroSpeedup", {"replay", "--speedup", "0"}, "--speedup"},
    {"ReplayNanSpeedup", {"replay", "--speedup", "nan"}, "--speedup"},
    {"ReplayZeroBlockSize", {"replay", "--block-size", "0"}, "--block-size"},
    {"ReplayNegativeKvEventDelay", {"replay", "--kv-event-delay-ms", "-1"}, "--kv-event-delay-ms"},
    {"ReplayMissingTrace", {"replay", "--trace", "/nonexistent/trace.jsonl"}, "--trace"},
    {"ReplayFleetOfAbsurdSize", {"replay", "--workers", "100000"}, "--num-gpu-blocks"},
    {"ReplayNoPolicy", {"replay", "--policies", ","}, "--policies"},
    {"ReplayLiveFlagIsGone", {"replay", "--live"}, "--live"},
    {"ReplayTakesNoNatsOption", {"replay", "--nats", kNoNats}, "--nats"},
    {"ReplayTakesNoConcurrency", {"replay", "--concurrency", "4"}, "--concurrency"},
    // replay-live
    {"ReplayLiveZeroConcurrency", {"replay-live", "--concurrency", "0"}, "--concurrency"},
    {"ReplayLiveZeroTimeout", {"replay-live", "--timeout", "0"}, "--timeout"},
    {"ReplayLiveZeroReadyTimeout", {"replay-live", "--ready-timeout", "0"}, "--ready-timeout"},
    {"ReplayLiveZeroBlockSize", {"replay-live", "--block-size", "0"}, "--block-size"},
    {"ReplayLiveZeroSpeedup", {"replay-live", "--speedup", "0"}, "--speedup"},
    {"ReplayLiveTakesNoWorkers", {"replay-live", "--workers", "4"}, "--workers"},
    {"ReplayLiveTakesNoPolicies", {"replay-live", "--policies", "kv-cost"}, "--policies"},
    {"ReplayLiveTakesNoEngineOption", {"replay-live", "--num-gpu-blocks", "8"}, "--num-gpu-blocks"},
};

std::string bad_option_name(const ::testing::TestParamInfo<BadOption>& param) {
  return param.param.name;
}

INSTANTIATE_TEST_SUITE_P(EverySubcommand, BadOptionTest, ::testing::ValuesIn(kBadOptions),
                         bad_option_name);

// ---- --help lists what applies ----------------------------------------------------------------

class CliHelpTest : public ::testing::Test {
 protected:
  std::string help(const std::string& subcommand) {
    const ProcessRun run = run_process({kvr::testing::kvr_binary(), subcommand, "--help"},
                                       directory_.path() / "help.log", 30s);
    EXPECT_EQ(run.exit_code, 0) << run.output;
    return run.output;
  }
  TemporaryDirectory directory_;
};

// What the simulation decides: live, the cluster does.
const char* const kOfflineOnly[] = {"--workers",
                                    "--policies",
                                    "--router-policy-config",
                                    "--seed",
                                    "--kv-event-delay-ms",
                                    "--temperature",
                                    "--num-gpu-blocks",
                                    "--max-num-batched-tokens",
                                    "--max-num-seqs",
                                    "--time-scale",
                                    "--no-prefix-caching",
                                    "--prefill-quadratic-ms",
                                    "--prefill-linear-ms",
                                    "--prefill-constant-ms",
                                    "--decode-quadratic-ms",
                                    "--decode-linear-ms",
                                    "--decode-constant-ms",
                                    "--decode-floor-ms"};
const char* const kLiveOnly[] = {"--live",          "--nats",          "--nats-user",
                                 "--nats-password", "--nats-token",    "--nats-tls-ca",
                                 "--nats-tls-cert", "--nats-tls-key",  "--nats-reconnect-wait-ms",
                                 "--namespace",     "--model",         "--concurrency",
                                 "--timeout",       "--ready-timeout", "--send-tokens"};
const char* const kBoth[] = {"--trace", "--limit", "--speedup",   "--json",
                             "--plot",  "--quiet", "--block-size"};

TEST_F(CliHelpTest, ReplayLiveListsNoOfflineOnlyOption) {
  const std::string text = help("replay-live");
  for (const char* option : kOfflineOnly) EXPECT_FALSE(lists_option(text, option)) << option;
  for (const char* option : kLiveOnly) {
    if (std::string_view{option} == "--live") continue;
    EXPECT_TRUE(lists_option(text, option)) << option << "\n" << text;
  }
  for (const char* option : kBoth) EXPECT_TRUE(lists_option(text, option)) << option;
}

TEST_F(CliHelpTest, ReplayListsNoLiveOnlyOption) {
  const std::string text = help("replay");
  for (const char* option : kLiveOnly) EXPECT_FALSE(lists_option(text, option)) << option;
  for (const char* option : kOfflineOnly) {
    EXPECT_TRUE(lists_option(text, option)) << option << "\n" << text;
  }
  for (const char* option : kBoth) EXPECT_TRUE(lists_option(text, option)) << option;
}

TEST_F(CliHelpTest, RouteDocumentsEachExitCode) {
  const std::string text = help("route");
  for (const char* code : {"0 routed", "1 route error", "2 usage or configuration error",
                           "3 rejected by admission", "4 no decision"}) {
    EXPECT_NE(text.find(code), std::string::npos) << code << "\n" << text;
  }
}

// ---- kvr node --check-config -----------------------------------------------------------------

class CliCheckConfigTest : public ::testing::Test {
 protected:
  // Runs `kvr node --check-config` with a router-policy YAML of `yaml` and `extra`; nothing
  // listens on its NATS port, so a node that tried to connect would fail.
  ProcessRun check(const std::string& yaml, std::vector<std::string> extra = {}) {
    const std::filesystem::path config = directory_.path() / "router.yaml";
    std::ofstream{config} << yaml;
    std::vector<std::string> argv{kvr::testing::kvr_binary(),
                                  "node",
                                  "--check-config",
                                  "--nats",
                                  "nats://127.0.0.1:" + std::to_string(testing::free_port()),
                                  "--router-policy-config",
                                  config.string()};
    argv.insert(argv.end(), extra.begin(), extra.end());
    return run_process(argv, directory_.path() / "kvr.log", 60s);
  }

  TemporaryDirectory directory_;
};

TEST_F(CliCheckConfigTest, AValidConfigurationExitsZeroWithoutConnecting) {
  const ProcessRun run = check(R"(worker_selection: {decode: least-loaded}
request_classifier: {type: max-in-flight, parameters: {max_in_flight: 4}}
models: {llama: {tokenizer_mode: engine}, mistral: {}}
)");
  EXPECT_EQ(run.exit_code, 0) << run.output;
  EXPECT_NE(run.output.find("the configuration is valid (2 models checked)"), std::string::npos)
      << run.output;
}

// The plugin's provider runs (and passes) at startup; only its factory, which each partition
// runs when it is created, throws: the check reports it before any traffic.
TEST_F(CliCheckConfigTest, AThrowingPolicyFactoryExitsTwoNamingTheModelRoleAndPlugin) {
  const ProcessRun run = check("worker_selection: {decode: unbuildable}\nmodels: {llama: {}}\n",
                               {"--plugin", KVR_UNBUILDABLE_POLICY_PLUGIN});
  EXPECT_EQ(run.exit_code, kUsageError) << run.output;
  EXPECT_NE(run.output.find("--check-config: policy 'unbuildable' (type unbuildable) for decode "
                            "requests of model 'llama' group 'default' could not be built: its "
                            "factory threw: no GPU budget configured"),
            std::string::npos)
      << run.output;
}

// ---- a node against a real NATS server ------------------------------------------------------

class CliNodeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string error;
    server_ = NatsServer::start(&error);
    ASSERT_TRUE(server_) << error;
  }

  // Starts `kvr node` with the server and a fixed block size, plus `extra`.
  std::optional<ChildProcess> start_node(const std::string& name,
                                         std::vector<std::string> extra = {}) {
    std::vector<std::string> argv{kvr::testing::kvr_binary(),
                                  "node",
                                  "--nats",
                                  server_->url(),
                                  "--namespace",
                                  "cli",
                                  "--block-size",
                                  "16"};
    argv.insert(argv.end(), extra.begin(), extra.end());
    return ChildProcess::start(argv, directory_.path() / (name + ".log"));
  }

  static bool healthy(std::uint16_t port) {
    return testing::http_get(port, "/healthz").find("200") != std::string::npos;
  }

  TemporaryDirectory directory_;
  std::unique_ptr<NatsServer> server_;
};

TEST_F(CliNodeTest, SecondNodeOnAMetricsPortInUseStopsWithTwoNamingThePort) {
  const std::uint16_t port = testing::free_port();
  const std::string port_text = std::to_string(port);
  auto first = start_node("first", {"--metrics-port", port_text});
  ASSERT_TRUE(first);
  ASSERT_TRUE(wait_until([&] { return healthy(port); }, 30s)) << first->log();

  auto second = start_node("second", {"--metrics-port", port_text});
  ASSERT_TRUE(second);
  const auto status = second->wait(30s);
  ASSERT_TRUE(status.has_value()) << "the second node kept running:\n" << second->log();
  EXPECT_EQ(*status, kUsageError) << second->log();
  EXPECT_NE(second->log().find("--metrics-port " + port_text), std::string::npos) << second->log();
  // The first node still owns the port.
  EXPECT_TRUE(first->running()) << first->log();
  EXPECT_TRUE(healthy(port));
}

// `kvr route`'s exit codes other than 0 (cli_defaults_test), 2 (BadOptionTest) and 3
// (node_admission_test).
constexpr int kRouteError = 1;
constexpr int kNoDecision = 4;

// Runs `kvr route` in the fixture's namespace.
ProcessRun run_route(const NatsServer& server, const std::filesystem::path& log) {
  return run_process({kvr::testing::kvr_binary(), "route", "--nats", server.url(), "--namespace",
                      "cli", "--text", "hello", "--timeout-ms", "1000"},
                     log, 30s);
}

TEST_F(CliNodeTest, RouteThatNoNodeAnswersExitsWithFour) {
  const ProcessRun run = run_route(*server_, directory_.path() / "route.log");
  EXPECT_EQ(run.exit_code, kNoDecision) << run.output;
  EXPECT_NE(run.output.find("no decision"), std::string::npos) << run.output;
}

TEST_F(CliNodeTest, RouteThatTheNodeAnswersWithAnErrorExitsWithOne) {
  auto node = start_node("node");
  ASSERT_TRUE(node);
  // No worker serves the model: once the node subscribed, it answers ROUTE_ERROR_NO_WORKERS.
  ProcessRun run;
  const bool answered = wait_until(
      [&] {
        run = run_route(*server_, directory_.path() / "route.log");
        return run.exit_code != kNoDecision || !node->running();
      },
      30s);
  ASSERT_TRUE(answered) << run.output << "\n---- node log\n" << node->log();
  EXPECT_EQ(run.exit_code, kRouteError) << run.output;
  EXPECT_NE(run.output.find("error ROUTE_ERROR_NO_WORKERS"), std::string::npos) << run.output;
  EXPECT_TRUE(node->running()) << node->log();
}

TEST_F(CliNodeTest, SigtermStopsARunningNodePromptly) {
  const std::uint16_t port = testing::free_port();
  auto node = start_node("node", {"--metrics-port", std::to_string(port)});
  ASSERT_TRUE(node);
  ASSERT_TRUE(wait_until([&] { return healthy(port); }, 30s)) << node->log();
  node->signal(SIGTERM);
  const auto status = node->wait(10s);
  ASSERT_TRUE(status.has_value()) << "SIGTERM did not stop the node:\n" << node->log();
  EXPECT_EQ(*status, 0) << node->log();
}

TEST_F(CliNodeTest, SigintStopsARunningMockerPromptly) {
  auto mocker = ChildProcess::start({kvr::testing::kvr_binary(), "mocker", "--nats", server_->url(),
                                     "--namespace", "cli", "--workers", "2"},
                                    directory_.path() / "mocker.log");
  ASSERT_TRUE(mocker);
  ASSERT_TRUE(wait_until([&] { return mocker->log().find("serving") != std::string::npos; }, 30s))
      << mocker->log();
  mocker->signal(SIGINT);
  const auto status = mocker->wait(10s);
  ASSERT_TRUE(status.has_value()) << "SIGINT did not stop the mocker:\n" << mocker->log();
  EXPECT_EQ(*status, 0) << mocker->log();
}

// A server that accepts the connection and never sends its INFO holds the NATS handshake, so
// the process is caught in its startup, after its options passed.
void expect_sigterm_stops_during_startup(const std::string& subcommand) {
  TemporaryDirectory directory;
  testing::SilentListener silent;
  ASSERT_NE(silent.port(), 0);
  auto process = ChildProcess::start(
      {kvr::testing::kvr_binary(), subcommand, "--nats",
       "nats://127.0.0.1:" + std::to_string(silent.port()), "--block-size", "16"},
      directory.path() / "kvr.log");
  ASSERT_TRUE(process);
  ASSERT_TRUE(silent.accept_one(30s)) << process->log();
  process->signal(SIGTERM);
  const auto status = process->wait(10s);
  ASSERT_TRUE(status.has_value()) << "SIGTERM did not stop kvr " << subcommand << ":\n"
                                  << process->log();
  // 128 + SIGTERM: stopped by the signal, not by the handshake's own timeout (which exits 2).
  EXPECT_EQ(*status, 128 + SIGTERM) << process->log();
}

TEST(CliStartupTest, SigtermStopsANodeDuringStartup) {
  expect_sigterm_stops_during_startup("node");
}

TEST(CliStartupTest, SigtermStopsAMockerDuringStartup) {
  expect_sigterm_stops_during_startup("mocker");
}

}  // namespace
}  // namespace kvr
