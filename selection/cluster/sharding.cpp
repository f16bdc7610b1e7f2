#include "selection/cluster/sharding.hpp"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <map>

#include <fmt/format.h>
#include <xxhash.h>

#include "selection/cluster/placement.hpp"

namespace kvr::cluster {
namespace {

std::uint64_t hash_bytes(const void* data, std::size_t size, std::uint64_t seed) {
  return XXH3_64bits_withSeed(data, size, seed);
}

// The shards in the rendezvous order of `key`: highest score first, ties by shard index.
std::vector<std::uint32_t> rendezvous_order(std::uint64_t key, std::uint32_t shards) {
  std::vector<std::pair<std::uint64_t, std::uint32_t>> scored;
  scored.reserve(shards);
  for (std::uint32_t shard = 0; shard < shards; ++shard) {
    // The shard's own seed: the index spread by a multiplier, so neighbouring shards share no bits.
    scored.emplace_back(hash_bytes(&key, sizeof key, 0x9E3779B97F4A7C15ULL * (shard + 1)), shard);
  }
  std::ranges::sort(scored, [](const auto& a, const auto& b) {
    return a.first != b.first ? a.first > b.first : a.second < b.second;
  });
  std::vector<std::uint32_t> order;
  order.reserve(shards);
  for (const auto& [score, shard] : scored) order.push_back(shard);
  return order;
}

}  // namespace

std::optional<std::string> validate(const ShardingConfig& config) {
  if (config.shards == 0 || config.shards > 1024) {
    return fmt::format("shards: {} is not in [1, 1024]", config.shards);
  }
  if (config.prefix_tokens == 0) return "prefix_tokens: must be at least 1";
  if (!(config.miss_cost >= 0.0) || !std::isfinite(config.miss_cost)) {
    return fmt::format("miss_cost: {} is not a finite number of at least 0", config.miss_cost);
  }
  if (config.load_interval_ms == 0 || config.load_interval_ms > 60'000) {
    return fmt::format("load_interval_ms: {} is not in [1, 60000]", config.load_interval_ms);
  }
  return std::nullopt;
}

std::string shard_key(std::string_view partition_key, std::uint32_t shard, std::uint32_t shards) {
  if (shards <= 1) return std::string{partition_key};
  return fmt::format("{}#{}", partition_key, shard);
}

std::string shard_group(std::string_view routing_group, std::uint32_t shard) {
  return fmt::format("{}{}{}", routing_group, kShardSeparator, shard);
}

ShardedGroup split_shard_group(std::string_view group) {
  const std::size_t separator = group.rfind(kShardSeparator);
  if (separator == std::string_view::npos) return {group, std::nullopt};
  std::uint32_t shard = 0;
  const std::string_view digits = group.substr(separator + 1);
  const auto [end, error] = std::from_chars(digits.data(), digits.data() + digits.size(), shard);
  if (digits.empty() || error != std::errc{} || end != digits.data() + digits.size()) {
    return {group, std::nullopt};
  }
  return {group.substr(0, separator), shard};
}

ShardMap::ShardMap(std::uint32_t shards) : workers_per_shard_(std::max<std::uint32_t>(1, shards)) {}

std::vector<WorkerId> ShardMap::assign(std::span<const ShardedWorker> workers) {
  const std::uint32_t count = shards();
  std::vector<PlacementMember> members;
  members.reserve(count);
  for (std::uint32_t shard = 0; shard < count; ++shard) {
    members.push_back({std::to_string(shard), 1.0});
  }
  // Each group is spread on its own; a worker's item is its decimal id.
  std::map<std::uint8_t, std::vector<std::string>> groups;
  for (const auto& worker : workers) groups[worker.group].push_back(std::to_string(worker.id));

  std::vector<std::pair<WorkerId, std::uint32_t>> owner;
  owner.reserve(workers.size());
  for (const auto& [group, items] : groups) {
    for (const auto& [item, shard] : cluster::assign(items, members, 0.0)) {
      owner.emplace_back(std::stoull(item), static_cast<std::uint32_t>(std::stoul(shard)));
    }
  }
  std::ranges::sort(owner);
  const auto duplicates =
      std::ranges::unique(owner, {}, &std::pair<WorkerId, std::uint32_t>::first);
  owner.erase(duplicates.begin(), duplicates.end());

  std::vector<WorkerId> moved;
  for (const auto& [worker, shard] : owner) {
    if (const auto before = shard_of(worker); before && *before != shard) moved.push_back(worker);
  }
  owner_ = std::move(owner);
  std::ranges::fill(workers_per_shard_, 0);
  for (const auto& [worker, shard] : owner_) ++workers_per_shard_[shard];
  return moved;
}

std::optional<std::uint32_t> ShardMap::shard_of(WorkerId worker) const {
  const auto it =
      std::ranges::lower_bound(owner_, worker, {}, &std::pair<WorkerId, std::uint32_t>::first);
  if (it == owner_.end() || it->first != worker) return std::nullopt;
  return it->second;
}

std::string_view as_str(ShardReason reason) {
  switch (reason) {
    case ShardReason::prefix:
      return "prefix";
    case ShardReason::session:
      return "session";
    case ShardReason::pinned:
      return "pinned";
    case ShardReason::spread:
      return "spread";
  }
  return "unknown";
}

ShardBalancer::ShardBalancer(std::uint32_t shards)
    : worker_tokens_(std::max<std::uint32_t>(1, shards)) {}

void ShardBalancer::set_load(std::uint32_t shard, std::vector<std::uint64_t> worker_tokens) {
  std::ranges::make_heap(worker_tokens, std::greater<>{});
  worker_tokens_.at(shard) = std::move(worker_tokens);
}

std::uint64_t ShardBalancer::least_worker_tokens(std::uint32_t shard) const {
  const auto& heap = worker_tokens_.at(shard);
  return heap.empty() ? 0 : heap.front();
}

ShardChoice ShardBalancer::choose(const ShardMap& map, const ShardingConfig& config,
                                  const ShardRequest& request) {
  const std::uint32_t shards = map.shards();
  if (shards <= 1) return {};

  // A shard may serve the request when it owns a worker, an allowed one if a list is given.
  std::vector<bool> eligible(shards, false);
  if (request.allowed_workers.empty()) {
    for (std::uint32_t shard = 0; shard < shards; ++shard) {
      eligible[shard] = map.workers_in(shard) > 0;
    }
  } else {
    for (const WorkerId worker : request.allowed_workers) {
      if (const auto shard = map.shard_of(worker)) eligible[*shard] = true;
    }
  }

  ShardReason reason = ShardReason::spread;
  std::uint64_t key = 0;
  std::optional<std::uint32_t> pinned_shard;
  if (request.pinned_worker) {
    reason = ShardReason::pinned;
    pinned_shard = map.shard_of(*request.pinned_worker);
    key = *request.pinned_worker;
  } else if (!request.session_id.empty()) {
    reason = ShardReason::session;
    key = hash_bytes(request.session_id.data(), request.session_id.size(), 0);
  } else if (!request.block_hashes.empty() && request.block_size > 0) {
    reason = ShardReason::prefix;
    const std::size_t blocks = std::clamp<std::size_t>(config.prefix_tokens / request.block_size, 1,
                                                       request.block_hashes.size());
    key = request.block_hashes[blocks - 1];
  } else {
    key = hash_bytes(request.request_id.data(), request.request_id.size(), 0);
  }

  const std::vector<std::uint32_t> order = rendezvous_order(key, shards);
  const auto first_eligible =
      std::ranges::find_if(order, [&](std::uint32_t shard) { return eligible[shard]; });
  std::uint32_t chosen = order.front();
  std::uint32_t home = chosen;
  if (pinned_shard) {
    chosen = home = *pinned_shard;
  } else if (first_eligible != order.end() && reason != ShardReason::pinned) {
    chosen = home = *first_eligible;
    if (reason == ShardReason::spread) {
      // No key: the shard with the least loaded worker, ties in the request's own order.
      for (const std::uint32_t shard : order) {
        if (eligible[shard] && least_worker_tokens(shard) < least_worker_tokens(chosen)) {
          chosen = shard;
        }
      }
      home = chosen;
    } else {
      // The first shard, in the key's order, where the prompt computed without its cache is
      // still sooner than on the home shard.
      const double penalty = config.miss_cost * static_cast<double>(request.prompt_tokens);
      const auto home_tokens = static_cast<double>(least_worker_tokens(home));
      for (const std::uint32_t shard : order) {
        if (!eligible[shard] || shard == home) continue;
        if (static_cast<double>(least_worker_tokens(shard)) + penalty < home_tokens) {
          chosen = shard;
          break;
        }
      }
    }
  }
  // Until the shard publishes again, its least loaded worker counts the request's prompt twice:
  // the prefill it may compute and the KV it will hold, as the shard's bookings count them.
  auto& heap = worker_tokens_[chosen];
  if (heap.empty()) heap.assign(std::max<std::size_t>(1, map.workers_in(chosen)), 0);
  std::ranges::pop_heap(heap, std::greater<>{});
  heap.back() += 2 * request.prompt_tokens;
  std::ranges::push_heap(heap, std::greater<>{});
  return {chosen, home, reason};
}

}  // namespace kvr::cluster
