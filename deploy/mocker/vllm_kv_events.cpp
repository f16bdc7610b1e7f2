#include "deploy/mocker/vllm_kv_events.hpp"

#include <variant>

#include <msgpack.hpp>

namespace kvr::mocker {
namespace {

// An odd multiplier: a bijection of 64-bit values, so engine hashes differ from kvr's.
constexpr std::uint64_t kEngineHashMultiplier = 0x9E3779B97F4A7C15ULL;

using KvPacker = msgpack::packer<msgpack::sbuffer>;

void pack_tier(KvPacker& packer, StorageTier tier) {
  packer.pack(std::string{tier == StorageTier::Host   ? "CPU"
                          : tier == StorageTier::Disk ? "DISK"
                                                      : "GPU"});
}

void pack_event(KvPacker& packer, const KvEvent& event, const BlockTokenTable& blocks,
                std::uint32_t block_size, std::span<const std::string> lora_names) {
  if (const auto* stored = std::get_if<KvStoredEvent>(&event)) {
    // One event is one chain of one request's blocks, so of one LoRA.
    const std::uint32_t lora =
        stored->block_hashes.empty() ? 0 : blocks.at(stored->block_hashes.front()).lora;
    // An adapter's block adds lora_name; a base model's stays 7 fields (omit_defaults).
    packer.pack_array(lora == 0 ? 7 : 8);
    packer.pack(std::string{"BlockStored"});
    packer.pack_array(static_cast<std::uint32_t>(stored->block_hashes.size()));
    for (BlockHash hash : stored->block_hashes) packer.pack_uint64(engine_hash(hash));
    if (stored->parent_hash) {
      packer.pack_uint64(engine_hash(*stored->parent_hash));
    } else {
      packer.pack_nil();
    }
    packer.pack_array(static_cast<std::uint32_t>(stored->block_hashes.size() * block_size));
    for (BlockHash hash : stored->block_hashes) {
      for (std::uint32_t token : blocks.at(hash).tokens) packer.pack_uint32(token);
    }
    packer.pack_uint32(block_size);
    if (lora == 0) {
      packer.pack_nil();  // lora_id
    } else {
      packer.pack_uint32(lora);
    }
    pack_tier(packer, stored->tier);
    if (lora != 0) packer.pack(lora_names[lora - 1]);  // lora_name
  } else if (const auto* removed = std::get_if<KvRemovedEvent>(&event)) {
    packer.pack_array(3);
    packer.pack(std::string{"BlockRemoved"});
    packer.pack_array(static_cast<std::uint32_t>(removed->block_hashes.size()));
    for (BlockHash hash : removed->block_hashes) packer.pack_uint64(engine_hash(hash));
    pack_tier(packer, removed->tier);
  } else {
    packer.pack_array(1);
    packer.pack(std::string{"AllBlocksCleared"});
  }
}

}  // namespace

std::uint64_t engine_hash(BlockHash hash) { return hash * kEngineHashMultiplier; }

void BlockTokenTable::add_prompt(std::span<const BlockHash> hashes,
                                 std::span<const std::uint32_t> tokens, std::uint32_t lora,
                                 std::uint32_t block_size) {
  for (std::size_t i = 0; i < hashes.size(); ++i) {
    auto [entry, inserted] = entries_.try_emplace(hashes[i]);
    if (inserted) {
      entry->second.lora = lora;
      entry->second.tokens.assign(
          tokens.begin() + static_cast<std::ptrdiff_t>(i * block_size),
          tokens.begin() + static_cast<std::ptrdiff_t>((i + 1) * block_size));
    }
    ++entry->second.live_refs;
  }
}

void BlockTokenTable::release(std::span<const BlockHash> hashes) {
  for (BlockHash hash : hashes) {
    auto found = entries_.find(hash);
    if (found == entries_.end()) continue;
    if (found->second.live_refs > 0) --found->second.live_refs;
    if (found->second.live_refs == 0) sweep_candidates_.push_back(hash);
  }
}

void BlockTokenTable::note_events(std::span<const KvEvent> events) {
  for (const KvEvent& event : events) {
    if (const auto* stored = std::get_if<KvStoredEvent>(&event)) {
      for (BlockHash hash : stored->block_hashes) {
        if (auto found = entries_.find(hash); found != entries_.end()) {
          found->second.stored = true;
        }
      }
    } else if (const auto* removed = std::get_if<KvRemovedEvent>(&event)) {
      for (BlockHash hash : removed->block_hashes) {
        if (auto found = entries_.find(hash); found != entries_.end()) {
          found->second.stored = false;
          sweep_candidates_.push_back(hash);
        }
      }
    } else {
      for (auto& [hash, entry] : entries_) {
        entry.stored = false;
        sweep_candidates_.push_back(hash);
      }
    }
  }
}

void BlockTokenTable::sweep() {
  for (BlockHash hash : sweep_candidates_) {
    auto found = entries_.find(hash);
    if (found != entries_.end() && found->second.live_refs == 0 && !found->second.stored) {
      entries_.erase(found);
    }
  }
  sweep_candidates_.clear();
}

bool BlockTokenTable::has_tokens_for(const KvEvent& event) const {
  if (const auto* stored = std::get_if<KvStoredEvent>(&event)) {
    for (BlockHash hash : stored->block_hashes) {
      if (!entries_.contains(hash)) return false;
    }
  }
  return true;
}

std::string encode_kv_event_batch(std::span<const KvEvent* const> events,
                                  const BlockTokenTable& blocks, std::uint32_t block_size,
                                  std::span<const std::string> lora_names, double unix_time) {
  msgpack::sbuffer buffer;
  KvPacker packer{buffer};
  packer.pack_array(3);
  packer.pack_double(unix_time);
  packer.pack_array(static_cast<std::uint32_t>(events.size()));
  for (const KvEvent* event : events) pack_event(packer, *event, blocks, block_size, lora_names);
  packer.pack_uint32(0);  // data_parallel_rank
  return std::string{buffer.data(), buffer.size()};
}

}  // namespace kvr::mocker
