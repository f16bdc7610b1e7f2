// `kvr replay` as a real process: equal runs write equal JSON reports, an unknown policy or a
// malformed trace stops it with exit code 2 and a message naming the culprit, and --plot draws a
// PNG through Debian's python3-matplotlib. With a classifier, tenants and --only-tenant it reports
// rejections and tenants; bad tenant and queue flags stop it with exit code 2.
#include <fstream>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "tests/testing/child_process.hpp"
#include "tests/testing/kvr_binary.hpp"
#include "tests/testing/kvr_processes.hpp"

namespace kvr {
namespace {

using namespace std::chrono_literals;
using testing::ChildProcess;
using testing::read_file;
using testing::TemporaryDirectory;

class ReplayCliTest : public ::testing::Test {
 protected:
  // Runs `kvr replay <arguments>` to completion; its exit code (nullopt: it did not end in time).
  // The output (stdout and stderr) is in log(name).
  std::optional<int> replay(const std::string& name, std::vector<std::string> arguments) {
    arguments.insert(arguments.begin(), {kvr::testing::kvr_binary(), "replay"});
    auto process = ChildProcess::start(arguments, log_path(name));
    if (!process) {
      ADD_FAILURE() << "cannot start " << kvr::testing::kvr_binary();
      return std::nullopt;
    }
    const auto status = process->wait(120s);
    EXPECT_TRUE(status.has_value()) << name << " did not finish:\n" << process->log();
    return status;
  }

  std::filesystem::path log_path(const std::string& name) const {
    return directory_.path() / (name + ".log");
  }
  std::string log(const std::string& name) const { return read_file(log_path(name)); }

  TemporaryDirectory directory_;
};

TEST_F(ReplayCliTest, EqualRunsWriteIdenticalJsonWithEveryPolicyCompleted) {
  const auto first_json = directory_.path() / "first.json";
  const auto second_json = directory_.path() / "second.json";
  for (const auto& [name, json] : {std::pair{"first", first_json}, {"second", second_json}}) {
    const auto status = replay(name, {"--limit", "300", "--workers", "4", "--policies",
                                      "kv-cost,round-robin", "--json", json.string(), "--quiet"});
    ASSERT_EQ(status, 0) << log(name);
  }
  const std::string first = read_file(first_json);
  ASSERT_FALSE(first.empty());
  EXPECT_EQ(first, read_file(second_json));

  const auto report = nlohmann::json::parse(first, nullptr, /*allow_exceptions=*/false);
  ASSERT_TRUE(report.is_object()) << first;
  EXPECT_EQ(report["requests"], 300);
  EXPECT_EQ(report["workers"], 4);
  ASSERT_EQ(report["policies"].size(), 2U);
  EXPECT_EQ(report["policies"][0]["policy"], "kv-cost");
  EXPECT_EQ(report["policies"][1]["policy"], "round-robin");
  for (const auto& policy : report["policies"]) {
    EXPECT_EQ(policy["completed"], 300) << policy.dump();
    EXPECT_EQ(policy["failed"], 0) << policy.dump();
  }
  // The table on stdout names both policies; --quiet leaves out the progress bar.
  const std::string output = log("first");
  EXPECT_NE(output.find("kv-cost"), std::string::npos) << output;
  EXPECT_NE(output.find("round-robin"), std::string::npos) << output;
  EXPECT_EQ(output.find("replayed in"), std::string::npos) << output;
}

TEST_F(ReplayCliTest, UnknownPolicyExitsWithTwoNamingItAndListingTheTypes) {
  const auto status = replay("unknown", {"--limit", "10", "--policies", "no-such-policy"});
  ASSERT_EQ(status, 2) << log("unknown");
  const std::string output = log("unknown");
  EXPECT_NE(output.find("no-such-policy"), std::string::npos) << output;
  EXPECT_NE(output.find("types"), std::string::npos) << output;
  EXPECT_NE(output.find("kv-cost"), std::string::npos) << output;
  EXPECT_NE(output.find("round-robin"), std::string::npos) << output;
  EXPECT_NE(output.find("least-loaded"), std::string::npos) << output;
}

TEST_F(ReplayCliTest, MalformedTraceExitsWithTwoNamingTheLine) {
  const auto trace = directory_.path() / "bad.jsonl";
  {
    std::ofstream output{trace};
    output << R"({"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [0, 1]})"
           << '\n'
           << R"({"timestamp": 10, "input_length": 100, "output_length": 5, "hash_ids": [2]})"
           << '\n'
           << R"({"timestamp": 20, "input_length": "many", "output_length": 5, "hash_ids": [3]})"
           << '\n';
  }
  const auto json_path = directory_.path() / "never.json";
  const auto status = replay("malformed", {"--trace", trace.string(), "--policies", "kv-cost",
                                           "--json", json_path.string(), "--quiet"});
  ASSERT_EQ(status, 2) << log("malformed");
  const std::string output = log("malformed");
  EXPECT_NE(output.find("line 3"), std::string::npos) << output;
  EXPECT_NE(output.find("input_length"), std::string::npos) << output;
  EXPECT_FALSE(std::filesystem::exists(json_path));
}

TEST_F(ReplayCliTest, PlotWritesAPngFile) {
  const auto plot = directory_.path() / "replay.png";
  const auto status = replay("plot", {"--limit", "60", "--workers", "2", "--policies",
                                      "kv-cost,random", "--plot", plot.string(), "--quiet"});
  ASSERT_EQ(status, 0) << log("plot");
  const std::string png = read_file(plot);
  ASSERT_GT(png.size(), 8U) << log("plot");
  EXPECT_EQ(png.substr(0, 8), std::string("\x89PNG\r\n\x1a\n", 8));
  // Without --json the report went through a temporary file, which is gone again.
  EXPECT_FALSE(std::filesystem::exists(plot.string() + ".json.tmp"));
}

TEST_F(ReplayCliTest, AClassifierAndTenantsGiveCountedRejectionsPerTenant) {
  const auto yaml = directory_.path() / "bucket.yaml";
  {
    std::ofstream output{yaml};
    output << "request_classifier: {type: token-bucket, parameters: {rate_tokens_per_s: 2000, "
              "burst_tokens: 20000}}\n";
  }
  const auto json_path = directory_.path() / "tenants.json";
  const auto status =
      replay("tenants", {"--limit", "200", "--workers", "4", "--speedup", "4", "--policies",
                         "kv-cost", "--tenants", "heavy:3,light:1", "--router-policy-config",
                         yaml.string(), "--json", json_path.string(), "--quiet"});
  ASSERT_EQ(status, 0) << log("tenants");
  const auto report = nlohmann::json::parse(read_file(json_path), nullptr, false);
  ASSERT_TRUE(report.is_object());
  const auto& policy = report["policies"][0];
  const int rate_limited = policy["rejected"].value("rate_limited", 0);
  EXPECT_GT(rate_limited, 0) << policy.dump();
  EXPECT_EQ(policy["failed"], 0);
  EXPECT_EQ(policy["completed"].get<int>() + rate_limited, 200);
  ASSERT_EQ(policy["tenants"].size(), 2U);
  EXPECT_EQ(policy["tenants"][0]["tenant"], "heavy");
  EXPECT_EQ(policy["tenants"][0]["requests"], 150);
  EXPECT_EQ(policy["tenants"][1]["requests"], 50);
  const std::string output = log("tenants");
  EXPECT_NE(output.find("rate_limited"), std::string::npos) << output;
  EXPECT_EQ(output.find("not applied"), std::string::npos) << output;

  // The light tenant alone: its 50 requests and nothing else.
  const auto alone_path = directory_.path() / "alone.json";
  ASSERT_EQ(replay("alone", {"--limit", "200", "--workers", "4", "--policies", "kv-cost",
                             "--tenants", "heavy:3,light:1", "--only-tenant", "light", "--json",
                             alone_path.string(), "--quiet"}),
            0)
      << log("alone");
  const auto alone = nlohmann::json::parse(read_file(alone_path), nullptr, false);
  EXPECT_EQ(alone["requests"], 50);
  ASSERT_EQ(alone["policies"][0]["tenants"].size(), 1U);
  EXPECT_EQ(alone["policies"][0]["tenants"][0]["tenant"], "light");
  EXPECT_EQ(alone["policies"][0]["completed"], 50);
}

TEST_F(ReplayCliTest, BadTenantAndQueueFlagsExitWithTwoNamingThem) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases{
      {{"--tenants", "heavy:0"}, "--tenants"},
      {{"--tenants", "a:1,a:2"}, "named twice"},
      {{"--tenants", "heavy:5,light:1", "--only-tenant", "medium"}, "--only-tenant"},
      {{"--only-tenant", "light"}, "--tenants"},
      {{"--router-queue-threshold", "0"}, "--router-queue-threshold"},
      {{"--router-queue-threshold", "1.5"}, "--router-queue-threshold"},
  };
  for (std::size_t i = 0; i < cases.size(); ++i) {
    const std::string name = "bad" + std::to_string(i);
    std::vector<std::string> arguments{"--limit", "10", "--policies", "kv-cost", "--quiet"};
    arguments.insert(arguments.end(), cases[i].first.begin(), cases[i].first.end());
    ASSERT_EQ(replay(name, arguments), 2) << log(name);
    EXPECT_NE(log(name).find(cases[i].second), std::string::npos) << log(name);
  }
}

}  // namespace
}  // namespace kvr
