#include "deploy/mocker/vllm_engine_server.hpp"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <limits>
#include <mutex>
#include <optional>
#include <thread>
#include <variant>

#include <fmt/format.h>
#include <httplib.h>
#include <msgpack.hpp>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>
#include <zmq.hpp>
#include <zmq_addon.hpp>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "deploy/mocker/mock_tokenizer.hpp"
#include "deploy/simulation/engine.hpp"
#include "deploy/worker/vllm_kv_frames.hpp"
#include "discovery/block_hash.hpp"
#include "selection/tokenizer/prompt_tokenizer.hpp"
#include "selection/tokenizer/request_json.hpp"

namespace kvr::mocker {
namespace {

using Clock = std::chrono::steady_clock;
using simulation::Engine;
using simulation::EngineRequestId;
using simulation::StepResult;

// An odd multiplier: a bijection of 64-bit values, so engine hashes differ from kvr's.
constexpr std::uint64_t kEngineHashMultiplier = 0x9E3779B97F4A7C15ULL;
// The ids the engine generates: the mock tokenizer's words.
constexpr std::uint32_t kWordTokens = kVocabSize - kFirstWordToken;

std::uint64_t engine_hash(BlockHash hash) { return hash * kEngineHashMultiplier; }

double unix_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// What the engine thread tells one HTTP response.
struct Token {
  std::uint32_t id = 0;
  bool last = false;
  bool stopped = false;  // the last token, and a stop token: finish_reason "stop"
};

// The sampling parameters the simulated engine honours (the others are accepted and ignored).
struct Sampling {
  std::optional<std::int64_t> seed;
  absl::flat_hash_set<std::uint32_t> stop_token_ids;
  std::uint32_t min_tokens = 0;
};

// The engine thread's side of one request and the HTTP thread's: guarded by `mutex`.
struct Channel {
  std::mutex mutex;
  std::condition_variable changed;
  bool answered = false;     // the engine accepted or refused the request
  std::string refusal;       // non-empty: refused, why
  std::deque<Token> tokens;  // produced, not yet written
  std::uint64_t cached_tokens = 0;
  // A prefill hop's answer for its decode hop, set before its last token (null otherwise).
  nlohmann::json kv_transfer_params;
  bool closed = false;  // the server is stopping
};

struct AddItem {
  EngineRequestId id = 0;
  std::uint32_t lora = 0;  // 0: the served model; i: the i-th LoRA adapter
  std::vector<std::uint32_t> tokens;
  std::vector<BlockHash> hashes;
  std::uint32_t max_tokens = 0;
  Sampling sampling;
  KvTransferRequest kv_transfer;
  std::shared_ptr<Channel> channel;
};
struct AbortItem {
  EngineRequestId id = 0;
};
using EngineInboxItem = std::variant<AddItem, AbortItem>;

// A block's tokens, for the BlockStored events that must carry them.
struct BlockTokens {
  std::vector<std::uint32_t> tokens;
  std::uint32_t lora = 0;       // the adapter whose namespace hashed the block (0: none)
  std::uint32_t live_refs = 0;  // live requests whose prompt has the block
  bool stored = false;          // in the pool as a cached block
};

struct LiveRequest {
  std::shared_ptr<Channel> channel;
  std::vector<BlockHash> hashes;
  std::uint64_t prompt_tokens = 0;
  std::uint64_t generated = 0;
  Sampling sampling;
  bool remote_decode = false;  // a prefill hop: its answer carries kv_transfer_params
};

struct LoadSnapshot {
  std::uint64_t running = 0;
  std::uint64_t waiting = 0;
  double kv_usage = 0;
  std::uint64_t prefix_queries = 0;
  std::uint64_t prefix_hits = 0;
  std::uint64_t prompt_tokens = 0;
  std::uint64_t generation_tokens = 0;
  std::uint64_t completed = 0;
};

// A request's JSON body and the model it names: 0 the served model (also when it names none), i
// the i-th LoRA adapter.
struct RequestBody {
  nlohmann::json json;
  std::uint32_t lora = 0;
  /// The body with its keys in the client's order, as a real tokenizer's chat template must see
  /// them (parsed only when the engine has one).
  nlohmann::ordered_json ordered;
};

// What a body asks of the engine besides its prompt.
struct Generation {
  KvTransferRequest kv_transfer;
  std::uint32_t max_tokens = 16;
  Sampling sampling;
  bool stream = false;
  bool include_usage = false;     // stream_options.include_usage: a last event with the usage
  bool continuous_usage = false;  // stream_options.continuous_usage_stats: usage in every event
  bool return_token_ids = false;  // vLLM's extension: each choice carries its token ids
};

// The two response formats one engine request can be served in.
enum class Api : std::uint8_t { completions, chat };

// A request the HTTP side refuses: its status and vLLM's error type.
struct HttpError {
  int status = 400;
  std::string message;
  std::string type;
};

HttpError bad_request(std::string message) { return {400, std::move(message), "BadRequestError"}; }

// vLLM's ErrorResponse.
void send_error(httplib::Response& response, const HttpError& error) {
  response.status = error.status;
  response.set_content(nlohmann::json{{"error",
                                       {{"message", error.message},
                                        {"type", error.type},
                                        {"param", nullptr},
                                        {"code", error.status}}}}
                           .dump(),
                       "application/json");
}

// A boolean field of `object`: `fallback` when absent or null, an error when not a boolean.
std::expected<bool, HttpError> read_bool(const nlohmann::json& object, const char* field,
                                         bool fallback) {
  const auto found = object.find(field);
  if (found == object.end() || found->is_null()) return fallback;
  if (!found->is_boolean())
    return std::unexpected(bad_request(fmt::format("{} must be a boolean", field)));
  return found->get<bool>();
}

// Calls of the endpoints that give a prompt's token ids without serving it.
struct RenderCalls {
  std::atomic<std::uint64_t> chat_render{0};
  std::atomic<std::uint64_t> completions_render{0};
  std::atomic<std::uint64_t> tokenize{0};
};

}  // namespace

struct VllmEngineServer::State {
  VllmEngineOptions options;
  std::optional<Engine> engine;
  // By LoRA: [0] the served model's, [i] the i-th adapter's, in the adapter's namespace, so that
  // an adapter's blocks are cached apart as vLLM's (whose block hashes include the LoRA) are.
  std::vector<discovery::BlockHasher> hashers;
  Clock::time_point start = Clock::now();
  // Unix time the engine started, published as prometheus_client's process_start_time_seconds:
  // a bridge reads a change of it as an engine restart.
  double start_unix_seconds = unix_seconds();
  std::uint16_t http_port = 0;

  zmq::context_t context{1};
  zmq::socket_t publisher{context, zmq::socket_type::pub};
  std::optional<zmq::socket_t> replay_socket;
  std::uint64_t next_sequence = 0;
  std::mutex replay_mutex;
  std::deque<std::pair<std::uint64_t, std::string>> replay_buffer;

  httplib::Server http;
  std::thread http_thread;
  std::thread engine_thread;
  std::thread replay_thread;
  std::atomic<bool> stopping{false};

  std::mutex inbox_mutex;
  std::condition_variable inbox_signal;
  std::deque<EngineInboxItem> inbox;
  bool engine_done = false;  // guarded by inbox_mutex
  std::atomic<EngineRequestId> next_request_id{1};
  std::atomic<std::uint64_t> next_render_id{1};
  RenderCalls render_calls;

  // Engine thread only.
  absl::flat_hash_map<EngineRequestId, LiveRequest> live;
  absl::flat_hash_map<BlockHash, BlockTokens> block_tokens;
  std::vector<BlockHash> sweep_candidates;
  std::optional<StepResult> in_flight;
  // Prefill hops' held blocks: (when the modelled transfer is over, request). There is no side
  // channel from the decode engine, so they are released on the model the decode side waits on.
  std::vector<std::pair<double, EngineRequestId>> pending_releases;

  mutable std::mutex load_mutex;
  LoadSnapshot load;

  double now_ms() const {
    return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
  }

  // False once the engine thread has ended: nobody would answer.
  bool enqueue(EngineInboxItem item) {
    {
      std::lock_guard lock{inbox_mutex};
      if (engine_done) return false;
      inbox.push_back(std::move(item));
    }
    inbox_signal.notify_one();
    return true;
  }

  // ---- KV events (engine thread) ----

  void pack_tier(msgpack::packer<msgpack::sbuffer>& packer, StorageTier tier) {
    packer.pack(std::string{tier == StorageTier::Host   ? "CPU"
                            : tier == StorageTier::Disk ? "DISK"
                                                        : "GPU"});
  }

  // Packs one event; false (nothing packed) when a stored block's tokens are unknown.
  bool can_pack(const KvEvent& event) const {
    if (const auto* stored = std::get_if<KvStoredEvent>(&event)) {
      for (BlockHash hash : stored->block_hashes) {
        if (!block_tokens.contains(hash)) return false;
      }
    }
    return true;
  }

  void pack_event(msgpack::packer<msgpack::sbuffer>& packer, const KvEvent& event) {
    if (const auto* stored = std::get_if<KvStoredEvent>(&event)) {
      // One event is one chain of one request's blocks, so of one LoRA.
      const std::uint32_t lora =
          stored->block_hashes.empty() ? 0 : block_tokens.at(stored->block_hashes.front()).lora;
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
      packer.pack_array(
          static_cast<std::uint32_t>(stored->block_hashes.size() * options.engine.block_size));
      for (BlockHash hash : stored->block_hashes) {
        for (std::uint32_t token : block_tokens.at(hash).tokens) packer.pack_uint32(token);
      }
      packer.pack_uint32(options.engine.block_size);
      if (lora == 0) {
        packer.pack_nil();  // lora_id
      } else {
        packer.pack_uint32(lora);
      }
      pack_tier(packer, stored->tier);
      if (lora != 0) packer.pack(options.lora_adapters[lora - 1]);  // lora_name
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

  // Records what the events did to the pool in the token map.
  void note_events(const std::vector<KvEvent>& events) {
    for (const KvEvent& event : events) {
      if (const auto* stored = std::get_if<KvStoredEvent>(&event)) {
        for (BlockHash hash : stored->block_hashes) {
          if (auto found = block_tokens.find(hash); found != block_tokens.end()) {
            found->second.stored = true;
          }
        }
      } else if (const auto* removed = std::get_if<KvRemovedEvent>(&event)) {
        for (BlockHash hash : removed->block_hashes) {
          if (auto found = block_tokens.find(hash); found != block_tokens.end()) {
            found->second.stored = false;
            sweep_candidates.push_back(hash);
          }
        }
      } else {
        for (auto& [hash, entry] : block_tokens) {
          entry.stored = false;
          sweep_candidates.push_back(hash);
        }
      }
    }
  }

  void publish_events(std::vector<KvEvent>& events) {
    if (events.empty()) return;
    std::vector<const KvEvent*> packable;
    for (const KvEvent& event : events) {
      if (can_pack(event)) {
        packable.push_back(&event);
      } else {
        spdlog::error("kvr mocker: a stored block without known tokens; event dropped");
      }
    }
    note_events(events);
    if (packable.empty()) return;
    msgpack::sbuffer buffer;
    msgpack::packer<msgpack::sbuffer> packer{buffer};
    packer.pack_array(3);
    packer.pack_double(unix_seconds());
    packer.pack_array(static_cast<std::uint32_t>(packable.size()));
    for (const KvEvent* event : packable) pack_event(packer, *event);
    packer.pack_uint32(0);  // data_parallel_rank
    std::string payload{buffer.data(), buffer.size()};
    const std::uint64_t sequence = next_sequence++;
    {
      std::lock_guard lock{replay_mutex};
      replay_buffer.emplace_back(sequence, payload);
      while (replay_buffer.size() > options.replay_buffer) replay_buffer.pop_front();
    }
    if (options.skip_every != 0 && (sequence + 1) % options.skip_every == 0) return;
    try {
      worker::send_kv_event(publisher, options.topic, sequence, payload, zmq::send_flags::dontwait);
    } catch (const zmq::error_t& error) {
      spdlog::warn("kvr mocker: KV event publish failed: {}", error.what());
    }
  }

  // ---- requests (engine thread) ----

  void release(const LiveRequest& request) {
    for (BlockHash hash : request.hashes) {
      auto found = block_tokens.find(hash);
      if (found == block_tokens.end()) continue;
      if (found->second.live_refs > 0) --found->second.live_refs;
      if (found->second.live_refs == 0) sweep_candidates.push_back(hash);
    }
  }

  // Forgets tokens of blocks no request and no pool entry needs; only between steps, since a
  // running step's events may still name blocks of requests aborted while it ran.
  void sweep() {
    for (BlockHash hash : sweep_candidates) {
      auto found = block_tokens.find(hash);
      if (found != block_tokens.end() && found->second.live_refs == 0 && !found->second.stored) {
        block_tokens.erase(found);
      }
    }
    sweep_candidates.clear();
  }

  void add(AddItem& item) {
    auto answer = [&](std::string refusal) {
      std::lock_guard lock{item.channel->mutex};
      item.channel->answered = true;
      item.channel->refusal = std::move(refusal);
      item.channel->changed.notify_all();
    };
    simulation::EngineRequest request{.id = item.id,
                                      .block_hashes = item.hashes,
                                      .prompt_tokens = item.tokens.size(),
                                      .output_tokens = item.max_tokens,
                                      .kv_transfer = item.kv_transfer.kv_transfer,
                                      .remote_blocks = item.kv_transfer.remote_blocks};
    if (auto added = engine->add_request(std::move(request), now_ms()); !added) {
      answer(std::string{simulation::as_str(added.error())});
      return;
    }
    const std::uint32_t block_size = options.engine.block_size;
    for (std::size_t i = 0; i < item.hashes.size(); ++i) {
      auto [entry, inserted] = block_tokens.try_emplace(item.hashes[i]);
      if (inserted) {
        entry->second.lora = item.lora;
        entry->second.tokens.assign(
            item.tokens.begin() + static_cast<std::ptrdiff_t>(i * block_size),
            item.tokens.begin() + static_cast<std::ptrdiff_t>((i + 1) * block_size));
      }
      ++entry->second.live_refs;
    }
    live.emplace(item.id, LiveRequest{.channel = item.channel,
                                      .hashes = std::move(item.hashes),
                                      .prompt_tokens = item.tokens.size(),
                                      .sampling = std::move(item.sampling),
                                      .remote_decode = item.kv_transfer.kv_transfer ==
                                                       simulation::KvTransfer::remote_decode});
    answer({});
  }

  void abort(EngineRequestId id) {
    auto found = live.find(id);
    if (found == live.end()) return;  // finished meanwhile
    engine->abort_request(id);
    release(found->second);
    live.erase(found);
  }

  // The index-th generated token, a word of the mock tokenizer: a function of the seed when the
  // request has one (the same seed gives the same tokens, as a seeded sampler does), else of the
  // request.
  static std::uint32_t token_for(EngineRequestId id, const Sampling& sampling,
                                 std::uint64_t index) {
    if (sampling.seed) {
      std::uint64_t mixed = static_cast<std::uint64_t>(*sampling.seed) * 0x9E3779B97F4A7C15ULL +
                            (index + 1) * 0xBF58476D1CE4E5B9ULL;
      mixed ^= mixed >> 31;
      mixed *= 0x94D049BB133111EBULL;
      mixed ^= mixed >> 29;
      return kFirstWordToken + static_cast<std::uint32_t>(mixed % kWordTokens);
    }
    return kFirstWordToken + static_cast<std::uint32_t>((id * 7919 + index) % kWordTokens);
  }

  // What this engine's prefill hops name as the source of their KV.
  KvTransferSource transfer_source() const {
    return KvTransferSource{.engine_id = fmt::format("kvr-mocker-{}-0", http_port),
                            .host = options.host,
                            .port = kNixlSideChannelPort};
  }

  void deliver(StepResult& result) {
    publish_events(result.kv_events);
    absl::flat_hash_map<EngineRequestId, bool> finished;
    for (const auto& done : result.completions) {
      finished[done.id] = true;
      // Even when the client left meanwhile: the blocks are held all the same.
      if (done.held_blocks > 0) {
        pending_releases.emplace_back(result.end_ms() + engine->transfer_ms(done.held_blocks),
                                      done.id);
      }
    }
    std::uint64_t generated = 0;
    std::uint64_t queries = 0;
    std::uint64_t hits = 0;
    std::uint64_t stopped = 0;
    auto emit = [&](EngineRequestId id, std::optional<std::uint64_t> cached) {
      auto found = live.find(id);
      if (found == live.end()) return;  // aborted while the step ran
      LiveRequest& request = found->second;
      const std::uint32_t token = token_for(id, request.sampling, request.generated++);
      // A stop token ends the request early (after min_tokens), as in vLLM: it is the last
      // token sent, and the engine frees the request at once.
      const bool stop = !finished.contains(id) &&
                        request.generated >= request.sampling.min_tokens &&
                        request.sampling.stop_token_ids.contains(token);
      const bool last = finished.contains(id) || stop;
      ++generated;
      {
        Channel& channel = *request.channel;
        std::lock_guard lock{channel.mutex};
        if (cached) channel.cached_tokens = *cached;
        if (last && request.remote_decode) {
          channel.kv_transfer_params = kv_transfer_answer(
              transfer_source(), fmt::format("req-{:016x}", id), engine->held_blocks(id));
        }
        channel.tokens.push_back(Token{token, last, stop});
        channel.changed.notify_all();
      }
      if (cached) {
        queries += request.prompt_tokens;
        hits += *cached;
      }
      if (stop) {
        engine->abort_request(id);
        ++stopped;
      }
      if (last) {
        release(request);
        live.erase(found);
      }
    };
    for (const auto& first : result.first_tokens) emit(first.id, first.cached_prompt_tokens);
    for (EngineRequestId id : result.next_tokens) emit(id, std::nullopt);
    std::lock_guard lock{load_mutex};
    load.generation_tokens += generated;
    load.prefix_queries += queries;
    load.prefix_hits += hits;
    load.prompt_tokens += queries;
    load.completed += result.completions.size() + stopped;
  }

  // Releases the held blocks whose modelled transfer is over; returns when the next one is.
  std::optional<double> release_transfers(double now) {
    std::optional<double> next;
    std::size_t kept = 0;
    for (const auto& [release_ms, id] : pending_releases) {
      if (release_ms <= now) {
        engine->release_transfer(id);
        continue;
      }
      next = std::min(next.value_or(release_ms), release_ms);
      pending_releases[kept++] = {release_ms, id};
    }
    pending_releases.resize(kept);
    return next;
  }

  // Publishes the step that ended and starts the next; returns when the step in flight ends.
  std::optional<double> step_engine(double now) {
    double step_start = now;
    if (in_flight) {
      if (in_flight->end_ms() > now) return in_flight->end_ms();
      step_start = in_flight->end_ms();
      StepResult done = std::move(*in_flight);
      in_flight.reset();
      deliver(done);
    }
    sweep();
    if (!engine->has_work()) return std::nullopt;
    in_flight = engine->step(step_start);
    return in_flight->end_ms();
  }

  // Advances the engine to `now`; returns when something is next due (nullopt: nothing is).
  std::optional<double> advance(double now) {
    const std::optional<double> next_release = release_transfers(now);
    const std::optional<double> step_end = step_engine(now);
    if (!next_release) return step_end;
    return std::min(step_end.value_or(*next_release), *next_release);
  }

  void update_load() {
    const auto engine_load = engine->load();
    std::lock_guard lock{load_mutex};
    load.running = engine_load.active_requests;
    load.waiting = engine_load.waiting_requests;
    load.kv_usage = engine_load.total_blocks == 0
                        ? 0.0
                        : static_cast<double>(engine_load.kv_blocks_used) /
                              static_cast<double>(engine_load.total_blocks);
  }

  void run_engine() {
    std::deque<EngineInboxItem> batch;
    while (!stopping) {
      {
        std::lock_guard lock{inbox_mutex};
        batch.swap(inbox);
      }
      for (EngineInboxItem& item : batch) {
        if (auto* add_item = std::get_if<AddItem>(&item)) {
          add(*add_item);
        } else {
          abort(std::get<AbortItem>(item).id);
        }
      }
      batch.clear();
      const std::optional<double> next_ms = advance(now_ms());
      update_load();
      std::unique_lock lock{inbox_mutex};
      auto ready = [&] { return !inbox.empty() || stopping; };
      if (next_ms) {
        inbox_signal.wait_until(lock,
                                start + std::chrono::duration_cast<Clock::duration>(
                                            std::chrono::duration<double, std::milli>(*next_ms)),
                                ready);
      } else {
        inbox_signal.wait(lock, ready);
      }
    }
    // Wake every response still waiting for an answer or a token.
    auto close = [](Channel& channel) {
      std::lock_guard lock{channel.mutex};
      channel.closed = true;
      channel.changed.notify_all();
    };
    for (auto& [id, request] : live) close(*request.channel);
    std::lock_guard lock{inbox_mutex};
    engine_done = true;
    for (EngineInboxItem& item : inbox) {
      if (auto* add_item = std::get_if<AddItem>(&item)) close(*add_item->channel);
    }
    inbox.clear();
  }

  // ---- replay (replay thread) ----

  void run_replay() {
    zmq::socket_t& router = *replay_socket;
    while (!stopping) {
      try {
        std::array<zmq::pollitem_t, 1> items = {{{router.handle(), 0, ZMQ_POLLIN, 0}}};
        if (zmq::poll(items.data(), items.size(), std::chrono::milliseconds(100)) == 0) continue;
        std::vector<zmq::message_t> frames;
        if (!zmq::recv_multipart(router, std::back_inserter(frames), zmq::recv_flags::dontwait)) {
          continue;
        }
        const auto request = worker::read_replay_request(frames);
        if (!request) continue;
        std::vector<std::pair<std::uint64_t, std::string>> answer;
        {
          std::lock_guard lock{replay_mutex};
          for (const auto& entry : replay_buffer) {
            if (entry.first >= request->first_sequence) answer.push_back(entry);
          }
        }
        for (const auto& [sequence, payload] : answer) {
          worker::send_replay_message(router, request->identity, sequence, payload);
        }
        worker::send_replay_end(router, request->identity);
      } catch (const zmq::error_t& error) {
        if (error.num() == ETERM) return;
        spdlog::warn("kvr mocker: replay socket: {}", error.what());
      }
    }
  }

  // ---- HTTP (server threads) ----

  std::string metrics_text() const {
    LoadSnapshot snapshot;
    {
      std::lock_guard lock{load_mutex};
      snapshot = load;
    }
    const std::string labels = fmt::format(R"(engine="0",model_name="{}")", options.model);
    std::string out;
    auto gauge = [&](std::string_view name, std::string_view help, double value) {
      out += fmt::format("# HELP {0} {1}\n# TYPE {0} gauge\n{0}{{{2}}} {3}\n", name, help, labels,
                         value);
    };
    auto counter = [&](std::string_view name, std::string_view help, std::uint64_t value) {
      out += fmt::format("# HELP {0} {1}\n# TYPE {0} counter\n{0}_total{{{2}}} {3}.0\n", name, help,
                         labels, value);
    };
    gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
          static_cast<double>(snapshot.running));
    gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
          static_cast<double>(snapshot.waiting));
    gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
          snapshot.kv_usage);
    counter("vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.", snapshot.prefix_queries);
    counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
            snapshot.prefix_hits);
    counter("vllm:prompt_tokens", "Number of prefill tokens processed.", snapshot.prompt_tokens);
    counter("vllm:generation_tokens", "Number of generation tokens processed.",
            snapshot.generation_tokens);
    out += fmt::format(
        "# HELP process_start_time_seconds Start time of the process since unix epoch in seconds.\n"
        "# TYPE process_start_time_seconds gauge\nprocess_start_time_seconds {:.3f}\n",
        start_unix_seconds);
    out +=
        "# HELP kvr_mock_render_requests Calls of the endpoints that give a prompt's token ids.\n";
    out += "# TYPE kvr_mock_render_requests counter\n";
    for (const auto& [endpoint, calls] :
         {std::pair{"/v1/chat/completions/render", &render_calls.chat_render},
          std::pair{"/v1/completions/render", &render_calls.completions_render},
          std::pair{"/tokenize", &render_calls.tokenize}}) {
      out +=
          fmt::format("kvr_mock_render_requests_total{{endpoint=\"{}\",model_name=\"{}\"}} {}.0\n",
                      endpoint, options.model, calls->load());
    }
    out += "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n";
    out += "# TYPE vllm:cache_config_info gauge\n";
    out += fmt::format(
        "vllm:cache_config_info{{block_size=\"{}\",cache_dtype=\"auto\",enable_prefix_caching=\"{}"
        "\","
        "engine=\"0\",gpu_memory_utilization=\"0.9\",num_cpu_blocks=\"None\",num_gpu_blocks=\"{}\","
        "prefix_caching_hash_algo=\"builtin\"}} 1.0\n",
        options.engine.block_size, options.engine.enable_prefix_caching ? "True" : "False",
        options.engine.num_gpu_blocks);
    return out;
  }

  static nlohmann::json finish_reason(const Token& token) {
    if (!token.last) return nullptr;
    return token.stopped ? "stop" : "length";
  }

  static nlohmann::json stop_reason(const Token& token) {
    return token.stopped ? nlohmann::json(token.id) : nlohmann::json();
  }

  static nlohmann::json usage_json(std::uint64_t prompt, std::uint64_t completion,
                                   std::uint64_t cached) {
    return {{"prompt_tokens", prompt},
            {"total_tokens", prompt + completion},
            {"completion_tokens", completion},
            {"prompt_tokens_details", {{"cached_tokens", cached}}}};
  }

  // The sampling parameters of a completions or chat body, checked for their types as vLLM checks
  // them; seed, stop_token_ids and min_tokens are honoured, the others (temperature, top_p, top_k,
  // min_p, stop, the penalties, ignore_eos: the simulated engine has no EOS token, so it always
  // generates to max_tokens or a stop token) accepted and ignored.
  static std::expected<Sampling, std::string> read_sampling(const nlohmann::json& body) {
    Sampling sampling;
    const auto null_or = [&](const char* field, auto&& valid) {
      const auto found = body.find(field);
      return found == body.end() || found->is_null() || valid(*found);
    };
    const auto number = [](const nlohmann::json& v) { return v.is_number(); };
    const auto boolean = [](const nlohmann::json& v) { return v.is_boolean(); };
    const auto integer = [](const nlohmann::json& v) { return v.is_number_integer(); };
    const auto strings = [](const nlohmann::json& v) {
      if (v.is_string()) return true;
      if (!v.is_array()) return false;
      for (const auto& entry : v) {
        if (!entry.is_string()) return false;
      }
      return true;
    };
    for (const char* field : {"temperature", "top_p", "min_p", "presence_penalty",
                              "frequency_penalty", "repetition_penalty"}) {
      if (!null_or(field, number))
        return std::unexpected(fmt::format("{} must be a number", field));
    }
    for (const char* field : {"ignore_eos", "include_stop_str_in_output", "skip_special_tokens"}) {
      if (!null_or(field, boolean))
        return std::unexpected(fmt::format("{} must be a boolean", field));
    }
    if (!null_or("top_k", integer)) return std::unexpected("top_k must be an integer");
    if (!null_or("stop", strings)) return std::unexpected("stop must be a string or strings");
    if (const auto seed = body.find("seed"); seed != body.end() && !seed->is_null()) {
      if (!seed->is_number_integer()) return std::unexpected("seed must be an integer");
      sampling.seed = seed->get<std::int64_t>();
    }
    if (const auto ids = body.find("stop_token_ids"); ids != body.end() && !ids->is_null()) {
      if (!ids->is_array()) return std::unexpected("stop_token_ids must be a list of token ids");
      for (const auto& id : *ids) {
        if (!id.is_number_unsigned() || id.get<std::uint64_t>() > UINT32_MAX) {
          return std::unexpected("stop_token_ids must be a list of token ids");
        }
        sampling.stop_token_ids.insert(id.get<std::uint32_t>());
      }
    }
    if (const auto min = body.find("min_tokens"); min != body.end() && !min->is_null()) {
      if (!min->is_number_unsigned() || min->get<std::uint64_t>() > simulation::kMaxOutputTokens) {
        return std::unexpected("min_tokens must be in [0, 1048576]");
      }
      sampling.min_tokens = min->get<std::uint32_t>();
    }
    return sampling;
  }

  // The name answers carry for a request of `lora`.
  const std::string& model_name(std::uint32_t lora) const {
    return lora == 0 ? options.model : options.lora_adapters[lora - 1];
  }

  // The body as a JSON object naming the served model, one of its adapters, or none.
  std::expected<RequestBody, HttpError> read_body(const httplib::Request& http_request) const {
    // Before nlohmann reads it: its ordered objects copy a member nested before another, and the
    // chat template walks what it is given, both recursively.
    if (const auto fault =
            tokenizer::check_request_json(http_request.body, tokenizer::kDefaultMaxJsonDepth)) {
      return std::unexpected(
          bad_request(tokenizer::request_json_message(*fault, tokenizer::kDefaultMaxJsonDepth)));
    }
    RequestBody body{.json = nlohmann::json::parse(http_request.body, nullptr, false)};
    if (body.json.is_discarded() || !body.json.is_object()) {
      return std::unexpected(bad_request("the body is not a JSON object"));
    }
    if (options.tokenizer) body.ordered = nlohmann::ordered_json::parse(http_request.body);
    const auto model = body.json.find("model");
    if (model == body.json.end() || model->is_null()) return body;
    if (!model->is_string()) return std::unexpected(bad_request("model must be a string"));
    const auto& name = model->get_ref<const std::string&>();
    if (name == options.model) return body;
    const auto adapter = std::ranges::find(options.lora_adapters, name);
    if (adapter == options.lora_adapters.end()) {
      return std::unexpected(
          HttpError{404, fmt::format("The model `{}` does not exist.", name), "NotFoundError"});
    }
    body.lora = static_cast<std::uint32_t>(adapter - options.lora_adapters.begin()) + 1;
    return body;
  }

  // The prompts of a completions body, each as the engine's token ids: a text (tokenized, after
  // BOS unless add_special_tokens is false), a list of ids (as they are), or a list of either.
  // A text prompt's ids: the model's tokenizer when one is given, else the mock tokenizer.
  std::expected<std::vector<std::uint32_t>, HttpError> encode_prompt_text(const std::string& text,
                                                                          bool add_bos) const {
    if (!options.tokenizer) return encode_text(text, add_bos);
    auto ids = options.tokenizer->tokenizer().encode(text, add_bos);
    if (!ids) return std::unexpected(bad_request(ids.error().message));
    return std::move(*ids);
  }

  std::expected<std::vector<std::vector<std::uint32_t>>, HttpError> read_prompts(
      const nlohmann::json& body) const {
    const auto add_bos = read_bool(body, "add_special_tokens", true);
    if (!add_bos) return std::unexpected(add_bos.error());
    const auto prompt = body.find("prompt");
    if (prompt == body.end() || prompt->is_null()) {
      return std::unexpected(bad_request("prompt is required"));
    }
    auto one = [&](const nlohmann::json& entry) -> std::optional<std::vector<std::uint32_t>> {
      if (entry.is_string()) {
        auto ids = encode_prompt_text(entry.get_ref<const std::string&>(), *add_bos);
        return ids ? std::optional{std::move(*ids)} : std::nullopt;
      }
      if (!entry.is_array()) return std::nullopt;
      std::vector<std::uint32_t> ids;
      ids.reserve(entry.size());
      for (const auto& token : entry) {
        if (!token.is_number_unsigned() || token.get<std::uint64_t>() > UINT32_MAX) {
          return std::nullopt;
        }
        ids.push_back(token.get<std::uint32_t>());
      }
      return ids;
    };
    std::vector<std::vector<std::uint32_t>> prompts;
    // A list of texts or of id lists is a batch; a list of integers is one prompt.
    const bool batch = prompt->is_array() && !prompt->empty() &&
                       ((*prompt)[0].is_string() || (*prompt)[0].is_array());
    if (batch) {
      for (const auto& entry : *prompt) {
        auto ids = one(entry);
        if (!ids) break;
        prompts.push_back(std::move(*ids));
      }
      if (prompts.size() != prompt->size()) prompts.clear();
    } else if (auto ids = one(*prompt)) {
      prompts.push_back(std::move(*ids));
    }
    if (prompts.empty()) {
      return std::unexpected(bad_request(
          "prompt must be a text, a list of unsigned 32-bit token ids, or a list of either"));
    }
    for (const auto& ids : prompts) {
      if (ids.empty() || ids.size() > simulation::kMaxPromptTokens) {
        return std::unexpected(bad_request("a prompt must have 1 to 4194304 tokens"));
      }
    }
    return prompts;
  }

  // The chat template's token ids for a body's messages (add_generation_prompt defaults to true;
  // add_special_tokens, false by default as in vLLM's chat requests, puts a second BOS first).
  std::expected<std::vector<std::uint32_t>, HttpError> read_chat_prompt(
      const RequestBody& request) const {
    const nlohmann::json& body = request.json;
    if (options.tokenizer) {
      auto chat = tokenizer::PromptTokenizer::chat_from_openai(request.ordered);
      if (!chat) return std::unexpected(bad_request(chat.error().message));
      auto rendered = options.tokenizer->encode_chat(*chat);
      if (!rendered) return std::unexpected(bad_request(rendered.error().message));
      if (rendered->ids.empty() || rendered->ids.size() > simulation::kMaxPromptTokens) {
        return std::unexpected(bad_request("a prompt must have 1 to 4194304 tokens"));
      }
      return std::move(rendered->ids);
    }
    const auto generation_prompt = read_bool(body, "add_generation_prompt", true);
    if (!generation_prompt) return std::unexpected(generation_prompt.error());
    const auto add_bos = read_bool(body, "add_special_tokens", false);
    if (!add_bos) return std::unexpected(add_bos.error());
    const auto messages = body.find("messages");
    if (messages == body.end() || !messages->is_array() || messages->empty()) {
      return std::unexpected(bad_request("messages must be a non-empty list of messages"));
    }
    std::vector<ChatMessage> chat;
    chat.reserve(messages->size());
    for (const auto& message : *messages) {
      if (!message.is_object()) return std::unexpected(bad_request("a message is not an object"));
      const auto role = message.find("role");
      if (role == message.end() || !role->is_string()) {
        return std::unexpected(bad_request("a message's role must be a string"));
      }
      ChatMessage& entry = chat.emplace_back();
      entry.role = role->get<std::string>();
      const auto content = message.find("content");
      if (content == message.end() || content->is_null()) continue;
      if (content->is_string()) {
        entry.content = content->get<std::string>();
        continue;
      }
      if (!content->is_array()) {
        return std::unexpected(
            bad_request("a message's content must be a text or a list of parts"));
      }
      for (const auto& part : *content) {
        const auto type = part.is_object() ? part.find("type") : part.end();
        if (!part.is_object() || type == part.end() || !type->is_string()) {
          return std::unexpected(bad_request("a content part must be an object with a type"));
        }
        if (*type != "text") {
          return std::unexpected(bad_request(fmt::format(
              "kvr mocker serves text content only, not a part of type `{}`", type->dump())));
        }
        const auto text = part.find("text");
        if (text == part.end() || !text->is_string()) {
          return std::unexpected(bad_request("a text part's text must be a string"));
        }
        entry.content += text->get<std::string>();
      }
    }
    std::vector<std::uint32_t> ids = render_chat(chat, *generation_prompt);
    if (*add_bos) ids.insert(ids.begin(), kBosToken);
    if (ids.size() > simulation::kMaxPromptTokens) {
      return std::unexpected(bad_request("a prompt must have 1 to 4194304 tokens"));
    }
    return ids;
  }

  // What a completions or chat body asks of the engine besides the prompt. Chat reads
  // max_completion_tokens before max_tokens. Both default to 16, vLLM's completions default (its
  // chat would generate to the end of the context, which no test of a mock wants).
  static std::expected<Generation, HttpError> read_generation(const nlohmann::json& body,
                                                              bool chat) {
    Generation generation;
    const auto given = [&](const char* field) -> const nlohmann::json* {
      const auto found = body.find(field);
      return found == body.end() || found->is_null() ? nullptr : &*found;
    };
    const nlohmann::json* max_tokens_field = chat ? given("max_completion_tokens") : nullptr;
    if (max_tokens_field == nullptr) max_tokens_field = given("max_tokens");
    const nlohmann::json max_tokens =
        max_tokens_field ? *max_tokens_field : nlohmann::json(std::uint64_t{16});
    if (!max_tokens.is_number_unsigned() || max_tokens.get<std::uint64_t>() == 0 ||
        max_tokens.get<std::uint64_t>() > simulation::kMaxOutputTokens) {
      return std::unexpected(bad_request("max_tokens must be in [1, 1048576]"));
    }
    generation.max_tokens = max_tokens.get<std::uint32_t>();
    auto sampling = read_sampling(body);
    if (!sampling) return std::unexpected(bad_request(sampling.error()));
    generation.sampling = std::move(*sampling);
    const auto stream = read_bool(body, "stream", false);
    if (!stream) return std::unexpected(stream.error());
    generation.stream = *stream;
    const auto return_token_ids = read_bool(body, "return_token_ids", false);
    if (!return_token_ids) return std::unexpected(return_token_ids.error());
    generation.return_token_ids = *return_token_ids;
    if (const auto found = body.find("stream_options"); found != body.end() && !found->is_null()) {
      if (!found->is_object()) {
        return std::unexpected(bad_request("stream_options must be an object"));
      }
      const auto include_usage = read_bool(*found, "include_usage", false);
      if (!include_usage) return std::unexpected(include_usage.error());
      const auto continuous = read_bool(*found, "continuous_usage_stats", false);
      if (!continuous) return std::unexpected(continuous.error());
      generation.include_usage = *include_usage;
      generation.continuous_usage = *include_usage && *continuous;
    }
    if (const auto found = body.find("kv_transfer_params"); found != body.end()) {
      auto kv_transfer = read_kv_transfer_params(*found);
      if (!kv_transfer) return std::unexpected(bad_request(kv_transfer.error()));
      generation.kv_transfer = *kv_transfer;
    }
    return generation;
  }

  // Hands a prompt to the engine and waits until it is admitted; its tokens then arrive on the
  // channel.
  std::expected<std::pair<EngineRequestId, std::shared_ptr<Channel>>, HttpError> submit(
      std::vector<std::uint32_t> tokens, std::uint32_t lora, const Generation& generation) {
    AddItem item;
    item.lora = lora;
    item.hashes = hashers[lora].sequence_hashes(tokens);
    item.tokens = std::move(tokens);
    item.max_tokens = generation.max_tokens;
    item.sampling = generation.sampling;
    item.kv_transfer = generation.kv_transfer;
    item.id = next_request_id++;
    item.channel = std::make_shared<Channel>();
    auto channel = item.channel;
    const EngineRequestId id = item.id;
    const HttpError stopping_error{503, "the engine is shutting down", "ServiceUnavailableError"};
    if (!enqueue(std::move(item))) return std::unexpected(stopping_error);
    std::unique_lock lock{channel->mutex};
    channel->changed.wait(lock, [&] { return channel->answered || channel->closed; });
    if (channel->closed) return std::unexpected(stopping_error);
    if (!channel->refusal.empty()) {
      return std::unexpected(
          bad_request(fmt::format("the engine refused the request: {}", channel->refusal)));
    }
    return std::pair{id, channel};
  }

  // One `data: {json}\n\n` event of a completions stream.
  static std::string completion_event(const std::string& id, const std::string& model,
                                      std::int64_t created, const Token& token,
                                      bool return_token_ids,
                                      const std::optional<nlohmann::json>& usage) {
    nlohmann::json choice = {{"index", 0},
                             {"text", token_text(token.id)},
                             {"logprobs", nullptr},
                             {"finish_reason", finish_reason(token)},
                             {"stop_reason", stop_reason(token)}};
    if (return_token_ids) choice["token_ids"] = {token.id};
    const nlohmann::json event = {{"id", id},
                                  {"object", "text_completion"},
                                  {"created", created},
                                  {"model", model},
                                  {"choices", {choice}},
                                  {"usage", usage ? *usage : nlohmann::json()}};
    return "data: " + event.dump() + "\n\n";
  }

  // One `data: {json}\n\n` event of a chat stream: the delta of one token, or (no token) the
  // first event's assistant role; usage only where continuous usage was asked for.
  static std::string chat_event(const std::string& id, const std::string& model,
                                std::int64_t created, const Token* token, bool return_token_ids,
                                const std::optional<nlohmann::json>& usage) {
    nlohmann::json choice = {{"index", 0}, {"logprobs", nullptr}};
    if (token) {
      choice["delta"] = {{"content", token_text(token->id)}};
      choice["finish_reason"] = finish_reason(*token);
      choice["stop_reason"] = stop_reason(*token);
      if (return_token_ids) choice["token_ids"] = {token->id};
    } else {
      choice["delta"] = {{"role", "assistant"}, {"content", ""}};
      choice["finish_reason"] = nullptr;
    }
    nlohmann::json event = {{"id", id},
                            {"object", "chat.completion.chunk"},
                            {"created", created},
                            {"model", model},
                            {"choices", {choice}}};
    if (usage) event["usage"] = *usage;
    return "data: " + event.dump() + "\n\n";
  }

  // Serves an admitted request: one JSON answer, or an event stream ending `data: [DONE]`, in the
  // completions or the chat format.
  void respond(Api api, EngineRequestId id, std::shared_ptr<Channel> channel, std::string model,
               std::uint64_t prompt_tokens, const Generation& generation,
               httplib::Response& response) {
    const bool chat = api == Api::chat;
    const std::string response_id = fmt::format("{}-{:016x}", chat ? "chatcmpl" : "cmpl", id);
    const auto created = static_cast<std::int64_t>(unix_seconds());
    // Waits for the next token; nullopt when the server stops.
    auto next_token = [channel]() -> std::optional<std::pair<Token, std::uint64_t>> {
      std::unique_lock lock{channel->mutex};
      channel->changed.wait(lock, [&] { return !channel->tokens.empty() || channel->closed; });
      if (channel->tokens.empty()) return std::nullopt;
      Token token = channel->tokens.front();
      channel->tokens.pop_front();
      return std::pair{token, channel->cached_tokens};
    };
    if (!generation.stream) {
      std::vector<std::uint32_t> ids;
      std::string text;
      std::uint64_t cached = 0;
      Token final_token;
      while (true) {
        auto token = next_token();
        if (!token) {
          send_error(response, {503, "the engine is shutting down", "ServiceUnavailableError"});
          return;
        }
        ids.push_back(token->first.id);
        text += token_text(token->first.id);
        cached = token->second;
        final_token = token->first;
        if (token->first.last) break;
      }
      nlohmann::json choice = {{"index", 0}};
      if (chat) {
        choice["message"] = {{"role", "assistant"}, {"content", text}};
      } else {
        choice["text"] = text;
      }
      choice["logprobs"] = nullptr;
      choice["finish_reason"] = finish_reason(final_token);
      choice["stop_reason"] = stop_reason(final_token);
      if (generation.return_token_ids) choice["token_ids"] = ids;
      nlohmann::json kv_transfer_params;
      {
        std::lock_guard lock{channel->mutex};
        kv_transfer_params = channel->kv_transfer_params;
      }
      response.set_content(nlohmann::json{{"id", response_id},
                                          {"object", chat ? "chat.completion" : "text_completion"},
                                          {"created", created},
                                          {"model", model},
                                          {"choices", {choice}},
                                          {"usage", usage_json(prompt_tokens, ids.size(), cached)},
                                          {"kv_transfer_params", std::move(kv_transfer_params)}}
                               .dump(),
                           "application/json");
      return;
    }
    // vLLM's stream responses have no kv_transfer_params field, so a streamed prefill hop's
    // parameters are not sent (vLLM's proxies send the prefill hop with stream=false).
    auto generated = std::make_shared<std::uint64_t>(0);
    response.set_chunked_content_provider(
        "text/event-stream",
        [chat, next_token, response_id, model, created, generation, prompt_tokens, generated](
            std::size_t, httplib::DataSink& sink) {
          auto token = next_token();
          if (!token) return false;
          const bool first = *generated == 0;
          ++*generated;
          auto usage = [&](std::uint64_t completion) -> std::optional<nlohmann::json> {
            if (!generation.continuous_usage) return std::nullopt;
            return usage_json(prompt_tokens, completion, token->second);
          };
          std::string out;
          if (chat) {
            // vLLM opens a chat stream with the role once the first token is out.
            if (first) out += chat_event(response_id, model, created, nullptr, false, usage(0));
            out += chat_event(response_id, model, created, &token->first,
                              generation.return_token_ids, usage(*generated));
          } else {
            out += completion_event(response_id, model, created, token->first,
                                    generation.return_token_ids, usage(*generated));
          }
          if (token->first.last) {
            if (generation.include_usage) {
              out += "data: " +
                     nlohmann::json{{"id", response_id},
                                    {"object", chat ? "chat.completion.chunk" : "text_completion"},
                                    {"created", created},
                                    {"model", model},
                                    {"choices", nlohmann::json::array()},
                                    {"usage", usage_json(prompt_tokens, *generated, token->second)}}
                         .dump() +
                     "\n\n";
            }
            out += "data: [DONE]\n\n";
          }
          if (!sink.write(out.data(), out.size())) return false;
          if (token->first.last) sink.done();
          return true;
        },
        [this, id](bool success) {
          // The client went away (or a write failed): the engine aborts, as vLLM does.
          if (!success) enqueue(AbortItem{id});
        });
  }

  void serve_completion(const httplib::Request& http_request, httplib::Response& response) {
    const auto body = read_body(http_request);
    if (!body) return send_error(response, body.error());
    auto prompts = read_prompts(body->json);
    if (!prompts) return send_error(response, prompts.error());
    if (prompts->size() != 1) {
      return send_error(response, bad_request("kvr mocker serves one prompt per request"));
    }
    const auto generation = read_generation(body->json, false);
    if (!generation) return send_error(response, generation.error());
    const std::uint64_t prompt_tokens = prompts->front().size();
    auto admitted = submit(std::move(prompts->front()), body->lora, *generation);
    if (!admitted) return send_error(response, admitted.error());
    respond(Api::completions, admitted->first, std::move(admitted->second), model_name(body->lora),
            prompt_tokens, *generation, response);
  }

  void serve_chat(const httplib::Request& http_request, httplib::Response& response) {
    const auto body = read_body(http_request);
    if (!body) return send_error(response, body.error());
    auto prompt = read_chat_prompt(*body);
    if (!prompt) return send_error(response, prompt.error());
    const auto generation = read_generation(body->json, true);
    if (!generation) return send_error(response, generation.error());
    const std::uint64_t prompt_tokens = prompt->size();
    auto admitted = submit(std::move(*prompt), body->lora, *generation);
    if (!admitted) return send_error(response, admitted.error());
    respond(Api::chat, admitted->first, std::move(admitted->second), model_name(body->lora),
            prompt_tokens, *generation, response);
  }

  // One prompt as vLLM's render endpoints give it: the request /inference/v1/generate would take.
  nlohmann::json rendered(std::string request_id, const std::vector<std::uint32_t>& tokens,
                          const RequestBody& request, const Generation& generation) const {
    const nlohmann::json& body = request.json;
    nlohmann::json sampling = {
        {"max_tokens", generation.max_tokens},
        {"min_tokens", generation.sampling.min_tokens},
        {"seed", generation.sampling.seed ? nlohmann::json(*generation.sampling.seed) : nullptr}};
    std::vector<std::uint32_t> stop_ids(generation.sampling.stop_token_ids.begin(),
                                        generation.sampling.stop_token_ids.end());
    std::ranges::sort(stop_ids);
    sampling["stop_token_ids"] = stop_ids;
    for (const char* field : {"temperature", "top_p", "top_k", "min_p", "presence_penalty",
                              "frequency_penalty", "repetition_penalty", "ignore_eos",
                              "skip_special_tokens", "include_stop_str_in_output"}) {
      if (const auto found = body.find(field); found != body.end() && !found->is_null()) {
        sampling[field] = *found;
      }
    }
    if (const auto stop = body.find("stop"); stop != body.end() && !stop->is_null()) {
      sampling["stop"] = stop->is_string() ? nlohmann::json::array({*stop}) : *stop;
    }
    return {{"request_id", std::move(request_id)},
            {"token_ids", tokens},
            {"features", nullptr},
            {"sampling_params", std::move(sampling)},
            {"model", model_name(request.lora)},
            {"stream", generation.stream}};
  }

  void serve_chat_render(const httplib::Request& http_request, httplib::Response& response) {
    ++render_calls.chat_render;
    const auto body = read_body(http_request);
    if (!body) return send_error(response, body.error());
    const auto prompt = read_chat_prompt(*body);
    if (!prompt) return send_error(response, prompt.error());
    const auto generation = read_generation(body->json, true);
    if (!generation) return send_error(response, generation.error());
    response.set_content(rendered(fmt::format("chatcmpl-render-{:016x}", next_render_id++), *prompt,
                                  *body, *generation)
                             .dump(),
                         "application/json");
  }

  void serve_completion_render(const httplib::Request& http_request, httplib::Response& response) {
    ++render_calls.completions_render;
    const auto body = read_body(http_request);
    if (!body) return send_error(response, body.error());
    const auto prompts = read_prompts(body->json);
    if (!prompts) return send_error(response, prompts.error());
    const auto generation = read_generation(body->json, false);
    if (!generation) return send_error(response, generation.error());
    const std::uint64_t render_id = next_render_id++;
    nlohmann::json answer = nlohmann::json::array();
    for (std::size_t i = 0; i < prompts->size(); ++i) {
      answer.push_back(rendered(fmt::format("cmpl-render-{:016x}-{}", render_id, i), (*prompts)[i],
                                *body, *generation));
    }
    response.set_content(answer.dump(), "application/json");
  }

  // vLLM's /tokenize: a text prompt (add_special_tokens defaults to true) or chat messages
  // (through the chat template; add_special_tokens defaults to false).
  void serve_tokenize(const httplib::Request& http_request, httplib::Response& response) {
    ++render_calls.tokenize;
    const auto body = read_body(http_request);
    if (!body) return send_error(response, body.error());
    std::vector<std::uint32_t> ids;
    if (body->json.contains("messages")) {
      auto prompt = read_chat_prompt(*body);
      if (!prompt) return send_error(response, prompt.error());
      ids = std::move(*prompt);
    } else {
      const auto prompt = body->json.find("prompt");
      if (prompt == body->json.end() || !prompt->is_string()) {
        return send_error(response, bad_request("prompt must be a text (or give messages)"));
      }
      const auto add_bos = read_bool(body->json, "add_special_tokens", true);
      if (!add_bos) return send_error(response, add_bos.error());
      auto encoded = encode_prompt_text(prompt->get_ref<const std::string&>(), *add_bos);
      if (!encoded) return send_error(response, encoded.error());
      ids = std::move(*encoded);
    }
    const auto return_strs = read_bool(body->json, "return_token_strs", false);
    if (!return_strs) return send_error(response, return_strs.error());
    nlohmann::json token_strs;
    if (*return_strs) {
      token_strs = nlohmann::json::array();
      for (std::uint32_t id : ids) token_strs.push_back(token_text(id));
    }
    response.set_content(nlohmann::json{{"count", ids.size()},
                                        {"max_model_len", max_model_len()},
                                        {"tokens", ids},
                                        {"token_strs", std::move(token_strs)}}
                             .dump(),
                         "application/json");
  }

  void serve_detokenize(const httplib::Request& http_request, httplib::Response& response) {
    const auto body = read_body(http_request);
    if (!body) return send_error(response, body.error());
    const auto tokens = body->json.find("tokens");
    const auto refuse = [&] {
      send_error(response, bad_request("tokens must be a list of unsigned 32-bit ids"));
    };
    if (tokens == body->json.end() || !tokens->is_array()) return refuse();
    std::vector<std::uint32_t> ids;
    ids.reserve(tokens->size());
    for (const auto& token : *tokens) {
      if (!token.is_number_unsigned() || token.get<std::uint64_t>() > UINT32_MAX) return refuse();
      ids.push_back(token.get<std::uint32_t>());
    }
    response.set_content(
        nlohmann::json{{"prompt", options.tokenizer
                                      ? options.tokenizer->tokenizer().decode(ids, false)
                                      : decode_tokens(ids)}}
            .dump(),
        "application/json");
  }

  std::uint64_t max_model_len() const {
    return std::uint64_t{options.engine.block_size} * options.engine.num_gpu_blocks;
  }

  void install_routes() {
    http.new_task_queue = [threads = options.http_threads] {
      return new httplib::ThreadPool(threads);
    };
    // As vLLM's server (uvicorn on asyncio) does: streamed tokens are small writes, which Nagle's
    // algorithm would hold back.
    http.set_tcp_nodelay(true);
    // uvicorn serves any number of requests on a kept-alive connection (cpp-httplib's default
    // closes it after 5) and closes one idle for 5 s.
    http.set_keep_alive_max_count(std::numeric_limits<std::size_t>::max());
    http.set_keep_alive_timeout(5);
    http.Get("/health",
             [](const httplib::Request&, httplib::Response& response) { response.status = 200; });
    http.Get("/v1/models", [this](const httplib::Request&, httplib::Response& response) {
      const auto created = static_cast<std::int64_t>(unix_seconds());
      auto card = [&](const std::string& id, std::string root, nlohmann::json parent) {
        return nlohmann::json{{"id", id},
                              {"object", "model"},
                              {"created", created},
                              {"owned_by", "vllm"},
                              {"root", std::move(root)},
                              {"parent", std::move(parent)},
                              {"max_model_len", max_model_len()}};
      };
      // vLLM lists the base model, then each adapter with the base as its parent and the
      // adapter's path as its root.
      nlohmann::json data = nlohmann::json::array({card(options.model, options.model, nullptr)});
      for (const std::string& adapter : options.lora_adapters) {
        data.push_back(card(adapter, "/adapters/" + adapter, options.model));
      }
      response.set_content(nlohmann::json{{"object", "list"}, {"data", std::move(data)}}.dump(),
                           "application/json");
    });
    http.Get("/metrics", [this](const httplib::Request&, httplib::Response& response) {
      response.set_content(metrics_text(), "text/plain; version=0.0.4; charset=utf-8");
    });
    auto post = [this](const char* path, auto serve) {
      http.Post(path, [this, serve](const httplib::Request& request, httplib::Response& response) {
        (this->*serve)(request, response);
      });
    };
    post("/v1/completions", &State::serve_completion);
    post("/v1/chat/completions", &State::serve_chat);
    post("/tokenize", &State::serve_tokenize);
    post("/detokenize", &State::serve_detokenize);
    // Without them (--no-render-endpoints) a front door must fall back to /tokenize.
    if (options.render_endpoints) {
      post("/v1/completions/render", &State::serve_completion_render);
      post("/v1/chat/completions/render", &State::serve_chat_render);
    }
  }
};

std::expected<void, std::string> check_lora_adapters(std::string_view model,
                                                     const std::vector<std::string>& adapters) {
  absl::flat_hash_set<std::string_view> seen;
  for (const std::string& name : adapters) {
    if (name.empty()) return std::unexpected("an adapter's name must not be empty");
    // A request naming it could not tell the base model from the adapter.
    if (name == model) {
      return std::unexpected(fmt::format("adapter `{}` has the served model's name", name));
    }
    if (!seen.insert(name).second) {
      return std::unexpected(fmt::format("adapter `{}` is given twice", name));
    }
  }
  return {};
}

std::expected<KvTransferRequest, std::string> read_kv_transfer_params(
    const nlohmann::json& params) {
  if (params.is_null()) return KvTransferRequest{};
  if (!params.is_object()) return std::unexpected("kv_transfer_params must be a JSON object");
  // A field that is absent or null is unset, as vLLM's router sends them on a prefill hop.
  const auto given = [&](const char* field) -> const nlohmann::json* {
    const auto found = params.find(field);
    return found == params.end() || found->is_null() ? nullptr : &*found;
  };
  const auto flag = [&](const char* field) -> std::expected<bool, std::string> {
    const nlohmann::json* value = given(field);
    if (value == nullptr) return false;
    if (!value->is_boolean()) {
      return std::unexpected(fmt::format("kv_transfer_params.{} must be a boolean", field));
    }
    return value->get<bool>();
  };
  for (const char* field : {"remote_engine_id", "remote_request_id", "remote_host"}) {
    if (const nlohmann::json* value = given(field); value != nullptr && !value->is_string()) {
      return std::unexpected(fmt::format("kv_transfer_params.{} must be a string", field));
    }
  }
  for (const char* field : {"remote_port", "tp_size"}) {
    if (const nlohmann::json* value = given(field);
        value != nullptr && !value->is_number_integer()) {
      return std::unexpected(fmt::format("kv_transfer_params.{} must be an integer", field));
    }
  }
  std::uint64_t remote_blocks = 0;
  if (const nlohmann::json* ids = given("remote_block_ids")) {
    // A flat list of block ids, or one list per KV-cache group (vLLM's current form): a group's
    // list covers the prompt's blocks, so the longest bounds the pull.
    const auto block_ids = [](const nlohmann::json& list) {
      return list.is_array() && std::ranges::all_of(list, [](const nlohmann::json& id) {
               return id.is_number_unsigned();
             });
    };
    const bool grouped = ids->is_array() && !ids->empty() && ids->front().is_array();
    const bool valid = grouped ? std::ranges::all_of(*ids, block_ids) : block_ids(*ids);
    if (!valid) {
      return std::unexpected(
          "kv_transfer_params.remote_block_ids must be a list of block ids (or one per KV-cache "
          "group)");
    }
    remote_blocks = ids->size();
    if (grouped) {
      remote_blocks = 0;
      for (const nlohmann::json& group : *ids)
        remote_blocks = std::max(remote_blocks, group.size());
    }
  }
  const auto remote_decode = flag("do_remote_decode");
  if (!remote_decode) return std::unexpected(remote_decode.error());
  const auto remote_prefill = flag("do_remote_prefill");
  if (!remote_prefill) return std::unexpected(remote_prefill.error());
  if (*remote_decode && *remote_prefill) {
    return std::unexpected(
        "kv_transfer_params: do_remote_decode and do_remote_prefill are both true; the simulated "
        "engine serves one hop of a request");
  }
  if (*remote_decode)
    return KvTransferRequest{.kv_transfer = simulation::KvTransfer::remote_decode};
  if (*remote_prefill) {
    return KvTransferRequest{.kv_transfer = simulation::KvTransfer::remote_prefill,
                             .remote_blocks = remote_blocks};
  }
  return KvTransferRequest{};
}

nlohmann::json kv_transfer_answer(const KvTransferSource& source, std::string_view request_id,
                                  std::span<const simulation::BlockIndex> blocks) {
  return {{"do_remote_prefill", true},
          {"do_remote_decode", false},
          {"remote_block_ids", std::vector<simulation::BlockIndex>(blocks.begin(), blocks.end())},
          {"remote_engine_id", source.engine_id},
          {"remote_request_id", request_id},
          {"remote_host", source.host},
          {"remote_port", source.port},
          {"tp_size", 1}};
}

VllmEngineServer::VllmEngineServer(std::unique_ptr<State> state) : state_(std::move(state)) {}

std::expected<std::unique_ptr<VllmEngineServer>, std::string> VllmEngineServer::start(
    VllmEngineOptions options) {
  auto engine = Engine::create(options.engine);
  if (!engine) return std::unexpected(engine.error().message());
  if (options.replay_buffer == 0) return std::unexpected("the replay buffer must hold a batch");
  if (options.http_threads == 0) return std::unexpected("the HTTP server needs a thread");
  if (auto valid = check_lora_adapters(options.model, options.lora_adapters); !valid) {
    return std::unexpected(fmt::format("LoRA adapters: {}", valid.error()));
  }
  auto state = std::make_unique<State>();
  state->options = std::move(options);
  state->engine = std::move(*engine);
  state->hashers.emplace_back(state->options.engine.block_size);
  for (const std::string& adapter : state->options.lora_adapters) {
    state->hashers.emplace_back(state->options.engine.block_size, adapter);
  }
  const VllmEngineOptions& opts = state->options;
  try {
    state->publisher.set(zmq::sockopt::linger, 0);
    state->publisher.set(zmq::sockopt::sndhwm, 100'000);  // vLLM's
    state->publisher.bind(fmt::format("tcp://{}:{}", opts.host, opts.kv_events_port));
    if (opts.replay_port != 0) {
      state->replay_socket.emplace(state->context, zmq::socket_type::router);
      state->replay_socket->set(zmq::sockopt::linger, 0);
      state->replay_socket->bind(fmt::format("tcp://{}:{}", opts.host, opts.replay_port));
    }
  } catch (const zmq::error_t& error) {
    return std::unexpected(fmt::format("cannot bind the KV event sockets on {} (ports {}, {}): {}",
                                       opts.host, opts.kv_events_port, opts.replay_port,
                                       error.what()));
  }
  state->install_routes();
  const int port =
      opts.http_port == 0
          ? state->http.bind_to_any_port(opts.host)
          : (state->http.bind_to_port(opts.host, opts.http_port) ? opts.http_port : -1);
  if (port <= 0) {
    return std::unexpected(
        fmt::format("cannot bind the HTTP server on {}:{}", opts.host, opts.http_port));
  }
  state->http_port = static_cast<std::uint16_t>(port);
  State* raw = state.get();
  state->engine_thread = std::thread{[raw] { raw->run_engine(); }};
  if (state->replay_socket) state->replay_thread = std::thread{[raw] { raw->run_replay(); }};
  state->http_thread = std::thread{[raw] { raw->http.listen_after_bind(); }};
  // httplib's stop() does nothing until the listen loop runs: wait for it.
  // (bounded: a loop that ends at once never shows as running)
  for (const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
       !state->http.is_running() && std::chrono::steady_clock::now() < until;) {
    std::this_thread::yield();
  }
  return std::unique_ptr<VllmEngineServer>(new VllmEngineServer(std::move(state)));
}

VllmEngineServer::~VllmEngineServer() {
  State& state = *state_;
  state.stopping = true;
  state.inbox_signal.notify_all();
  // The engine thread closes every channel as it ends, which frees the HTTP threads.
  if (state.engine_thread.joinable()) state.engine_thread.join();
  state.http.stop();
  if (state.http_thread.joinable()) state.http_thread.join();
  if (state.replay_thread.joinable()) state.replay_thread.join();
}

std::string VllmEngineServer::url() const {
  return fmt::format("http://{}:{}", state_->options.host, state_->http_port);
}

}  // namespace kvr::mocker
