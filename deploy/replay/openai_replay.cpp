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

#include "messages/http_url.hpp"

namespace kvr::replay {
namespace {

namespace beast = boost::beast;
namespace http = beast::http;
namespace net = boost::asio;
using tcp = net::ip::tcp;
using Json = nlohmann::json;
using Clock = std::chrono::steady_clock;

double ms_between(Clock::time_point from, Clock::time_point to) {
  return std::chrono::duration<double, std::milli>(to - from).count();
}

// One base URL, split once.
struct Target {
  std::string host;
  std::string port;
  std::string path;  // ends in /v1
};

class Replay;

// One request: its connection, its streamed answer and what was measured of it.
class Call : public std::enable_shared_from_this<Call> {
 public:
  Call(Replay& replay, std::size_t index, const Target& target, std::string body,
       std::string tenant)
      : replay_(replay),
        index_(index),
        target_(target),
        body_(std::move(body)),
        tenant_(std::move(tenant)),
        stream_(executor_of(replay)),
        resolver_(stream_.get_executor()) {}

  void start(Clock::time_point arrival);

 private:
  static net::any_io_executor executor_of(Replay& replay);
  void fail(std::string why, bool timeout = false);
  void on_bytes(std::string_view bytes);
  void read_body();
  void finish();

  Replay& replay_;
  std::size_t index_;
  const Target& target_;
  std::string body_;
  std::string tenant_;
  beast::tcp_stream stream_;
  tcp::resolver resolver_;
  beast::flat_buffer buffer_;
  http::request<http::string_body> request_;
  std::optional<http::response_parser<http::buffer_body>> parser_;
  std::array<char, 8192> chunk_{};
  std::string pending_;  // SSE bytes not yet split into events
  Clock::time_point arrival_;
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
    for (const std::string& url : options.base_urls) {
      const auto parts = split_http_url(url);
      targets_.push_back(Target{parts->host, parts->port, parts->path});
    }
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
  const OpenAiReplayOptions& options() const { return options_; }

  void completed(std::size_t index, Clock::time_point arrival, Clock::time_point first_token,
                 Clock::time_point last_token, double max_gap_ms, std::uint64_t output_tokens,
                 std::uint64_t cached_tokens, std::optional<std::uint64_t> predicted_cached_tokens,
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
    if (engine_first_byte_ms)
      front_door_added_ms_.push_back(stats.ttft_ms() - *engine_first_byte_ms);
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
    const Target& target = targets_[index % targets_.size()];
    std::make_shared<Call>(*this, index, target, body.dump(), std::move(tenant))
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

net::any_io_executor Call::executor_of(Replay& replay) { return replay.io().get_executor(); }

void Call::start(Clock::time_point arrival) {
  arrival_ = arrival;
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
  stream_.expires_after(replay_.options().request_timeout);
  resolver_.async_resolve(
      target_.host, target_.port,
      [self = shared_from_this()](beast::error_code error, tcp::resolver::results_type found) {
        if (error) return self->fail("cannot resolve: " + error.message());
        self->stream_.async_connect(found, [self](beast::error_code connect_error,
                                                  const tcp::endpoint&) {
          if (connect_error) return self->fail("cannot connect: " + connect_error.message());
          http::async_write(
              self->stream_, self->request_, [self](beast::error_code write_error, std::size_t) {
                if (write_error) {
                  return self->fail("cannot send: " + write_error.message());
                }
                self->parser_.emplace();
                self->parser_->body_limit(std::numeric_limits<std::uint64_t>::max());
                // A fresh buffer reads 512 bytes at a time; a stream's events come in bursts.
                self->buffer_.reserve(16 * 1024);
                http::async_read_header(self->stream_, self->buffer_, *self->parser_,
                                        [self](beast::error_code read_error, std::size_t) {
                                          if (read_error) {
                                            return self->fail("no answer: " + read_error.message(),
                                                              read_error == beast::error::timeout);
                                          }
                                          self->read_body();
                                        });
              });
        });
      });
}

void Call::read_body() {
  auto& body = parser_->get().body();
  body.data = chunk_.data();
  body.size = chunk_.size();
  http::async_read_some(stream_, buffer_, *parser_,
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
  std::size_t end = 0;
  while ((end = pending_.find("\n\n")) != std::string::npos) {
    const std::string event = pending_.substr(0, end);
    pending_.erase(0, end + 2);
    if (!event.starts_with("data: ")) continue;
    const std::string_view data = std::string_view{event}.substr(6);
    if (data == "[DONE]") continue;
    const Json json = Json::parse(data, nullptr, false);
    if (json.is_discarded() || json.contains("error")) {
      done_ = true;
      return replay_.failed(index_, fmt::format("error event: {}", data.substr(0, 200)), 0, false,
                            true);
    }
    if (const auto usage = json.find("usage"); usage != json.end() && usage->is_object()) {
      completion_tokens_ = usage->value("completion_tokens", std::uint64_t{0});
      const Json details = usage->value("prompt_tokens_details", Json());
      if (details.is_object()) cached_tokens_ = details.value("cached_tokens", std::uint64_t{0});
    }
    const Json choices = json.value("choices", Json::array());
    if (choices.empty()) continue;
    const Json& choice = choices[0];
    const Json delta = choice.value("delta", Json::object());
    const bool has_token = (choice.contains("text") && choice["text"].is_string() &&
                            !choice["text"].get_ref<const std::string&>().empty()) ||
                           (delta.contains("content") && delta["content"].is_string() &&
                            !delta["content"].get_ref<const std::string&>().empty());
    if (!has_token) continue;
    const auto now = Clock::now();
    if (!first_token_) {
      first_token_ = now;
    } else {
      max_gap_ms_ = std::max(max_gap_ms_, ms_between(last_token_, now));
    }
    last_token_ = now;
    ++output_events_;
  }
}

void Call::finish() {
  done_ = true;
  beast::error_code ignored;
  stream_.socket().shutdown(tcp::socket::shutdown_both, ignored);
  const unsigned status = parser_->get().result_int();
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
  replay_.completed(index_, arrival_, *first_token_, last_token_, max_gap_ms_,
                    completion_tokens_ != 0 ? completion_tokens_ : output_events_, cached_tokens_,
                    predicted_cached_, engine_first_byte_ms_, worker_);
}

void Call::fail(std::string why, bool timeout) {
  if (done_) return;
  done_ = true;
  beast::error_code ignored;
  stream_.socket().shutdown(tcp::socket::shutdown_both, ignored);
  stream_.close();
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
