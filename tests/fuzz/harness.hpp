// The fuzz harness bodies: one function per decoder that reads untrusted bytes, feeding them
// through the same entry points the node (selection/wire/nats_bridge.cpp, the front doors) and the
// engine bridge call on a received message, then checking what a decoded value promises. Each
// libFuzzer binary (fuzz_main.cpp) runs one of them; under GCC, corpus_replay_test.cpp runs every
// committed corpus file through all of them, so both builds exercise the same code.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

namespace kvr::fuzz {

/// The bytes of one input.
using Input = std::span<const std::uint8_t>;

/// A harness body: decodes `input`, checks its properties with KVR_FUZZ_CHECK.
using Harness = void (*)(Input input);

/// Reports a broken property. Each binary defines it: the fuzzer aborts (a crash libFuzzer keeps
/// as a reproducer), the replay test throws so that the failing corpus file is named.
[[noreturn]] void fail(std::string_view condition, std::string_view file, int line);

/// The input as text, for the decoders that take a string_view.
inline std::string_view as_text(Input input) {
  return {reinterpret_cast<const char*>(input.data()), input.size()};
}

// One body per harness; the corpus of each lives in tests/fuzz/corpus/<name>/.
void route_request(Input input);         ///< kvr.v1.RouteRequest on <ns>.router.route
void generate_request(Input input);      ///< GenerateRequest, GenerateCancel, GenerateChunk
void lifecycle_report(Input input);      ///< kvr.v1.LifecycleReport on <ns>.router.report
void worker_registration(Input input);   ///< kvr.v1.WorkerRegistration
void worker_heartbeat(Input input);      ///< kvr.v1.WorkerHeartbeat and WorkerDeregistration
void load_metrics(Input input);          ///< kvr.v1.LoadMetrics
void shard_load(Input input);            ///< kvr.v1.ShardLoad on <ns>.router.shard_load
void kv_event_batch(Input input);        ///< kvr.v1.KvEventBatch and KvDumpReply
void router_policy_yaml(Input input);    ///< the router-policy YAML, parsed and resolved
void engine_kv_events(Input input);      ///< an engine's msgpack KVEventBatch (kvr bridge)
void peer_port_handshake(Input input);   ///< a stranger's bytes on the actor or cluster port
void openai_request(Input input);        ///< a client's headers and body at the HTTP front door
void epp_request(Input input);           ///< Envoy's ext_proc messages to the endpoint picker
void engine_answer(Input input);         ///< an engine's answer: its usage, its rendered ids
void chat_request(Input input);          ///< a client's chat rendered by the native tokenizer
void chat_template_source(Input input);  ///< a chat template's source, parsed and rendered
void tokenizer_bytes(Input input);       ///< the native tokenizer encoding and decoding bytes

}  // namespace kvr::fuzz

/// Checks a property of a decoded value; a failure is a finding.
#define KVR_FUZZ_CHECK(condition) \
  ((condition) ? static_cast<void>(0) : ::kvr::fuzz::fail(#condition, __FILE__, __LINE__))
