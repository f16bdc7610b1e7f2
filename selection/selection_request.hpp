// One request as worker selection sees it: the prompt's block hashes, session metadata, the
// caller's soft target and hard restrictions. Owns its values, so the router's actors carry it
// from the decoder to the partition's selector as it is; the selection host reads it.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "messages/ids.hpp"
#include "messages/session_context.hpp"
#include "selection/worker_selection.hpp"

namespace kvr::selection {

/// A preferred worker taint and its weight; matching weights lower the kv-cost.
struct PreferredTaint {
  std::string taint;
  double weight = 0;
  friend bool operator==(const PreferredTaint&, const PreferredTaint&) = default;
};

/// What a request's block hashes are keys of.
enum class PromptKeys : std::uint8_t {
  /// Token blocks, as the engines hash them: matched against the KV index of their events.
  kv_blocks,
  /// Blocks of the prompt's text (the `estimate` tokenizer mode): matched against the partition's
  /// own index of the text blocks it routed, never against engine KV events.
  text_blocks,
};

/// One request to select a worker for.
struct SelectionRequest {
  std::string request_id;
  std::size_t prompt_tokens = 0;
  /// Chained block hashes of the prompt's full blocks.
  std::vector<BlockHash> block_hashes;
  PromptKeys prompt_keys = PromptKeys::kv_blocks;
  std::optional<std::uint32_t> expected_output_tokens;
  std::optional<SessionContext> session;
  /// Soft target offered to the policy (session affinity or a classifier's choice).
  std::optional<plugins::worker_selection::WorkerAffinityTarget> affinity_target;
  /// Hard restriction: only this worker (or rank) is eligible.
  std::optional<plugins::worker_selection::WorkerAffinityTarget> pinned_worker;
  std::uint32_t strict_priority = 0;
  /// Non-empty: only these workers are eligible.
  std::vector<WorkerId> allowed_workers;
  /// These workers are never eligible (a retry excludes the worker that failed the request).
  std::vector<WorkerId> excluded_workers;
  /// A worker must carry every one of these taints.
  std::vector<std::string> required_taints;
  std::vector<PreferredTaint> preferred_taints;
  /// When the selection runs; set by whoever runs it.
  std::chrono::steady_clock::time_point now;
};

/// The first hard restriction of `request` that a worker breaks (pin, allow-list, exclusions,
/// required taints, availability), shared by the selection host's eligibility pass and the
/// selector's direct dispatch, so both apply one rule set.
struct RestrictionViolation {
  enum class Kind : std::uint8_t {
    unavailable,
    pinned_elsewhere,
    not_allowed,
    excluded,
    missing_taint
  };
  Kind kind = Kind::unavailable;
  /// The missing taint, for missing_taint.
  std::string_view taint;
};

/// Checks `worker` (its availability and taints) against `request`'s hard restrictions; empty
/// when it may serve the request. Busy thresholds are the host's, not part of this rule set.
std::optional<RestrictionViolation> violated_restriction(const SelectionRequest& request,
                                                         WorkerWithDpRank worker, bool available,
                                                         std::span<const std::string> taints);

/// A sentence on why `violation` keeps a worker from a request ("it lacks the required taint 'x'").
std::string describe(const RestrictionViolation& violation, const SelectionRequest& request);

}  // namespace kvr::selection
