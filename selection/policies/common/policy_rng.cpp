#include "selection/policies/common/policy_rng.hpp"

#include <bit>

#include "selection/policies/common/hashing.hpp"

namespace kvr::selection::policies {

PolicyRng::PolicyRng(std::uint64_t seed) {
  // splitmix64 expands the seed, so that even seed 0 gives a non-zero, well-mixed state.
  std::uint64_t expanded = seed;
  for (std::uint64_t& word : state_) {
    word = mix64(expanded);
    expanded += 0x9E3779B97F4A7C15ULL;
  }
}

PolicyRng::result_type PolicyRng::operator()() {
  const std::uint64_t result = std::rotl(state_[1] * 5, 7) * 9;
  const std::uint64_t shifted = state_[1] << 17U;
  state_[2] ^= state_[0];
  state_[3] ^= state_[1];
  state_[1] ^= state_[2];
  state_[0] ^= state_[3];
  state_[2] ^= shifted;
  state_[3] = std::rotl(state_[3], 45);
  return result;
}

std::size_t PolicyRng::uniform_index(std::size_t count) {
  const std::uint64_t bound = count;
  // Draws below 2^64 mod bound would favour small results; reject them.
  const std::uint64_t threshold = (0 - bound) % bound;
  while (true) {
    const std::uint64_t draw = (*this)();
    if (draw >= threshold) return static_cast<std::size_t>(draw % bound);
  }
}

double PolicyRng::uniform_unit() { return static_cast<double>((*this)() >> 11U) * 0x1.0p-53; }

std::uint64_t resolve_seed(std::optional<std::uint64_t> policy_seed, const RouterConfig& config,
                           WorkerType worker_type, const RoutingPartition& partition) {
  if (policy_seed) return *policy_seed;
  if (config.seed) return *config.seed;
  std::uint64_t seed = hash_text(partition.model);
  seed = hash_combine(seed, hash_text(partition.routing_group));
  return hash_combine(seed, static_cast<std::uint64_t>(worker_type));
}

}  // namespace kvr::selection::policies
