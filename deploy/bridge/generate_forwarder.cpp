#include "deploy/bridge/generate_forwarder.hpp"

#include <atomic>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

#include <httplib.h>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "absl/container/flat_hash_map.h"

namespace kvr::bridge {
namespace {

// Bounds of what one request may ask for, as kvr's simulated worker has them.
constexpr std::uint32_t kMaxOutputTokens = 1 << 20;
constexpr std::size_t kMaxPromptTokens = 1 << 22;
// An HTTP error body is quoted in the error chunk up to this length.
constexpr std::size_t kMaxErrorBody = 512;
// nlohmann copies and prints JSON recursively: a value nested deeper than this, from a request or
// the engine, is refused rather than risk a pool thread's stack. vLLM's answers nest about 5 deep.
constexpr int kMaxJsonDepth = 64;
// A non-streaming answer may be this long, plus kAnswerBytesPerPromptToken per prompt token: with
// return_token_ids vLLM echoes the prompt's ids, and kv_transfer_params list its KV blocks.
constexpr std::size_t kMaxAnswerBytes = std::size_t{1} << 20;
constexpr std::size_t kAnswerBytesPerPromptToken = 16;

// Parses JSON no deeper than kMaxJsonDepth; throws nlohmann::json::exception when unreadable, and
// std::nullopt when too deep.
std::optional<nlohmann::json> parse_bounded_json(std::string_view text) {
  bool too_deep = false;
  nlohmann::json json =
      nlohmann::json::parse(text, [&](int depth, nlohmann::json::parse_event_t, nlohmann::json&) {
        too_deep = too_deep || depth > kMaxJsonDepth;
        return !too_deep;
      });
  if (too_deep) return std::nullopt;
  return json;
}

// True when vLLM's kv_transfer_params ask the engine to prefill and keep the KV for a remote
// decode: the prefill hop.
bool asks_remote_decode(const nlohmann::json& params) {
  const auto flag = params.find("do_remote_decode");
  return flag != params.end() && flag->is_boolean() && flag->get<bool>();
}

std::string_view trim_leading_space(std::string_view text) {
  if (!text.empty() && text.front() == ' ') text.remove_prefix(1);
  return text;
}

// The engine's error message from an OpenAI-style error body, else the body itself (truncated).
std::string error_message_of(std::string_view body) {
  try {
    const auto json = nlohmann::json::parse(body);
    if (json.contains("error") && json["error"].is_object()) {
      return json["error"].value("message", json["error"].dump());
    }
    if (json.contains("message") && json["message"].is_string()) {
      return json["message"].get<std::string>();
    }
  } catch (const nlohmann::json::exception&) {
  }
  return std::string{body.substr(0, kMaxErrorBody)};
}

// The request's sampling parameters under vLLM's (and, where it has them, OpenAI's) names; only
// the ones set, so the engine's defaults stay in force for the rest.
void add_sampling_params(const v1::SamplingParams& sampling, nlohmann::json& body) {
  if (sampling.has_temperature()) body["temperature"] = sampling.temperature();
  if (sampling.has_top_p()) body["top_p"] = sampling.top_p();
  if (sampling.has_top_k()) body["top_k"] = sampling.top_k();
  if (sampling.has_min_p()) body["min_p"] = sampling.min_p();
  if (sampling.has_seed()) body["seed"] = sampling.seed();
  if (!sampling.stop().empty()) {
    body["stop"] = std::vector<std::string>(sampling.stop().begin(), sampling.stop().end());
  }
  if (!sampling.stop_token_ids().empty()) {
    body["stop_token_ids"] = std::vector<std::uint32_t>(sampling.stop_token_ids().begin(),
                                                        sampling.stop_token_ids().end());
  }
  if (sampling.has_presence_penalty()) body["presence_penalty"] = sampling.presence_penalty();
  if (sampling.has_frequency_penalty()) body["frequency_penalty"] = sampling.frequency_penalty();
  if (sampling.has_repetition_penalty()) {
    body["repetition_penalty"] = sampling.repetition_penalty();
  }
  if (sampling.has_ignore_eos()) body["ignore_eos"] = sampling.ignore_eos();
  if (sampling.has_min_tokens()) body["min_tokens"] = sampling.min_tokens();
  if (sampling.has_include_stop_str_in_output()) {
    body["include_stop_str_in_output"] = sampling.include_stop_str_in_output();
  }
  if (sampling.has_skip_special_tokens()) {
    body["skip_special_tokens"] = sampling.skip_special_tokens();
  }
}

}  // namespace

CompletionEvent parse_completion_event(std::string_view data) {
  CompletionEvent event;
  if (data == "[DONE]") {
    event.done = true;
    return event;
  }
  try {
    const auto parsed = parse_bounded_json(data);
    if (!parsed) {
      event.error = "the engine's JSON is nested more than 64 deep";
      return event;
    }
    const nlohmann::json& json = *parsed;
    if (!json.is_object()) {
      event.error = "the engine's JSON is not an object";
      return event;
    }
    if (const auto error = json.find("error"); error != json.end() && !error->is_null()) {
      event.error = error->is_object() ? error->value("message", error->dump()) : error->dump();
      return event;
    }
    if (const auto choices = json.find("choices");
        choices != json.end() && choices->is_array() && !choices->empty()) {
      const auto& choice = choices->front();
      event.has_choice = true;
      if (const auto ids = choice.find("token_ids"); ids != choice.end() && ids->is_array()) {
        for (const auto& id : *ids) {
          if (!id.is_number_unsigned() || id.get<std::uint64_t>() > UINT32_MAX) {
            event = CompletionEvent{};
            event.error = "a token id is not an unsigned 32-bit number";
            return event;
          }
          event.token_ids.push_back(id.get<std::uint32_t>());
        }
      }
      if (const auto reason = choice.find("finish_reason");
          reason != choice.end() && reason->is_string()) {
        event.finish_reason = reason->get<std::string>();
      }
    }
    if (const auto usage = json.find("usage"); usage != json.end() && usage->is_object()) {
      if (const auto details = usage->find("prompt_tokens_details");
          details != usage->end() && details->is_object()) {
        if (const auto cached = details->find("cached_tokens");
            cached != details->end() && cached->is_number_unsigned()) {
          event.cached_prompt_tokens = cached->get<std::uint32_t>();
        }
      }
    }
    // vLLM's answer has `"kv_transfer_params": null` when the connector returned none.
    if (const auto params = json.find("kv_transfer_params");
        params != json.end() && params->is_object()) {
      event.kv_transfer_params = params->dump();
    }
  } catch (const nlohmann::json::exception& error) {
    event = CompletionEvent{};
    event.error = std::string{"unreadable JSON from the engine: "} + error.what();
  }
  return event;
}

bool SseReader::feed(std::string_view bytes,
                     const std::function<bool(std::string_view)>& on_event) {
  buffer_.append(bytes);
  std::size_t start = 0;
  while (true) {
    const std::size_t end = buffer_.find('\n', start);
    if (end == std::string::npos) break;
    std::string_view line{buffer_.data() + start, end - start};
    start = end + 1;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.empty()) {
      // A blank line ends the event.
      if (has_data_ && !on_event(data_)) return false;
      data_.clear();
      has_data_ = false;
      continue;
    }
    if (line.starts_with("data:")) {
      if (has_data_) data_.push_back('\n');
      data_.append(trim_leading_space(line.substr(5)));
      has_data_ = true;
      if (data_.size() > max_event_bytes_) return false;
    }
  }
  buffer_.erase(0, start);
  return buffer_.size() <= max_event_bytes_;
}

std::expected<CompletionCall, std::string> completion_call(const v1::GenerateRequest& request,
                                                           std::string_view model) {
  const auto& route = request.route();
  if (!route.has_tokens() || route.tokens().ids().empty()) {
    return std::unexpected("the bridge needs the prompt as token ids");
  }
  if (static_cast<std::size_t>(route.tokens().ids().size()) > kMaxPromptTokens) {
    return std::unexpected("the prompt has more than 4194304 tokens");
  }
  std::uint32_t max_tokens = request.max_output_tokens();
  if (max_tokens == 0 && route.has_expected_output_tokens()) {
    max_tokens = route.expected_output_tokens();
  }
  if (max_tokens == 0 || max_tokens > kMaxOutputTokens) {
    return std::unexpected("max_output_tokens must be in [1, 1048576]");
  }
  std::optional<nlohmann::json> transfer;
  if (!request.kv_transfer_params().empty()) {
    try {
      transfer = parse_bounded_json(request.kv_transfer_params());
      if (!transfer) return std::unexpected("kv_transfer_params: nested more than 64 deep");
    } catch (const nlohmann::json::exception& error) {
      return std::unexpected(std::string{"kv_transfer_params: not valid JSON: "} + error.what());
    }
    if (!transfer->is_object()) return std::unexpected("kv_transfer_params: not a JSON object");
  }
  const bool prefill_hop = transfer && asks_remote_decode(*transfer);
  nlohmann::json body;
  body["model"] = route.cache_namespace().empty() ? std::string{model} : route.cache_namespace();
  body["prompt"] =
      std::vector<std::uint32_t>(route.tokens().ids().begin(), route.tokens().ids().end());
  body["max_tokens"] = max_tokens;
  // vLLM refuses stream_options on a request that does not stream.
  body["stream"] = !prefill_hop;
  if (!prefill_hop) {
    body["stream_options"] = {{"include_usage", true}, {"continuous_usage_stats", true}};
  }
  body["return_token_ids"] = true;
  if (request.has_sampling()) add_sampling_params(request.sampling(), body);
  if (transfer) {
    // The prefill hop generates one token; vLLM refuses a min_tokens above max_tokens, and its own
    // P/D proxy leaves min_tokens to the decode hop.
    if (prefill_hop) body.erase("min_tokens");
    body["kv_transfer_params"] = std::move(*transfer);
  }
  return CompletionCall{.body = body.dump(), .stream = !prefill_hop};
}

namespace {

// One request from submit() to its last chunk.
struct Job {
  v1::GenerateRequest request;
  std::atomic<bool> cancelled{false};
  // The client serving it while its stream is open; guarded by State::jobs_mutex.
  httplib::Client* client = nullptr;
};

}  // namespace

struct GenerateForwarder::State {
  GenerateForwarderOptions options;
  Publish publish;

  mutable std::mutex model_mutex;
  std::string model;

  std::mutex jobs_mutex;
  std::condition_variable jobs_signal;
  std::deque<std::shared_ptr<Job>> queue;
  // Every request not yet ended, queued or streaming, by request id.
  absl::flat_hash_map<std::string, std::shared_ptr<Job>> jobs;
  // Set once by the destructor: streams still open then end with an error, not "cancelled".
  std::atomic<bool> stopping{false};
  std::vector<std::thread> threads;

  std::atomic<std::uint64_t> requests{0};
  std::atomic<std::uint64_t> completed{0};
  std::atomic<std::uint64_t> cancelled{0};
  std::atomic<std::uint64_t> failed{0};
  std::atomic<std::uint64_t> refused{0};

  std::string current_model() const {
    std::lock_guard lock{model_mutex};
    return model;
  }

  v1::GenerateChunk chunk_for(const v1::GenerateRequest& request, std::uint32_t index) const {
    v1::GenerateChunk chunk;
    chunk.set_request_id(request.route().request_id());
    chunk.set_index(index);
    chunk.set_worker_id(options.worker_id);
    chunk.set_dp_rank(request.dp_rank());
    return chunk;
  }

  void publish_end(const v1::GenerateRequest& request, std::uint32_t index, std::string_view reason,
                   std::optional<v1::RouteErrorCode> code = std::nullopt,
                   std::string_view message = {}) {
    v1::GenerateChunk chunk = chunk_for(request, index);
    chunk.set_finished(true);
    chunk.set_finish_reason(std::string{reason});
    if (code) {
      chunk.mutable_error()->set_code(*code);
      chunk.mutable_error()->set_message(std::string{message});
    }
    publish(request.stream_subject(), chunk);
  }

  // The end of a stream whose job was cancelled: by the caller, or by the bridge shutting down.
  void publish_cancelled(const v1::GenerateRequest& request, std::uint32_t index) {
    if (stopping) {
      ++failed;
      publish_end(request, index, "error", v1::ROUTE_ERROR_WORKER_FAILED,
                  "the bridge shut down during the request");
      return;
    }
    ++cancelled;
    publish_end(request, index, "cancelled");
  }

  void refuse(const v1::GenerateRequest& request, v1::RouteErrorCode code,
              std::string_view message) {
    ++refused;
    spdlog::warn("kvr bridge: refused generate '{}': {}", request.route().request_id(), message);
    publish_end(request, 0, "error", code, message);
  }

  // Publishes a non-streaming answer as chunks: the generated tokens, then the last one with the
  // finish reason and the engine's kv_transfer_params. False (and `error` set) when the answer
  // cannot be read or has no finish reason.
  bool publish_answer(const v1::GenerateRequest& request, std::string_view answer,
                      std::uint32_t& next_index, std::optional<std::string>& error) {
    const CompletionEvent event = parse_completion_event(answer);
    if (event.error) {
      error = *event.error;
      return false;
    }
    if (!event.has_choice || !event.finish_reason) {
      error = "the engine's answer has no finish reason";
      return false;
    }
    if (!event.token_ids.empty()) {
      v1::GenerateChunk tokens = chunk_for(request, next_index++);
      for (std::uint32_t token : event.token_ids) tokens.add_token_ids(token);
      tokens.set_cached_prompt_tokens(event.cached_prompt_tokens.value_or(0));
      publish(request.stream_subject(), tokens);
    }
    v1::GenerateChunk last = chunk_for(request, next_index);
    if (next_index == 0) last.set_cached_prompt_tokens(event.cached_prompt_tokens.value_or(0));
    ++next_index;
    last.set_finished(true);
    last.set_finish_reason(*event.finish_reason);
    if (event.kv_transfer_params) last.set_kv_transfer_params(*event.kv_transfer_params);
    ++completed;
    publish(request.stream_subject(), last);
    return true;
  }

  // Serves one request through the engine, streamed or (a prefill hop) as one answer; returns once
  // its last chunk is published.
  void serve(Job& job) {
    const v1::GenerateRequest& request = job.request;
    auto call = completion_call(request, current_model());
    if (!call) {
      refuse(request, v1::ROUTE_ERROR_INVALID_REQUEST, call.error());
      return;
    }
    httplib::Client client{options.engine_url};
    const auto micros = [](std::chrono::milliseconds ms) {
      return static_cast<time_t>(std::chrono::duration_cast<std::chrono::microseconds>(ms).count());
    };
    client.set_connection_timeout(0, micros(options.connect_timeout));
    client.set_read_timeout(0, micros(options.read_timeout));
    {
      std::lock_guard lock{jobs_mutex};
      if (job.cancelled) {
        publish_cancelled(request, 0);
        return;
      }
      job.client = &client;
    }

    std::uint32_t next_index = 0;
    bool finished = false;
    std::optional<std::string> engine_error;
    int status = 0;
    std::string error_body;
    SseReader reader;
    // A non-streaming answer, whole; bounded by the prompt's length (see kMaxAnswerBytes).
    std::string answer;
    const std::size_t max_answer_bytes =
        kMaxAnswerBytes +
        kAnswerBytesPerPromptToken * static_cast<std::size_t>(request.route().tokens().ids_size());
    auto on_event = [&](std::string_view data) {
      const CompletionEvent event = parse_completion_event(data);
      if (event.error) {
        engine_error = *event.error;
        return false;
      }
      if (finished || event.done) return true;
      // A usage-only event (no choice) carries no token; an event with neither tokens nor a
      // finish reason (a keep-alive) neither.
      if (!event.has_choice || (event.token_ids.empty() && !event.finish_reason)) return true;
      v1::GenerateChunk chunk = chunk_for(request, next_index);
      for (std::uint32_t token : event.token_ids) chunk.add_token_ids(token);
      if (next_index == 0) chunk.set_cached_prompt_tokens(event.cached_prompt_tokens.value_or(0));
      if (event.finish_reason) {
        chunk.set_finished(true);
        chunk.set_finish_reason(*event.finish_reason);
        finished = true;
        // Counted before the last chunk is published, as every other end is: whoever sees it
        // sees the counters final.
        ++completed;
      }
      ++next_index;
      publish(request.stream_subject(), chunk);
      return true;
    };

    httplib::Request http;
    http.method = "POST";
    http.path = "/v1/completions";
    http.headers = {{"Accept", call->stream ? "text/event-stream" : "application/json"},
                    {"X-Request-Id", request.route().request_id()}};
    if (options.data_parallel_size > 1) {
      http.headers.emplace("X-data-parallel-rank", std::to_string(request.dp_rank()));
    }
    http.set_header("Content-Type", "application/json");
    http.body = std::move(call->body);
    http.response_handler = [&](const httplib::Response& response) {
      status = response.status;
      return true;
    };
    http.content_receiver = [&](const char* data, std::size_t size, std::uint64_t, std::uint64_t) {
      if (job.cancelled) return false;
      if (status != 200) {
        error_body.append(data, std::min(size, kMaxErrorBody * 4 - error_body.size()));
        return error_body.size() < kMaxErrorBody * 4;
      }
      if (!call->stream) {
        if (answer.size() + size > max_answer_bytes) {
          engine_error =
              "the engine's answer is longer than " + std::to_string(max_answer_bytes) + " bytes";
          return false;
        }
        answer.append(data, size);
        return true;
      }
      if (!reader.feed({data, size}, on_event)) {
        if (!engine_error) engine_error = "the engine sent an unreadable event stream";
        return false;
      }
      return true;
    };
    const httplib::Result result = client.send(http);
    {
      std::lock_guard lock{jobs_mutex};
      job.client = nullptr;
    }

    if (!call->stream && result && status == 200 && !engine_error && !job.cancelled) {
      finished = publish_answer(request, answer, next_index, engine_error);
    }
    if (finished) return;
    if (job.cancelled) {
      publish_cancelled(request, next_index);
      return;
    }
    ++failed;
    std::string message;
    if (engine_error) {
      message = "engine error: " + *engine_error;
    } else if (status != 0 && status != 200) {
      message =
          "engine answered HTTP " + std::to_string(status) + ": " + error_message_of(error_body);
    } else if (!result) {
      message = "engine request failed: " + httplib::to_string(result.error());
    } else {
      message = "the engine ended the stream without a finish reason";
    }
    spdlog::warn("kvr bridge: generate '{}' failed: {}", request.route().request_id(), message);
    publish_end(request, next_index, "error", v1::ROUTE_ERROR_WORKER_FAILED, message);
  }

  void run_thread() {
    while (true) {
      std::shared_ptr<Job> job;
      {
        std::unique_lock lock{jobs_mutex};
        jobs_signal.wait(lock, [&] { return stopping || !queue.empty(); });
        if (queue.empty()) return;
        job = std::move(queue.front());
        queue.pop_front();
      }
      serve(*job);
      std::lock_guard lock{jobs_mutex};
      if (auto found = jobs.find(job->request.route().request_id());
          found != jobs.end() && found->second == job) {
        jobs.erase(found);
      }
    }
  }
};

GenerateForwarder::GenerateForwarder(std::shared_ptr<State> state) : state_(std::move(state)) {}

std::expected<std::unique_ptr<GenerateForwarder>, std::string> GenerateForwarder::start(
    GenerateForwarderOptions options, Publish publish) {
  if (!options.engine_url.starts_with("http://") && !options.engine_url.starts_with("https://")) {
    return std::unexpected("--engine-url must start with http:// or https://");
  }
  if (options.concurrency == 0 || options.concurrency > 4096) {
    return std::unexpected("--max-concurrent-generates must be in [1, 4096]");
  }
  if (options.data_parallel_size == 0) {
    return std::unexpected("--data-parallel-size must be at least 1");
  }
  auto state = std::make_shared<State>();
  state->options = std::move(options);
  state->publish = std::move(publish);
  for (std::uint32_t i = 0; i < state->options.concurrency; ++i) {
    state->threads.emplace_back([raw = state.get()] { raw->run_thread(); });
  }
  return std::unique_ptr<GenerateForwarder>(new GenerateForwarder(std::move(state)));
}

GenerateForwarder::~GenerateForwarder() {
  State& state = *state_;
  {
    std::lock_guard lock{state.jobs_mutex};
    state.stopping = true;
    for (auto& [id, job] : state.jobs) {
      job->cancelled = true;
      if (job->client != nullptr) job->client->stop();
    }
  }
  state.jobs_signal.notify_all();
  // Queued jobs are drained by the threads, each ending with its "cancelled" chunk.
  for (std::thread& thread : state.threads) thread.join();
}

void GenerateForwarder::set_model(std::string model) {
  std::lock_guard lock{state_->model_mutex};
  state_->model = std::move(model);
}

void GenerateForwarder::submit(v1::GenerateRequest request) {
  State& state = *state_;
  ++state.requests;
  if (request.stream_subject().empty()) {
    ++state.refused;
    spdlog::warn("kvr bridge: dropped generate '{}' without a stream subject",
                 request.route().request_id());
    return;
  }
  if (request.dp_rank() >= state.options.data_parallel_size) {
    state.refuse(request, v1::ROUTE_ERROR_INVALID_REQUEST, "dp_rank out of range");
    return;
  }
  if (request.route().request_id().empty()) {
    state.refuse(request, v1::ROUTE_ERROR_INVALID_REQUEST, "request_id is empty");
    return;
  }
  if (state.options.engine == EngineKind::sglang && !request.kv_transfer_params().empty()) {
    state.refuse(request, v1::ROUTE_ERROR_INVALID_REQUEST,
                 "kv_transfer_params: the engine is SGLang, whose prefill/decode exchange "
                 "(bootstrap_host, bootstrap_port, bootstrap_room) the bridge does not speak");
    return;
  }
  auto job = std::make_shared<Job>();
  job->request = std::move(request);
  std::string_view refusal;
  {
    std::lock_guard lock{state.jobs_mutex};
    if (state.stopping) {
      refusal = "the bridge is shutting down";
    } else if (state.queue.size() >= state.options.max_queued) {
      refusal = "too many generate requests waiting for the engine";
    } else if (!state.jobs.try_emplace(job->request.route().request_id(), job).second) {
      refusal = "duplicate request id";
    } else {
      state.queue.push_back(job);
    }
  }
  if (!refusal.empty()) {
    state.refuse(job->request,
                 refusal == "duplicate request id" ? v1::ROUTE_ERROR_INVALID_REQUEST
                                                   : v1::ROUTE_ERROR_WORKER_FAILED,
                 refusal);
    return;
  }
  state.jobs_signal.notify_one();
}

void GenerateForwarder::cancel(const std::string& request_id) {
  std::lock_guard lock{state_->jobs_mutex};
  const auto found = state_->jobs.find(request_id);
  if (found == state_->jobs.end()) return;
  found->second->cancelled = true;
  // Closes the socket under the client's own lock; the stream's read then fails at once.
  if (found->second->client != nullptr) found->second->client->stop();
}

GenerateForwarderStats GenerateForwarder::stats() const {
  return GenerateForwarderStats{.requests = state_->requests.load(),
                                .completed = state_->completed.load(),
                                .cancelled = state_->cancelled.load(),
                                .failed = state_->failed.load(),
                                .refused = state_->refused.load()};
}

}  // namespace kvr::bridge
