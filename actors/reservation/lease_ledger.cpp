#include "actors/reservation/lease_ledger.hpp"

#include <fmt/format.h>

namespace kvr::actors {

std::string_view as_str(LeaseError error) {
  switch (error) {
    case LeaseError::unknown_lease:
      return "unknown_lease";
    case LeaseError::first_token_repeated:
      return "first_token_repeated";
  }
  return "unknown";
}

LeaseLedger::LeaseLedger(std::string id_prefix) : id_prefix_(std::move(id_prefix)) {}

std::string LeaseLedger::open(plugins::worker_selection::RoutingPartition partition,
                              std::string request_id, WorkerWithDpRank worker,
                              std::chrono::steady_clock::time_point expires_at) {
  std::string lease_id = fmt::format("{}-{}", id_prefix_, next_id_++);
  const auto expiry = by_expiry_.emplace(expires_at, lease_id);
  leases_.emplace(lease_id, Entry{Lease{.lease_id = lease_id,
                                        .partition = std::move(partition),
                                        .request_id = std::move(request_id),
                                        .worker = worker,
                                        .expires_at = expires_at},
                                  expiry});
  return lease_id;
}

std::expected<Lease, LeaseError> LeaseLedger::first_token(std::string_view lease_id) {
  const auto it = leases_.find(absl::string_view{lease_id.data(), lease_id.size()});
  if (it == leases_.end()) return std::unexpected(LeaseError::unknown_lease);
  if (it->second.lease.first_token_reported) {
    return std::unexpected(LeaseError::first_token_repeated);
  }
  it->second.lease.first_token_reported = true;
  return it->second.lease;
}

std::expected<Lease, LeaseError> LeaseLedger::close(std::string_view lease_id) {
  const auto it = leases_.find(absl::string_view{lease_id.data(), lease_id.size()});
  if (it == leases_.end()) return std::unexpected(LeaseError::unknown_lease);
  Lease lease = std::move(it->second.lease);
  by_expiry_.erase(it->second.expiry);
  leases_.erase(it);
  return lease;
}

std::vector<Lease> LeaseLedger::expire(std::chrono::steady_clock::time_point now) {
  std::vector<Lease> expired;
  while (!by_expiry_.empty() && by_expiry_.begin()->first <= now) {
    const auto it = leases_.find(by_expiry_.begin()->second);
    by_expiry_.erase(by_expiry_.begin());
    if (it == leases_.end()) continue;
    expired.push_back(std::move(it->second.lease));
    leases_.erase(it);
  }
  return expired;
}

const Lease* LeaseLedger::find(std::string_view lease_id) const {
  const auto it = leases_.find(absl::string_view{lease_id.data(), lease_id.size()});
  return it == leases_.end() ? nullptr : &it->second.lease;
}

}  // namespace kvr::actors
