// The set of (worker, rank) slots holding one indexed block, with the tiers each holds it on.
// Internal to the KV indexer (discovery/indexer/kv_indexer.cpp); exposed for its tests.
#pragma once

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>
#include <span>

namespace kvr::discovery {

/// Small integer standing for one registered (worker, rank) inside an index.
using SlotId = std::uint32_t;

/// Tier bits of a holder entry: bit 0 device, bit 1 host, bit 2 disk.
inline constexpr std::uint32_t kTierBits = 3;
inline constexpr std::uint32_t kTierMask = (1U << kTierBits) - 1;
inline constexpr std::uint32_t kDeviceBit = 1U;
/// Largest slot id an entry can carry.
inline constexpr SlotId kMaxSlot = (1U << (32 - kTierBits)) - 1;

/// One holder: slot in the high bits, tier bits in the low three. Ordering by entry value orders
/// by slot, so sets stay sorted by slot and can be searched and merged.
constexpr std::uint32_t make_holder_entry(SlotId slot, std::uint32_t tier_bits) {
  return (slot << kTierBits) | tier_bits;
}
constexpr SlotId holder_slot(std::uint32_t entry) { return entry >> kTierBits; }
constexpr std::uint32_t holder_tiers(std::uint32_t entry) { return entry & kTierMask; }

/// A sorted small vector of holder entries: two inline, then a power-of-two heap array.
/// Deliberately trivially copyable so index nodes relocate with memcpy when the node slab grows;
/// the owner frees heap storage explicitly through release().
class HolderSet {
 public:
  static constexpr std::uint32_t kInline = 2;

  std::uint32_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  /// Holders that have the block on the device tier.
  std::uint32_t device_holders() const { return device_holders_; }
  /// Entries sorted by slot.
  std::span<const std::uint32_t> entries() const { return {data(), size_}; }

  /// Position of `slot`'s entry, or size() when absent.
  std::uint32_t find(SlotId slot) const {
    const std::uint32_t* begin = data();
    const std::uint32_t* it = std::lower_bound(begin, begin + size_, make_holder_entry(slot, 0));
    if (it != begin + size_ && holder_slot(*it) == slot)
      return static_cast<std::uint32_t>(it - begin);
    return size_;
  }
  /// Where an entry for `slot` would be inserted.
  std::uint32_t lower_bound(SlotId slot) const {
    const std::uint32_t* begin = data();
    return static_cast<std::uint32_t>(
        std::lower_bound(begin, begin + size_, make_holder_entry(slot, 0)) - begin);
  }
  std::uint32_t entry(std::uint32_t position) const { return data()[position]; }

  /// Replaces the tier bits of the entry at `position`.
  void set_tiers(std::uint32_t position, std::uint32_t tier_bits) {
    std::uint32_t& slot_entry = data()[position];
    device_holders_ += (tier_bits & kDeviceBit) - (slot_entry & kDeviceBit);
    slot_entry = make_holder_entry(holder_slot(slot_entry), tier_bits);
  }

  /// Inserts `entry` at `position` (which keeps the order).
  void insert(std::uint32_t position, std::uint32_t new_entry) {
    const std::uint32_t capacity = capacity_for(size_);
    if (size_ == capacity) {
      const std::uint32_t grown = capacity * 2;
      auto* storage = new std::uint32_t[grown];
      const std::uint32_t* old = data();
      std::memcpy(storage, old, position * sizeof(std::uint32_t));
      storage[position] = new_entry;
      std::memcpy(storage + position + 1, old + position,
                  (size_ - position) * sizeof(std::uint32_t));
      if (size_ > kInline) delete[] storage_.heap;
      storage_.heap = storage;
    } else {
      std::uint32_t* entries = data();
      std::memmove(entries + position + 1, entries + position,
                   (size_ - position) * sizeof(std::uint32_t));
      entries[position] = new_entry;
    }
    ++size_;
    device_holders_ += new_entry & kDeviceBit;
  }

  /// Removes the entry at `position`, shrinking storage when it falls to a smaller capacity.
  void erase(std::uint32_t position) {
    std::uint32_t* entries = data();
    device_holders_ -= entries[position] & kDeviceBit;
    const std::uint32_t old_capacity = capacity_for(size_);
    const std::uint32_t new_capacity = capacity_for(size_ - 1);
    if (new_capacity == old_capacity) {
      std::memmove(entries + position, entries + position + 1,
                   (size_ - position - 1) * sizeof(std::uint32_t));
      --size_;
      return;
    }
    // Capacities differ only above the inline size, so the entries are on the heap; the inline
    // array overlaps the heap pointer, which is why the pointer is saved first.
    std::uint32_t* heap = storage_.heap;
    std::uint32_t* target =
        new_capacity == kInline ? storage_.inline_entries : new std::uint32_t[new_capacity];
    std::memcpy(target, heap, position * sizeof(std::uint32_t));
    std::memcpy(target + position, heap + position + 1,
                (size_ - position - 1) * sizeof(std::uint32_t));
    delete[] heap;
    if (new_capacity != kInline) storage_.heap = target;
    --size_;
  }

  /// Frees heap storage; the set becomes empty.
  void release() {
    if (size_ > kInline) delete[] storage_.heap;
    size_ = 0;
    device_holders_ = 0;
  }

  /// Heap bytes held for `size` entries.
  static std::size_t heap_bytes_for(std::uint32_t size) {
    return size <= kInline ? 0 : capacity_for(size) * sizeof(std::uint32_t);
  }

 private:
  static std::uint32_t capacity_for(std::uint32_t size) {
    return size <= kInline ? kInline : std::bit_ceil(size);
  }
  std::uint32_t* data() { return size_ <= kInline ? storage_.inline_entries : storage_.heap; }
  const std::uint32_t* data() const {
    return size_ <= kInline ? storage_.inline_entries : storage_.heap;
  }

  std::uint32_t size_ = 0;
  std::uint32_t device_holders_ = 0;
  union Storage {
    std::uint32_t inline_entries[kInline];
    std::uint32_t* heap;
  } storage_{};
};

}  // namespace kvr::discovery
