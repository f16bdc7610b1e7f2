#include "messages/ids.hpp"

#include <unordered_set>

#include <gtest/gtest.h>

namespace kvr {
namespace {

TEST(WorkerTypeTest, NamesRoundTrip) {
  for (WorkerType type : kAllWorkerTypes) {
    EXPECT_EQ(parse_worker_type(as_str(type)), type);
  }
  EXPECT_EQ(as_str(WorkerType::Prefill), "prefill");
}

TEST(WorkerTypeTest, ParseRejectsUnknownAndWrongCase) {
  EXPECT_FALSE(parse_worker_type("Aggregated").has_value());
  EXPECT_FALSE(parse_worker_type("").has_value());
  EXPECT_FALSE(parse_worker_type("mixed").has_value());
}

TEST(WorkerWithDpRankTest, OrdersByWorkerThenRankAndHashesDistinctly) {
  WorkerWithDpRank a{1, 0};
  WorkerWithDpRank b{1, 1};
  WorkerWithDpRank c{2, 0};
  EXPECT_LT(a, b);
  EXPECT_LT(b, c);
  std::unordered_set<WorkerWithDpRank> set{a, b, c, a};
  EXPECT_EQ(set.size(), 3U);
}

TEST(StorageTierTest, NamesEveryTier) {
  EXPECT_EQ(as_str(StorageTier::Device), "device");
  EXPECT_EQ(as_str(StorageTier::Host), "host");
  EXPECT_EQ(as_str(StorageTier::Disk), "disk");
}

}  // namespace
}  // namespace kvr
