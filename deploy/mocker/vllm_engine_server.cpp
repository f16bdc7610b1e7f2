#include "deploy/mocker/vllm_engine_server.hpp"

#include <atomic>
#include <condition_variable>
#include <deque>
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
#include "deploy/simulation/engine.hpp"
#include "deploy/worker/vllm_kv_frames.hpp"
#include "discovery/block_hash.hpp"

namespace kvr::mocker {
namespace {

using Clock = std::chrono::steady_clock;
using simulation::Engine;
using simulation::EngineRequestId;
using simulation::StepResult;

// An odd multiplier: a bijection of 64-bit values, so engine hashes differ from kvr's.
constexpr std::uint64_t kEngineHashMultiplier = 0x9E3779B97F4A7C15ULL;
constexpr std::size_t kMaxPromptTokens = 1 << 22;
constexpr std::uint32_t kMaxOutputTokens = 1 << 20;

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
  bool closed = false;  // the server is stopping
};

struct AddItem {
  EngineRequestId id = 0;
  std::vector<std::uint32_t> tokens;
  std::vector<BlockHash> hashes;
  std::uint32_t max_tokens = 0;
  Sampling sampling;
  std::shared_ptr<Channel> channel;
};
struct AbortItem {
  EngineRequestId id = 0;
};
using InboxItem = std::variant<AddItem, AbortItem>;

// A block's tokens, for the BlockStored events that must carry them.
struct BlockTokens {
  std::vector<std::uint32_t> tokens;
  std::uint32_t live_refs = 0;  // live requests whose prompt has the block
  bool stored = false;          // in the pool as a cached block
};

struct LiveRequest {
  std::shared_ptr<Channel> channel;
  std::vector<BlockHash> hashes;
  std::uint64_t prompt_tokens = 0;
  std::uint64_t generated = 0;
  Sampling sampling;
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

std::string error_body(std::string_view message, std::string_view type, int code) {
  return nlohmann::json{
      {"object", "error"}, {"message", message}, {"type", type}, {"param", nullptr}, {"code", code}}
      .dump();
}

}  // namespace

struct VllmEngineServer::State {
  VllmEngineOptions options;
  std::optional<Engine> engine;
  discovery::BlockHasher hasher{1};
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
  std::deque<InboxItem> inbox;
  bool engine_done = false;  // guarded by inbox_mutex
  std::atomic<EngineRequestId> next_request_id{1};

  // Engine thread only.
  absl::flat_hash_map<EngineRequestId, LiveRequest> live;
  absl::flat_hash_map<BlockHash, BlockTokens> block_tokens;
  std::vector<BlockHash> sweep_candidates;
  std::optional<StepResult> in_flight;

  mutable std::mutex load_mutex;
  LoadSnapshot load;

  double now_ms() const {
    return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
  }

  // False once the engine thread has ended: nobody would answer.
  bool enqueue(InboxItem item) {
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
      packer.pack_array(7);
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
      packer.pack_nil();  // lora_id
      pack_tier(packer, stored->tier);
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
                                      .output_tokens = item.max_tokens};
    if (auto added = engine->add_request(std::move(request), now_ms()); !added) {
      answer(std::string{simulation::as_str(added.error())});
      return;
    }
    const std::uint32_t block_size = options.engine.block_size;
    for (std::size_t i = 0; i < item.hashes.size(); ++i) {
      auto [entry, inserted] = block_tokens.try_emplace(item.hashes[i]);
      if (inserted) {
        entry->second.tokens.assign(
            item.tokens.begin() + static_cast<std::ptrdiff_t>(i * block_size),
            item.tokens.begin() + static_cast<std::ptrdiff_t>((i + 1) * block_size));
      }
      ++entry->second.live_refs;
    }
    live.emplace(item.id, LiveRequest{.channel = item.channel,
                                      .hashes = std::move(item.hashes),
                                      .prompt_tokens = item.tokens.size(),
                                      .sampling = std::move(item.sampling)});
    answer({});
  }

  void abort(EngineRequestId id) {
    auto found = live.find(id);
    if (found == live.end()) return;  // finished meanwhile
    engine->abort_request(id);
    release(found->second);
    live.erase(found);
  }

  // The index-th generated token: a function of the seed when the request has one (the same
  // seed gives the same tokens, as a seeded sampler does), else of the request.
  static std::uint32_t token_for(EngineRequestId id, const Sampling& sampling,
                                 std::uint64_t index) {
    if (sampling.seed) {
      std::uint64_t mixed = static_cast<std::uint64_t>(*sampling.seed) * 0x9E3779B97F4A7C15ULL +
                            (index + 1) * 0xBF58476D1CE4E5B9ULL;
      mixed ^= mixed >> 31;
      mixed *= 0x94D049BB133111EBULL;
      mixed ^= mixed >> 29;
      return static_cast<std::uint32_t>(mixed % 32000);
    }
    return static_cast<std::uint32_t>((id * 7919 + index) % 32000);
  }

  void deliver(StepResult& result) {
    publish_events(result.kv_events);
    absl::flat_hash_map<EngineRequestId, bool> finished;
    for (const auto& done : result.completions) finished[done.id] = true;
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

  std::optional<double> advance(double now) {
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
    std::deque<InboxItem> batch;
    while (!stopping) {
      {
        std::lock_guard lock{inbox_mutex};
        batch.swap(inbox);
      }
      for (InboxItem& item : batch) {
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
    for (InboxItem& item : inbox) {
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

  std::string completion_event(const std::string& id, std::int64_t created, const Token& token,
                               bool return_token_ids, const std::optional<nlohmann::json>& usage) {
    nlohmann::json choice = {{"index", 0},
                             {"text", fmt::format(" t{}", token.id)},
                             {"logprobs", nullptr},
                             {"finish_reason", finish_reason(token)},
                             {"stop_reason", token.stopped ? nlohmann::json(token.id) : nullptr}};
    if (return_token_ids) choice["token_ids"] = {token.id};
    const nlohmann::json event = {{"id", id},
                                  {"object", "text_completion"},
                                  {"created", created},
                                  {"model", options.model},
                                  {"choices", {choice}},
                                  {"usage", usage ? *usage : nlohmann::json()}};
    return "data: " + event.dump() + "\n\n";
  }

  static nlohmann::json usage_json(std::uint64_t prompt, std::uint64_t completion,
                                   std::uint64_t cached) {
    return {{"prompt_tokens", prompt},
            {"total_tokens", prompt + completion},
            {"completion_tokens", completion},
            {"prompt_tokens_details", {{"cached_tokens", cached}}}};
  }

  // The sampling parameters of a completions body, checked for their types as vLLM checks them;
  // seed, stop_token_ids and min_tokens are honoured, the others (temperature, top_p, top_k,
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
      if (!min->is_number_unsigned() || min->get<std::uint64_t>() > kMaxOutputTokens) {
        return std::unexpected("min_tokens must be in [0, 1048576]");
      }
      sampling.min_tokens = min->get<std::uint32_t>();
    }
    return sampling;
  }

  void serve_completion(const httplib::Request& http_request, httplib::Response& response) {
    auto bad = [&](int status, std::string_view message, std::string_view type) {
      response.status = status;
      response.set_content(error_body(message, type, status), "application/json");
    };
    const auto body = nlohmann::json::parse(http_request.body, nullptr, false);
    if (body.is_discarded() || !body.is_object()) {
      bad(400, "the body is not a JSON object", "BadRequestError");
      return;
    }
    if (body.value("model", options.model) != options.model) {
      bad(404, fmt::format("The model `{}` does not exist.", body.value("model", "")),
          "NotFoundError");
      return;
    }
    nlohmann::json prompt = body.value("prompt", nlohmann::json());
    if (prompt.is_array() && prompt.size() == 1 && prompt[0].is_array()) prompt = prompt[0];
    AddItem item;
    if (!prompt.is_array() || prompt.empty() || prompt.size() > kMaxPromptTokens) {
      bad(400, "kvr mocker serves prompts of token ids only (a non-empty list of integers)",
          "BadRequestError");
      return;
    }
    for (const auto& token : prompt) {
      if (!token.is_number_unsigned() || token.get<std::uint64_t>() > UINT32_MAX) {
        bad(400, "a prompt token is not an unsigned 32-bit integer", "BadRequestError");
        return;
      }
      item.tokens.push_back(token.get<std::uint32_t>());
    }
    const auto max_tokens = body.value("max_tokens", nlohmann::json(16));
    if (!max_tokens.is_number_unsigned() || max_tokens.get<std::uint64_t>() == 0 ||
        max_tokens.get<std::uint64_t>() > kMaxOutputTokens) {
      bad(400, "max_tokens must be in [1, 1048576]", "BadRequestError");
      return;
    }
    item.max_tokens = max_tokens.get<std::uint32_t>();
    auto sampling = read_sampling(body);
    if (!sampling) {
      bad(400, sampling.error(), "BadRequestError");
      return;
    }
    item.sampling = std::move(*sampling);
    const bool stream = body.value("stream", false);
    const bool return_token_ids = body.value("return_token_ids", false);
    const auto stream_options = body.value("stream_options", nlohmann::json::object());
    const bool include_usage =
        stream_options.is_object() && stream_options.value("include_usage", false);
    const bool continuous_usage =
        include_usage && stream_options.value("continuous_usage_stats", false);
    item.hashes = hasher.sequence_hashes(item.tokens);
    item.id = next_request_id++;
    item.channel = std::make_shared<Channel>();
    auto channel = item.channel;
    const EngineRequestId id = item.id;
    const std::uint64_t prompt_tokens = item.tokens.size();
    if (!enqueue(std::move(item))) {
      bad(503, "the engine is shutting down", "ServiceUnavailableError");
      return;
    }
    {
      std::unique_lock lock{channel->mutex};
      channel->changed.wait(lock, [&] { return channel->answered || channel->closed; });
      if (channel->closed) {
        bad(503, "the engine is shutting down", "ServiceUnavailableError");
        return;
      }
      if (!channel->refusal.empty()) {
        bad(400, fmt::format("the engine refused the request: {}", channel->refusal),
            "BadRequestError");
        return;
      }
    }
    const std::string completion_id = fmt::format("cmpl-{:016x}", id);
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
    if (!stream) {
      std::vector<std::uint32_t> ids;
      std::string text;
      std::uint64_t cached = 0;
      Token final_token;
      while (true) {
        auto token = next_token();
        if (!token) {
          bad(503, "the engine is shutting down", "ServiceUnavailableError");
          return;
        }
        ids.push_back(token->first.id);
        text += fmt::format(" t{}", token->first.id);
        cached = token->second;
        final_token = token->first;
        if (token->first.last) break;
      }
      nlohmann::json choice = {
          {"index", 0},
          {"text", text},
          {"logprobs", nullptr},
          {"finish_reason", finish_reason(final_token)},
          {"stop_reason", final_token.stopped ? nlohmann::json(final_token.id) : nullptr}};
      if (return_token_ids) choice["token_ids"] = ids;
      response.set_content(nlohmann::json{{"id", completion_id},
                                          {"object", "text_completion"},
                                          {"created", created},
                                          {"model", options.model},
                                          {"choices", {choice}},
                                          {"usage", usage_json(prompt_tokens, ids.size(), cached)}}
                               .dump(),
                           "application/json");
      return;
    }
    auto generated = std::make_shared<std::uint64_t>(0);
    response.set_chunked_content_provider(
        "text/event-stream",
        [this, next_token, completion_id, created, return_token_ids, include_usage,
         continuous_usage, prompt_tokens, generated](std::size_t, httplib::DataSink& sink) {
          auto token = next_token();
          if (!token) return false;
          ++*generated;
          std::optional<nlohmann::json> usage;
          if (continuous_usage) usage = usage_json(prompt_tokens, *generated, token->second);
          std::string out =
              completion_event(completion_id, created, token->first, return_token_ids, usage);
          if (token->first.last) {
            if (include_usage) {
              out += "data: " +
                     nlohmann::json{{"id", completion_id},
                                    {"object", "text_completion"},
                                    {"created", created},
                                    {"model", options.model},
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

  void install_routes() {
    http.new_task_queue = [threads = options.http_threads] {
      return new httplib::ThreadPool(threads);
    };
    http.Get("/health",
             [](const httplib::Request&, httplib::Response& response) { response.status = 200; });
    http.Get("/v1/models", [this](const httplib::Request&, httplib::Response& response) {
      const std::uint64_t max_len =
          std::uint64_t{options.engine.block_size} * options.engine.num_gpu_blocks;
      response.set_content(nlohmann::json{{"object", "list"},
                                          {"data",
                                           {{{"id", options.model},
                                             {"object", "model"},
                                             {"created", static_cast<std::int64_t>(unix_seconds())},
                                             {"owned_by", "vllm"},
                                             {"root", options.model},
                                             {"parent", nullptr},
                                             {"max_model_len", max_len}}}}}
                               .dump(),
                           "application/json");
    });
    http.Get("/metrics", [this](const httplib::Request&, httplib::Response& response) {
      response.set_content(metrics_text(), "text/plain; version=0.0.4; charset=utf-8");
    });
    http.Post("/v1/completions",
              [this](const httplib::Request& request, httplib::Response& response) {
                serve_completion(request, response);
              });
  }
};

VllmEngineServer::VllmEngineServer(std::unique_ptr<State> state) : state_(std::move(state)) {}

std::expected<std::unique_ptr<VllmEngineServer>, std::string> VllmEngineServer::start(
    VllmEngineOptions options) {
  auto engine = Engine::create(options.engine);
  if (!engine) return std::unexpected(engine.error().message());
  if (options.replay_buffer == 0) return std::unexpected("the replay buffer must hold a batch");
  if (options.http_threads == 0) return std::unexpected("the HTTP server needs a thread");
  auto state = std::make_unique<State>();
  state->options = std::move(options);
  state->engine = std::move(*engine);
  state->hasher = discovery::BlockHasher{state->options.engine.block_size};
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
