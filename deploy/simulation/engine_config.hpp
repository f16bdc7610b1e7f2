// Every parameter of the simulated inference engine, with its default and meaning. Used by the
// engine (deploy/simulation/engine.hpp), `kvr replay` and `kvr mocker`.
#pragma once

#include <cstdint>
#include <expected>
#include <string>

namespace kvr::simulation {

/// How the cost of a step that both prefills and decodes is combined.
enum class MixedStepCost : std::uint8_t {
  /// prefill_ms(T) + decode_ms(u): the conservative choice of most simulators; a mixed batch is
  /// never cheaper than its parts run back to back.
  Sum,
  /// max(prefill_ms(T), decode_ms(u)): the optimistic choice; decodes ride free on the prefill.
  Max,
};

/// The polynomial step-time model; every time is in milliseconds of real GPU time and is divided
/// by time_scale before the engine's clock sees it. The defaults are the vLLM fit that Dynamo's
/// mocker uses.
struct TimingConfig {
  /// Prefill: prefill_ms(T) = quadratic·T² + linear·T + constant for T > 0 uncached prompt tokens
  /// computed in one step, and 0 for T = 0.
  double prefill_quadratic_ms = 4.209989e-7;
  /// See prefill_quadratic_ms.
  double prefill_linear_ms = 0.01518344;
  /// See prefill_quadratic_ms.
  double prefill_constant_ms = 16.50142;

  /// Decode: decode_ms(u) = max(decode_floor_ms, quadratic·u² + linear·u + constant), where u is
  /// the KV utilisation during the step: blocks referenced by running requests / num_gpu_blocks.
  double decode_quadratic_ms = -25.74;
  /// See decode_quadratic_ms.
  double decode_linear_ms = 54.01;
  /// See decode_quadratic_ms.
  double decode_constant_ms = 5.74;
  /// The shortest decode step; positive, so that a decode step always advances the clock.
  double decode_floor_ms = 1.0;

  /// How a step with both prefill tokens and decoding requests is costed.
  MixedStepCost mixed_step_cost = MixedStepCost::Sum;

  /// Divides every engine time (`--time-scale`): 10 runs a simulated fleet ten times faster than
  /// the GPUs the model was fitted on. Positive and finite.
  double time_scale = 1.0;
};

/// The cost of moving KV blocks between engines (disaggregated serving: a decode worker pulls a
/// prompt's KV from the prefill worker that computed it). Like every engine time, these are
/// unscaled real milliseconds, divided by TimingConfig::time_scale.
struct TransferConfig {
  /// Fixed cost of one transfer (handshake, descriptor setup, completion notification). Finite,
  /// >= 0.
  double latency_ms = 2.0;
  /// Cost per KV block moved. The default is an 8B model (Llama-3.1-8B: 32 layers x 8 KV heads x
  /// 128 dims x K and V x 2 bytes = 128 KiB of KV per token) with 64-token blocks, 8 MiB a block,
  /// over a ~25 GB/s RDMA link: 8 MiB / 25 GB/s = 0.34 ms. Finite, >= 0.
  double ms_per_block = 0.34;
};

/// A parameter outside its allowed range: names the field and says what is allowed.
struct EngineConfigError {
  /// The field's path, e.g. "block_size", "timing.time_scale" or "transfer.ms_per_block".
  std::string field;
  /// What is allowed, e.g. "must be > 0".
  std::string reason;

  /// "engine config: <field> <reason>".
  std::string message() const;
};

/// The parameters of one simulated engine (one data-parallel rank), vLLM names where vLLM has one.
struct EngineConfig {
  /// Tokens per KV block; the block hashes a request carries must use the same size.
  std::uint32_t block_size = 64;
  /// Blocks in the KV pool; capacity in tokens is num_gpu_blocks · block_size.
  std::uint32_t num_gpu_blocks = 16'384;
  /// Token budget of one step: decodes (one token each) first, then chunked prefill.
  std::uint32_t max_num_batched_tokens = 8'192;
  /// Most requests running at once; further requests wait.
  std::uint32_t max_num_seqs = 256;
  /// When false, no block is ever reused or announced: no prefix hits, no Stored events.
  bool enable_prefix_caching = true;
  /// The step-time model.
  TimingConfig timing;
  /// The KV transfer model (requests with KvTransfer::remote_prefill).
  TransferConfig transfer;

  /// Checks every field; the error names the first field out of range.
  std::expected<void, EngineConfigError> validate() const;
};

}  // namespace kvr::simulation
