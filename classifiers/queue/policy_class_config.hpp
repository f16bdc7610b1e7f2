// The settings of one policy class of the admission queue (`policy_classes:` in the router-policy
// YAML) and the rule that decides whether a worker is too busy for a class. Read by the
// router-policy loader (selection/config/) and by the partition's policy-class queue.
// Installed with the plugin SDK; the contract: docs/plugin-api.md.
#pragma once

#include <cstdint>
#include <expected>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace kvr::classifiers {

/// The class every request belongs to unless a classifier names another one.
inline constexpr std::string_view kDefaultPolicyClass = "default";

/// The quantum a class gets when its configuration names none, in uncached tokens per round.
inline constexpr std::uint64_t kDefaultQuantum = 4096;

/// How a class orders its own queued requests once priority and due time are equal.
enum class QueueOrder : std::uint8_t {
  Fcfs,  ///< first come, first served: by arrival
  Wspt,  ///< weighted shortest processing time: by scheduling cost ascending, ties by arrival
};

/// "fcfs" or "wspt".
std::string_view as_str(QueueOrder order);
/// Parses "fcfs" or "wspt"; nullopt for anything else.
std::optional<QueueOrder> parse_queue_order(std::string_view text);

/// One policy class. A worker is busy for the class when its active prefill tokens or its KV
/// usage exceed the class's thresholds (see is_worker_busy); a request queues only when every
/// eligible worker is busy for its class. Without any threshold the class never queues.
struct PolicyClassConfig {
  /// Unique among the classes; requests name it (ClassifyRequest::policy_class).
  std::string name;
  /// Deficit-round-robin quantum in uncached tokens (> 0): the share of dispatches the class gets
  /// while other classes are backlogged is proportional to it.
  std::uint64_t quantum = kDefaultQuantum;
  QueueOrder order = QueueOrder::Fcfs;
  /// Busy above this many active prefill tokens; empty: no absolute threshold.
  std::optional<std::uint64_t> prefill_busy_threshold;
  /// Busy above this fraction, in (0, 1], of the worker's max batched tokens; empty: none.
  std::optional<double> prefill_busy_threshold_frac;
  /// Busy above this fraction, in (0, 1], of the worker's KV blocks in use (bookings included),
  /// so that a class can keep KV headroom for the others; empty: none.
  std::optional<double> kv_busy_threshold;
  /// At most this many queued requests (> 0) per eligible worker; empty: no limit.
  std::optional<std::uint64_t> request_queue_limit_per_worker;
  /// At most this many queued uncached tokens (> 0) per eligible worker; empty: no limit.
  std::optional<std::uint64_t> uncached_token_queue_limit_per_worker;

  friend bool operator==(const PolicyClassConfig&, const PolicyClassConfig&) = default;
};

/// Why a class's settings are invalid: the offending field (its YAML key) and the problem.
struct PolicyClassConfigError {
  /// The YAML key ("quantum", "name" ...).
  std::string key;
  /// What is wrong, e.g. "must be greater than 0".
  std::string message;
};

/// Checks one class: a non-empty name, quantum > 0, finite threshold fractions in (0, 1], limits
/// greater than 0.
std::expected<void, PolicyClassConfigError> validate_policy_class(const PolicyClassConfig& config);

/// The class `default` with the given settings and no other: what applies when no `policy_classes`
/// are configured. `prefill_busy_threshold_frac` is the node's queue threshold (empty: requests
/// never queue, the behaviour without a queue).
PolicyClassConfig default_policy_class(std::optional<double> prefill_busy_threshold_frac = {});

/// The classes a queue is built from: `configured` in order, followed by `fallback_default` when
/// `configured` has no class named "default" (requests that no classifier classifies are in it).
std::vector<PolicyClassConfig> resolve_policy_classes(std::span<const PolicyClassConfig> configured,
                                                      PolicyClassConfig fallback_default);

/// What the busy rule reads about one worker.
struct WorkerPrefillLoad {
  /// Prompt tokens the worker is prefilling or about to (booked, not yet at first token).
  std::uint64_t active_prefill_tokens = 0;
  /// The worker's max batched tokens per step; 0 when unknown (no fraction threshold applies).
  std::uint64_t max_batched_tokens = 0;
  /// The fraction of its KV blocks in use, bookings included; empty without a load observation
  /// or a registered capacity (no KV threshold applies).
  std::optional<double> kv_usage;
};

/// True when `worker` is busy for `config`: its active prefill tokens exceed
/// prefill_busy_threshold, or exceed prefill_busy_threshold_frac × max_batched_tokens (when the
/// worker's max batched tokens are known), or its KV usage exceeds kv_busy_threshold (when known).
/// Any threshold exceeded makes it busy; with none set, or only ones whose input is unknown, it
/// never is.
bool is_worker_busy(const PolicyClassConfig& config, const WorkerPrefillLoad& worker);

/// True when a request of `config` must queue rather than go to selection now: every one of its
/// `eligible_workers` is busy for the class. False for no eligible workers (the caller answers
/// "no workers" as without a queue). A selector also enqueues, then drains, when its queue already
/// holds requests, so that a newcomer never overtakes queued requests of its lane.
bool should_queue(const PolicyClassConfig& config,
                  std::span<const WorkerPrefillLoad> eligible_workers);

}  // namespace kvr::classifiers
