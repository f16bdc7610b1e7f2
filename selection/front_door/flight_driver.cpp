#include "selection/front_door/flight_driver.hpp"

#include <algorithm>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "messages/http_url.hpp"
#include "messages/metrics/node_metrics.hpp"
#include "selection/front_door/front_door_state.hpp"

namespace kvr::front_door {
namespace {

namespace beast = boost::beast;
namespace http = beast::http;
namespace net = boost::asio;

// Output tokens when the request names none: OpenAI's default for completions; a chat, which
// OpenAI lets run to the end of the context, gets a bound.
constexpr std::uint32_t kDefaultCompletionTokens = 16;
constexpr std::uint32_t kDefaultChatTokens = 256;

std::string header_text(beast::string_view view) { return {view.data(), view.size()}; }

// True when prefill and decode workers serve the model and no aggregated worker does.
bool disaggregated(const ModelTarget& target) {
  const auto has = [&](WorkerType role) {
    return std::ranges::any_of(target.workers,
                               [&](const DirectoryWorker& worker) { return worker.role == role; });
  };
  return !has(WorkerType::Aggregated) && has(WorkerType::Decode);
}

// The usage event ends a stream (when the client asked for it): 4 KiB hold it whole.
void keep_stream_tail(std::string& tail, std::string_view bytes) {
  constexpr std::size_t kTail = 4096;
  if (bytes.size() >= kTail) {
    tail.assign(bytes.substr(bytes.size() - kTail));
    return;
  }
  tail.append(bytes);
  if (tail.size() > 2 * kTail) tail.erase(0, tail.size() - kTail);
}

}  // namespace

// A callback, on any thread, that hands its value to `handle` on the connection's strand while
// the connection lives (a value for an older flight is then ignored by `epoch`).
template <typename Value>
std::function<void(Value)> FlightDriver::on_strand(void (FlightDriver::*handle)(std::uint64_t,
                                                                                Value)) {
  return [this, weak = client_.weak_hold(), epoch = epoch_, handle](Value value) {
    if (auto hold = weak.lock()) {
      server_.post(executor_, [this, hold, epoch, handle, value = std::move(value)]() mutable {
        (this->*handle)(epoch, std::move(value));
      });
    }
  };
}

void FlightDriver::start(Endpoint endpoint, http::request<http::string_body> request,
                         std::string request_id, std::chrono::steady_clock::time_point received) {
  request_id_ = std::move(request_id);
  const std::string_view path = path_of(endpoint);
  auto parsed = parse_generation_request(endpoint, request.body(), server_.renderer.text_use(),
                                         server_.options.max_json_depth);
  if (!parsed) return client_.respond_error(path, parsed.error());
  auto metadata = read_request_metadata(
      [&request](std::string_view name) -> std::string_view {
        const auto found = request.find(beast::string_view{name.data(), name.size()});
        if (found == request.end()) return {};
        return {found->value().data(), found->value().size()};
      },
      server_.options.session_header);
  if (!metadata) return client_.respond_error(path, metadata.error());
  const ModelTarget target = server_.directory->target(parsed->model);
  if (target.workers.empty()) {
    return client_.respond_error(
        path, HttpError{.status = 404,
                        .message = fmt::format("The model `{}` does not exist (no live worker "
                                               "serves it).",
                                               quote_for_error(parsed->model)),
                        .type = "invalid_request_error",
                        .code = "model_not_found",
                        .param = "model"});
  }
  std::vector<std::string> engine_urls;
  for (const auto& worker : target.workers) {
    if (!worker.http_url.empty()) engine_urls.push_back(worker.http_url);
  }
  std::shared_ptr<const tokenizer::PromptTokenizer> tokenizer;
  // Through kvr's generate API (token ids in, token ids out) when nothing can be forwarded to,
  // or when prefill and decode workers serve the model (the node runs both hops): the node's
  // tokenizer turns the ids into the answer.
  const bool two_hops = disaggregated(target);
  if (two_hops || engine_urls.empty()) {
    // kvr's generate API runs one sequence a request: more choices would be silently lost.
    const std::uint64_t choices = parsed->choices.value_or(1);
    if (choices == 0) {
      return client_.respond_error(path, bad_request("n: a positive integer is required", "n"));
    }
    if (choices > 1) {
      return client_.respond_error(
          path, bad_request(fmt::format("n: {} choices were asked for; `{}` is served through "
                                        "kvr's generate API, which answers one choice a "
                                        "request (send n requests, or n: 1)",
                                        choices, quote_for_error(parsed->model)),
                            "n"));
    }
    tokenizer = server_.renderer.native_tokenizer(parsed->model);
    if (!tokenizer) {
      const std::string why =
          two_hops ? fmt::format(
                         "`{}` is served by prefill and decode workers, whose two hops "
                         "run through kvr's generate API",
                         parsed->model)
                   : fmt::format("no worker of `{}` registered an HTTP URL to forward to",
                                 parsed->model);
      return client_.respond_error(
          path, HttpError{.status = 503,
                          .message = fmt::format(
                              "{0}, and the node has no tokenizer for `{1}` to serve it through "
                              "kvr's generate API (token ids in, token ids out): give the node one "
                              "(--tokenizer {1}=DIR, or `tokenizers` in the router-policy YAML){2}",
                              why, parsed->model,
                              two_hops ? "" : ", or run the engines behind `kvr bridge`"),
                          .code = "service_unavailable"});
    }
  }
  flight_.emplace();
  flight_->tokenizer = std::move(tokenizer);
  flight_->endpoint = endpoint;
  flight_->endpoint_path = std::string{path};
  // The node's part starts with the whole body (how fast it comes is the client's part), so
  // parsing it is the node's.
  flight_->received = received;
  flight_->body = std::move(request.body());
  flight_->request = std::move(*parsed);
  flight_->metadata = std::move(*metadata);
  if (const auto found = request.find(http::field::authorization); found != request.end()) {
    flight_->authorization = header_text(found->value());
  }
  if (const auto found = request.find(http::field::accept); found != request.end()) {
    flight_->accept = header_text(found->value());
  }
  server_.in_flight.fetch_add(1);
  server_.in_flight_gauge.set(static_cast<double>(server_.in_flight.load()));
  client_.watch_client();
  const std::uint64_t epoch = ++epoch_;
  server_.renderer.render(
      executor_, flight_->request, flight_->body, std::move(engine_urls),
      [this, hold = client_.hold(), epoch](RenderResult key) {
        if (epoch != epoch_ || !flight_) return;
        if (!key) return fail_flight(key.error(), {});
        flight_->key = std::move(*key);
        route();
      },
      client_address_);
}

void FlightDriver::route() {
  Flight& flight = *flight_;
  if (flight.tokenizer) return generate();
  flight.core.emplace(request_id_, flight.key.tokens.size(),
                      FlightOptions{.max_retries = server_.options.max_retries,
                                    .first_token_timeout = server_.options.first_byte_timeout,
                                    .stall_timeout = server_.options.stall_timeout});
  carry_out(flight.core->start(std::chrono::steady_clock::now()));
}

// Asks the node for a worker, excluding those that failed the request (each attempt is booked
// under its own id: the request's, then `<id>.<retry>`).
void FlightDriver::request_route(const FlightRouteRequest& route) {
  Flight& flight = *flight_;
  // Only workers whose engines the node can forward to (for an adapter: that serve it).
  const ModelTarget target = server_.directory->target(flight.request.model);
  std::vector<WorkerId> eligible;
  for (const auto& worker : target.workers) {
    if (!worker.http_url.empty()) eligible.push_back(worker.worker_id);
  }
  if (eligible.empty()) {
    return fail_flight(HttpError{.status = 503,
                                 .message = fmt::format("no live engine serves `{}` any more",
                                                        flight.request.model),
                                 .code = "service_unavailable"},
                       {});
  }
  const std::uint32_t retry = flight.core->retries();
  v1::RouteRequest request =
      make_route_request(retry == 0 ? request_id_ : fmt::format("{}.{}", request_id_, retry),
                         flight.request, flight.metadata, target, eligible, flight.key);
  request.mutable_excluded_workers()->Add(route.excluded.begin(), route.excluded.end());
  // The decision holds the connection only weakly, and the connection holds itself while it
  // waits (until the decision or the end of its flight): a connection that is gone (its client
  // left, or the front door stopped while its actors still decided) is not kept alive by the
  // actors beyond its io_context; its booking is then ended here.
  routing_ = client_.hold();
  server_.gateway->route(
      std::move(request), [this, weak = client_.weak_hold(), epoch = epoch_,
                           gateway = server_.gateway](v1::RouteDecision decision) {
        if (auto hold = weak.lock()) {
          server_.post(executor_, [this, hold, epoch, decision = std::move(decision)]() mutable {
            on_decision(epoch, std::move(decision));
          });
        } else if (decision.has_success()) {
          report_booking(*gateway, decision.success().booking_id(), v1::LIFECYCLE_EVENT_ABORTED,
                         v1::ABORT_CAUSE_CLIENT_CANCELLED, "the client went away");
        }
      });
}

void FlightDriver::on_decision(std::uint64_t epoch, v1::RouteDecision decision) {
  if (epoch != epoch_ || !flight_) {
    // The client went away while the request was routed: release what was booked for it.
    if (decision.has_success()) {
      report(decision.success().booking_id(), v1::LIFECYCLE_EVENT_ABORTED,
             v1::ABORT_CAUSE_CLIENT_CANCELLED, "the client went away");
    }
    return;
  }
  routing_.reset();  // decided: the posted handler holds the connection now
  Flight& flight = *flight_;
  const auto now = std::chrono::steady_clock::now();
  if (decision.has_error()) {
    HttpError error = error_for_route(decision.error());
    if (flight.core->retries() > 0 && (decision.error().code() == v1::ROUTE_ERROR_NO_WORKERS ||
                                       decision.error().code() == v1::ROUTE_ERROR_ALL_FILTERED)) {
      error = HttpError{.status = 502,
                        .message =
                            "the engine failed and no other worker can serve the "
                            "request: " +
                            decision.error().message(),
                        .code = "worker_failed"};
    }
    return carry_out(flight.core->route_failed(Error::unavailable, error.message, now), &error);
  }
  const v1::RouteSuccess& success = decision.success();
  flight.booking_id = success.booking_id();
  flight.worker_id = success.worker_id();
  flight.worker_url = success.worker_http_url();
  flight.first_byte = false;
  std::uint32_t block_size = 0;
  for (const auto& worker : server_.directory->target(flight.request.model).workers) {
    if (worker.worker_id == success.worker_id()) block_size = worker.block_size;
  }
  flight.predicted_cached_tokens = std::uint64_t{success.device_overlap_blocks()} * block_size;
  // A worker without a URL (it re-registered meanwhile) fails at forward(), as an unreachable
  // one.
  carry_out(
      flight.core->routed(FlightRoute{.worker = {success.worker_id(), success.dp_rank()},
                                      .predicted_cached_tokens = flight.predicted_cached_tokens},
                          now));
}

// Carries out what the core decided; `failure`: the answer a request it ends gets (the core's
// own words otherwise), `why`: what its booking's release reports.
void FlightDriver::carry_out(FlightResult result, const HttpError* failure, std::string_view why) {
  if (!result) return;  // an input the core refused (a late one) changes nothing
  FlightStep& step = *result;
  Flight& flight = *flight_;
  std::string timeout;
  if (step.timed_out) {
    const bool first = step.timed_out == FlightTimeout::first_token;
    timeout =
        first
            ? fmt::format("no first byte within {} ms", server_.options.first_byte_timeout.count())
            : fmt::format("the answer stalled for {} ms", server_.options.stall_timeout.count());
    server_.metrics->add(kEngineFailures, {{"phase", first ? "first_byte" : "answer"}});
    spdlog::warn("front door: request {}: worker {} ({}): {}", request_id_, flight.worker_id,
                 flight.worker_url, timeout);
    end_attempt();
    why = timeout;
  }
  if (step.first_token) report(flight.booking_id, v1::LIFECYCLE_EVENT_FIRST_TOKEN);
  if (step.release) report_release(*step.release, why);
  if (step.end_stream) {
    return fail_flight(
        failure != nullptr ? *failure : error_for(*step.end_stream, step.timed_out, why), {});
  }
  if (step.route) {
    if (step.route->retry) {
      server_.metrics->add(kRetries);
      ++epoch_;  // the failed attempt's late handlers do nothing
    }
    return request_route(*step.route);
  }
  if (step.dispatch) {
    flight.runs = 0;
    forward();
  }
  arm_deadline();
}

// One timer for the core's deadline (first byte, stall): re-armed only for an earlier one; a
// deadline that moved later (bytes kept coming) is found when the timer wakes.
void FlightDriver::arm_deadline() {
  if (!flight_ || !flight_->core) return;
  Flight& flight = *flight_;
  const auto due = flight.core->deadline();
  if (!due || (flight.deadline_at && *flight.deadline_at <= *due)) return;
  flight.deadline_at = *due;
  deadline_.expires_at(*due);
  deadline_.async_wait([this, hold = client_.hold()](beast::error_code error) {
    if (error || !flight_ || !flight_->core) return;
    flight_->deadline_at.reset();
    carry_out(flight_->core->tick(std::chrono::steady_clock::now()));
  });
}

// The answer of a request the core ended: a timeout in the front door's words, else the core's.
HttpError FlightDriver::error_for(const StreamEnd& end, std::optional<FlightTimeout> timed_out,
                                  std::string_view timeout) const {
  const bool first_byte = timed_out == FlightTimeout::first_token;
  return HttpError{.status = first_byte ? 504u : 502u,
                   .message = fmt::format("worker {} failed: {}", flight_->worker_id,
                                          timed_out ? timeout : std::string_view{end.message}),
                   .code = first_byte ? "timeout" : "worker_failed"};
}

// Reports the end of the attempt's booking. An engine's refusal (a 4xx answer, relayed as it
// is) blames nobody; a failure names its cause.
void FlightDriver::report_release(const BookingChange& release, std::string_view why,
                                  v1::AbortCause otherwise) {
  Flight& flight = *flight_;
  if (release.end == discovery::BookingEnd::completed) {
    if (flight.answer_status == 200) {
      report(flight.booking_id, v1::LIFECYCLE_EVENT_COMPLETED);
    } else {
      report(flight.booking_id, v1::LIFECYCLE_EVENT_ABORTED, v1::ABORT_CAUSE_UNSPECIFIED,
             fmt::format("the engine answered {}", flight.answer_status));
    }
  } else {
    v1::AbortCause cause = otherwise;
    if (release.end == discovery::BookingEnd::cancelled) {
      cause = v1::ABORT_CAUSE_CLIENT_CANCELLED;
    } else if (release.health && release.health->failure) {
      switch (*release.health->failure) {
        case FailureCause::first_token_timeout:
          cause = v1::ABORT_CAUSE_FIRST_TOKEN_TIMEOUT;
          break;
        case FailureCause::stream_timeout:
          cause = v1::ABORT_CAUSE_STREAM_TIMEOUT;
          break;
        case FailureCause::dispatch_failed:
        case FailureCause::worker_failed:
          cause = v1::ABORT_CAUSE_WORKER_FAILED;
          break;
      }
    }
    report(flight.booking_id, v1::LIFECYCLE_EVENT_ABORTED, cause, std::string{why});
  }
  flight.booking_id.clear();
}

// The attempt is over: its engine connection closes, and the request's body is taken back from
// it for a retry (a request is retried only before its first byte, when the body is still
// whole).
void FlightDriver::end_attempt() {
  if (relay_) {
    if (auto body = relay_->take_body()) flight_->body = std::move(*body);
  }
  close_engine();
}

// ---- through the node's generate API ------------------------------------------------------------
// The node routes, dispatches to the worker over NATS, retries a worker failure before the first
// token and ends the booking; the front door turns the chunks into OpenAI's answer.

void FlightDriver::generate() {
  Flight& flight = *flight_;
  const ModelTarget target = server_.directory->target(flight.request.model);
  std::vector<WorkerId> eligible;
  const bool two_hops = disaggregated(target);
  for (const auto& worker : target.workers) {
    // A disaggregated model's workers are all reached over NATS, HTTP URL or not.
    if (worker.http_url.empty() || two_hops) eligible.push_back(worker.worker_id);
  }
  if (eligible.empty() || flight.key.tokens.empty()) {
    return fail_flight(HttpError{.status = 503,
                                 .message = fmt::format("no live worker serves `{}` any more",
                                                        flight.request.model),
                                 .code = "service_unavailable"},
                       {});
  }
  v1::GenerateRequest request;
  *request.mutable_route() = make_route_request(request_id_, flight.request, flight.metadata,
                                                target, eligible, flight.key);
  request.set_max_output_tokens(flight.request.max_tokens.value_or(
      flight.endpoint == Endpoint::completions ? kDefaultCompletionTokens : kDefaultChatTokens));
  *request.mutable_sampling() = flight.request.sampling;
  const auto now = std::chrono::system_clock::now().time_since_epoch();
  flight.generated.emplace(flight.request, flight.tokenizer->tokenizer(), request_id_,
                           flight.key.tokens.size(),
                           std::chrono::duration_cast<std::chrono::seconds>(now).count());
  flight.answer_type = "text/event-stream";
  flight.generation = server_.gateway->generate(
      std::move(request),
      GenerateCallbacks{.decision = on_strand(&FlightDriver::on_generate_decision),
                        .chunk = on_strand(&FlightDriver::on_generate_chunk)});
}

void FlightDriver::on_generate_decision(std::uint64_t epoch, v1::RouteDecision decision) {
  if (epoch != epoch_ || !flight_) return;
  Flight& flight = *flight_;
  if (decision.has_error()) {
    flight.generation.reset();  // nothing to cancel: it ended with its decision
    return fail_flight(error_for_route(decision.error()), {});
  }
  const v1::RouteSuccess& success = decision.success();
  flight.worker_id = success.worker_id();
  std::uint32_t block_size = 0;
  for (const auto& worker : server_.directory->target(flight.request.model).workers) {
    if (worker.worker_id == success.worker_id()) block_size = worker.block_size;
  }
  flight.predicted_cached_tokens = std::uint64_t{success.device_overlap_blocks()} * block_size;
  server_.added_latency.observe(
      std::chrono::duration<double>(std::chrono::steady_clock::now() - flight.received).count());
}

void FlightDriver::on_generate_chunk(std::uint64_t epoch, v1::GenerateChunk chunk) {
  if (epoch != epoch_ || !flight_) return;
  Flight& flight = *flight_;
  GeneratedAnswer& answer = *flight.generated;
  // A retry moved the request to another worker: the answer's worker is the chunk's.
  if (chunk.worker_id() != 0) flight.worker_id = chunk.worker_id();
  if (auto failure = answer.failure(chunk)) {
    flight.generation.reset();  // the node ended it
    return fail_flight(*failure, {});
  }
  std::string events = answer.take(chunk);
  if (!flight.request.stream) {
    if (!answer.finished()) return;
    flight.generation.reset();
    std::string whole = answer.whole();
    auto headers = kvr_headers();
    const std::string endpoint = flight.endpoint_path;
    end_flight();
    return client_.respond(endpoint, 200, std::move(whole), "application/json", std::move(headers));
  }
  if (answer.finished()) flight.generation.reset();
  flight.events += events;
  flight.events_end = answer.finished();
  if (flight.events.size() > server_.options.max_pending_stream_bytes) {
    // Nothing holds the worker back while the client does not read: the generation ends
    // here rather than in the node's memory. The client, not reading, cannot be told.
    server_.streams_overflowed.add();
    server_.client_log.warn(
        "overflow", fmt::format("front door: request {}: the client lags more than {} bytes "
                                "behind its stream; its generation is cancelled",
                                request_id_, server_.options.max_pending_stream_bytes));
    end_flight();
    return client_.close();
  }
  write_events();
}

// Writes the events gathered while the last write was under way, in one chunk.
void FlightDriver::write_events() {
  Flight& flight = *flight_;
  if (client_.writing() || flight.events.empty()) return;
  const bool last = flight.events_end;
  auto events = std::make_shared<std::string>(std::move(flight.events));
  flight.events.clear();
  const net::const_buffer bytes = net::buffer(*events);
  send_chunk(bytes, std::move(events), last, &FlightDriver::write_events);
}

// ---- forwarding to the engine -------------------------------------------------------------------

void FlightDriver::forward() {
  Flight& flight = *flight_;
  const auto url = split_http_url(flight.worker_url);
  if (!url || url->https) {
    return engine_failed(fmt::format("cannot reach '{}' (the front door forwards over http:// "
                                     "only)",
                                     flight.worker_url),
                         std::nullopt);  // unreachable here: not the worker's fault
  }
  // The relay reports to this driver while the connection lives (an alias of its ownership).
  std::weak_ptr<EngineSink> sink = std::shared_ptr<EngineSink>(client_.hold(), this);
  relay_ =
      std::make_shared<EngineRelay>(executor_,
                                    EngineRelayPool{.connections = &server_.engine_connections,
                                                    .opened = server_.engine_connection_new,
                                                    .reused = server_.engine_connection_reused,
                                                    .resent = server_.engine_connection_resent},
                                    std::move(sink),
                                    EngineRequest{.host = url->host,
                                                  .port = url->port,
                                                  .target = url->path + flight.endpoint_path,
                                                  .request_id = request_id_,
                                                  .accept = flight.accept,
                                                  .authorization = flight.authorization,
                                                  .body = std::move(flight.body)});
  // The node's part ends here: connecting and sending are what a client reaching the engine
  // directly pays as well, so they count as the engine's.
  flight.forwarded = std::chrono::steady_clock::now();
  server_.added_latency.observe(
      std::chrono::duration<double>(flight.forwarded - flight.received).count());
  relay_->send();
}

// Keeps the engine connection for the next request when its answer ended cleanly and the engine
// keeps it alive; otherwise it is closed with the attempt.
void FlightDriver::park_engine() {
  if (relay_ && relay_->park()) relay_.reset();
}

void FlightDriver::engine_header(unsigned status, std::string content_type) {
  Flight& flight = *flight_;
  flight.answer_status = status;
  flight.answer_type = std::move(content_type);
  if (flight.answer_status >= 500) {
    return engine_failed(fmt::format("the engine answered {}", flight.answer_status),
                         FailureCause::worker_failed);
  }
  flight.streaming =
      flight.answer_status == 200 && flight.answer_type.starts_with("text/event-stream");
  read_engine_body();
}

// Held here as well: the relay's report may end the attempt (and drop relay_) before it returns.
void FlightDriver::read_engine_body() {
  const std::shared_ptr<EngineRelay> relay = relay_;
  relay->read_body();
}

void FlightDriver::engine_bytes(std::string_view bytes, bool done) {
  Flight& flight = *flight_;
  const auto now = std::chrono::steady_clock::now();
  bool first = false;
  if (!bytes.empty() && !flight.first_byte) {
    first = true;
    flight.first_byte = true;
    flight.engine_first_byte = now;
    server_.engine_first_byte.observe(
        std::chrono::duration<double>(now - flight.forwarded).count());
    // No retry after the first byte: a long stream keeps neither its prompt nor its body.
    relay_->drop_request();
    flight.key = {};
  }
  if (!flight.streaming) {
    if (first) carry_out(flight.core->on_chunk(engine_run(false), now));
    if (flight.answer.size() + bytes.size() > server_.options.max_response_bytes) {
      return engine_failed(fmt::format("the engine's answer is larger than {} bytes",
                                       server_.options.max_response_bytes),
                           FailureCause::worker_failed);
    }
    flight.answer.append(bytes);
    if (!done) return read_engine_body();
    return finish_whole_answer();
  }
  if (bytes.empty()) return finish_stream();  // done: nothing decoded means nothing is left
  keep_stream_tail(flight.stream_tail, bytes);
  // Written straight from the relay's buffer, which nothing refills before the write completes.
  send_chunk(net::buffer(bytes.data(), bytes.size()), relay_, done,
             &FlightDriver::read_engine_body);
  // After the write went out: the first token's report wakes an actor thread, which must not
  // delay the client's first token (the end is fed when the last write completed).
  carry_out(flight.core->on_chunk(engine_run(false), now));
}

// The next run of the engine's answer bytes, as the core counts a worker's chunks.
StreamChunk FlightDriver::engine_run(bool last) {
  Flight& flight = *flight_;
  return StreamChunk{.worker = *flight.core->worker(), .index = flight.runs++, .finished = last};
}

AnswerHeaders FlightDriver::kvr_headers() const {
  const Flight& flight = *flight_;
  AnswerHeaders headers{{"x-kvr-request-id", request_id_},
                        {"x-kvr-worker-id", std::to_string(flight.worker_id)},
                        {"x-kvr-cached-tokens", std::to_string(flight.predicted_cached_tokens)}};
  if (flight.first_byte) {
    // W3C Server-Timing, in ms: the node's part before forwarding and the engine's to its first
    // byte, so that a client can tell what the front door added to its time to first token.
    using Ms = std::chrono::duration<double, std::milli>;
    headers.emplace_back("server-timing",
                         fmt::format("kvr;dur={:.3f}, engine;dur={:.3f}",
                                     Ms(flight.forwarded - flight.received).count(),
                                     Ms(flight.engine_first_byte - flight.forwarded).count()));
  }
  return headers;
}

// Counts the answer's cache outcome (its usage against the route's prediction) in the node's
// hit-rate ladder; answers without usage are not counted.
void FlightDriver::record_cache_outcome(const Flight& flight, std::string_view answer) {
  const auto usage = answer_usage(answer);
  if (!usage) return;
  metrics::record_cache_outcome(
      metrics::NodeMetrics{*server_.metrics}, server_.cache_mismatch, server_.cache_log,
      server_.directory->target(flight.request.model).model, usage->prompt_tokens,
      flight.predicted_cached_tokens, usage->cached_tokens);
}

void FlightDriver::finish_whole_answer() {
  Flight& flight = *flight_;
  park_engine();
  const unsigned status = flight.answer_status;
  // A refusal (4xx) goes back as it is, blaming nobody (report_release).
  carry_out(flight.core->on_chunk(engine_run(true), std::chrono::steady_clock::now()));
  if (status == 200) record_cache_outcome(flight, flight.answer);
  auto headers = kvr_headers();
  std::string answer = std::move(flight.answer);
  std::string type = flight.answer_type.empty() ? "application/json" : flight.answer_type;
  const std::string endpoint = flight.endpoint_path;
  end_flight();
  client_.respond(endpoint, status, std::move(answer), std::move(type), std::move(headers));
}

// Streams `bytes` (kept alive by `holder`) to the client, its response header first; then
// `then` runs, unless it was the last chunk or the client went away.
template <class Holder>
void FlightDriver::send_chunk(net::const_buffer bytes, Holder holder, bool last,
                              void (FlightDriver::*then)()) {
  Flight& flight = *flight_;
  const std::uint64_t epoch = epoch_;
  std::optional<StreamHead> head;
  if (!flight.header_sent) {
    flight.header_sent = true;
    head = StreamHead{.content_type = flight.answer_type, .headers = kvr_headers()};
  }
  client_.write_chunk(bytes, head ? &*head : nullptr,
                      [this, hold = client_.hold(), epoch, holder = std::move(holder), last, then,
                       first = head.has_value()](beast::error_code error) {
                        // The relay's part of the time to first token: from the engine's first byte
                        // to the client's first event written (the node's other part ends where
                        // forwarding starts).
                        if (first && !error && epoch == epoch_ && flight_ && flight_->first_byte) {
                          server_.relay_first_byte.observe(
                              std::chrono::duration<double>(std::chrono::steady_clock::now() -
                                                            flight_->engine_first_byte)
                                  .count());
                        }
                        if (epoch != epoch_ || !flight_) return;
                        if (error) return client_gone();
                        if (last) return finish_stream();
                        (this->*then)();
                      });
}

void FlightDriver::finish_stream() {
  Flight& flight = *flight_;
  park_engine();
  carry_out(flight.core->on_chunk(engine_run(true), std::chrono::steady_clock::now()));
  record_cache_outcome(flight, flight.stream_tail);
  server_.count(flight.endpoint_path, 200);
  end_stream();
}

// Ends a chunked answer (with an error event first, when `failure` is set).
void FlightDriver::end_stream(const HttpError* failure) {
  std::string tail;
  if (failure != nullptr) {
    tail = fmt::format("data: {}\n\ndata: [DONE]\n\n", failure->body());
  }
  end_flight();
  client_.end_chunks(std::move(tail));
}

// ---- failures -----------------------------------------------------------------------------------

// The engine failed the attempt: the core retries it elsewhere while nothing reached the
// client (max_retries times), else the request ends with an explicit error.
void FlightDriver::engine_failed(std::string why, std::optional<FailureCause> cause) {
  Flight& flight = *flight_;
  server_.metrics->add(kEngineFailures, {{"phase", flight.first_byte ? "answer" : "first_byte"}});
  spdlog::warn("front door: request {}: worker {} ({}): {}", request_id_, flight.worker_id,
               flight.worker_url, why);
  end_attempt();
  const HttpError failure{.status = 502,
                          .message = fmt::format("worker {} failed: {}", flight.worker_id, why),
                          .code = "worker_failed"};
  carry_out(flight.core->attempt_failed(cause, why, std::chrono::steady_clock::now()), &failure,
            why);
}

void FlightDriver::fail_flight(const HttpError& error, v1::AbortCause cause) {
  Flight& flight = *flight_;
  if (flight.core) {
    // Ended by the connection (shutdown, a render or write failure): the booking, if one is
    // open, ends with it. After the core's own end this is refused and releases nothing.
    auto aborted = flight.core->abort(Error::unavailable, error.message);
    if (aborted && aborted->release) report_release(*aborted->release, error.message, cause);
  }
  close_engine();
  if (flight.header_sent) {
    server_.count(flight.endpoint_path, error.status);
    if (client_.writing()) {
      // A chunk is on its way: the connection cannot carry a clean end.
      end_flight();
      return client_.close();
    }
    return end_stream(&error);
  }
  const std::string endpoint = flight.endpoint_path;
  end_flight();
  if (client_.writing()) return client_.close();
  client_.respond_error(endpoint, error);
}

void FlightDriver::client_gone() {
  server_.metrics->add(kClientsGone);
  if (flight_ && flight_->core) {
    auto cancelled = flight_->core->cancel("the client went away");
    if (cancelled && cancelled->release) {
      report_release(*cancelled->release, "the client went away");
    }
  }
  end_flight();
  client_.close();
}

void FlightDriver::end_flight() {
  if (!flight_) return;
  // Ended before its answer did (the client went away, a write failed, the node stops).
  if (flight_->generation && !(flight_->generated && flight_->generated->finished())) {
    flight_->generation->cancel();
  }
  flight_.reset();
  routing_.reset();
  ++epoch_;
  deadline_.cancel();
  close_engine();
  server_.in_flight.fetch_sub(1);
  server_.in_flight_gauge.set(static_cast<double>(server_.in_flight.load()));
}

void FlightDriver::close_engine() {
  if (!relay_) return;
  relay_->close();
  relay_.reset();
}

void FlightDriver::report(const std::string& booking_id, v1::LifecycleEvent event,
                          v1::AbortCause cause, std::string error) {
  report_booking(*server_.gateway, booking_id, event, cause, std::move(error));
}

}  // namespace kvr::front_door
