#include "deploy/simulation/mooncake_trace.hpp"

#include <fstream>
#include <optional>

#include <nlohmann/json.hpp>

#include "discovery/block_hash.hpp"
#include "messages/metrics/hit_rate_ceilings.hpp"

namespace kvr::simulation {
namespace {

std::string line_error(std::size_t line_number, std::string_view what) {
  return "trace line " + std::to_string(line_number) + ": " + std::string{what};
}

template <typename T>
std::optional<T> unsigned_field(const nlohmann::json& record, const char* key) {
  auto it = record.find(key);
  if (it == record.end() || !it->is_number_unsigned()) return std::nullopt;
  const auto value = it->get<std::uint64_t>();
  if (value > std::numeric_limits<T>::max()) return std::nullopt;
  return static_cast<T>(value);
}

}  // namespace

std::expected<std::vector<TraceRequest>, std::string> load_mooncake_trace(
    const std::filesystem::path& path, std::size_t limit) {
  std::ifstream input{path};
  if (!input) return std::unexpected("cannot open trace " + path.string());
  std::vector<TraceRequest> requests;
  std::string line;
  std::size_t line_number = 0;
  while (std::getline(input, line)) {
    ++line_number;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const nlohmann::json record = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (record.is_discarded() || !record.is_object()) {
      return std::unexpected(line_error(line_number, "not a JSON object"));
    }
    TraceRequest request;
    const auto timestamp = unsigned_field<std::uint64_t>(record, "timestamp");
    const auto input_length = unsigned_field<std::uint32_t>(record, "input_length");
    const auto output_length = unsigned_field<std::uint32_t>(record, "output_length");
    if (!timestamp) return std::unexpected(line_error(line_number, "bad or missing timestamp"));
    if (!input_length || *input_length == 0) {
      return std::unexpected(line_error(line_number, "bad or missing input_length"));
    }
    if (!output_length) {
      return std::unexpected(line_error(line_number, "bad or missing output_length"));
    }
    request.timestamp_ms = *timestamp;
    request.input_length = *input_length;
    request.output_length = *output_length;
    auto hash_ids = record.find("hash_ids");
    if (hash_ids == record.end() || !hash_ids->is_array()) {
      return std::unexpected(line_error(line_number, "bad or missing hash_ids"));
    }
    request.hash_ids.reserve(hash_ids->size());
    for (const auto& id : *hash_ids) {
      if (!id.is_number_unsigned() || id.get<std::uint64_t>() > UINT32_MAX) {
        return std::unexpected(line_error(line_number, "hash_ids must be integers below 2^32"));
      }
      request.hash_ids.push_back(id.get<std::uint64_t>());
    }
    const std::size_t needed =
        discovery::blocks_for_tokens(request.input_length, kMooncakeTraceBlockSize);
    if (request.hash_ids.size() < needed) {
      return std::unexpected(line_error(line_number, "hash_ids do not cover input_length"));
    }
    if (!requests.empty() && request.timestamp_ms < requests.back().timestamp_ms) {
      return std::unexpected(line_error(line_number, "timestamps go backwards"));
    }
    requests.push_back(std::move(request));
    if (limit > 0 && requests.size() == limit) break;
  }
  if (requests.empty()) return std::unexpected("trace " + path.string() + " holds no requests");
  return requests;
}

std::vector<std::uint32_t> synthesize_prompt_tokens(const TraceRequest& request) {
  std::vector<std::uint32_t> tokens(request.input_length);
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    tokens[i] = static_cast<std::uint32_t>(request.hash_ids[i / kMooncakeTraceBlockSize]);
  }
  return tokens;
}

std::vector<BlockHash> expand_to_block_hashes(const TraceRequest& request,
                                              std::uint32_t engine_block_size) {
  const discovery::BlockHasher hasher{engine_block_size};
  const std::size_t full_blocks = request.input_length / engine_block_size;
  std::vector<BlockHash> hashes;
  hashes.reserve(full_blocks);
  // One block's tokens at a time: equal to hashing the whole synthesized prompt, without it.
  std::vector<std::uint32_t> block(engine_block_size);
  std::optional<BlockHash> parent;
  // An engine block inside one trace block repeats a single token, so its local hash depends on
  // that token alone: consecutive such blocks (eight per trace block at 64 tokens) share it.
  std::optional<std::uint64_t> uniform_token;
  discovery::LocalBlockHash uniform_hash{};
  for (std::size_t b = 0; b < full_blocks; ++b) {
    const std::size_t first_token = b * engine_block_size;
    const std::size_t first_id = first_token / kMooncakeTraceBlockSize;
    const bool uniform =
        first_id == (first_token + engine_block_size - 1) / kMooncakeTraceBlockSize;
    discovery::LocalBlockHash local{};
    if (uniform && uniform_token == request.hash_ids[first_id]) {
      local = uniform_hash;
    } else {
      for (std::size_t i = 0; i < engine_block_size; ++i) {
        block[i] = static_cast<std::uint32_t>(
            request.hash_ids[(first_token + i) / kMooncakeTraceBlockSize]);
      }
      local = hasher.local_hash(block);
      if (uniform) {
        uniform_token = request.hash_ids[first_id];
        uniform_hash = local;
      }
    }
    const BlockHash hash = discovery::BlockHasher::chain(parent, local);
    hashes.push_back(hash);
    parent = hash;
  }
  return hashes;
}

namespace {

// The ceilings of the requests in order, exactly; `capacity_blocks` 0: the capacity-bound one is
// 0.
struct CeilingRates {
  double workload = 0;
  double capacity = 0;
};
CeilingRates exact_ceilings(const std::vector<TraceRequest>& requests,
                            const std::vector<std::vector<BlockHash>>& block_hashes,
                            std::uint32_t block_size, std::uint64_t capacity_blocks) {
  metrics::HitRateCeilings ceilings;
  std::uint64_t prompt_tokens = 0;
  std::uint64_t workload_tokens = 0;
  std::uint64_t capacity_tokens = 0;
  for (std::size_t i = 0; i < requests.size(); ++i) {
    const auto cached =
        ceilings.record(block_hashes[i], requests[i].input_length, block_size, capacity_blocks);
    prompt_tokens += requests[i].input_length;
    workload_tokens += cached.workload_tokens;
    capacity_tokens += cached.capacity_tokens;
  }
  if (prompt_tokens == 0) return {};
  const auto prompt = static_cast<double>(prompt_tokens);
  return {static_cast<double>(workload_tokens) / prompt,
          static_cast<double>(capacity_tokens) / prompt};
}

}  // namespace

double infinite_cache_hit_rate(const std::vector<TraceRequest>& requests,
                               const std::vector<std::vector<BlockHash>>& block_hashes,
                               std::uint32_t block_size) {
  return exact_ceilings(requests, block_hashes, block_size, 0).workload;
}

double capacity_bound_hit_rate(const std::vector<TraceRequest>& requests,
                               const std::vector<std::vector<BlockHash>>& block_hashes,
                               std::uint32_t block_size, std::uint64_t capacity_blocks) {
  return exact_ceilings(requests, block_hashes, block_size, capacity_blocks).capacity;
}

}  // namespace kvr::simulation
