#include "deploy/bridge/kv_translator.hpp"

#include <algorithm>
#include <cctype>
#include <span>

#include "discovery/block_hash.hpp"
#include "discovery/catalog/worker_registration.hpp"

namespace kvr::bridge {
namespace {

bool equals_ignoring_case(std::string_view a, std::string_view b) {
  return std::ranges::equal(a, b, [](char x, char y) {
    return std::toupper(static_cast<unsigned char>(x)) ==
           std::toupper(static_cast<unsigned char>(y));
  });
}

std::uint32_t tier_bit(StorageTier tier) { return 1U << static_cast<std::uint32_t>(tier); }

}  // namespace

std::optional<StorageTier> tier_of_medium(std::string_view medium) {
  if (medium.empty() || equals_ignoring_case(medium, "GPU")) return StorageTier::Device;
  if (equals_ignoring_case(medium, "CPU")) return StorageTier::Host;
  if (equals_ignoring_case(medium, "DISK")) return StorageTier::Disk;
  return std::nullopt;
}

std::string cache_namespace_of(const EngineBlockStored& stored) {
  if (stored.lora_name && !stored.lora_name->empty()) return *stored.lora_name;
  if (stored.lora_id && *stored.lora_id != 0) return std::to_string(*stored.lora_id);
  return {};
}

std::expected<void, std::string> TranslatorOptions::validate() const {
  if (worker_id == 0) return std::unexpected("worker id must not be 0");
  if (block_size == 0) return std::unexpected("block size must be positive");
  if (data_parallel_size == 0 || data_parallel_size > 64) {
    return std::unexpected("data-parallel size must be in [1, 64]");
  }
  if (capacity_blocks && *capacity_blocks == 0) {
    return std::unexpected("KV capacity must be positive when given");
  }
  return {};
}

std::expected<KvTranslator, std::string> KvTranslator::create(TranslatorOptions options) {
  if (auto valid = options.validate(); !valid) return std::unexpected(valid.error());
  return KvTranslator{options};
}

KvTranslator::KvTranslator(TranslatorOptions options)
    : options_(options), ranks_(options.data_parallel_size) {
  reset_picture();
}

void KvTranslator::reset_picture() {
  picture_ = discovery::KvIndexer{};
  for (std::uint32_t rank = 0; rank < options_.data_parallel_size; ++rank) {
    // Registration cannot fail: the slots are new and the capacity was validated.
    (void)picture_.add_worker(
        slot(rank),
        discovery::RankIndexOptions{
            .capacity_blocks = options_.capacity_blocks.value_or(discovery::kMaxKvBlocksPerRank),
            .incarnation = options_.incarnation});
  }
}

void KvTranslator::reset(Incarnation incarnation) {
  options_.incarnation = incarnation;
  ranks_.assign(options_.data_parallel_size, RankState{});
  reset_picture();
}

std::optional<KvEvent> KvTranslator::translate_stored(DpRank rank,
                                                      const EngineBlockStored& stored) {
  const auto tier = tier_of_medium(stored.medium);
  if (!tier) {
    ++stats_.unknown_media;
    return std::nullopt;
  }
  if (stored.block_hashes.empty() || stored.block_size != options_.block_size ||
      stored.token_ids.size() !=
          stored.block_hashes.size() * static_cast<std::size_t>(stored.block_size)) {
    ++stats_.bad_stored_events;
    return std::nullopt;
  }
  RankState& state = ranks_[rank];
  KvStoredEvent event{.tier = *tier};
  if (stored.parent_block_hash) {
    auto parent = state.kvr_hash.find(*stored.parent_block_hash);
    // A parent the rank no longer holds (evicted with its descendants) is as unknown as one
    // never announced: the chain cannot be placed.
    if (parent == state.kvr_hash.end() || picture_.tiers_held(slot(rank), parent->second) == 0) {
      ++stats_.unknown_parents;
      return std::nullopt;
    }
    event.parent_hash = parent->second;
  }
  const discovery::BlockHasher hasher{options_.block_size, cache_namespace_of(stored)};
  std::optional<BlockHash> previous = event.parent_hash;
  event.block_hashes.reserve(stored.block_hashes.size());
  const std::span<const std::uint32_t> tokens{stored.token_ids};
  for (std::size_t i = 0; i < stored.block_hashes.size(); ++i) {
    const BlockHash hash = discovery::BlockHasher::chain(
        previous, hasher.local_hash(tokens.subspan(i * options_.block_size, options_.block_size)));
    event.block_hashes.push_back(hash);
    previous = hash;
  }
  if (!picture_.apply_event(slot(rank), event)) {
    ++stats_.refused_events;
    return std::nullopt;
  }
  for (std::size_t i = 0; i < stored.block_hashes.size(); ++i) {
    state.kvr_hash[stored.block_hashes[i]] = event.block_hashes[i];
  }
  stats_.blocks_stored += event.block_hashes.size();
  return event;
}

std::optional<KvEvent> KvTranslator::translate_removed(DpRank rank,
                                                       const EngineBlockRemoved& removed) {
  const auto tier = tier_of_medium(removed.medium);
  if (!tier) {
    ++stats_.unknown_media;
    return std::nullopt;
  }
  RankState& state = ranks_[rank];
  KvRemovedEvent event{.tier = *tier};
  // Applied one block at a time: a block removed from its last tier takes the blocks after it in
  // its chain along, so a later hash of the same event may be gone already. Forwarding only the
  // blocks that were still held when their turn came gives routers, which apply the event in the
  // same order, exactly the picture's result.
  KvRemovedEvent single{.block_hashes = {0}, .tier = *tier};
  for (EngineBlockHash engine_hash : removed.block_hashes) {
    auto known = state.kvr_hash.find(engine_hash);
    if (known == state.kvr_hash.end()) {
      ++stats_.unknown_removed_blocks;
      continue;
    }
    const BlockHash hash = known->second;
    // Gone already from this tier: removed with an evicted ancestor, or announced twice.
    if ((picture_.tiers_held(slot(rank), hash) & tier_bit(*tier)) == 0) {
      ++stats_.unknown_removed_blocks;
      if (picture_.tiers_held(slot(rank), hash) == 0) state.kvr_hash.erase(known);
      continue;
    }
    single.block_hashes[0] = hash;
    if (!picture_.apply_event(slot(rank), single)) {
      ++stats_.refused_events;
      continue;
    }
    event.block_hashes.push_back(hash);
  }
  if (event.block_hashes.empty()) return std::nullopt;
  for (EngineBlockHash engine_hash : removed.block_hashes) {
    auto known = state.kvr_hash.find(engine_hash);
    if (known != state.kvr_hash.end() && picture_.tiers_held(slot(rank), known->second) == 0) {
      state.kvr_hash.erase(known);
    }
  }
  stats_.blocks_removed += event.block_hashes.size();
  return event;
}

KvEventBatch KvTranslator::make_batch(DpRank rank, std::vector<KvEvent> events) {
  ++stats_.batches_translated;
  return KvEventBatch{.worker = slot(rank),
                      .incarnation = options_.incarnation,
                      .event_id = ranks_[rank].next_event_id++,
                      .events = std::move(events)};
}

std::optional<KvEventBatch> KvTranslator::translate(DpRank rank, const EngineKvEventBatch& batch) {
  if (rank >= ranks_.size()) {
    ++stats_.bad_rank_batches;
    return std::nullopt;
  }
  std::vector<KvEvent> events;
  for (const EngineKvEvent& engine_event : batch.events) {
    std::optional<KvEvent> event;
    if (const auto* stored = std::get_if<EngineBlockStored>(&engine_event)) {
      event = translate_stored(rank, *stored);
    } else if (const auto* removed = std::get_if<EngineBlockRemoved>(&engine_event)) {
      event = translate_removed(rank, *removed);
    } else {
      (void)picture_.apply_event(slot(rank), KvClearedEvent{});
      ranks_[rank].kvr_hash.clear();
      ++stats_.ranks_cleared;
      event = KvClearedEvent{};
    }
    if (event) events.push_back(std::move(*event));
  }
  if (events.empty()) return std::nullopt;
  return make_batch(rank, std::move(events));
}

std::optional<KvEventBatch> KvTranslator::clear_rank(DpRank rank) {
  if (rank >= ranks_.size()) return std::nullopt;
  (void)picture_.apply_event(slot(rank), KvClearedEvent{});
  ranks_[rank].kvr_hash.clear();
  ++stats_.ranks_cleared;
  return make_batch(rank, {KvClearedEvent{}});
}

std::optional<KvDump> KvTranslator::dump(DpRank rank) const {
  if (rank >= ranks_.size()) return std::nullopt;
  auto dump = picture_.dump(slot(rank));
  if (!dump) return std::nullopt;
  dump->incarnation = options_.incarnation;
  dump->last_event_id = ranks_[rank].next_event_id - 1;
  return std::move(*dump);
}

std::uint64_t KvTranslator::blocks_held(DpRank rank, StorageTier tier) const {
  if (rank >= ranks_.size()) return 0;
  return picture_.blocks_held(slot(rank), tier);
}

std::optional<BlockHash> KvTranslator::kvr_hash_of(DpRank rank, EngineBlockHash engine_hash) const {
  if (rank >= ranks_.size()) return std::nullopt;
  auto found = ranks_[rank].kvr_hash.find(engine_hash);
  if (found == ranks_[rank].kvr_hash.end()) return std::nullopt;
  return found->second;
}

SequenceTracker::Check SequenceTracker::check(DpRank rank, std::uint64_t sequence) const {
  if (rank >= next_.size()) return {Verdict::stale};
  const std::uint64_t expected = next_[rank].value_or(0);
  if (sequence == expected) return {Verdict::next};
  if (sequence < expected) return {Verdict::stale};
  return {Verdict::gap, expected};
}

void SequenceTracker::accept(DpRank rank, std::uint64_t sequence) {
  if (rank < next_.size()) next_[rank] = sequence + 1;
}

void SequenceTracker::reset(DpRank rank) {
  if (rank < next_.size()) next_[rank].reset();
}

std::optional<std::uint64_t> SequenceTracker::expected(DpRank rank) const {
  if (rank >= next_.size()) return std::nullopt;
  return next_[rank];
}

}  // namespace kvr::bridge
