// Reads an engine's Prometheus `/metrics` text: the per-rank load kvr's LoadMetrics carry and
// the KV cache configuration vLLM publishes. Used by `kvr bridge`.
//
// The mapping (per data-parallel rank; vLLM labels the rank `engine`, SGLang `dp_rank`; a sample
// without the label is rank 0):
//   kvr RankLoad          vLLM                                  SGLang
//   running requests      vllm:num_requests_running             sglang:num_running_reqs
//   waiting_requests      vllm:num_requests_waiting             sglang:num_queue_reqs
//   active_requests       running + waiting                     running + waiting
//   kv_blocks_used        vllm:kv_cache_usage_perc (or the      sglang:token_usage
//                         older vllm:gpu_cache_usage_perc)
//                         × the rank's KV capacity in blocks, both usages being fractions in
//                         [0, 1] that count evictable cached blocks as free, as kvr does
//                         (0 without a capacity).
//   block size, capacity  vllm:cache_config_info labels         (flags only)
//                         block_size, num_gpu_blocks; the block size is required (from the flag
//                         if not), the capacity optional.
//   engine restart        process_start_time_seconds changes    the same
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace kvr::bridge {

/// The engine a bridge speaks for.
enum class EngineKind : std::uint8_t { vllm, sglang };

/// "vllm" or "sglang".
std::string_view as_str(EngineKind kind);

/// Parses "vllm" or "sglang".
std::optional<EngineKind> parse_engine_kind(std::string_view name);

/// One sample line of the Prometheus text format.
struct PrometheusSample {
  std::string name;
  std::vector<std::pair<std::string, std::string>> labels;
  double value = 0;

  /// The value of label `key`, if present.
  std::optional<std::string_view> label(std::string_view key) const;
};

/// Every sample of `text`; comments, blank and unparsable lines are skipped.
std::vector<PrometheusSample> parse_prometheus_text(std::string_view text);

/// The load of one rank as the engine reports it.
struct EngineRankLoad {
  std::uint32_t running = 0;
  std::uint32_t waiting = 0;
  std::optional<double> kv_usage;  ///< fraction of KV blocks held by requests, when reported

  friend bool operator==(const EngineRankLoad&, const EngineRankLoad&) = default;
};

/// The load of ranks 0 .. data_parallel_size - 1 (samples of other ranks are ignored).
std::vector<EngineRankLoad> engine_load(const std::vector<PrometheusSample>& samples,
                                        EngineKind kind, std::uint32_t data_parallel_size);

/// What the engine says about its KV cache.
struct EngineCacheConfig {
  std::optional<std::uint32_t> block_size;
  std::optional<std::uint64_t> num_gpu_blocks;
};

/// vLLM's `vllm:cache_config_info` labels; empty for an engine that does not publish them.
EngineCacheConfig engine_cache_config(const std::vector<PrometheusSample>& samples);

/// prometheus_client's `process_start_time_seconds` (the serving process's start, Unix seconds),
/// which vLLM and SGLang expose with its default registry; a change means the engine restarted.
/// nullopt when absent (e.g. a multi-process metrics registry).
std::optional<double> engine_start_time(const std::vector<PrometheusSample>& samples);

}  // namespace kvr::bridge
