// Predicted load: bookings add shared prompt blocks once and uncached prefill tokens, first token
// and the request's end release them, each booking exactly once under random interleavings, and
// every rank's active prefix of a candidate matches the open bookings.
#include "discovery/load/predicted_load.hpp"

#include <map>
#include <random>
#include <set>

#include <gtest/gtest.h>

#include "discovery/block_hash.hpp"

namespace kvr::discovery {
namespace {

constexpr WorkerWithDpRank kRank0{5, 0};
constexpr WorkerWithDpRank kRank1{5, 1};
const std::chrono::steady_clock::time_point kStart{};

std::vector<BlockHash> prompt(std::size_t length, std::uint64_t branch, std::size_t shared = 0) {
  std::vector<BlockHash> hashes;
  std::optional<BlockHash> parent;
  for (std::size_t i = 0; i < length; ++i) {
    parent = BlockHasher::chain(parent, i < shared ? i : branch * 100 + i);
    hashes.push_back(*parent);
  }
  return hashes;
}

BookingRequest booking(std::string id, WorkerWithDpRank worker, std::vector<BlockHash> blocks,
                       std::uint64_t tokens, std::chrono::seconds ttl = std::chrono::seconds(60)) {
  return BookingRequest{std::move(id), worker, std::move(blocks), tokens, kStart + ttl};
}

class PredictedLoadTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(load_.add_rank(kRank0, 1000));
    ASSERT_TRUE(load_.add_rank(kRank1, 1000));
  }
  PredictedLoad load_;
};

TEST_F(PredictedLoadTest, SharedPromptBlocksCountOnce) {
  ASSERT_TRUE(load_.book(booking("a", kRank0, prompt(6, 1, 4), 96)));
  ASSERT_TRUE(load_.book(booking("b", kRank0, prompt(6, 2, 4), 32)));
  const auto view = load_.rank_load(kRank0).value();
  EXPECT_EQ(view.booked_blocks, 8U);
  EXPECT_EQ(view.booked_prefill_tokens, 128U);
  EXPECT_EQ(view.open_bookings, 2U);
  EXPECT_EQ(load_.book(booking("a", kRank0, {}, 0)).error(), LoadError::duplicate_booking);
  EXPECT_EQ(load_.book(booking("z", {9, 0}, {}, 0)).error(), LoadError::unknown_rank);
}

TEST_F(PredictedLoadTest, FirstTokenReleasesPrefillAndTheEndReleasesTheRest) {
  ASSERT_TRUE(load_.book(booking("a", kRank0, prompt(4, 1), 64)));
  ASSERT_TRUE(load_.first_token("a"));
  EXPECT_EQ(load_.rank_load(kRank0)->booked_prefill_tokens, 0U);
  EXPECT_EQ(load_.rank_load(kRank0)->booked_blocks, 4U);
  EXPECT_EQ(load_.first_token("a").error(), LoadError::prefill_already_released);
  ASSERT_TRUE(load_.release("a", BookingEnd::completed));
  EXPECT_EQ(load_.rank_load(kRank0)->booked_blocks, 0U);
  EXPECT_EQ(load_.release("a", BookingEnd::cancelled).error(), LoadError::unknown_booking);
  EXPECT_EQ(load_.active_block_count(), 0U);
}

TEST_F(PredictedLoadTest, ExpiryReleasesUnreportedBookings) {
  ASSERT_TRUE(load_.book(booking("a", kRank0, prompt(4, 1), 64, std::chrono::seconds(5))));
  ASSERT_TRUE(load_.book(booking("b", kRank1, prompt(4, 1), 64, std::chrono::seconds(9))));
  EXPECT_EQ(load_.expire(kStart + std::chrono::seconds(5)), 1U);
  EXPECT_EQ(load_.rank_load(kRank0)->open_bookings, 0U);
  EXPECT_EQ(load_.rank_load(kRank1)->open_bookings, 1U);
  EXPECT_EQ(load_.release("a", BookingEnd::completed).error(), LoadError::unknown_booking);
}

TEST_F(PredictedLoadTest, BoundedExpiryReleasesTheEarliestDueBookingsFirst) {
  for (int i = 0; i < 5; ++i) {
    // Booked out of expiry order: booking i expires at (5 - i) s.
    ASSERT_TRUE(load_.book(booking(std::string(1, static_cast<char>('a' + i)), kRank0,
                                   prompt(4, static_cast<std::uint64_t>(i)), 64,
                                   std::chrono::seconds(5 - i))));
  }
  ASSERT_TRUE(load_.book(booking("later", kRank1, prompt(4, 9), 64, std::chrono::seconds(60))));
  EXPECT_EQ(load_.expire(kStart + std::chrono::seconds(10), 2), 2U);
  EXPECT_FALSE(load_.has_booking("e"));
  EXPECT_FALSE(load_.has_booking("d"));
  EXPECT_TRUE(load_.has_booking("c"));
  EXPECT_EQ(load_.expire(kStart + std::chrono::seconds(10)), 3U);
  EXPECT_EQ(load_.rank_load(kRank0)->open_bookings, 0U);
  EXPECT_TRUE(load_.has_booking("later"));
  EXPECT_EQ(load_.expire(kStart + std::chrono::seconds(10), 2), 0U);
  ASSERT_TRUE(load_.check_consistency());
}

TEST_F(PredictedLoadTest, CountsBookedPromptBlocksOfEveryBooking) {
  // Shared blocks count in each booking: each keeps its own copy of its prompt's hashes.
  ASSERT_TRUE(load_.book(booking("a", kRank0, prompt(6, 1, 4), 0)));
  ASSERT_TRUE(load_.book(booking("b", kRank1, prompt(6, 2, 4), 0)));
  EXPECT_EQ(load_.booked_prompt_blocks(), 12U);
  ASSERT_TRUE(load_.first_token("a"));
  EXPECT_EQ(load_.booked_prompt_blocks(), 12U);
  ASSERT_TRUE(load_.release("a", BookingEnd::completed));
  EXPECT_EQ(load_.booked_prompt_blocks(), 6U);
  EXPECT_EQ(load_.expire(kStart + std::chrono::seconds(60)), 1U);
  EXPECT_EQ(load_.booked_prompt_blocks(), 0U);
}

TEST_F(PredictedLoadTest, TheLedgerGivesItsMemoryBackAfterABurstOfLongPrompts) {
  // Ten unreported 20,000-block bookings, as a client that never reports leaves them.
  for (std::uint64_t i = 0; i < 10; ++i) {
    ASSERT_TRUE(load_.book(booking("r" + std::to_string(i), kRank0, prompt(20'000, i + 1), 0)));
  }
  const std::size_t peak = load_.ledger_capacity();
  EXPECT_GE(peak, 200'000U);
  for (std::uint64_t i = 0; i < 9; ++i) {
    ASSERT_TRUE(load_.release("r" + std::to_string(i), BookingEnd::cancelled));
  }
  EXPECT_EQ(load_.active_block_count(), 20'000U);
  EXPECT_LE(load_.ledger_capacity(), peak / 4);
  ASSERT_TRUE(load_.check_consistency()) << load_.check_consistency().error();
}

TEST_F(PredictedLoadTest, EachRanksActivePrefixEndsAtItsFirstMissingBlock) {
  constexpr WorkerWithDpRank kRank2{6, 0};
  constexpr WorkerWithDpRank kRank3{7, 0};
  ASSERT_TRUE(load_.add_rank(kRank2, 1000));
  ASSERT_TRUE(load_.add_rank(kRank3, 1000));
  const std::vector<BlockHash> candidate{11, 12, 13, 14, 15};
  // Rank 0 holds four leading blocks over two bookings, rank 1 two, and rank 2 the first and
  // third but not the second (unchained hashes a client may send): its prefix stops at one.
  ASSERT_TRUE(load_.book(booking("a", kRank0, {11, 12}, 0)));
  ASSERT_TRUE(load_.book(booking("b", kRank0, {11, 12, 13, 14, 99}, 0)));
  ASSERT_TRUE(load_.book(booking("c", kRank1, {11, 12}, 0)));
  ASSERT_TRUE(load_.book(booking("d", kRank2, {11, 98, 13}, 0)));
  ProjectionScratch scratch;
  load_.prepare(candidate, scratch);
  EXPECT_EQ(load_.project(kRank0, {5, 0}, scratch)->new_blocks, 1U);
  EXPECT_EQ(load_.project(kRank1, {5, 0}, scratch)->new_blocks, 3U);
  EXPECT_EQ(load_.project(kRank2, {5, 0}, scratch)->new_blocks, 4U);
  EXPECT_EQ(load_.project(kRank3, {5, 0}, scratch)->new_blocks, 5U);
  // The same scratch for the next request: nothing of the previous walk is left over.
  ASSERT_TRUE(load_.release("b", BookingEnd::completed));
  load_.prepare(std::vector<BlockHash>{11, 12, 13}, scratch);
  EXPECT_EQ(load_.project(kRank0, {3, 0}, scratch)->new_blocks, 1U);
  EXPECT_EQ(load_.project(kRank1, {3, 0}, scratch)->new_blocks, 1U);
  EXPECT_EQ(load_.project(kRank2, {3, 0}, scratch)->new_blocks, 2U);
  load_.prepare(std::vector<BlockHash>{50}, scratch);
  EXPECT_EQ(load_.project(kRank0, {1, 0}, scratch)->new_blocks, 1U);
  EXPECT_EQ(load_.project(kRank2, {1, 0}, scratch)->new_blocks, 1U);
}

TEST_F(PredictedLoadTest, ProjectionAddsTheCandidatesNewBlocksAndPrefill) {
  ASSERT_TRUE(load_.update_confirmed(kRank0, ConfirmedLoad{3, 1, 40, 500, 60}));
  ASSERT_TRUE(load_.book(booking("a", kRank0, prompt(6, 1, 4), 96)));
  const auto candidate_prompt = prompt(10, 2, 4);
  ProjectionScratch scratch;
  load_.prepare(candidate_prompt, scratch);
  const auto busy = load_.project(kRank0, {10, 200}, scratch).value();
  EXPECT_TRUE(busy.is_available);
  EXPECT_EQ(busy.active_requests, 4U);
  EXPECT_EQ(busy.active_prefill_tokens, 500U + 96U + 200U);
  EXPECT_EQ(busy.new_blocks, 6U);  // the first four blocks are already active
  EXPECT_EQ(busy.decode_cost_blocks, 40U + 6U + 6U);
  EXPECT_EQ(busy.total_kv_blocks, 1000U);
  const auto idle = load_.project(kRank1, {10, 200}, scratch).value();
  EXPECT_FALSE(idle.is_available);
  EXPECT_EQ(idle.new_blocks, 10U);
  EXPECT_EQ(idle.decode_cost_blocks, 10U);
  EXPECT_FALSE(load_.project({9, 0}, {10, 200}, scratch));
  EXPECT_EQ(uncached_prefill_tokens(1000, 3, 256), 232U);
  EXPECT_EQ(uncached_prefill_tokens(500, 3, 256), 0U);
}

TEST_F(PredictedLoadTest, ARankWithoutCapacityProjectsItsLoadWithNoTotal) {
  constexpr WorkerWithDpRank kUnknown{6, 0};
  ASSERT_TRUE(load_.add_rank(kUnknown, std::nullopt));
  ASSERT_TRUE(load_.update_confirmed(kUnknown, ConfirmedLoad{2, 0, 30, 100, 0}));
  ASSERT_TRUE(load_.book(booking("a", kUnknown, prompt(4, 1), 64)));
  EXPECT_EQ(load_.rank_load(kUnknown)->total_kv_blocks, std::nullopt);
  ProjectionScratch scratch;
  load_.prepare(prompt(6, 1), scratch);
  const auto projected = load_.project(kUnknown, {6, 32}, scratch).value();
  // Everything but the capacity is projected as for any rank.
  EXPECT_TRUE(projected.is_available);
  EXPECT_EQ(projected.active_requests, 3U);
  EXPECT_EQ(projected.active_prefill_tokens, 100U + 64U + 32U);
  EXPECT_EQ(projected.new_blocks, 2U);
  EXPECT_EQ(projected.decode_cost_blocks, 30U + 4U + 2U);
  EXPECT_EQ(projected.total_kv_blocks, std::nullopt);
  EXPECT_EQ(load_.project(kRank0, {6, 32}, scratch)->total_kv_blocks, 1000U);
}

TEST_F(PredictedLoadTest, RemovingAWorkerReleasesItsBookings) {
  ASSERT_TRUE(load_.book(booking("a", kRank0, prompt(4, 1), 64)));
  ASSERT_TRUE(load_.book(booking("b", kRank1, prompt(4, 2), 64)));
  EXPECT_EQ(load_.remove_worker(5), 2U);
  EXPECT_EQ(load_.open_bookings(), 0U);
  EXPECT_FALSE(load_.rank_load(kRank0));
  EXPECT_EQ(load_.first_token("a").error(), LoadError::unknown_booking);
}

// Random book / first-token / complete / cancel / fail / expire / remove-worker interleavings:
// every release succeeds exactly once, and the counters always equal those recomputed from the
// bookings the test believes open.
TEST(PredictedLoadPropertyTest, EveryBookingIsReleasedExactlyOnce) {
  std::mt19937_64 rng(42);
  PredictedLoad load;
  const std::vector<WorkerWithDpRank> ranks{{1, 0}, {1, 1}, {2, 0}, {3, 0}};
  for (const auto rank : ranks) ASSERT_TRUE(load.add_rank(rank, 100));
  struct Open {
    WorkerWithDpRank worker;
    std::vector<BlockHash> blocks;
    std::uint64_t tokens;
    bool prefill_done;
    std::chrono::steady_clock::time_point expires_at;
  };
  std::map<std::string, Open> open;
  std::set<std::string> closed;
  auto now = kStart;
  int next_id = 0;
  for (int step = 0; step < 4000; ++step) {
    const auto roll = rng() % 100;
    if (roll < 35 || open.empty()) {
      // Appended rather than `"r" + ...`, which trips GCC 12's false -Wrestrict at -O3.
      const std::string id = std::string{"r"}.append(std::to_string(next_id++));
      const WorkerWithDpRank worker = ranks[rng() % ranks.size()];
      auto blocks = prompt(1 + rng() % 8, rng() % 5, rng() % 5);
      const std::uint64_t tokens = rng() % 500;
      const auto expires_at = now + std::chrono::seconds(1 + rng() % 50);
      ASSERT_TRUE(load.book(BookingRequest{id, worker, blocks, tokens, expires_at}));
      open[id] = Open{worker, blocks, tokens, false, expires_at};
    } else if (roll < 90) {
      auto it = open.begin();
      std::advance(it, static_cast<std::ptrdiff_t>(rng() % open.size()));
      const std::string id = it->first;
      if (roll < 55) {
        const auto result = load.first_token(id);
        ASSERT_EQ(result.has_value(), !it->second.prefill_done);
        it->second.prefill_done = true;
      } else {
        const auto end = static_cast<BookingEnd>(rng() % 3);
        ASSERT_TRUE(load.release(id, end));
        open.erase(it);
        closed.insert(id);
      }
    } else if (roll < 97) {
      now += std::chrono::seconds(rng() % 10);
      std::size_t due = 0;
      for (auto it = open.begin(); it != open.end();) {
        if (it->second.expires_at <= now) {
          closed.insert(it->first);
          it = open.erase(it);
          ++due;
        } else {
          ++it;
        }
      }
      ASSERT_EQ(load.expire(now), due);
    } else {
      const WorkerId worker_id = 1 + rng() % 3;
      std::size_t doomed = 0;
      for (auto it = open.begin(); it != open.end();) {
        if (it->second.worker.worker_id == worker_id) {
          closed.insert(it->first);
          it = open.erase(it);
          ++doomed;
        } else {
          ++it;
        }
      }
      ASSERT_EQ(load.remove_worker(worker_id), doomed);
      for (const auto rank : ranks) {
        if (rank.worker_id == worker_id) {
          ASSERT_TRUE(load.add_rank(rank, 100));
        }
      }
    }
    // A closed booking can never be released again.
    if (!closed.empty() && rng() % 10 == 0) {
      auto it = closed.begin();
      std::advance(it, static_cast<std::ptrdiff_t>(rng() % closed.size()));
      ASSERT_EQ(load.release(*it, BookingEnd::completed).error(), LoadError::unknown_booking);
      ASSERT_EQ(load.first_token(*it).error(), LoadError::unknown_booking);
    }
    for (const auto rank : ranks) {
      std::uint32_t bookings = 0;
      std::uint64_t tokens = 0;
      std::set<BlockHash> blocks;
      for (const auto& [id, booking_state] : open) {
        if (booking_state.worker != rank) continue;
        ++bookings;
        if (!booking_state.prefill_done) tokens += booking_state.tokens;
        blocks.insert(booking_state.blocks.begin(), booking_state.blocks.end());
      }
      const auto view = load.rank_load(rank).value();
      ASSERT_EQ(view.open_bookings, bookings) << "step " << step;
      ASSERT_EQ(view.booked_prefill_tokens, tokens) << "step " << step;
      ASSERT_EQ(view.booked_blocks, blocks.size()) << "step " << step;
    }
    const auto consistent = load.check_consistency();
    ASSERT_TRUE(consistent) << "step " << step << ": " << consistent.error();
    // Each rank's active prefix of a candidate equals the one recomputed from the open bookings.
    const auto candidate = prompt(1 + rng() % 8, rng() % 5, rng() % 5);
    ProjectionScratch scratch;
    load.prepare(candidate, scratch);
    for (const auto rank : ranks) {
      std::set<BlockHash> active;
      for (const auto& [id, booking_state] : open) {
        if (booking_state.worker == rank) {
          active.insert(booking_state.blocks.begin(), booking_state.blocks.end());
        }
      }
      std::size_t prefix = 0;
      while (prefix < candidate.size() && active.contains(candidate[prefix])) ++prefix;
      const auto projection = load.project(rank, CandidateRequest{candidate.size(), 0}, scratch);
      ASSERT_EQ(projection->new_blocks, candidate.size() - prefix) << "step " << step;
    }
  }
  for (const auto& [id, booking_state] : open) ASSERT_TRUE(load.release(id, BookingEnd::completed));
  EXPECT_EQ(load.open_bookings(), 0U);
  EXPECT_EQ(load.active_block_count(), 0U);
}

}  // namespace
}  // namespace kvr::discovery

namespace kvr::discovery {
namespace {

class PredictedLoadReportTest : public PredictedLoadTest {
 protected:
  LoadProjection project_empty_candidate() {
    ProjectionScratch scratch;
    load_.prepare({}, scratch);
    return load_.project(kRank0, CandidateRequest{}, scratch).value();
  }
};

TEST_F(PredictedLoadReportTest, ReportThatCountsTheBookingsIsNotAddedTwice) {
  ASSERT_TRUE(load_.book(booking("a", kRank0, prompt(4, 1), 64)));
  ASSERT_TRUE(load_.book(booking("b", kRank0, prompt(4, 2), 32)));
  EXPECT_EQ(project_empty_candidate().active_requests, 2U);  // bookings alone before any report
  // The worker reports both requests; the projection follows the report, not report + bookings.
  ASSERT_TRUE(load_.update_confirmed(
      kRank0,
      ConfirmedLoad{.active_requests = 2, .active_decode_blocks = 8, .active_prefill_tokens = 96}));
  const auto projection = project_empty_candidate();
  EXPECT_EQ(projection.active_requests, 2U);
  EXPECT_EQ(projection.active_prefill_tokens, 96U);
  EXPECT_EQ(projection.decode_cost_blocks, 8U);
}

TEST_F(PredictedLoadReportTest, BookingsAfterTheReportAddAndReleasesSubtract) {
  ASSERT_TRUE(load_.book(booking("a", kRank0, prompt(4, 1), 64)));
  ASSERT_TRUE(load_.update_confirmed(
      kRank0,
      ConfirmedLoad{.active_requests = 1, .active_decode_blocks = 4, .active_prefill_tokens = 64}));
  ASSERT_TRUE(load_.book(booking("b", kRank0, prompt(4, 2), 32)));
  auto projection = project_empty_candidate();
  EXPECT_EQ(projection.active_requests, 2U);
  EXPECT_EQ(projection.active_prefill_tokens, 96U);
  EXPECT_EQ(projection.decode_cost_blocks, 8U);
  // "a" (counted by the report) finishes before the next report: the rank is lighter now.
  ASSERT_TRUE(load_.release("a", BookingEnd::completed));
  projection = project_empty_candidate();
  EXPECT_EQ(projection.active_requests, 1U);
  EXPECT_EQ(projection.active_prefill_tokens, 32U);
  EXPECT_EQ(projection.decode_cost_blocks, 4U);
}

TEST_F(PredictedLoadReportTest, ReleasesBeyondTheReportNeverGoBelowZero) {
  ASSERT_TRUE(load_.book(booking("a", kRank0, prompt(4, 1), 64)));
  ASSERT_TRUE(load_.update_confirmed(kRank0, ConfirmedLoad{}));  // the report missed "a"
  ASSERT_TRUE(load_.release("a", BookingEnd::cancelled));
  const auto projection = project_empty_candidate();
  EXPECT_EQ(projection.active_requests, 0U);
  EXPECT_EQ(projection.active_prefill_tokens, 0U);
  EXPECT_EQ(projection.decode_cost_blocks, 0U);
}

}  // namespace
}  // namespace kvr::discovery
