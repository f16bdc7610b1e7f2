// Disaggregated serving in the partition core: which hop of a generate request a route is for,
// and the core's decision whether a request takes the prefill hop (conditional disaggregation,
// docs/disaggregation.md). Values only: route requests and answers carry them between the
// actors, `kvr replay` and the core.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace kvr {

/// Which hop of a generate request a route is for.
enum class RouteHop : std::uint8_t {
  /// An ordinary route: the request's role, one worker.
  single,
  /// The first route of a generate request. In a partition that serves the request by prefill and
  /// decode workers (it names the decode role, or aggregated where only decode workers serve),
  /// the core decides (DisaggregationDecision): it books a prefill worker for the prefill hop, or
  /// a decode worker that serves the request alone; elsewhere it is a single route.
  plan,
  /// The decode hop after the prefill hop answered: the prompt's KV arrives by transfer, so the
  /// decode worker's booking carries no prefill tokens.
  decode_after_transfer,
};

/// Why the core sent a request through the prefill hop or not (the label of
/// kvr_disaggregation_decisions_total{reason}).
enum class DisaggregationReason : std::uint8_t {
  disaggregated,      ///< the prefill hop, then decode
  short_prompt,       ///< fewer uncached tokens on the best decode worker than min_uncached_tokens
  prefill_queue,      ///< the prefill pool's queue costs more than prefilling on the decode worker
  no_prefill_worker,  ///< no prefill worker may take the request: decode alone
};
inline constexpr std::size_t kDisaggregationReasons = 4;

/// "disaggregated", "short_prompt", "prefill_queue" or "no_prefill_worker".
constexpr std::string_view as_str(DisaggregationReason reason) {
  switch (reason) {
    case DisaggregationReason::disaggregated:
      return "disaggregated";
    case DisaggregationReason::short_prompt:
      return "short_prompt";
    case DisaggregationReason::prefill_queue:
      return "prefill_queue";
    case DisaggregationReason::no_prefill_worker:
      return "no_prefill_worker";
  }
  return "disaggregated";
}

/// What the core decided for a request routed with RouteHop::plan in a disaggregated partition.
struct DisaggregationDecision {
  DisaggregationReason reason = DisaggregationReason::disaggregated;
  /// Prompt tokens the best decode worker would have to compute itself.
  std::uint64_t decode_uncached_tokens = 0;
  /// How long the prefill's transfer parameters stay usable for a decode retry (the model's
  /// disaggregation.transfer_valid_ms).
  std::chrono::milliseconds transfer_valid{30'000};

  /// True when the answer's worker is a prefill worker: the decode hop follows.
  bool prefill_hop() const { return reason == DisaggregationReason::disaggregated; }
};

}  // namespace kvr
