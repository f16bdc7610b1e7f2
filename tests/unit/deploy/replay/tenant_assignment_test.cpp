// Tenants for replays: `name:weight,...` parses or fails naming the entry, and the seeded
// assignment is deterministic, exactly proportional in every round of the weights, independent of
// how many requests follow, and changes with the seed.
#include "deploy/replay/tenant_assignment.hpp"

#include <algorithm>
#include <set>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace kvr::replay {
namespace {

using ::testing::HasSubstr;

std::vector<TenantWeight> weights(std::string_view text) {
  auto parsed = parse_tenant_weights(text);
  EXPECT_TRUE(parsed) << parsed.error();
  return parsed.value_or(std::vector<TenantWeight>{});
}

std::string parse_error(std::string_view text) {
  auto parsed = parse_tenant_weights(text);
  EXPECT_FALSE(parsed) << "accepted: " << text;
  return parsed ? std::string{} : parsed.error();
}

TEST(TenantWeightsTest, ParsesNamesAndWeights) {
  EXPECT_EQ(weights("heavy:5,light:1"), (std::vector<TenantWeight>{{"heavy", 5}, {"light", 1}}));
  EXPECT_EQ(weights("solo"), (std::vector<TenantWeight>{{"solo", 1}}));
  EXPECT_EQ(weights("a:10000,b"), (std::vector<TenantWeight>{{"a", 10'000}, {"b", 1}}));
}

TEST(TenantWeightsTest, BadEntriesFailNamingThem) {
  EXPECT_THAT(parse_error(""), HasSubstr("expected name:weight"));
  EXPECT_THAT(parse_error("heavy:5,"), HasSubstr("expected name:weight"));
  EXPECT_THAT(parse_error(":3"), HasSubstr("':3': expected name:weight"));
  EXPECT_THAT(parse_error("heavy:0"), HasSubstr("'heavy:0': the weight must be an integer"));
  EXPECT_THAT(parse_error("heavy:2.5"), HasSubstr("'heavy:2.5'"));
  EXPECT_THAT(parse_error("heavy:"), HasSubstr("'heavy:'"));
  EXPECT_THAT(parse_error("heavy:10001"), HasSubstr("from 1 to 10000"));
  EXPECT_THAT(parse_error("heavy:-1"), HasSubstr("'heavy:-1'"));
  EXPECT_EQ(parse_error("a:1,b:2,a:3"), "tenant 'a' is named twice");
}

TEST(TenantAssignmentTest, EveryRoundOfTheWeightsIsExactlyProportional) {
  const auto tenants = weights("heavy:5,light:1");
  const TenantAssignment assignment = assign_tenants(tenants, 6'000, 7);
  EXPECT_EQ(assignment.names, (std::vector<std::string>{"heavy", "light"}));
  ASSERT_EQ(assignment.of_request.size(), 6'000U);
  for (std::size_t round = 0; round < 1'000; ++round) {
    const auto begin = assignment.of_request.begin() + static_cast<std::ptrdiff_t>(6 * round);
    EXPECT_EQ(std::count(begin, begin + 6, 1U), 1) << "round " << round;
  }
  EXPECT_EQ(std::ranges::count(assignment.of_request, 0U), 5'000);
}

TEST(TenantAssignmentTest, TheSameSeedGivesTheSameAssignmentAndAnotherSeedAnother) {
  const auto tenants = weights("a:3,b:2,c:1");
  const TenantAssignment first = assign_tenants(tenants, 600, 1);
  EXPECT_EQ(assign_tenants(tenants, 600, 1).of_request, first.of_request);
  EXPECT_NE(assign_tenants(tenants, 600, 2).of_request, first.of_request);
  // The order within a round is drawn, not fixed: the light tenant does not always come last.
  std::set<std::size_t> light_positions;
  for (std::size_t round = 0; round < 100; ++round) {
    for (std::size_t i = 0; i < 6; ++i) {
      if (first.of_request[6 * round + i] == 2) light_positions.insert(i);
    }
  }
  EXPECT_GT(light_positions.size(), 3U);
}

TEST(TenantAssignmentTest, ARequestsTenantDoesNotDependOnHowManyFollow) {
  const auto tenants = weights("heavy:5,light:1");
  const TenantAssignment all = assign_tenants(tenants, 1'000, 3);
  const TenantAssignment first_hundred = assign_tenants(tenants, 100, 3);
  ASSERT_EQ(first_hundred.of_request.size(), 100U);
  EXPECT_TRUE(std::equal(first_hundred.of_request.begin(), first_hundred.of_request.end(),
                         all.of_request.begin()));
  // A trace shorter than one round is cut mid-round.
  EXPECT_EQ(assign_tenants(tenants, 4, 3).of_request.size(), 4U);
  EXPECT_TRUE(assign_tenants({}, 10, 3).empty());
}

}  // namespace
}  // namespace kvr::replay
