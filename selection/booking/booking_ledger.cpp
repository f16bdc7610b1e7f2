#include "selection/booking/booking_ledger.hpp"

#include <algorithm>
#include <charconv>
#include <functional>

#include <fmt/format.h>

namespace kvr {

std::string_view as_str(BookingError error) {
  switch (error) {
    case BookingError::unknown_booking:
      return "unknown_booking";
    case BookingError::first_token_repeated:
      return "first_token_repeated";
    case BookingError::already_ended:
      return "already_ended";
  }
  return "unknown";
}

namespace {

// The open booking under `counter` if its id is exactly `booking_id` ("n-07" is not "n-7"), else
// end(); for the ledger's map, const or not.
template <class Bookings>
auto find_exact(Bookings& bookings, std::optional<std::uint64_t> counter,
                std::string_view booking_id) {
  const auto it = counter ? bookings.find(*counter) : bookings.end();
  return it != bookings.end() && it->second.booking_id == booking_id ? it : bookings.end();
}

}  // namespace

BookingLedger::BookingLedger(std::string id_prefix) : id_prefix_(std::move(id_prefix) + '-') {}

std::optional<std::uint64_t> BookingLedger::counter_of(std::string_view booking_id) const {
  if (!booking_id.starts_with(id_prefix_)) return std::nullopt;
  const std::string_view digits = booking_id.substr(id_prefix_.size());
  std::uint64_t counter = 0;
  const auto [end, error] = std::from_chars(digits.data(), digits.data() + digits.size(), counter);
  if (error != std::errc{} || end != digits.data() + digits.size()) return std::nullopt;
  return counter;
}

std::string BookingLedger::open(plugins::worker_selection::RoutingPartition partition,
                                std::string request_id, WorkerWithDpRank worker,
                                std::chrono::steady_clock::time_point expires_at) {
  const std::uint64_t counter = next_id_++;
  std::string booking_id = fmt::format("{}{}", id_prefix_, counter);
  bookings_.emplace(counter, Booking{.booking_id = booking_id,
                                     .partition = std::move(partition),
                                     .request_id = std::move(request_id),
                                     .worker = worker,
                                     .expires_at = expires_at});
  expiries_.emplace_back(expires_at, counter);
  std::ranges::push_heap(expiries_, std::greater{});
  return booking_id;
}

const Booking* BookingLedger::find(std::string_view booking_id) const {
  const auto it = find_exact(bookings_, counter_of(booking_id), booking_id);
  return it == bookings_.end() ? nullptr : &it->second;
}

std::expected<Booking, BookingError> BookingLedger::first_token(std::string_view booking_id) {
  const auto counter = counter_of(booking_id);
  const auto it = find_exact(bookings_, counter, booking_id);
  if (it == bookings_.end()) return std::unexpected(not_open(counter));
  Booking* booking = &it->second;
  if (booking->first_token_reported) return std::unexpected(BookingError::first_token_repeated);
  booking->first_token_reported = true;
  return *booking;
}

std::expected<Booking, BookingError> BookingLedger::close(std::string_view booking_id) {
  const auto counter = counter_of(booking_id);
  const auto it = find_exact(bookings_, counter, booking_id);
  if (it == bookings_.end()) return std::unexpected(not_open(counter));
  Booking booking = std::move(it->second);
  ended_order_.push_back(it->first);
  ended_.insert(it->first);
  if (ended_order_.size() > kRecentlyEnded) {
    ended_.erase(ended_order_.front());
    ended_order_.pop_front();
  }
  bookings_.erase(it);
  compact_expiries();
  return booking;
}

std::vector<Booking> BookingLedger::expire(std::chrono::steady_clock::time_point now,
                                           std::size_t limit) {
  std::vector<Booking> expired;
  while (expired.size() < limit && !expiries_.empty() && expiries_.front().first <= now) {
    const std::uint64_t counter = expiries_.front().second;
    std::ranges::pop_heap(expiries_, std::greater{});
    expiries_.pop_back();
    const auto it = bookings_.find(counter);
    if (it == bookings_.end()) continue;  // ended before its expiry
    expired.push_back(std::move(it->second));
    bookings_.erase(it);
  }
  return expired;
}

BookingError BookingLedger::not_open(std::optional<std::uint64_t> counter) const {
  return counter && ended_.contains(*counter) ? BookingError::already_ended
                                              : BookingError::unknown_booking;
}

void BookingLedger::compact_expiries() {
  if (expiries_.size() < 1024 || expiries_.size() < 2 * bookings_.size()) return;
  std::erase_if(expiries_, [&](const Expiry& entry) { return !bookings_.contains(entry.second); });
  std::ranges::make_heap(expiries_, std::greater{});
}

}  // namespace kvr
