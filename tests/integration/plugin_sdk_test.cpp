// The extension door end to end, as a user outside the project walks it: `cmake --install` the SDK
// into a fresh prefix; check that each public header compiles on its own and names no CAF, NATS or
// protobuf type; build deploy/examples (an out-of-tree plugin project) against that prefix alone;
// run `kvr node --plugin` with a router-policy YAML naming the plugin's type and route through it
// with `kvr route`; compare it with a built-in in `kvr replay --plugin`. Every plugin kvr must
// refuse stops startup with exit 2, naming the plugin and the cause. And a plugin whose components
// throw, return NaN or a row past the last, or read a group they did not declare fails only the
// selections it spoils, under a steady route stream.
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "kvr/version.hpp"
#include "messages/nats/route_client.hpp"
#include "messages/subjects.hpp"
#include "tests/testing/kvr_binary.hpp"
#include "tests/testing/kvr_cluster_test.hpp"
#include "tests/testing/loopback_http.hpp"

namespace kvr {
namespace {

using namespace std::chrono_literals;
namespace fs = std::filesystem;
using testing::ChildProcess;
using testing::read_file;

constexpr std::string_view kNamespace = "plugins";

// Runs a program to its end; its exit code (nullopt: it did not end in time).
std::optional<int> run(const std::vector<std::string>& argv, const fs::path& log,
                       std::chrono::milliseconds timeout = 300s) {
  auto process = ChildProcess::start(argv, log);
  if (!process) return std::nullopt;
  return process->wait(timeout);
}

// Output of a program run to its end, or nullopt when it failed.
std::optional<std::string> output_of(const std::vector<std::string>& argv, const fs::path& log) {
  fs::remove(log);
  if (run(argv, log, 30s) != 0) return std::nullopt;
  return read_file(log);
}

// Package names of a Depends-style field ("a (>= 1), b | c"), version constraints and
// architecture qualifiers dropped; every alternative is listed.
std::vector<std::string> package_names(std::string_view field) {
  std::vector<std::string> names;
  std::string name;
  bool in_version = false;
  auto flush = [&] {
    if (auto colon = name.find(':'); colon != std::string::npos) name.resize(colon);
    if (!name.empty()) names.push_back(name);
    name.clear();
  };
  for (const char c : field) {
    if (c == '(') in_version = true;
    if (in_version) {
      in_version = c != ')';
      continue;
    }
    if (c == ',' || c == '|' || c == ' ' || c == '\n') {
      flush();
    } else {
      name.push_back(c);
    }
  }
  flush();
  return names;
}

// The installed packages apt would bring in for `depends`: the field's packages and, through
// their Depends and Pre-Depends, everything they need; a virtual name brings in the installed
// packages that provide it.
std::set<std::string> dependency_closure(std::string_view depends, const fs::path& log) {
  std::map<std::string, std::vector<std::string>> needs;      // package -> its dependencies
  std::map<std::string, std::vector<std::string>> providers;  // virtual name -> packages
  const auto installed = output_of(
      {"dpkg-query", "-W", "-f", "${Package}\t${Provides}\t${Depends}, ${Pre-Depends}\n"}, log);
  if (!installed) return {};
  std::istringstream rows{*installed};
  for (std::string row; std::getline(rows, row);) {
    const auto first_tab = row.find('\t');
    const auto second_tab = row.find('\t', first_tab + 1);
    if (second_tab == std::string::npos) continue;
    const std::string package = row.substr(0, first_tab);
    for (auto& name : package_names(row.substr(first_tab + 1, second_tab - first_tab - 1))) {
      providers[name].push_back(package);
    }
    needs[package] = package_names(row.substr(second_tab + 1));
  }
  std::set<std::string> closure;
  std::vector<std::string> pending = package_names(depends);
  while (!pending.empty()) {
    std::string name = std::move(pending.back());
    pending.pop_back();
    if (closure.contains(name)) continue;
    if (auto package = needs.find(name); package != needs.end()) {
      closure.insert(name);
      pending.insert(pending.end(), package->second.begin(), package->second.end());
    }
    if (auto provided = providers.find(name); provided != providers.end()) {
      pending.insert(pending.end(), provided->second.begin(), provided->second.end());
    }
  }
  return closure;
}

// The package owning a library file ldd resolved (merged /usr: a /lib path may be listed under
// /usr/lib), or nullopt.
std::optional<std::string> owning_package(const fs::path& library, const fs::path& log) {
  std::vector<std::string> candidates{library.string()};
  if (library.string().starts_with("/lib")) candidates.push_back("/usr" + library.string());
  std::error_code ignored;
  candidates.push_back(fs::canonical(library, ignored).string());
  for (const auto& candidate : candidates) {
    if (candidate.empty()) continue;
    if (auto owner = output_of({"dpkg-query", "-S", candidate}, log)) {
      const auto colon = owner->find(':');  // "libc6:amd64: /lib/..." or "libc6: /lib/..."
      return owner->substr(0, colon);
    }
  }
  return std::nullopt;
}

// The SDK installed once for the suite, and the plugin projects built against it.
class PluginSdkTest : public testing::KvrClusterTest {
 protected:
  PluginSdkTest() : KvrClusterTest(kvr::testing::kvr_binary(), std::string{kNamespace}) {}

  // The fixture's SDK (tests/integration/prepare_plugin_sdk.cmake, PluginSdkTest.Prepare) when
  // ctest prepared it for this build; else, run alone, the same steps into a folder of its own.
  // A failure here is kept and fails every test (SetUp): ctest would count a suite whose
  // SetUpTestSuite failed as skipped, not failed.
  static void SetUpTestSuite() {
    const fs::path prepared{KVR_PLUGIN_SDK_DIR};
    if (fs::exists(prepared / "prepared") &&
        fs::last_write_time(prepared / "prepared") >= fs::last_write_time(KVR_BINARY)) {
      root_ = prepared;
      return;
    }
    own_ = std::make_unique<testing::TemporaryDirectory>();
    root_ = own_->path();
    const fs::path log = root_ / "sdk.log";
    if (run({"cmake", "-DKVR_BUILD_DIR=" KVR_BUILD_DIR, "-DKVR_SOURCE_DIR=" KVR_SOURCE_DIR,
             "-DKVR_CXX_COMPILER=" KVR_CXX_COMPILER, "-DOUT=" + (root_ / "sdk").string(), "-P",
             KVR_SOURCE_DIR "/tests/integration/prepare_plugin_sdk.cmake"},
            log, 600s) != 0) {
      setup_failure_ = "preparing the SDK failed:\n" + read_file(log);
    }
    root_ /= "sdk";
  }
  void SetUp() override {
    ASSERT_EQ(setup_failure_, "") << "the SDK or a project built against it";
    KvrClusterTest::SetUp();
  }
  static void TearDownTestSuite() { own_.reset(); }

  static fs::path prefix() { return root_ / "prefix"; }
  static std::string example_plugin() {
    return (root_ / "examples" / "libkvr_example_policies.so").string();
  }
  static std::string test_plugin(std::string_view name) {
    return (root_ / "test-plugins" / ("lib" + std::string{name} + ".so")).string();
  }

  // `kvr replay` of a few requests with these extra arguments: (exit code, its output).
  std::pair<std::optional<int>, std::string> replay(std::vector<std::string> arguments) {
    std::vector<std::string> argv{
        kvr::testing::kvr_binary(), "replay", "--limit", "40", "--workers", "4"};
    argv.insert(argv.end(), arguments.begin(), arguments.end());
    const fs::path log = directory_.path() / "replay.log";
    fs::remove(log);
    const auto status = run(argv, log, 120s);
    return {status, read_file(log)};
  }

  static fs::path root_;
  static std::unique_ptr<testing::TemporaryDirectory> own_;
  static std::string setup_failure_;
};

fs::path PluginSdkTest::root_;
std::unique_ptr<testing::TemporaryDirectory> PluginSdkTest::own_;
std::string PluginSdkTest::setup_failure_;

TEST_F(PluginSdkTest, EveryPublicHeaderCompilesAloneAndNamesNoCafNatsOrProtobuf) {
  const fs::path include = prefix() / "include";
  std::vector<fs::path> headers;
  for (const auto& entry : fs::recursive_directory_iterator(include / "kvr")) {
    // The actor client's header is CAF and protobuf by design; the plugin API's are not.
    if (entry.path().parent_path() == include / "kvr" / "actors" / "client") continue;
    if (entry.path().extension() == ".hpp") headers.push_back(entry.path());
  }
  ASSERT_GE(headers.size(), 10U);
  for (const fs::path& header : headers) {
    const std::string text = read_file(header);
    for (const std::string_view internal : {"caf/", "nats", "google/protobuf", ".pb.h"}) {
      EXPECT_EQ(text.find("#include <" + std::string{internal}), std::string::npos)
          << header << " includes " << internal;
      EXPECT_EQ(text.find("#include \"" + std::string{internal}), std::string::npos)
          << header << " includes " << internal;
    }
    const fs::path unit = directory_.path() / (header.stem().string() + "_alone.cpp");
    std::ofstream{unit} << "#include \"" << fs::relative(header, include / "kvr").string()
                        << "\"\n";
    const fs::path log = directory_.path() / "header.log";
    EXPECT_EQ(run({KVR_CXX_COMPILER, "-std=c++23", "-fsyntax-only", "-Wall", "-Wextra", "-Werror",
                   "-I" + include.string(), "-I" + (include / "kvr").string(), unit.string()},
                  log, 120s),
              0)
        << header << " does not compile alone:\n"
        << read_file(log);
  }
}

TEST_F(PluginSdkTest, ANodeRoutesWithAPolicyLoadedFromAPluginAndReplayComparesIt) {
  auto mocker = kvr_->start_mocker({.workers = 2, .block_size = 16});
  ASSERT_TRUE(mocker);
  const fs::path yaml = directory_.path() / "policy.yaml";
  std::ofstream{yaml} << "worker_selection:\n"
                         "  aggregated: headroom\n"
                         "  instances:\n"
                         "    - name: headroom\n"
                         "      type: cache-headroom\n"
                         "      parameters: {max_active_requests: 8, queue_weight: 1.0}\n";
  const std::uint16_t metrics_port = testing::free_port();
  auto node = kvr_->start_node(
      {.metrics_port = metrics_port,
       .extra = {"--plugin", example_plugin(), "--router-policy-config", yaml.string()}});
  ASSERT_TRUE(node);
  ASSERT_TRUE(testing::wait_until_healthy(metrics_port, 30s)) << node->log();
  EXPECT_NE(node->log().find("loaded plugin " + example_plugin()), std::string::npos);
  EXPECT_NE(node->log().find("selected by 'headroom' (type cache-headroom"), std::string::npos)
      << node->log();

  std::string routed;
  ASSERT_TRUE(testing::wait_until(
      [&] {
        auto route = kvr_->start({"route"}, {"--text", "a policy from a plugin"}, "route.log");
        if (!route || route->wait(30s) != 0) return false;
        routed = route->log();
        return true;
      },
      30s))
      << routed;
  EXPECT_NE(routed.find("policy headroom"), std::string::npos) << routed;

  // The same type side by side with a built-in in `kvr replay`.
  const auto [status, output] =
      replay({"--plugin", example_plugin(), "--policies", "cache-headroom,kv-cost", "--quiet"});
  ASSERT_EQ(status, 0) << output;
  EXPECT_NE(output.find("cache-headroom"), std::string::npos) << output;
  EXPECT_NE(output.find("kv-cost"), std::string::npos) << output;

  // Named in the YAML's `plugins` list instead, relative to the YAML's folder.
  fs::copy_file(example_plugin(), directory_.path() / "example.so");
  const fs::path listing = directory_.path() / "listing.yaml";
  std::ofstream{listing} << "plugins: [example.so]\n";
  const auto [listed, listed_output] = replay(
      {"--router-policy-config", listing.string(), "--policies", "cache-headroom", "--quiet"});
  EXPECT_EQ(listed, 0) << listed_output;
}

TEST_F(PluginSdkTest, APluginKvrCannotUseStopsStartupNamingItAndTheCause) {
  const std::string missing = (directory_.path() / "missing.so").string();
  const std::string not_elf = (directory_.path() / "text.so").string();
  std::ofstream{not_elf} << "not a shared library\n";
  const struct {
    std::vector<std::string> plugins;
    std::string named;
    std::string cause;
  } cases[] = {
      {{missing}, missing, "no such file"},
      {{not_elf}, not_elf, "cannot load"},
      {{test_plugin("not_a_plugin")},
       test_plugin("not_a_plugin"),
       "not a kvr plugin: it exports no kvr_plugin_abi_stamp"},
      {{test_plugin("wrong_abi")},
       test_plugin("wrong_abi"),
       "built for another ABI: plugin API version 2, this kvr speaks 1"},
      {{test_plugin("throwing_catalog")},
       test_plugin("throwing_catalog"),
       "its registration threw: the catalog could not read its model file"},
      {{test_plugin("missing_symbol")},
       test_plugin("missing_symbol"),
       "cannot load: " + test_plugin("missing_symbol") +
           ": undefined symbol: kvr_function_this_kvr_lacks"},
      {{example_plugin(), example_plugin()}, example_plugin(), "its registration was refused"},
  };
  for (const auto& bad : cases) {
    std::vector<std::string> arguments{"--policies", "kv-cost"};
    for (const std::string& plugin : bad.plugins) {
      arguments.push_back("--plugin");
      arguments.push_back(plugin);
    }
    const auto [status, output] = replay(arguments);
    EXPECT_EQ(status, 2) << output;
    EXPECT_NE(output.find("plugin " + bad.named + ": " + bad.cause), std::string::npos) << output;
  }
  // The node the same way.
  auto node = kvr_->start_node({.extra = {"--plugin", test_plugin("wrong_abi")}});
  ASSERT_TRUE(node);
  EXPECT_EQ(node->wait(30s), 2) << node->log();
  EXPECT_NE(
      node->log().find("--plugin: plugin " + test_plugin("wrong_abi") + ": built for another ABI"),
      std::string::npos)
      << node->log();
}

// `cpack -G DEB` of this build, unpacked into a clean root: the binary finds every library it
// needs, runs, and the package carries the SDK and the node's unit and declares its dependencies.
TEST_F(PluginSdkTest, APluginsFaultsFailOnlyTheSelectionsTheySpoilUnderARouteStream) {
  auto mocker = kvr_->start_mocker({.workers = 2, .block_size = 16});
  ASSERT_TRUE(mocker);
  const fs::path yaml = directory_.path() / "misbehaving.yaml";
  std::ofstream{yaml} << "worker_selection: {aggregated: misbehaving}\n";
  const std::uint16_t metrics_port = testing::free_port();
  auto node = kvr_->start_node(
      {.metrics_port = metrics_port,
       .extra = {"--plugin", test_plugin("misbehaving"), "--router-policy-config", yaml.string()}});
  ASSERT_TRUE(node);
  ASSERT_TRUE(testing::wait_until_healthy(metrics_port, 30s)) << node->log();
  auto router = nats::RouteClient::open(*client_, subjects::router_route(kNamespace),
                                        subjects::router_report(kNamespace));
  ASSERT_TRUE(router) << router.error();
  // Both workers registered: a request whose prompt spoils nothing is served.
  ASSERT_TRUE(testing::wait_until(
      [&] {
        return testing::metric(testing::http_get(metrics_port, "/metrics"),
                               "kvr_workers{partition=\"mock-model/default\"}") == 2;
      },
      30s));

  // A steady stream: the prompt's length picks the fault (misbehaving.cpp), one in six serves.
  constexpr int kRequests = 120;
  int served = 0;
  int failed = 0;
  for (int i = 0; i < kRequests; ++i) {
    const std::size_t length = 96 + static_cast<std::size_t>(i);
    v1::RouteRequest request;
    request.set_request_id(fmt::format("stream-{}", i));
    request.set_model("mock-model");
    for (std::uint32_t token : testing::prompt(length, static_cast<std::uint32_t>(1000 + i))) {
      request.mutable_tokens()->add_ids(token);
    }
    auto routed = router->route(request, {.max_attempts = 1});
    ASSERT_TRUE(routed) << "request " << i << ": " << routed.error() << "\n" << node->log();
    const v1::RouteDecision& decision = routed->decision;
    if (length % 6 == 0) {
      ASSERT_TRUE(decision.has_success()) << "request " << i << ": " << decision.error().message();
      ++served;
      v1::LifecycleReport report;
      report.set_booking_id(decision.success().booking_id());
      report.set_event(v1::LIFECYCLE_EVENT_COMPLETED);
      client_->publish(subjects::router_report(kNamespace), report.SerializeAsString());
    } else {
      ASSERT_TRUE(decision.has_error()) << "request " << i << " was served";
      EXPECT_EQ(decision.error().code(), v1::ROUTE_ERROR_POLICY_FAILED)
          << decision.error().message();
      ++failed;
    }
  }
  EXPECT_EQ(served, kRequests / 6);
  // Each fault is counted, and its message names the component.
  const std::string metrics = testing::http_get(metrics_port, "/metrics");
  EXPECT_EQ(testing::metric(metrics, "kvr_route_errors_total{code=\"policy_failed\"}"), failed);
  EXPECT_TRUE(node->running());
}

// deploy/examples/actor_client, built against the installed SDK alone (its actor_client component),
// run against a node's actor port: it routes, reports and streams a generate request.
TEST_F(PluginSdkTest, AnActorClientBuiltAgainstTheSdkRoutesReportsAndStreams) {
  auto mocker = kvr_->start_mocker({.workers = 1, .block_size = 16});
  ASSERT_TRUE(mocker);
  const std::uint16_t actor_port = testing::free_port();
  const std::uint16_t metrics_port = testing::free_port();
  auto node = kvr_->start_node({.metrics_port = metrics_port, .actor_port = actor_port});
  ASSERT_TRUE(node);
  ASSERT_TRUE(testing::wait_until_healthy(metrics_port, 30s)) << node->log();
  const fs::path log = directory_.path() / "actor_client.log";
  const auto status = run({(root_ / "actor_client" / "kvr_actor_client").string(), "127.0.0.1",
                           std::to_string(actor_port), "mock-model"},
                          log, 120s);
  const std::string output = read_file(log);
  ASSERT_EQ(status, 0) << output << "\n---- node log\n" << node->log();
  EXPECT_NE(output.find("routed actor-client-route-"), std::string::npos) << output;
  EXPECT_NE(output.find("reported completed: accepted"), std::string::npos) << output;
  EXPECT_NE(output.find(": 8 tokens, finished (length)"), std::string::npos) << output;
  const std::string metrics = testing::http_get(metrics_port, "/metrics");
  EXPECT_GE(testing::metric(metrics, "kvr_generate_requests_total{ingress=\"actor\"}"), 1)
      << metrics;
}

TEST_F(PluginSdkTest,
       TheDebianPackageCarriesTheBinaryTheSdkAndTheUnitAndDependsOnEveryLibraryItLoads) {
  const fs::path packages = directory_.path() / "packages";
  const fs::path log = directory_.path() / "cpack.log";
  ASSERT_EQ(run({"cpack", "-G", "DEB", "--config", KVR_BUILD_DIR "/CPackConfig.cmake", "-B",
                 packages.string()},
                log, 600s),
            0)
      << read_file(log);
  const fs::path deb = packages / ("kvr_" KVR_VERSION_STRING "_amd64.deb");
  ASSERT_TRUE(fs::exists(deb)) << read_file(log);

  const fs::path fields = directory_.path() / "fields.log";
  ASSERT_EQ(run({"dpkg-deb", "-f", deb.string(), "Package", "Version", "Architecture", "Depends"},
                fields),
            0);
  const std::string control = read_file(fields);
  EXPECT_NE(control.find("Package: kvr"), std::string::npos) << control;
  EXPECT_NE(control.find("Version: " KVR_VERSION_STRING), std::string::npos) << control;
  EXPECT_NE(control.find("Architecture: amd64"), std::string::npos) << control;
  for (const std::string_view library : {"libyaml-cpp", "libprotobuf", "libnats"}) {
    EXPECT_NE(control.find(library), std::string::npos) << "Depends names no " << library << "\n"
                                                        << control;
  }

  const fs::path listing = directory_.path() / "contents.log";
  ASSERT_EQ(run({"dpkg-deb", "-c", deb.string()}, listing), 0);
  const std::string contents = read_file(listing);
  for (const std::string_view path :
       {"./usr/bin/kvr", "./usr/include/kvr/plugin.hpp",
        "./usr/include/kvr/selection/worker_selection.hpp", "./usr/lib/cmake/kvr/kvrConfig.cmake",
        "./usr/include/kvr/actors/client/ingress_protocol.hpp",
        "./usr/include/kvr/kvr/v1/routing.pb.h", "./usr/share/kvr/protocol/kvr/v1/routing.pb.cc",
        "./usr/lib/cmake/kvr/kvrActorClientTargets.cmake", "./usr/lib/cmake/kvr/FindCAF.cmake",
        "./usr/lib/systemd/system/kvr-node.service", "./usr/share/doc/kvr/kvr-node.env"}) {
    EXPECT_NE(contents.find(path), std::string::npos) << path << " is not in the package";
  }

  const fs::path root = directory_.path() / "root";
  ASSERT_EQ(run({"dpkg", "-x", deb.string(), root.string()}, log), 0) << read_file(log);
  const fs::path libraries = directory_.path() / "ldd.log";
  ASSERT_EQ(run({"ldd", (root / "usr/bin/kvr").string()}, libraries), 0) << read_file(libraries);
  const std::string resolved = read_file(libraries);
  EXPECT_EQ(resolved.find("not found"), std::string::npos) << resolved;
  // No fresh root can be made here, so the package's Depends are checked instead: every library
  // the binary loads must belong to a package that installing the Depends brings in.
  const std::string depends = control.substr(control.find("Depends:") + 8);
  const std::set<std::string> installed_with_kvr =
      dependency_closure(depends, directory_.path() / "dpkg-query.log");
  std::size_t checked = 0;
  std::istringstream lines{resolved};
  for (std::string line; std::getline(lines, line);) {
    // "\tlibx.so.1 => /lib/.../libx.so.1 (0x...)" or "\t/lib64/ld-linux-x86-64.so.2 (0x...)"
    const auto arrow = line.find("=> ");
    const auto start = arrow != std::string::npos ? arrow + 3 : line.find('/');
    if (start == std::string::npos) continue;  // the vDSO
    const fs::path library = line.substr(start, line.find(" (", start) - start);
    const auto owner = owning_package(library, directory_.path() / "dpkg-query.log");
    ASSERT_TRUE(owner.has_value()) << library << " belongs to no package";
    EXPECT_TRUE(installed_with_kvr.contains(*owner))
        << library << " comes from " << *owner << ", which the package's Depends do not bring in:\n"
        << control;
    ++checked;
  }
  EXPECT_GE(checked, 10u) << resolved;
  const fs::path version = directory_.path() / "version.log";
  ASSERT_EQ(run({(root / "usr/bin/kvr").string(), "--version"}, version), 0);
  EXPECT_NE(read_file(version).find("kvr " KVR_VERSION_STRING), std::string::npos)
      << read_file(version);
  const std::string unit = read_file(root / "usr/lib/systemd/system/kvr-node.service");
  EXPECT_NE(unit.find("ExecStart=/usr/bin/kvr node --cluster"), std::string::npos) << unit;
}

}  // namespace
}  // namespace kvr
