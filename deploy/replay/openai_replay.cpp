#include "deploy/replay/openai_replay.hpp"

#include <array>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <deque>
#include <limits>
#include <memory>
#include <optional>

#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <simdjson.h>

#include "messages/http_url.hpp"

namespace kvr::replay {
namespace {

namespace beast = boost::beast;
namespace http = beast::http;
namespace net = boost::asio;
using tcp = net::ip::tcp;
using Json = nlohmann::json;
using Clock = std::chrono::steady_clock;

using simulation::ms_between;

// One base URL, split and resolved once (as a client with a DNS cache would).
struct Target {
  std::string host;
  std::string port;
  std::string path;  // ends in /v1
  tcp::resolver::results_type endpoints;
  std::string unresolved;  // why `endpoints` is empty
};

class Replay;

// One request: its connection, its streamed answer and what was measured of it.
class Call : public std::enable_shared_from_this<Call> {
 public:
  Call(Replay& replay, std::size_t index, std::size_t target_index, const Target& target,
       std::string body, std::string tenant)
      : replay_(replay),
        index_(index),
        target_index_(target_index),
        target_(target),
        body_(std::move(body)),
        tenant_(std::move(tenant)) {}

  void start(Clock::time_point arrival);

 private:
  void connect();
  void send();
  // A kept-alive connection the server closed meanwhile fails before any answer byte: the
  // request is sent again on a new connection (what HTTP clients do with idempotent retries).
  bool retry_on_new_connection();
  void fail(std::string why, bool timeout = false);
  void on_bytes(std::string_view bytes);
  struct Usage {
    std::uint64_t completion_tokens = 0;
    std::uint64_t cached_tokens = 0;
  };
  struct Event {
    bool has_token = false;
    std::optional<Usage> usage;
  };
  std::optional<Event> read_event(std::string_view data);
  void read_body();
  void finish();

  Replay& replay_;
  std::size_t index_;
  std::size_t target_index_;
  const Target& target_;
  std::string body_;
  std::string tenant_;
  std::unique_ptr<beast::tcp_stream> stream_;
  bool reused_ = false;  // the connection served an earlier request
  beast::flat_buffer buffer_;
  http::request<http::string_body> request_;
  std::optional<http::response_parser<http::buffer_body>> parser_;
  std::array<char, 8192> chunk_{};
  std::string pending_;  // SSE bytes not yet split into events
  simdjson::ondemand::parser events_parser_;
  Clock::time_point arrival_;
  // When the request was handed to the connection: a late client's own delay (an open-loop
  // arrival it could not keep) is not counted against the node.
  Clock::time_point sent_;
  std::optional<Clock::time_point> first_token_;
  Clock::time_point last_token_;
  double max_gap_ms_ = 0;
  std::uint64_t output_events_ = 0;
  std::uint64_t cached_tokens_ = 0;
  std::uint64_t completion_tokens_ = 0;
  std::string worker_;
  // The node's predicted cached tokens (x-kvr-cached-tokens); none from an engine reached directly.
  std::optional<std::uint64_t> predicted_cached_;
  // The engine's own time to its first byte (the node's Server-Timing "engine"), in ms.
  std::optional<double> engine_first_byte_ms_;
  bool done_ = false;
};

// A metric's duration in a Server-Timing header ("kvr;dur=0.4, engine;dur=12.3"), in ms.
std::optional<double> server_timing_ms(beast::string_view header, std::string_view metric) {
  const std::string value{header.data(), header.size()};
  const std::string key = std::string{metric} + ";dur=";
  for (std::size_t at = value.find(key); at != std::string::npos; at = value.find(key, at + 1)) {
    if (at != 0 && value[at - 1] != ' ' && value[at - 1] != ',') continue;
    const char* start = value.c_str() + at + key.size();
    char* end = nullptr;
    const double ms = std::strtod(start, &end);
    if (end != start && std::isfinite(ms)) return ms;
  }
  return std::nullopt;
}

class Replay {
 public:
  Replay(const OpenAiReplayOptions& options, const std::vector<simulation::TraceRequest>& trace)
      : options_(options), trace_(trace), timer_(io_) {
    tcp::resolver resolver{io_};
    for (const std::string& url : options.base_urls) {
      const auto parts = split_http_url(url);
      beast::error_code error;
      auto endpoints = resolver.resolve(parts->host, parts->port, error);
      targets_.push_back(Target{parts->host, parts->port, parts->path, std::move(endpoints),
                                error ? "cannot resolve: " + error.message() : std::string{}});
    }
    idle_.resize(targets_.size());
  }

  OpenAiReplayResult run() {
    start_ = Clock::now();
    schedule();
    io_.run();
    std::ranges::sort(outcomes_, {}, &simulation::ReplayRequestOutcome::trace_index);
    result_.report = simulation::make_policy_report("openai", trace_.size(), outcomes_,
                                                    std::max<std::size_t>(1, workers_.size()));
    result_.report.failed -= std::min(result_.report.failed, result_.rejected_by_admission);
    if (!front_door_added_ms_.empty()) {
      result_.report.front_door_added_ms = simulation::summarize(std::move(front_door_added_ms_));
    }
    for (const auto& [why, count] : failures_) result_.report.failures.emplace_back(why, count);
    result_.outcomes = std::move(outcomes_);
    return std::move(result_);
  }

  net::io_context& io() { return io_; }

  // Keep-alive connections, per target, as the OpenAI SDKs keep them: a request takes an idle
  // one when there is one, and a finished answer gives its connection back.
  std::unique_ptr<beast::tcp_stream> take_idle(std::size_t target) {
    if (idle_[target].empty()) return nullptr;
    auto stream = std::move(idle_[target].back());
    idle_[target].pop_back();
    return stream;
  }
  void park(std::size_t target, std::unique_ptr<beast::tcp_stream> stream) {
    idle_[target].push_back(std::move(stream));
  }
  const OpenAiReplayOptions& options() const { return options_; }

  void completed(std::size_t index, Clock::time_point arrival, Clock::time_point sent,
                 Clock::time_point first_token, Clock::time_point last_token, double max_gap_ms,
                 std::uint64_t output_tokens, std::uint64_t cached_tokens,
                 std::optional<std::uint64_t> predicted_cached_tokens,
                 std::optional<double> engine_first_byte_ms, const std::string& worker) {
    simulation::RequestStats stats;
    stats.id = index;
    stats.arrival_ms = ms_between(start_, arrival);
    stats.first_token_ms = ms_between(start_, first_token);
    stats.completion_ms = ms_between(start_, last_token);
    stats.prompt_tokens = trace_[index].input_length;
    stats.cached_prompt_tokens = cached_tokens;
    stats.output_tokens = output_tokens;
    stats.max_inter_token_ms = max_gap_ms;
    if (engine_first_byte_ms && index >= options_.warmup) {
      front_door_added_ms_.push_back(ms_between(sent, first_token) - *engine_first_byte_ms);
    }
    const auto [slot, inserted] = workers_.emplace(worker, workers_.size() + 1);
    ++result_.requests_per_worker[worker];
    outcomes_.push_back(
        simulation::ReplayRequestOutcome{.trace_index = index,
                                         .worker = {slot->second, 0},
                                         .stats = stats,
                                         .predicted_cached_tokens = predicted_cached_tokens});
    ended();
  }

  void failed(std::size_t index, const std::string& why, unsigned status, bool timeout,
              bool stream_error) {
    (void)index;
    if (status != 0) ++result_.errors_by_status[status];
    if (status == 429) {
      ++result_.rejected_by_admission;
    } else {
      ++failures_[why.substr(0, 120)];
    }
    if (timeout) ++result_.timed_out;
    if (stream_error) ++result_.stream_errors;
    ended();
  }

 private:
  // Starts every request that is due (within the concurrency cap), then sleeps until the next.
  void schedule() {
    const auto now = Clock::now();
    while (next_ < trace_.size() && in_flight_ < options_.concurrency && due(next_) <= now) {
      if (now - due(next_) > std::chrono::milliseconds(1) &&
          in_flight_ + 1 >= options_.concurrency) {
        ++result_.delayed_by_cap;
      }
      send(next_++);
    }
    if (next_ < trace_.size() && in_flight_ < options_.concurrency) {
      timer_.expires_at(due(next_));
      timer_.async_wait([this](beast::error_code error) {
        if (!error) schedule();
      });
    }
  }

  Clock::time_point due(std::size_t index) const {
    const double ms =
        static_cast<double>(trace_[index].timestamp_ms - trace_.front().timestamp_ms) /
        options_.speedup;
    return start_ + std::chrono::microseconds(static_cast<std::int64_t>(ms * 1000));
  }

  void send(std::size_t index) {
    ++in_flight_;
    const simulation::TraceRequest& request = trace_[index];
    Json body{{"model", options_.model},
              {"max_tokens", std::max<std::uint32_t>(1, request.output_length)},
              {"stream", true},
              {"stream_options", {{"include_usage", true}}}};
    if (options_.api == OpenAiApi::chat) {
      body["messages"] =
          Json::array({Json{{"role", "user"}, {"content", synthesize_prompt_text(request)}}});
    } else {
      body["prompt"] = simulation::synthesize_prompt_tokens(request);
    }
    std::string tenant =
        options_.tenants > 0 ? fmt::format("t{}", index % options_.tenants) : options_.tenant;
    const std::size_t target = index % targets_.size();
    std::make_shared<Call>(*this, index, target, targets_[target], body.dump(), std::move(tenant))
        ->start(options_.measure_from_send ? Clock::now() : std::max(due(index), start_));
  }

  void ended() {
    --in_flight_;
    ++ended_;
    if (options_.on_progress) options_.on_progress(ended_);
    if (ended_ == trace_.size()) {
      timer_.cancel();
      return;
    }
    schedule();
  }

  const OpenAiReplayOptions& options_;
  const std::vector<simulation::TraceRequest>& trace_;
  net::io_context io_;
  net::steady_timer timer_;
  std::vector<Target> targets_;
  std::vector<std::vector<std::unique_ptr<beast::tcp_stream>>> idle_;
  Clock::time_point start_;
  std::size_t next_ = 0;
  std::size_t in_flight_ = 0;
  std::size_t ended_ = 0;
  OpenAiReplayResult result_;
  std::vector<simulation::ReplayRequestOutcome> outcomes_;
  std::map<std::string, std::size_t> workers_;
  std::map<std::string, std::size_t> failures_;
  std::vector<double> front_door_added_ms_;
};

void Call::start(Clock::time_point arrival) {
  arrival_ = arrival;
  sent_ = Clock::now();
  const std::string path =
      target_.path +
      (replay_.options().api == OpenAiApi::chat ? "/chat/completions" : "/completions");
  request_ = http::request<http::string_body>{http::verb::post, path, 11};
  request_.set(http::field::host, target_.host + ":" + target_.port);
  request_.set(http::field::content_type, "application/json");
  request_.set(http::field::accept, "text/event-stream");
  if (!tenant_.empty()) request_.set("x-kvr-tenant", tenant_);
  request_.body() = std::move(body_);
  request_.prepare_payload();
  if ((stream_ = replay_.take_idle(target_index_))) {
    reused_ = true;
    return send();
  }
  connect();
}

void Call::connect() {
  if (!target_.unresolved.empty()) return fail(target_.unresolved);
  stream_ = std::make_unique<beast::tcp_stream>(replay_.io());
  stream_->expires_after(replay_.options().request_timeout);
  stream_->async_connect(target_.endpoints, [self = shared_from_this()](beast::error_code error,
                                                                        const tcp::endpoint&) {
    if (error) return self->fail("cannot connect: " + error.message());
    self->send();
  });
}

void Call::send() {
  stream_->expires_after(replay_.options().request_timeout);
  http::async_write(*stream_, request_,
                    [self = shared_from_this()](beast::error_code error, std::size_t) {
                      if (error) {
                        if (self->retry_on_new_connection()) return;
                        return self->fail("cannot send: " + error.message());
                      }
                      self->parser_.emplace();
                      self->parser_->body_limit(std::numeric_limits<std::uint64_t>::max());
                      // A fresh buffer reads 512 bytes at a time; a stream's events come in bursts.
                      self->buffer_.reserve(16 * 1024);
                      http::async_read_header(
                          *self->stream_, self->buffer_, *self->parser_,
                          [self](beast::error_code read_error, std::size_t) {
                            if (read_error) {
                              if (!self->parser_->got_some() && self->retry_on_new_connection())
                                return;
                              return self->fail("no answer: " + read_error.message(),
                                                read_error == beast::error::timeout);
                            }
                            self->read_body();
                          });
                    });
}

bool Call::retry_on_new_connection() {
  if (!reused_ || done_) return false;
  reused_ = false;
  beast::error_code ignored;
  stream_->socket().close(ignored);
  buffer_.clear();
  connect();
  return true;
}

void Call::read_body() {
  auto& body = parser_->get().body();
  body.data = chunk_.data();
  body.size = chunk_.size();
  http::async_read_some(*stream_, buffer_, *parser_,
                        [self = shared_from_this()](beast::error_code error, std::size_t) {
                          if (error == http::error::need_buffer) error = {};
                          const std::size_t bytes =
                              self->chunk_.size() - self->parser_->get().body().size;
                          if (error) {
                            return self->fail("the answer broke off: " + error.message(),
                                              error == beast::error::timeout);
                          }
                          if (bytes > 0) self->on_bytes({self->chunk_.data(), bytes});
                          if (self->done_) return;
                          if (self->parser_->is_done()) return self->finish();
                          self->read_body();
                        });
}

void Call::on_bytes(std::string_view bytes) {
  const unsigned status = parser_->get().result_int();
  pending_.append(bytes);
  if (status != 200) return;  // gathered for the error message
  if (worker_.empty()) {
    worker_ = std::string{parser_->get()["x-kvr-worker-id"]};
    if (worker_.empty()) worker_ = target_.host + ":" + target_.port;
    const auto predicted = parser_->get()["x-kvr-cached-tokens"];
    std::uint64_t tokens = 0;
    const auto [end_of_number, error] =
        std::from_chars(predicted.data(), predicted.data() + predicted.size(), tokens);
    if (!predicted.empty() && error == std::errc{} &&
        end_of_number == predicted.data() + predicted.size()) {
      predicted_cached_ = tokens;
    }
    engine_first_byte_ms_ = server_timing_ms(parser_->get()["server-timing"], "engine");
  }
  std::size_t begin = 0;
  for (std::size_t end = 0; (end = pending_.find("\n\n", begin)) != std::string::npos;
       begin = end + 2) {
    const std::string_view event = std::string_view{pending_}.substr(begin, end - begin);
    if (!event.starts_with("data: ")) continue;
    const std::string_view data = event.substr(6);
    if (data == "[DONE]") continue;
    const auto read = read_event(data);
    if (!read) {
      done_ = true;
      return replay_.failed(index_, fmt::format("error event: {}", data.substr(0, 200)), 0, false,
                            true);
    }
    if (read->usage) {
      completion_tokens_ = read->usage->completion_tokens;
      cached_tokens_ = read->usage->cached_tokens;
    }
    if (!read->has_token) continue;
    const auto now = Clock::now();
    if (!first_token_) {
      first_token_ = now;
    } else {
      max_gap_ms_ = std::max(max_gap_ms_, ms_between(last_token_, now));
    }
    last_token_ = now;
    ++output_events_;
  }
  pending_.erase(0, begin);
}

// What one streamed event says: a token (a non-empty `text` or `delta.content` in its first
// choice) and the usage; nullopt for an error event or one that is not JSON. simdjson's on-demand
// parser: a client that spends more per event than the node would blur what the node adds.
std::optional<Call::Event> Call::read_event(std::string_view data) {
  namespace ondemand = simdjson::ondemand;
  const simdjson::padded_string padded{data};
  ondemand::document document;
  ondemand::object object;
  if (events_parser_.iterate(padded).get(document) || document.get_object().get(object)) {
    return std::nullopt;
  }
  Event event;
  for (auto field : object) {
    std::string_view key;
    if (field.unescaped_key().get(key)) return std::nullopt;
    ondemand::value value;
    if (field.value().get(value)) return std::nullopt;
    if (key == "error") return std::nullopt;
    if (key == "usage") {
      ondemand::object usage;
      if (value.get_object().get(usage)) continue;  // null before the last event
      Usage read;
      for (auto usage_field : usage) {
        std::string_view name;
        if (usage_field.unescaped_key().get(name)) return std::nullopt;
        ondemand::value usage_value;
        if (usage_field.value().get(usage_value)) return std::nullopt;
        std::uint64_t count = 0;
        ondemand::object details;
        if (name == "completion_tokens" && !usage_value.get_uint64().get(count)) {
          read.completion_tokens = count;
        } else if (name == "prompt_tokens_details" && !usage_value.get_object().get(details) &&
                   !details.find_field_unordered("cached_tokens").get_uint64().get(count)) {
          read.cached_tokens = count;
        }
      }
      event.usage = read;
    } else if (key == "choices") {
      ondemand::object choice;  // the first one only
      if (value.at(0).get_object().get(choice)) continue;
      std::string_view text;
      ondemand::object delta;
      event.has_token =
          (!choice.find_field_unordered("text").get_string().get(text) && !text.empty()) ||
          (!choice.find_field_unordered("delta").get_object().get(delta) &&
           !delta.find_field_unordered("content").get_string().get(text) && !text.empty());
    }
  }
  return event;
}

void Call::finish() {
  done_ = true;
  const unsigned status = parser_->get().result_int();
  if (status == 200 && parser_->keep_alive()) {
    stream_->expires_never();
    replay_.park(target_index_, std::move(stream_));
  } else {
    beast::error_code ignored;
    stream_->socket().shutdown(tcp::socket::shutdown_both, ignored);
  }
  if (status != 200) {
    const Json error = Json::parse(pending_, nullptr, false);
    const std::string message =
        error.is_object() && error.contains("error") && error["error"].is_object()
            ? error["error"].value("message", pending_)
            : pending_.substr(0, 200);
    return replay_.failed(index_, fmt::format("HTTP {}: {}", status, message), status, false,
                          false);
  }
  if (!first_token_) return replay_.failed(index_, "the stream carried no token", 0, false, true);
  replay_.completed(index_, arrival_, sent_, *first_token_, last_token_, max_gap_ms_,
                    completion_tokens_ != 0 ? completion_tokens_ : output_events_, cached_tokens_,
                    predicted_cached_, engine_first_byte_ms_, worker_);
}

void Call::fail(std::string why, bool timeout) {
  if (done_) return;
  done_ = true;
  if (stream_) {
    beast::error_code ignored;
    stream_->socket().shutdown(tcp::socket::shutdown_both, ignored);
    stream_->close();
  }
  replay_.failed(index_, timeout ? "timed out" : why, 0, timeout, false);
}

}  // namespace

std::string synthesize_prompt_text(const simulation::TraceRequest& request) {
  static constexpr std::string_view kAlphabet = "abcdefghijklmnopqrstuvwxyz ";
  std::string text;
  text.reserve(request.input_length);
  for (std::uint32_t i = 0; i < request.input_length; ++i) {
    const std::uint64_t block = request.hash_ids[i / simulation::kMooncakeTraceBlockSize];
    // A cheap mix of the block's hash id and the position in it: equal blocks, equal text.
    std::uint64_t mixed =
        (block + 1) * 0x9E3779B97F4A7C15ULL + (i % simulation::kMooncakeTraceBlockSize);
    mixed ^= mixed >> 29;
    mixed *= 0xBF58476D1CE4E5B9ULL;
    mixed ^= mixed >> 32;
    text += kAlphabet[mixed % kAlphabet.size()];
  }
  return text;
}

OpenAiReplayResult run_openai_replay(const OpenAiReplayOptions& options,
                                     const std::vector<simulation::TraceRequest>& requests) {
  if (requests.empty()) return {};
  return Replay{options, requests}.run();
}

std::string format_openai_summary(const OpenAiReplayResult& result) {
  std::size_t least = SIZE_MAX;
  std::size_t most = 0;
  for (const auto& [worker, count] : result.requests_per_worker) {
    least = std::min(least, count);
    most = std::max(most, count);
  }
  if (least == SIZE_MAX) least = 0;
  std::string text = fmt::format(
      "openai: requests per worker over {} workers named: min {} max {}; timed out {}, stream "
      "errors {}, arrivals held by --concurrency {}; rejected by admission (429): {}\n",
      result.requests_per_worker.size(), least, most, result.timed_out, result.stream_errors,
      result.delayed_by_cap, result.rejected_by_admission);
  if (const auto& added = result.report.front_door_added_ms) {
    text += fmt::format(
        "openai: time to first token the front door added (the client's less the engine's own, "
        "from Server-Timing): p50 {:.3f} ms, p90 {:.3f} ms, p99 {:.3f} ms\n",
        added->p50, added->p90, added->p99);
  }
  if (!result.errors_by_status.empty()) {
    std::vector<std::string> statuses;
    for (const auto& [status, count] : result.errors_by_status) {
      statuses.push_back(fmt::format("{} x{}", status, count));
    }
    text += fmt::format("openai: error answers: {}\n", fmt::join(statuses, ", "));
  }
  return text;
}

}  // namespace kvr::replay
