// The node's budget of worker rank entries, shared by its partitions: a registration takes its
// data-parallel ranks from it and a worker that leaves gives them back, so that registrations
// claiming many ranks cannot grow a node's memory without bound (each rank costs the partition
// a row of load state, KV-index bookkeeping and a share of every selection).
#pragma once

#include <atomic>
#include <cstdint>

namespace kvr {

class RankBudget {
 public:
  explicit RankBudget(std::uint64_t limit) : limit_(limit) {}

  /// Takes `ranks` when the budget holds them; false (nothing taken) when it does not.
  bool try_take(std::uint64_t ranks) {
    std::uint64_t held = held_.load(std::memory_order_relaxed);
    do {
      if (ranks > limit_ - held) return false;
    } while (!held_.compare_exchange_weak(held, held + ranks, std::memory_order_relaxed));
    return true;
  }

  void give_back(std::uint64_t ranks) { held_.fetch_sub(ranks, std::memory_order_relaxed); }

  std::uint64_t limit() const { return limit_; }
  std::uint64_t held() const { return held_.load(std::memory_order_relaxed); }

 private:
  const std::uint64_t limit_;
  std::atomic<std::uint64_t> held_{0};
};

}  // namespace kvr
