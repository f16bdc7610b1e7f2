// Reads Mooncake-format JSONL traces (timestamp, input_length, output_length, 512-token hash_ids)
// and expands their hash ids into kvr block hashes. Used by `kvr replay` and the benchmarks.
#pragma once

#include <cstddef>
#include <cstdint>
#include <expected>
#include <filesystem>
#include <string>
#include <vector>

#include "messages/ids.hpp"

namespace kvr::simulation {

/// Tokens per hash id in Mooncake traces.
inline constexpr std::uint32_t kMooncakeTraceBlockSize = 512;

/// One request of a trace.
struct TraceRequest {
  std::uint64_t timestamp_ms = 0;       ///< arrival, from the trace start
  std::uint32_t input_length = 0;       ///< prompt tokens
  std::uint32_t output_length = 0;      ///< tokens to generate
  std::vector<std::uint64_t> hash_ids;  ///< one per 512-token block; equal prefixes share ids
};

/// Loads a Mooncake JSONL trace; `limit` > 0 keeps the first `limit` requests. Fails naming the
/// line of the first malformed record (missing field, wrong type, hash_ids not covering the
/// prompt, timestamps going backwards).
std::expected<std::vector<TraceRequest>, std::string> load_mooncake_trace(
    const std::filesystem::path& path, std::size_t limit = 0);

/// The prompt's tokens as the trace defines them: token i is hash_ids[i / 512], cut to
/// input_length. Clients in live mode send these; they hash to expand_to_block_hashes' result.
std::vector<std::uint32_t> synthesize_prompt_tokens(const TraceRequest& request);

/// Chained block hashes (discovery/block_hash.hpp) of every full `engine_block_size` block of the
/// synthesized prompt, so replay and live clients agree without materialising the tokens.
std::vector<BlockHash> expand_to_block_hashes(const TraceRequest& request,
                                              std::uint32_t engine_block_size);

/// The hit rate of one shared infinite cache over `requests` in order, `block_hashes[i]` being
/// request i's expand_to_block_hashes(…, block_size): an upper bound for any router. As an engine
/// does, the last prompt token is always computed.
double infinite_cache_hit_rate(const std::vector<TraceRequest>& requests,
                               const std::vector<std::vector<BlockHash>>& block_hashes,
                               std::uint32_t block_size);

/// The hit rate of one shared LRU cache of `capacity_blocks` blocks over the same requests (the
/// capacity-bound ceiling: one cache as large as the whole fleet's KV, which no router can beat
/// with that memory). A request reuses its longest cached prefix, then its blocks become the most
/// recently used, its first block most recent of all: engines free a prompt's blocks tail first,
/// so what eviction leaves of a prompt is a prefix that can still be reused. As an engine does,
/// the last prompt token is always computed. Capacity 0 caches nothing.
double capacity_bound_hit_rate(const std::vector<TraceRequest>& requests,
                               const std::vector<std::vector<BlockHash>>& block_hashes,
                               std::uint32_t block_size, std::uint64_t capacity_blocks);

}  // namespace kvr::simulation
