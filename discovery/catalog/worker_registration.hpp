// A worker's validated registration (the plain form of kvr.v1.WorkerRegistration) and the rules
// that validate it. Used by the worker catalog and the discovery actor's decoder.
#pragma once

#include <chrono>
#include <cstdint>
#include <expected>
#include <optional>
#include <string>
#include <vector>

#include "kvr/v1/worker.pb.h"
#include "messages/ids.hpp"

namespace kvr::discovery {

/// Everything a worker announces about itself, validated.
struct WorkerRegistration {
  WorkerId worker_id = 0;
  Incarnation incarnation = 0;
  std::string model;
  WorkerType role = WorkerType::Aggregated;
  std::string routing_group = "default";
  std::uint32_t block_size = 0;  ///< tokens per KV block
  /// KV capacity of each data-parallel rank; nullopt: the engine did not say (the wire's 0).
  std::optional<std::uint64_t> total_kv_blocks;
  std::uint32_t data_parallel_size = 1;  ///< ranks 0 .. data_parallel_size - 1
  std::vector<std::string> taints;
  std::uint32_t max_num_batched_tokens = 0;
  std::uint32_t max_num_seqs = 0;
  bool publishes_kv_events = true;  ///< false: the index predicts the cache (approximate mode)
  std::chrono::milliseconds liveness_ttl{0};
  std::string generate_subject;
  std::string dump_subject;
  std::string http_url;  ///< the engine's HTTP base URL, without a trailing '/'; empty: none
  /// LoRA adapters served on top of `model`: requests naming one route in this partition.
  std::vector<std::string> lora_adapters;

  friend bool operator==(const WorkerRegistration&, const WorkerRegistration&) = default;
};

/// What the router accepts in a registration.
/// The largest KV block a worker may announce, in tokens (engines use 16 to 512): a block size
/// of 10^9 would make every prompt one partial block that nothing can match.
inline constexpr std::uint32_t kMaxBlockSize = 4096;
/// The largest KV capacity a rank may announce, in blocks; also what bounds the KV picture of a
/// rank that announces none.
inline constexpr std::uint64_t kMaxKvBlocksPerRank = std::uint64_t{1} << 26;

struct RegistrationLimits {
  std::uint32_t required_block_size = 0;  ///< the router's block size; 0 accepts any in range
  std::uint32_t max_block_size = kMaxBlockSize;
  std::uint64_t max_kv_blocks_per_rank = kMaxKvBlocksPerRank;
  std::uint32_t max_data_parallel_size = 1024;
  std::size_t max_taints = 64;
  std::size_t max_lora_adapters = 1024;
  std::size_t max_string_length = 256;
  std::chrono::milliseconds default_liveness_ttl{10'000};  ///< used when the worker sends 0
  std::chrono::milliseconds min_liveness_ttl{100};
  std::chrono::milliseconds max_liveness_ttl{600'000};
};

/// A rejected registration: the field at fault and why.
struct RegistrationError {
  std::string field;
  std::string reason;

  /// "block_size: 32 differs from the router's 16".
  std::string message() const { return field + ": " + reason; }

  friend bool operator==(const RegistrationError&, const RegistrationError&) = default;
};

/// Checks a registration against the limits; returns it with defaults applied (liveness TTL).
std::expected<WorkerRegistration, RegistrationError> validate_registration(
    WorkerRegistration registration, const RegistrationLimits& limits);

/// Converts and validates a wire registration (data_parallel_size 0 reads as 1, an empty
/// routing group as "default", total_kv_blocks 0 as no capacity).
std::expected<WorkerRegistration, RegistrationError> registration_from_proto(
    const v1::WorkerRegistration& wire, const RegistrationLimits& limits);

}  // namespace kvr::discovery
