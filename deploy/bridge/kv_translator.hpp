// Translates an engine's KV events (kv_event_decoder.hpp) into kvr's own: kvr's chained block
// hashes recomputed from the tokens, kvr's storage tiers and kvr's per-rank event ids, with the
// per-rank picture (which blocks a rank holds) that answers the router's KV dump requests. Also
// the per-rank tracker of the engine's ZMQ sequence numbers. Used by `kvr bridge`.
#pragma once

#include <cstdint>
#include <expected>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "deploy/bridge/kv_event_decoder.hpp"
#include "discovery/indexer/kv_indexer.hpp"
#include "messages/kv_event.hpp"

namespace kvr::bridge {

/// The tier of an engine medium: "GPU" device, "CPU" host, "DISK" disk (case-insensitive; an
/// empty medium is the GPU); nullopt for a medium kvr has no tier for.
std::optional<StorageTier> tier_of_medium(std::string_view medium);

/// The kvr cache namespace of a stored chain: the LoRA name, else the decimal LoRA id when it is
/// not 0, else none (the base model). A router must be given the same namespace for the prompt.
std::string cache_namespace_of(const EngineBlockStored& stored);

/// What the translator is told about the worker it speaks for.
struct TranslatorOptions {
  WorkerId worker_id = 0;
  Incarnation incarnation = 0;
  std::uint32_t block_size = 16;  ///< must equal the engine's (and the router's) block size
  std::uint32_t data_parallel_size = 1;
  /// KV capacity per rank, as registered; nullopt: not known (the picture of a rank is then
  /// bounded as the router bounds such a rank, by discovery::kMaxKvBlocksPerRank).
  std::optional<std::uint64_t> capacity_blocks;

  /// Checks ranges; the error names the field.
  std::expected<void, std::string> validate() const;
};

/// Counters of what the translator dropped or produced, for the bridge's metrics.
struct TranslatorStats {
  std::uint64_t batches_translated = 0;  ///< kvr batches produced
  std::uint64_t blocks_stored = 0;       ///< blocks forwarded in Stored events
  std::uint64_t blocks_removed = 0;      ///< blocks forwarded in Removed events
  std::uint64_t ranks_cleared = 0;       ///< Cleared events forwarded (engine or bridge)
  /// Removed hashes the bridge does not know (never stored, or gone already): skipped.
  std::uint64_t unknown_removed_blocks = 0;
  /// Stored chains continuing an engine block the bridge does not know: skipped.
  std::uint64_t unknown_parents = 0;
  /// Stored chains whose block size or token count does not match the blocks: skipped.
  std::uint64_t bad_stored_events = 0;
  /// Events on a medium kvr has no tier for: skipped.
  std::uint64_t unknown_media = 0;
  /// Events the rank's picture refused (capacity, chain conflicts): skipped.
  std::uint64_t refused_events = 0;
  /// Batches naming a rank outside the worker's data-parallel size: dropped.
  std::uint64_t bad_rank_batches = 0;
};

/// Per-rank translation state. Single-threaded: the owner serialises calls.
class KvTranslator {
 public:
  /// An error names the invalid option.
  static std::expected<KvTranslator, std::string> create(TranslatorOptions options);

  /// Translates one engine batch of `rank`. Returns the kvr batch to publish, or nullopt when no
  /// event survived (then no event id is used). Events are applied to the rank's picture one by
  /// one; those it refuses are counted and left out, so the router sees what the picture holds.
  std::optional<KvEventBatch> translate(DpRank rank, const EngineKvEventBatch& batch);

  /// Forgets what `rank` holds (its engine stream lost events that cannot be replayed) and
  /// returns the batch, with one Cleared event, that makes routers forget it too.
  std::optional<KvEventBatch> clear_rank(DpRank rank);

  /// The picture of `rank` as a kvr dump, consistent as of the last event id produced.
  std::optional<KvDump> dump(DpRank rank) const;

  /// Starts over for a new process start of the worker: empty pictures, event ids from 1.
  void reset(Incarnation incarnation);

  /// Blocks `rank` holds on `tier`.
  std::uint64_t blocks_held(DpRank rank, StorageTier tier) const;

  /// The kvr hash the bridge maps an engine hash of `rank` to, if it knows the block.
  std::optional<BlockHash> kvr_hash_of(DpRank rank, EngineBlockHash engine_hash) const;

  const TranslatorStats& stats() const { return stats_; }
  const TranslatorOptions& options() const { return options_; }

 private:
  struct RankState {
    EventId next_event_id = 1;
    /// Engine hash → kvr hash of every block the engine announced and has not removed.
    absl::flat_hash_map<EngineBlockHash, BlockHash> kvr_hash;
  };

  explicit KvTranslator(TranslatorOptions options);
  void reset_picture();
  std::optional<KvEvent> translate_stored(DpRank rank, const EngineBlockStored& stored);
  std::optional<KvEvent> translate_removed(DpRank rank, const EngineBlockRemoved& removed);
  WorkerWithDpRank slot(DpRank rank) const { return {options_.worker_id, rank}; }
  KvEventBatch make_batch(DpRank rank, std::vector<KvEvent> events);

  TranslatorOptions options_;
  std::vector<RankState> ranks_;
  discovery::KvIndexer picture_;
  TranslatorStats stats_;
};

/// The engine's per-rank ZMQ sequence numbers: whether a message is the next one, a repeat
/// (already seen, e.g. during a replay) or the first after missed ones.
class SequenceTracker {
 public:
  enum class Verdict : std::uint8_t {
    next,   ///< apply it
    stale,  ///< seen before: drop it
    gap,    ///< messages first_missing .. sequence - 1 are missing: replay them first
  };
  struct Check {
    Verdict verdict = Verdict::next;
    std::uint64_t first_missing = 0;  ///< for a gap: the first sequence number to replay
  };

  explicit SequenceTracker(std::uint32_t ranks) : next_(ranks) {}

  /// Classifies `sequence` on `rank`. A rank's first message is `next` when it is sequence 0 and
  /// a gap from 0 otherwise (what the engine published before the bridge listened).
  Check check(DpRank rank, std::uint64_t sequence) const;

  /// Records that `sequence` was applied (or deliberately skipped): `sequence + 1` comes next.
  void accept(DpRank rank, std::uint64_t sequence);

  /// Forgets what `rank` has seen: its next message is classified as a first one (the publisher
  /// restarted and numbers from 0 again).
  void reset(DpRank rank);

  /// The next sequence number `rank` expects, if it has seen any.
  std::optional<std::uint64_t> expected(DpRank rank) const;

 private:
  std::vector<std::optional<std::uint64_t>> next_;
};

}  // namespace kvr::bridge
