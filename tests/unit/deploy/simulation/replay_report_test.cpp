// The replay report: nearest-rank percentiles, hit rate, throughput and imbalance from request
// outcomes, the text table's columns, and JSON whose keys are sorted and whose bytes are stable.
#include "deploy/simulation/replay_report.hpp"

#include <algorithm>
#include <numeric>
#include <random>
#include <sstream>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

namespace kvr::simulation {
namespace {

ReplayRequestOutcome outcome(WorkerId worker, double arrival, double first_token, double completion,
                             std::uint64_t prompt, std::uint64_t cached, std::uint64_t output) {
  ReplayRequestOutcome result;
  result.worker = {worker, 0};
  result.stats.arrival_ms = arrival;
  result.stats.first_token_ms = first_token;
  result.stats.completion_ms = completion;
  result.stats.prompt_tokens = prompt;
  result.stats.cached_prompt_tokens = cached;
  result.stats.output_tokens = output;
  return result;
}

std::vector<double> one_to(std::size_t n, std::uint32_t shuffle_seed) {
  std::vector<double> values(n);
  std::iota(values.begin(), values.end(), 1.0);
  std::shuffle(values.begin(), values.end(), std::mt19937{shuffle_seed});
  return values;
}

// Fails naming the first object whose keys are not in ascending order.
void expect_sorted_keys(const nlohmann::ordered_json& json, const std::string& path) {
  if (json.is_object()) {
    std::vector<std::string> keys;
    for (const auto& [key, value] : json.items()) {
      keys.push_back(key);
      expect_sorted_keys(value, path + "." + key);
    }
    EXPECT_TRUE(std::ranges::is_sorted(keys)) << "keys of " << path << " are not sorted";
  } else if (json.is_array()) {
    for (std::size_t i = 0; i < json.size(); ++i) {
      expect_sorted_keys(json[i], path + "[" + std::to_string(i) + "]");
    }
  }
}

ReplayReport sample_report() {
  ReplayReport report;
  report.trace = "sample.jsonl";
  report.requests = 4;
  report.workers = 4;
  report.speedup = 2;
  report.seed = 3;
  report.block_size = 64;
  report.infinite_cache_hit_rate = 2.0 / 3.0;
  const std::vector<ReplayRequestOutcome> outcomes{
      outcome(1, 0, 100, 400, 1000, 500, 4),
      outcome(2, 10, 60, 90, 300, 0, 2),
  };
  PolicyReport policy = make_policy_report("kv-cost", 4, outcomes, 4);
  policy.failures = {{"zeta failure", 1}, {"alpha failure", 1}, {"alpha failure", 2}};
  policy.utilization = 1.0 / 3.0;
  report.policies.push_back(policy);
  report.policies.push_back(make_policy_report("round-robin", 4, outcomes, 4));
  return report;
}

// ---- summarize ----------------------------------------------------------------------------

TEST(SummarizeTest, PercentilesUseTheNearestRank) {
  const LatencySummary ten = summarize(one_to(10, 1));
  EXPECT_DOUBLE_EQ(ten.mean, 5.5);
  EXPECT_DOUBLE_EQ(ten.p50, 5.0);
  EXPECT_DOUBLE_EQ(ten.p90, 9.0);
  EXPECT_DOUBLE_EQ(ten.p99, 10.0);
  EXPECT_DOUBLE_EQ(ten.max, 10.0);

  const LatencySummary hundred = summarize(one_to(100, 2));
  EXPECT_DOUBLE_EQ(hundred.p50, 50.0);
  EXPECT_DOUBLE_EQ(hundred.p90, 90.0);
  EXPECT_DOUBLE_EQ(hundred.p99, 99.0);
  EXPECT_DOUBLE_EQ(hundred.max, 100.0);

  // Nearest rank never interpolates: the median of 1..4 is 2, not 2.5.
  const LatencySummary four = summarize({4, 1, 3, 2});
  EXPECT_DOUBLE_EQ(four.p50, 2.0);
  EXPECT_DOUBLE_EQ(four.p90, 4.0);
}

TEST(SummarizeTest, PercentileRanksMatchIntegerArithmeticForEverySize) {
  for (std::size_t n = 1; n <= 300; ++n) {
    const LatencySummary summary = summarize(one_to(n, static_cast<std::uint32_t>(n)));
    // The rank ceil(q * n), computed exactly; the values are 1..n, so the value is the rank.
    EXPECT_DOUBLE_EQ(summary.p50, static_cast<double>((n + 1) / 2)) << n;
    EXPECT_DOUBLE_EQ(summary.p90, static_cast<double>((9 * n + 9) / 10)) << n;
    EXPECT_DOUBLE_EQ(summary.p99, static_cast<double>((99 * n + 99) / 100)) << n;
  }
}

TEST(SummarizeTest, SingleValueAndEmptyInput) {
  const LatencySummary single = summarize({7.5});
  EXPECT_DOUBLE_EQ(single.mean, 7.5);
  EXPECT_DOUBLE_EQ(single.p50, 7.5);
  EXPECT_DOUBLE_EQ(single.p99, 7.5);
  EXPECT_DOUBLE_EQ(single.max, 7.5);
  const LatencySummary empty = summarize({});
  EXPECT_DOUBLE_EQ(empty.mean, 0.0);
  EXPECT_DOUBLE_EQ(empty.p50, 0.0);
  EXPECT_DOUBLE_EQ(empty.max, 0.0);
}

// ---- make_policy_report -------------------------------------------------------------------

TEST(PolicyReportTest, HitRateThroughputAndLatenciesFromOutcomes) {
  const std::vector<ReplayRequestOutcome> outcomes{
      outcome(1, 0, 100, 400, 1000, 500, 4),      // ttft 100, itl 100, e2e 400
      outcome(1, 50, 250, 250, 1000, 0, 1),       // ttft 200, one token: no itl
      outcome(2, 100, 400, 1100, 2000, 1500, 8),  // ttft 300, itl 100, e2e 1000
  };
  const PolicyReport report = make_policy_report("kv-cost", 4, outcomes, 4);
  EXPECT_EQ(report.policy, "kv-cost");
  EXPECT_EQ(report.requests, 4U);
  EXPECT_EQ(report.completed, 3U);
  EXPECT_EQ(report.failed, 1U);
  EXPECT_DOUBLE_EQ(report.hit_rate, 2000.0 / 4000.0);
  EXPECT_DOUBLE_EQ(report.ttft_ms.mean, 200.0);
  EXPECT_DOUBLE_EQ(report.ttft_ms.p50, 200.0);
  EXPECT_DOUBLE_EQ(report.ttft_ms.max, 300.0);
  EXPECT_DOUBLE_EQ(report.itl_ms.mean, 100.0);
  EXPECT_DOUBLE_EQ(report.itl_ms.max, 100.0);
  EXPECT_DOUBLE_EQ(report.e2e_ms.p50, 400.0);
  EXPECT_DOUBLE_EQ(report.e2e_ms.max, 1000.0);
  EXPECT_DOUBLE_EQ(report.makespan_s, 1.1);
  EXPECT_DOUBLE_EQ(report.output_tokens_per_s, 13.0 / 1.1);
  EXPECT_DOUBLE_EQ(report.requests_per_s, 3.0 / 1.1);
}

TEST(PolicyReportTest, ImbalanceIsTheBusiestWorkerOverTheFleetMean) {
  const std::vector<ReplayRequestOutcome> outcomes{
      outcome(1, 0, 10, 20, 998, 0, 4),
      outcome(1, 0, 10, 20, 994, 0, 4),
      outcome(2, 0, 10, 20, 1996, 0, 4),
  };
  // 2000 tokens on each of two workers; the two idle workers count towards the mean.
  EXPECT_DOUBLE_EQ(make_policy_report("p", 3, outcomes, 4).load_imbalance, 2.0);
  EXPECT_DOUBLE_EQ(make_policy_report("p", 3, outcomes, 2).load_imbalance, 1.0);
  const std::vector<ReplayRequestOutcome> one_worker{outcome(3, 0, 10, 20, 96, 0, 4)};
  EXPECT_DOUBLE_EQ(make_policy_report("p", 1, one_worker, 5).load_imbalance, 5.0);
}

TEST(PolicyReportTest, NoOutcomesGiveAnEmptyReport) {
  const PolicyReport report = make_policy_report("p", 5, {}, 4);
  EXPECT_EQ(report.completed, 0U);
  EXPECT_EQ(report.failed, 5U);
  EXPECT_DOUBLE_EQ(report.hit_rate, 0.0);
  EXPECT_DOUBLE_EQ(report.makespan_s, 0.0);
  EXPECT_DOUBLE_EQ(report.output_tokens_per_s, 0.0);
  EXPECT_DOUBLE_EQ(report.load_imbalance, 0.0);
}

// ---- table --------------------------------------------------------------------------------

TEST(ReplayTableTest, EveryValueSitsUnderItsColumnHeader) {
  const std::string table = format_table(sample_report());
  std::istringstream lines{table};
  std::string title, header, row;
  std::getline(lines, title);
  std::getline(lines, header);
  std::getline(lines, row);
  // Columns are right-aligned: each header label ends where its value ends.
  const std::vector<std::string> labels{"completed", "hit",       "ttft mean", "ttft p50",
                                        "ttft p90",  "ttft p99",  "itl",       "e2e p50",
                                        "e2e p99",   "out tok/s", "imbal",     "busy"};
  std::vector<std::size_t> label_ends;
  std::size_t from = 0;
  for (const std::string& label : labels) {
    const std::size_t at = header.find(label, from);
    ASSERT_NE(at, std::string::npos) << "no column '" << label << "' in: " << header;
    label_ends.push_back(at + label.size());
    from = at + label.size();
  }
  std::vector<std::size_t> value_ends;
  for (std::size_t i = 0; i < row.size(); ++i) {
    if (row[i] != ' ' && (i + 1 == row.size() || row[i + 1] == ' ')) value_ends.push_back(i + 1);
  }
  ASSERT_EQ(value_ends.size(), labels.size() + 1) << row;  // the policy name first
  value_ends.erase(value_ends.begin());
  EXPECT_EQ(label_ends, value_ends) << header << "\n" << row;
  EXPECT_NE(row.find("2/4"), std::string::npos) << row;
}

// ---- JSON ---------------------------------------------------------------------------------

TEST(ReplayJsonTest, KeysAreSortedAtEveryLevel) {
  const std::string json = to_json(sample_report());
  const auto parsed = nlohmann::ordered_json::parse(json);
  expect_sorted_keys(parsed, "$");
  ASSERT_EQ(parsed["policies"].size(), 2U);
  EXPECT_EQ(parsed["policies"][0]["policy"], "kv-cost");
  EXPECT_EQ(parsed["policies"][0]["completed"], 2);
  EXPECT_EQ(parsed["policies"][0]["failed"], 2);
  // Failures are listed by message, and a message given twice counts both times.
  EXPECT_EQ(parsed["policies"][0]["failures"]["alpha failure"], 3);
  EXPECT_EQ(parsed["policies"][0]["failures"]["zeta failure"], 1);
  EXPECT_EQ(parsed["workers"], 4);
}

TEST(ReplayJsonTest, EqualReportsGiveEqualBytesWithFixedPrecision) {
  ReplayReport first = sample_report();
  ReplayReport second = sample_report();
  // Wall-clock time varies between runs and is left out.
  first.policies[0].wall_seconds = 1.5;
  second.policies[0].wall_seconds = 9.25;
  const std::string json = to_json(first);
  EXPECT_EQ(json, to_json(second));
  EXPECT_EQ(json.find("wall"), std::string::npos);
  EXPECT_NE(json.find("\"infinite_cache_hit_rate\": 0.666667"), std::string::npos) << json;
  EXPECT_NE(json.find("\"utilization\": 0.333333"), std::string::npos) << json;
  EXPECT_EQ(json.back(), '\n');
}

TEST(ReplayTableTest, RejectionsAndTenantsAreListedBelowTheTableOnlyWhenThereAreAny) {
  ReplayReport report = sample_report();
  EXPECT_EQ(format_table(report).find("rejected"), std::string::npos);
  EXPECT_EQ(format_table(report).find("tenant"), std::string::npos);

  report.policies[0].rejected = {{"overloaded", 3}, {"rate_limited", 12}};
  TenantReport light{.tenant = "light", .requests = 4, .completed = 2};
  light.ttft_ms.p50 = 12.5;
  light.ttft_ms.p99 = 40;
  light.rejected = {{"rate_limited", 2}};
  report.policies[0].tenants = {light};
  const std::string table = format_table(report);
  EXPECT_NE(table.find("kv-cost                    15 (overloaded 3, rate_limited 12)"),
            std::string::npos)
      << table;
  EXPECT_NE(table.find("round-robin                0 (none)"), std::string::npos) << table;
  EXPECT_NE(table.find("light                4         2         2      12.5      40.0  "
                       "rate_limited 2\n"),
            std::string::npos)
      << table;
}

TEST(ReplayJsonTest, RejectionsAndTenantsAreCountedByCode) {
  ReplayReport report = sample_report();
  report.policies[0].rejected = {{"rate_limited", 12}, {"overloaded", 3}};
  TenantReport heavy{.tenant = "heavy", .requests = 3, .completed = 1};
  heavy.rejected = {{"rate_limited", 2}};
  heavy.ttft_ms.p99 = 250;
  report.policies[0].tenants = {heavy, TenantReport{.tenant = "light", .requests = 1}};
  const auto parsed = nlohmann::ordered_json::parse(to_json(report));
  expect_sorted_keys(parsed, "$");
  const auto& policy = parsed["policies"][0];
  EXPECT_EQ(policy["rejected"]["rate_limited"], 12);
  EXPECT_EQ(policy["rejected"]["overloaded"], 3);
  ASSERT_EQ(policy["tenants"].size(), 2U);
  EXPECT_EQ(policy["tenants"][0]["tenant"], "heavy");
  EXPECT_EQ(policy["tenants"][0]["requests"], 3);
  EXPECT_EQ(policy["tenants"][0]["completed"], 1);
  EXPECT_EQ(policy["tenants"][0]["rejected"]["rate_limited"], 2);
  EXPECT_EQ(policy["tenants"][0]["ttft_ms"]["p99"], 250.0);
  EXPECT_TRUE(policy["tenants"][1]["rejected"].empty());
  EXPECT_TRUE(parsed["policies"][1]["rejected"].empty());
  EXPECT_TRUE(parsed["policies"][1]["tenants"].empty());
}

// ---- the hit-rate ladder -------------------------------------------------------------------

// Two completed requests of 1000 prompt tokens: the router predicted 500 and 0 cached, the
// engines delivered 400 and 100.
ReplayReport ladder_report(bool predicted_known) {
  ReplayReport report = sample_report();
  report.model = "llama";
  report.fleet_kv_blocks = 2048;
  report.capacity_bound_hit_rate = 0.5;
  report.infinite_cache_hit_rate = 0.75;
  std::vector<ReplayRequestOutcome> outcomes{outcome(1, 0, 10, 20, 1000, 400, 2),
                                             outcome(2, 0, 10, 20, 1000, 100, 2)};
  if (predicted_known) {
    outcomes[0].predicted_cached_tokens = 500;
    outcomes[1].predicted_cached_tokens = 0;
  }
  report.policies = {make_policy_report("kv-cost", 2, outcomes, 2)};
  return report;
}

TEST(PolicyReportTest, TheLaddersMeasuredRungsComeFromTheOutcomes) {
  const PolicyReport policy = ladder_report(true).policies[0];
  EXPECT_TRUE(policy.predicted_known);
  EXPECT_EQ(policy.cache_outcomes.totals.prompt_tokens, 2000U);
  EXPECT_EQ(policy.cache_outcomes.totals.predicted_cached_tokens, 500U);
  EXPECT_EQ(policy.cache_outcomes.totals.engine_cached_tokens, 500U);
  EXPECT_DOUBLE_EQ(policy.cache_outcomes.totals.delivered_hit_rate(), policy.hit_rate);
  EXPECT_EQ(policy.cache_outcomes.engine_below_predicted, 1U);
  EXPECT_EQ(policy.cache_outcomes.engine_above_predicted, 1U);
  EXPECT_FALSE(ladder_report(false).policies[0].predicted_known);
}

TEST(ReplayTableTest, TheLadderListsTheRungsFromTheTopDown) {
  const std::string table = format_table(ladder_report(true));
  EXPECT_NE(table.find("hit-rate ladder, model llama"), std::string::npos) << table;
  EXPECT_NE(table.find("fleet's 2048 KV blocks"), std::string::npos) << table;
  // workload, capacity, predicted, delivered; prompt, predicted and engine tokens; below, as,
  // above.
  EXPECT_NE(table.find("kv-cost                        0.750     0.500     0.250     0.250"
                       "           2000            500            500           1       0       1"
                       "\n"),
            std::string::npos)
      << table;
}

TEST(ReplayTableTest, UnknownRungsShowAsDashes) {
  ReplayReport report = ladder_report(false);
  report.fleet_kv_blocks = 0;
  const std::string table = format_table(report);
  EXPECT_NE(table.find("fleet's (unknown) KV blocks"), std::string::npos) << table;
  EXPECT_NE(table.find("kv-cost                        0.750         -         -     0.250"
                       "           2000              -            500           -       -       -"
                       "\n"),
            std::string::npos)
      << table;
}

TEST(ReplayJsonTest, TheLadderIsInThePolicyAndItsCeilingsAtTheTop) {
  auto parsed = nlohmann::ordered_json::parse(to_json(ladder_report(true)));
  expect_sorted_keys(parsed, "$");
  EXPECT_EQ(parsed["model"], "llama");
  EXPECT_EQ(parsed["fleet_kv_blocks"], 2048);
  EXPECT_EQ(parsed["capacity_bound_hit_rate"], 0.5);
  const auto& ladder = parsed["policies"][0]["hit_rate_ladder"];
  EXPECT_EQ(ladder["prompt_tokens"], 2000);
  EXPECT_EQ(ladder["predicted_cached_tokens"], 500);
  EXPECT_EQ(ladder["engine_cached_tokens"], 500);
  EXPECT_EQ(ladder["predicted"], 0.25);
  EXPECT_EQ(ladder["delivered"], 0.25);
  EXPECT_EQ(ladder["engine_below_predicted"], 1);

  ReplayReport unknown = ladder_report(false);
  unknown.fleet_kv_blocks = 0;
  parsed = nlohmann::ordered_json::parse(to_json(unknown));
  EXPECT_TRUE(parsed["capacity_bound_hit_rate"].is_null());
  EXPECT_TRUE(parsed["policies"][0]["hit_rate_ladder"]["predicted"].is_null());
}

}  // namespace
}  // namespace kvr::simulation
