// vLLM's KV events as the simulated engine of `kvr mocker --speak vllm` writes them: the block
// hashes it names, the tokens of the blocks its events must carry (BlockTokenTable), and the
// msgpack KVEventBatch payload. Used by the engine loop (vllm_engine_loop.hpp).
//
// A batch is vLLM's msgspec Structs with array_like=True and omit_defaults=True:
// [ts, [events...], dp_rank], each event tagged by its class name first:
// ["BlockStored", hashes, parent, token_ids, block_size, lora_id, "GPU"] (an adapter's blocks:
// lora_id its 1-based index, then lora_name), ["BlockRemoved", hashes, "GPU"],
// ["AllBlocksCleared"].
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "messages/ids.hpp"
#include "messages/kv_event.hpp"

namespace kvr::mocker {

/// The hash the engine publishes for kvr's chained `hash`: kvr's times an odd constant (a
/// bijection), so that a bridge forwarding them unchanged, instead of recomputing kvr's from the
/// tokens, would route nowhere.
std::uint64_t engine_hash(BlockHash hash);

/// The tokens of the blocks that live requests or the cache hold, which BlockStored events must
/// carry; owned by the engine thread.
class BlockTokenTable {
 public:
  /// One block's tokens and who still needs them.
  struct Entry {
    std::vector<std::uint32_t> tokens;
    std::uint32_t lora = 0;       ///< the adapter whose namespace hashed the block (0: none)
    std::uint32_t live_refs = 0;  ///< live requests whose prompt has the block
    bool stored = false;          ///< in the pool as a cached block
  };

  /// Records a request's prompt blocks (`hashes`, one per full block of `tokens`) as used by one
  /// more live request; a block seen before keeps its tokens.
  void add_prompt(std::span<const BlockHash> hashes, std::span<const std::uint32_t> tokens,
                  std::uint32_t lora, std::uint32_t block_size);

  /// A live request whose prompt had `hashes` is gone.
  void release(std::span<const BlockHash> hashes);

  /// Records what a step's events did to the pool.
  void note_events(std::span<const KvEvent> events);

  /// Forgets tokens of blocks no request and no pool entry needs; only between steps, since a
  /// running step's events may still name blocks of requests aborted while it ran.
  void sweep();

  /// False when `event` stores a block whose tokens are unknown (it cannot be encoded).
  bool has_tokens_for(const KvEvent& event) const;

  /// The entry of a block has_tokens_for() vouched for.
  const Entry& at(BlockHash hash) const { return entries_.at(hash); }

 private:
  absl::flat_hash_map<BlockHash, Entry> entries_;
  std::vector<BlockHash> sweep_candidates_;
};

/// One KVEventBatch payload (data-parallel rank 0) of `events`, each of which `blocks` has the
/// tokens of; `lora_names[i]` is the name of adapter i + 1.
std::string encode_kv_event_batch(std::span<const KvEvent* const> events,
                                  const BlockTokenTable& blocks, std::uint32_t block_size,
                                  std::span<const std::string> lora_names, double unix_time);

}  // namespace kvr::mocker
