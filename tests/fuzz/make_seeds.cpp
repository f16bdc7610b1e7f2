// Writes the protobuf seeds of tests/fuzz/corpus/ with kvr's own encoders and the generated
// protobuf classes: one small, valid message per shape a worker or client sends, plus a few that
// each decoder must refuse, and the ext_proc streams Envoy sends the endpoint picker. Run from the
// repository root after changing the wire contract:
//   build/test/tests/fuzz/kvr_fuzz_seeds tests/fuzz/corpus
// The msgpack seeds come from make_engine_seeds.py (Python's msgpack), the YAML seeds are the
// documented router-policy examples; the JSON, template and text seeds are written by hand.
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <google/protobuf/util/delimited_message_util.h>

#include "envoy/ext_proc.pb.h"
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

namespace ext = envoy::service::ext_proc::v3;

// One ext_proc stream: its messages in protobuf's delimited form (epp_request.cpp).
void write_stream(const std::string& name, const std::vector<ext::ProcessingRequest>& messages) {
  const std::filesystem::path folder = corpus / "epp_request";
  std::filesystem::create_directories(folder);
  std::ofstream out{folder / (name + ".pb"), std::ios::binary};
  for (const auto& message : messages) {
    google::protobuf::util::SerializeDelimitedToOstream(message, &out);
  }
}

ext::ProcessingRequest request_headers(
    std::initializer_list<std::pair<std::string, std::string>> headers, bool end_of_stream,
    std::optional<ext::ProcessingMode::BodySendMode> body_mode) {
  ext::ProcessingRequest message;
  if (body_mode) message.mutable_protocol_config()->set_request_body_mode(*body_mode);
  auto& sent = *message.mutable_request_headers();
  sent.set_end_of_stream(end_of_stream);
  bool raw = false;
  for (const auto& [key, value] : headers) {
    auto& header = *sent.mutable_headers()->add_headers();
    header.set_key(key);
    // Envoy before 1.32 filled value, later ones raw_value: both are read.
    if (raw) {
      header.set_raw_value(value);
    } else {
      header.set_value(value);
    }
    raw = !raw;
  }
  return message;
}

ext::ProcessingRequest request_body(std::string body, bool end_of_stream) {
  ext::ProcessingRequest message;
  message.mutable_request_body()->set_body(std::move(body));
  message.mutable_request_body()->set_end_of_stream(end_of_stream);
  return message;
}

ext::ProcessingRequest response_headers(std::string status) {
  ext::ProcessingRequest message;
  auto& header = *message.mutable_response_headers()->mutable_headers()->add_headers();
  header.set_key(":status");
  header.set_raw_value(std::move(status));
  return message;
}

void picker_seeds() {
  const auto buffered = ext::ProcessingMode::BUFFERED;
  const auto duplex = ext::ProcessingMode::FULL_DUPLEX_STREAMED;
  write_stream("buffered_chat",
               {request_headers({{":method", "POST"},
                                 {":path", "/v1/chat/completions"},
                                 {"content-type", "application/json"},
                                 {"X-Session-Id", "chat-7"},
                                 {"x-kvr-tenant", "team-a"},
                                 {"x-kvr-priority", "2"}},
                                false, buffered),
                request_body(R"({"model":"qwen3","messages":[{"role":"user","content":"Hello"}],)"
                             R"("stream":true,"stream_options":{"include_usage":true}})",
                             true),
                response_headers("200")});
  ext::ProcessingRequest trailers;
  trailers.mutable_request_trailers();
  write_stream("duplex_completion_chunks",
               {request_headers({{":method", "POST"},
                                 {":path", "/v1/completions?stream=1"},
                                 {"x-kvr-routing-group", "canary"}},
                                false, duplex),
                request_body(R"({"model":"m","prompt":[1,22,)", false),
                request_body(R"(333,4444],"max_tokens":16,"temperature":0.5})", false), trailers,
                response_headers("503")});
  write_stream(
      "deep_tool_parameters",
      {request_headers({{":method", "POST"}, {":path", "/v1/chat/completions"}}, false, buffered),
       request_body("%nest 40000\t{\"a\":\t1\t}\n"
                    R"({"model":"qwen3","messages":[{"role":"user","content":"hi"}],)"
                    R"("tools":[{"type":"function","function":{"name":"f","parameters":%%}}]})",
                    true)});
  write_stream("refused_get", {request_headers({{":method", "GET"}, {":path", "/v1/completions"}},
                                               false, std::nullopt)});
  write_stream(
      "refused_headers_only",
      {request_headers({{":method", "POST"}, {":path", "/v1/chat/completions"}}, true, buffered)});
  write_stream("refused_streamed_mode",
               {request_headers({{":method", "POST"}, {":path", "/v1/chat/completions"}}, false,
                                ext::ProcessingMode::STREAMED)});
  ext::ProcessingRequest observed =
      request_headers({{":path", "/v1/chat/completions"}}, false, buffered);
  observed.set_observability_mode(true);
  write_stream("observability_mode", {observed});
  write_stream("refused_long_session",
               {request_headers({{":method", "POST"},
                                 {":path", "/v1/chat/completions"},
                                 {"x-session-id", std::string(300, 's')},
                                 {"x-kvr-priority", "-1"}},
                                false, buffered),
                request_body(R"({"model":"m","messages":[{"role":"user","content":"x"}]})", true)});
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
  picker_seeds();
  return 0;
}
