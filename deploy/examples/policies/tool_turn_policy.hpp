// An example worker-selection policy, `tool-turn-local`, that reads the request's session: an
// agent's tool-result turn appends a tool's output to a conversation whose prefix some worker
// already caches, and the agent waits on it before it can act again. Such a turn goes to the
// worker holding most of its prompt whatever that worker's queue (recomputing the conversation
// elsewhere costs more than waiting in line); every other turn goes to the cheapest worker, as in
// `cache-headroom` (uncached blocks plus `queue_weight` per active request, whose scorers it
// reuses). tool_turn_policy_test.cpp runs it through the host.
#pragma once

#include <cstddef>
#include <expected>
#include <string_view>

#include "cache_headroom_policy.hpp"

namespace kvr::examples {

/// The registered type name.
inline constexpr std::string_view kToolTurnLocalPolicyType = "tool-turn-local";

/// A tool-result turn (SessionContext::input_trigger()): the row holding most of the prompt on
/// its device, ties to the lower cost, then the lower (worker id, rank). Any other request: the
/// lowest cost, ties to the lower (worker id, rank).
class ToolTurnLocalPicker final : public WorkerPicker {
 public:
  WorkerInputs required_worker_inputs() const override { return WorkerInputs::CACHE; }
  PolicyResult<std::size_t> pick(const WorkerSelectionContext& context,
                                 const WorkerInputView& view) override;
};

/// The `tool-turn-local` provider: reads `queue_weight` (finite, ≥ 0, default 1.0) and rejects any
/// other key.
std::expected<WorkerSelectionPolicyFactory, WorkerSelectionPolicyProviderError>
tool_turn_local_provider(const WorkerSelectionPolicyParameters& parameters);

}  // namespace kvr::examples
