// Throughput of the bridge's hot path on one core: a msgpack KVEventBatch as vLLM sends it is
// decoded, translated (kvr's chained hashes recomputed from the tokens, the per-rank picture and
// hash map updated) and encoded as the protobuf kvr publishes. Each iteration stores a chain of
// `blocks` blocks and removes it again (tail first), so the picture stays at a steady size; the
// counter `blocks/s` counts both the stored and the removed blocks. The goal is ≥ 1 M blocks/s.
#include <benchmark/benchmark.h>
#include <msgpack.hpp>

#include "deploy/bridge/kv_event_decoder.hpp"
#include "deploy/bridge/kv_translator.hpp"
#include "kvr/v1/kv_events.pb.h"
#include "selection/wire/kv_event_codec.hpp"

namespace kvr::bridge {
namespace {

constexpr std::uint32_t kBlockSize = 16;

// vLLM's array-like encoding: [ts, [["BlockStored", hashes, parent, tokens, 16, nil, "GPU"]], 0].
std::string stored_payload(std::uint32_t blocks) {
  msgpack::sbuffer buffer;
  msgpack::packer<msgpack::sbuffer> packer{buffer};
  packer.pack_array(3);
  packer.pack_double(1.0);
  packer.pack_array(1);
  packer.pack_array(7);
  packer.pack(std::string{"BlockStored"});
  packer.pack_array(blocks);
  for (std::uint32_t i = 0; i < blocks; ++i) packer.pack_uint64(0x8000'0000'0000'0000ULL + i);
  packer.pack_nil();
  packer.pack_array(blocks * kBlockSize);
  for (std::uint32_t i = 0; i < blocks * kBlockSize; ++i) packer.pack_uint32(1000 + i);
  packer.pack_uint32(kBlockSize);
  packer.pack_nil();
  packer.pack(std::string{"GPU"});
  packer.pack_uint32(0);
  return {buffer.data(), buffer.size()};
}

std::string removed_payload(std::uint32_t blocks) {
  msgpack::sbuffer buffer;
  msgpack::packer<msgpack::sbuffer> packer{buffer};
  packer.pack_array(3);
  packer.pack_double(2.0);
  packer.pack_array(1);
  packer.pack_array(3);
  packer.pack(std::string{"BlockRemoved"});
  packer.pack_array(blocks);
  // Tail first, as engines evict a prompt's blocks: each removal is a leaf's.
  for (std::uint32_t i = blocks; i-- > 0;) packer.pack_uint64(0x8000'0000'0000'0000ULL + i);
  packer.pack(std::string{"GPU"});
  packer.pack_uint32(0);
  return {buffer.data(), buffer.size()};
}

void BM_DecodeTranslateEncode(benchmark::State& state) {
  const auto blocks = static_cast<std::uint32_t>(state.range(0));
  const std::string stored = stored_payload(blocks);
  const std::string removed = removed_payload(blocks);
  auto translator = KvTranslator::create(TranslatorOptions{
      .worker_id = 7, .incarnation = 1, .block_size = kBlockSize, .capacity_blocks = 1 << 20});
  if (!translator) {
    state.SkipWithError(translator.error().c_str());
    return;
  }
  std::string wire;
  for (auto _ : state) {
    for (const std::string* payload : {&stored, &removed}) {
      auto batch = decode_kv_event_batch(*payload);
      if (!batch) {
        state.SkipWithError(batch.error().message().c_str());
        return;
      }
      auto translated = translator->translate(0, *batch);
      if (!translated) {
        const TranslatorStats& t = translator->stats();
        const std::string why = "a batch translated to nothing: unknown parents " +
                                std::to_string(t.unknown_parents) + ", bad stored " +
                                std::to_string(t.bad_stored_events) + ", refused " +
                                std::to_string(t.refused_events) + ", unknown removed " +
                                std::to_string(t.unknown_removed_blocks) + ", stored " +
                                std::to_string(t.blocks_stored);
        state.SkipWithError(why.c_str());
        return;
      }
      wire = encode_kv_event_batch(*translated).SerializeAsString();
      benchmark::DoNotOptimize(wire.data());
    }
  }
  state.counters["blocks/s"] = benchmark::Counter(
      static_cast<double>(state.iterations()) * 2.0 * blocks, benchmark::Counter::kIsRate);
  state.counters["payload_bytes"] = static_cast<double>(stored.size());
}
BENCHMARK(BM_DecodeTranslateEncode)->Arg(1)->Arg(16)->Arg(64)->Arg(256);

void BM_DecodeOnly(benchmark::State& state) {
  const auto blocks = static_cast<std::uint32_t>(state.range(0));
  const std::string stored = stored_payload(blocks);
  for (auto _ : state) {
    auto batch = decode_kv_event_batch(stored);
    benchmark::DoNotOptimize(batch);
  }
  state.counters["blocks/s"] = benchmark::Counter(static_cast<double>(state.iterations()) * blocks,
                                                  benchmark::Counter::kIsRate);
}
BENCHMARK(BM_DecodeOnly)->Arg(16)->Arg(256);

}  // namespace
}  // namespace kvr::bridge

BENCHMARK_MAIN();
