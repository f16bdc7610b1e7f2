#include "selection/booking/booking_ledger.hpp"

#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

namespace kvr {
namespace {

using namespace std::chrono_literals;
const auto kStart = std::chrono::steady_clock::time_point{} + 1h;
const plugins::worker_selection::RoutingPartition kPartition{"m", "default"};

TEST(BookingLedgerTest, IssuesUniqueIdsWithThePrefix) {
  BookingLedger ledger{"node1"};
  const std::string a = ledger.open(kPartition, "r1", {7, 0}, kStart + 1s);
  const std::string b = ledger.open(kPartition, "r1", {7, 0}, kStart + 1s);
  EXPECT_NE(a, b);
  EXPECT_EQ(a.rfind("node1-", 0), 0U);
  EXPECT_EQ(ledger.size(), 2U);
}

TEST(BookingLedgerTest, CloseReturnsTheBookingExactlyOnce) {
  BookingLedger ledger{"n"};
  const std::string id = ledger.open(kPartition, "r1", {7, 1}, kStart + 1s);
  auto closed = ledger.close(id);
  ASSERT_TRUE(closed);
  EXPECT_EQ(closed->request_id, "r1");
  EXPECT_EQ(closed->worker, (WorkerWithDpRank{7, 1}));
  EXPECT_EQ(closed->partition.model, "m");
  EXPECT_EQ(ledger.close(id).error(), BookingError::already_ended);
  EXPECT_EQ(ledger.close("n-999").error(), BookingError::unknown_booking);
  EXPECT_EQ(ledger.size(), 0U);
}

TEST(BookingLedgerTest, FirstTokenKeepsTheBookingOpenAndRefusesARepeat) {
  BookingLedger ledger{"n"};
  const std::string id = ledger.open(kPartition, "r1", {7, 0}, kStart + 1s);
  ASSERT_TRUE(ledger.first_token(id));
  EXPECT_EQ(ledger.first_token(id).error(), BookingError::first_token_repeated);
  EXPECT_TRUE(ledger.close(id));
  EXPECT_EQ(ledger.first_token(id).error(), BookingError::already_ended);
}

// Reports travel independently: a completion may overtake its first token, which then finds the
// booking ended (not unknown), for the last kRecentlyEnded closed bookings only.
TEST(BookingLedgerTest, AFirstTokenAfterItsCompletionFindsTheBookingEnded) {
  BookingLedger ledger{"n"};
  const std::string first = ledger.open(kPartition, "r0", {1, 0}, kStart + 10s);
  ASSERT_TRUE(ledger.close(first));
  const auto late = ledger.first_token(first);
  ASSERT_FALSE(late);
  EXPECT_EQ(late.error(), BookingError::already_ended);
  EXPECT_EQ(ledger.first_token("n-999").error(), BookingError::unknown_booking);
  for (std::size_t i = 0; i < BookingLedger::kRecentlyEnded; ++i) {
    ASSERT_TRUE(ledger.close(ledger.open(kPartition, "r", {1, 0}, kStart + 10s)));
  }
  EXPECT_EQ(ledger.first_token(first).error(), BookingError::unknown_booking) << "forgotten by now";
  EXPECT_EQ(ledger.close(first).error(), BookingError::unknown_booking) << "forgotten by now";
}

TEST(BookingLedgerTest, ExpireEndsOnlyDueBookingsAndNeverAClosedOne) {
  BookingLedger ledger{"n"};
  const std::string early = ledger.open(kPartition, "early", {1, 0}, kStart + 1s);
  const std::string closed = ledger.open(kPartition, "closed", {1, 0}, kStart + 1s);
  const std::string late = ledger.open(kPartition, "late", {1, 0}, kStart + 5s);
  ASSERT_TRUE(ledger.close(closed));
  EXPECT_TRUE(ledger.expire(kStart).empty());
  const auto expired = ledger.expire(kStart + 1s);
  ASSERT_EQ(expired.size(), 1U);
  EXPECT_EQ(expired.front().booking_id, early);
  EXPECT_EQ(ledger.close(early).error(), BookingError::unknown_booking);
  EXPECT_NE(ledger.find(late), nullptr);
  EXPECT_EQ(ledger.expire(kStart + 10s).size(), 1U);
  EXPECT_EQ(ledger.size(), 0U);
}

TEST(BookingLedgerTest, BoundedExpiryEndsTheEarliestDueBookingsFirst) {
  BookingLedger ledger{"n"};
  std::vector<std::string> ids;
  for (int i = 0; i < 5; ++i) {
    // Opened out of expiry order: booking i expires at (5 - i) s.
    ids.push_back(ledger.open(kPartition, fmt::format("r{}", i), {1, 0}, kStart + (5s - i * 1s)));
  }
  const std::string not_due = ledger.open(kPartition, "later", {1, 0}, kStart + 60s);
  const auto first = ledger.expire(kStart + 10s, 2);
  ASSERT_EQ(first.size(), 2U);
  EXPECT_EQ(first[0].booking_id, ids[4]);
  EXPECT_EQ(first[1].booking_id, ids[3]);
  EXPECT_EQ(ledger.size(), 4U);
  EXPECT_EQ(ledger.expire(kStart + 10s).size(), 3U);
  EXPECT_NE(ledger.find(not_due), nullptr);
  EXPECT_TRUE(ledger.expire(kStart + 10s, 2).empty());
}

TEST(BookingLedgerTest, OnlyTheExactIdFindsABooking) {
  BookingLedger ledger{"n"};
  const std::string id = ledger.open(kPartition, "r", {1, 0}, kStart + 1s);
  ASSERT_EQ(id, "n-1");
  for (const char* other :
       {"n-01", "n-1 ", "m-1", "n-", "n-x", "n1", "", "n-18446744073709551616"}) {
    EXPECT_EQ(ledger.find(other), nullptr) << other;
    EXPECT_EQ(ledger.close(other).error(), BookingError::unknown_booking) << other;
  }
  EXPECT_TRUE(ledger.close(id));
}

TEST(BookingLedgerTest, ManyClosedBookingsLeaveExpiryWorkBoundedAndCorrect) {
  BookingLedger ledger{"n"};
  std::vector<std::string> open_ids;
  // Out-of-order expiries, most bookings closed early: the survivors still expire in time order.
  for (int i = 0; i < 10'000; ++i) {
    const auto expiry = kStart + std::chrono::milliseconds{(i * 7919) % 10'000};
    std::string id = ledger.open(kPartition, fmt::format("r{}", i), {1, 0}, expiry);
    if (i % 100 == 0) {
      open_ids.push_back(std::move(id));
    } else {
      ASSERT_TRUE(ledger.close(id));
    }
  }
  EXPECT_EQ(ledger.size(), open_ids.size());
  std::size_t expired = 0;
  for (int ms = 0; ms <= 10'000; ms += 500) {
    for (const Booking& booking : ledger.expire(kStart + std::chrono::milliseconds{ms})) {
      EXPECT_LE(booking.expires_at, kStart + std::chrono::milliseconds{ms});
      EXPECT_GT(booking.expires_at, kStart + std::chrono::milliseconds{ms - 500});
      ++expired;
    }
  }
  EXPECT_EQ(expired, open_ids.size());
  EXPECT_EQ(ledger.size(), 0U);
}

}  // namespace
}  // namespace kvr
