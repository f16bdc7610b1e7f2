// Writes the protobuf seeds of tests/fuzz/corpus/ with kvr's own encoders and the generated
// protobuf classes: one small, valid message per shape a worker or client sends, plus a few that
// each decoder must refuse. Run from the repository root after changing the wire contract:
//   build/test/tests/fuzz/kvr_fuzz_seeds tests/fuzz/corpus
// The msgpack seeds come from make_engine_seeds.py (Python's msgpack), the YAML seeds are the
// documented router-policy examples.
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include "kvr/v1/cluster.pb.h"
#include "kvr/v1/kv_events.pb.h"
#include "kvr/v1/routing.pb.h"
#include "kvr/v1/worker.pb.h"
#include "selection/wire/kv_event_codec.hpp"
#include "selection/wire/route_messages.hpp"

namespace {

std::filesystem::path corpus;

void write(const std::string& harness, const std::string& name,
           const google::protobuf::MessageLite& message) {
  const std::filesystem::path folder = corpus / harness;
  std::filesystem::create_directories(folder);
  std::ofstream{folder / (name + ".pb"), std::ios::binary} << message.SerializeAsString();
}

kvr::v1::RouteRequest route_with_hashes() {
  kvr::RouteRequest request;
  request.selection.request_id = "req-1";
  request.partition.model = "llama-3-8b";
  request.partition.routing_group = "default";
  request.selection.prompt_tokens = 40;
  request.selection.block_hashes = {0x1111, 0x2222};
  request.selection.expected_output_tokens = 128;
  return kvr::encode_route_request(request);
}

kvr::v1::RouteRequest route_with_everything() {
  kvr::v1::RouteRequest wire;
  wire.set_request_id("req-2");
  wire.set_model("llama-3-8b");
  wire.set_routing_group("canary");
  wire.set_worker_role(kvr::v1::WORKER_ROLE_PREFILL);
  for (std::uint32_t token = 1; token <= 20; ++token) wire.mutable_tokens()->add_ids(token);
  wire.set_cache_namespace("lora-a");
  wire.set_expected_output_tokens(64);
  auto* session = wire.mutable_session();
  session->set_session_id("chat-7");
  session->set_parent_session_id("chat-6");
  session->set_session_final(false);
  session->set_input_trigger(kvr::v1::INPUT_TRIGGER_TOOL_RESULT);
  wire.set_priority(2);
  wire.mutable_pinned_worker()->set_worker_id(42);
  wire.mutable_pinned_worker()->set_dp_rank(1);
  wire.add_allowed_workers(42);
  wire.add_allowed_workers(43);
  wire.add_required_taints("gpu=h100");
  (*wire.mutable_preferred_taints())["zone=a"] = 0.5;
  (*wire.mutable_preferred_taints())["zone=b"] = 0.25;
  wire.set_tenant("team-x");
  return wire;
}

void route_seeds() {
  write("route_request", "block_hashes", route_with_hashes());
  write("route_request", "tokens_session_taints", route_with_everything());
  kvr::v1::RouteRequest decode_role = route_with_hashes();
  decode_role.set_worker_role(kvr::v1::WORKER_ROLE_DECODE);
  decode_role.clear_expected_output_tokens();
  write("route_request", "decode_role", decode_role);
  kvr::v1::RouteRequest no_prompt = route_with_hashes();
  no_prompt.clear_block_hashes();
  write("route_request", "refused_no_prompt", no_prompt);
}

void generate_seeds() {
  kvr::v1::GenerateRequest generate;
  *generate.mutable_route() = route_with_everything();
  generate.set_max_output_tokens(32);
  generate.set_stream_subject("_INBOX.client.1");
  write("generate_request", "tokens_stream", generate);
  generate.clear_max_output_tokens();
  *generate.mutable_route() = route_with_hashes();
  write("generate_request", "expected_output_tokens", generate);
  generate.set_stream_subject("bad subject");
  write("generate_request", "refused_subject", generate);
  kvr::v1::GenerateCancel cancel;
  cancel.set_request_id("req-1");
  write("generate_request", "cancel", cancel);
  kvr::v1::GenerateChunk chunk;
  chunk.set_request_id("req-1");
  chunk.set_index(2);
  chunk.add_token_ids(17);
  chunk.add_token_ids(18);
  chunk.set_worker_id(42);
  chunk.set_dp_rank(1);
  chunk.set_cached_prompt_tokens(16);
  write("generate_request", "chunk", chunk);
  chunk.set_finished(true);
  chunk.set_finish_reason("error");
  chunk.mutable_error()->set_code(kvr::v1::ROUTE_ERROR_WORKER_FAILED);
  chunk.mutable_error()->set_message("engine crashed");
  write("generate_request", "chunk_error", chunk);
}

void lifecycle_seeds() {
  kvr::v1::LifecycleReport report;
  report.set_booking_id("n1-00000001");
  report.set_event(kvr::v1::LIFECYCLE_EVENT_FIRST_TOKEN);
  write("lifecycle_report", "first_token", report);
  report.set_event(kvr::v1::LIFECYCLE_EVENT_COMPLETED);
  report.set_context_tokens(512);
  write("lifecycle_report", "completed", report);
  report.clear_context_tokens();
  report.set_event(kvr::v1::LIFECYCLE_EVENT_ABORTED);
  report.set_error("client disconnected");
  write("lifecycle_report", "aborted", report);
  report.set_event(kvr::v1::LIFECYCLE_EVENT_UNSPECIFIED);
  write("lifecycle_report", "refused_unspecified", report);
}

kvr::v1::WorkerRegistration registration() {
  kvr::v1::WorkerRegistration wire;
  wire.set_worker_id(42);
  wire.set_incarnation(1700000000000);
  wire.set_model("llama-3-8b");
  wire.set_role(kvr::v1::WORKER_ROLE_AGGREGATED);
  wire.set_block_size(16);
  wire.set_total_kv_blocks(4096);
  wire.set_data_parallel_size(2);
  wire.set_max_num_batched_tokens(8192);
  wire.set_max_num_seqs(256);
  wire.set_publishes_kv_events(true);
  wire.set_liveness_ttl_ms(3000);
  wire.set_generate_subject("kvr.default.worker.42.generate");
  wire.set_dump_subject("kvr.default.worker.42.dump");
  return wire;
}

void registration_seeds() {
  write("worker_registration", "aggregated", registration());
  kvr::v1::WorkerRegistration prefill = registration();
  prefill.set_role(kvr::v1::WORKER_ROLE_PREFILL);
  prefill.set_routing_group("canary");
  prefill.add_taints("gpu=h100");
  prefill.add_taints("zone=a");
  prefill.set_publishes_kv_events(false);
  prefill.set_liveness_ttl_ms(0);
  prefill.set_data_parallel_size(0);
  write("worker_registration", "prefill_taints_defaults", prefill);
  kvr::v1::WorkerRegistration no_model = registration();
  no_model.clear_model();
  write("worker_registration", "refused_no_model", no_model);
}

void liveness_seeds() {
  kvr::v1::WorkerHeartbeat heartbeat;
  heartbeat.set_worker_id(42);
  heartbeat.set_incarnation(1700000000000);
  heartbeat.set_sent_at_unix_ms(1700000012345);
  write("worker_heartbeat", "heartbeat", heartbeat);
  kvr::v1::WorkerDeregistration bye;
  bye.set_worker_id(42);
  bye.set_incarnation(1700000000000);
  bye.set_reason("shutting down");
  write("worker_heartbeat", "deregistration", bye);
  heartbeat.set_worker_id(0);
  write("worker_heartbeat", "refused_worker_zero", heartbeat);
}

void load_seeds() {
  kvr::v1::LoadMetrics load;
  load.set_worker_id(42);
  load.set_incarnation(1700000000000);
  load.set_sent_at_unix_ms(1700000012345);
  for (std::uint32_t rank = 0; rank < 2; ++rank) {
    auto* entry = load.add_ranks();
    entry->set_dp_rank(rank);
    entry->set_active_requests(8 + rank);
    entry->set_waiting_requests(2);
    entry->set_active_decode_blocks(300);
    entry->set_active_prefill_tokens(4096);
    entry->set_kv_blocks_used(1200);
  }
  write("load_metrics", "two_ranks", load);
  load.clear_ranks();
  write("load_metrics", "no_ranks", load);
  auto* twice = load.add_ranks();
  twice->set_dp_rank(1);
  *load.add_ranks() = *twice;
  write("load_metrics", "refused_rank_twice", load);
}

void shard_seeds() {
  kvr::v1::ShardLoad load;
  load.set_model("mock-model");
  load.set_routing_group("default");
  load.set_shard(2);
  load.set_shards(4);
  for (const std::uint64_t tokens : {0ULL, 8192ULL, 123456ULL, 4ULL})
    load.add_worker_tokens(tokens);
  write("shard_load", "four_workers", load);
  load.clear_routing_group();
  load.clear_worker_tokens();
  write("shard_load", "default_group_no_workers", load);
  load.set_shard(4);
  write("shard_load", "refused_shard_past_count", load);
}

void kv_seeds() {
  kvr::KvEventBatch batch;
  batch.worker = {42, 1};
  batch.incarnation = 1700000000000;
  batch.event_id = 7;
  batch.events.emplace_back(
      kvr::KvStoredEvent{std::nullopt, {0xA1, 0xA2, 0xA3}, kvr::StorageTier::Device});
  batch.events.emplace_back(kvr::KvStoredEvent{0xA3, {0xA4}, kvr::StorageTier::Host});
  batch.events.emplace_back(kvr::KvRemovedEvent{{0xA4}, kvr::StorageTier::Host});
  batch.events.emplace_back(kvr::KvClearedEvent{});
  write("kv_event_batch", "batch_all_kinds", kvr::encode_kv_event_batch(batch));
  kvr::KvDump dump;
  dump.worker = {42, 0};
  dump.incarnation = 1700000000000;
  dump.last_event_id = 6;
  dump.stored.push_back({std::nullopt, {0xB1, 0xB2}, kvr::StorageTier::Device});
  dump.stored.push_back({0xB2, {0xB3}, kvr::StorageTier::Disk});
  write("kv_event_batch", "dump_reply", kvr::encode_kv_dump(dump));
  kvr::v1::KvEventBatch unknown_tier = kvr::encode_kv_event_batch(batch);
  unknown_tier.mutable_events(0)->mutable_stored()->set_tier(static_cast<kvr::v1::StorageTier>(7));
  write("kv_event_batch", "refused_unknown_tier", unknown_tier);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s <corpus folder>\n", argv[0]);
    return 2;
  }
  corpus = argv[1];
  route_seeds();
  generate_seeds();
  lifecycle_seeds();
  registration_seeds();
  liveness_seeds();
  load_seeds();
  shard_seeds();
  kv_seeds();
  return 0;
}
