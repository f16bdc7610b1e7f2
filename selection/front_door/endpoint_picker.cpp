#include "selection/front_door/endpoint_picker.hpp"

#include <algorithm>
#include <atomic>
#include <charconv>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <mutex>
#include <optional>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/address.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/strand.hpp>
#include <fmt/format.h>
#include <grpc/support/log.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/resource_quota.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server.h>
#include <grpcpp/server_builder.h>
#include <malloc.h>
#include <spdlog/spdlog.h>

#include "envoy/ext_proc.grpc.pb.h"
#include "messages/http_url.hpp"
#include "messages/metrics/rate_limited_log.hpp"
#include "selection/front_door/openai_api.hpp"
#include "selection/front_door/prompt_renderer.hpp"
#include "selection/front_door/request_routing.hpp"

namespace kvr::front_door {
namespace {

namespace net = boost::asio;
namespace ext = envoy::service::ext_proc::v3;
using BodyMode = ext::ProcessingMode::BodySendMode;
using Reactor = grpc::ServerBidiReactor<ext::ProcessingRequest, ext::ProcessingResponse>;

constexpr std::string_view kRequests = "kvr_epp_requests_total";
constexpr std::string_view kStreamsOpen = "kvr_epp_streams_open";
constexpr std::string_view kInFlight = "kvr_epp_requests_in_flight";
constexpr std::string_view kAddedLatency = "kvr_epp_added_latency_seconds";
constexpr std::string_view kStreamTimeouts = "kvr_epp_stream_timeouts_total";
constexpr std::string_view kStreamsRefused = "kvr_epp_streams_refused_total";
constexpr std::string_view kAcceptFailures = "kvr_epp_accept_failures_total";
constexpr std::string_view kBufferedBody = "kvr_epp_buffered_body_bytes";

// The connections' own bounds (gRPC's defaults are 120 s, none and 2 h). A peer that has not sent
// HTTP/2's preface and SETTINGS this long after connecting is not Envoy, which sends them at once:
// its descriptor is given back.
constexpr std::chrono::milliseconds kHandshakeTimeout{10'000};
// A connection without a stream this long is closed (GOAWAY; Envoy opens a new one for its next
// request), so that idle connections do not hold descriptors for good.
constexpr std::chrono::milliseconds kConnectionIdleLimit{300'000};
// Pings find peers that vanished without closing, or stopped reading (their streams end,
// bookings with them).
constexpr std::chrono::milliseconds kKeepaliveInterval{60'000};
constexpr std::chrono::milliseconds kKeepaliveTimeout{20'000};
// A stream's last replies wait for the peer's HTTP/2 flow-control window; one that does not read
// them within this has its stream cancelled, so that an ended stream is never held by its peer.
constexpr std::chrono::milliseconds kFinishGrace{10'000};
// Streams answered 503 at the open-stream limit whose answer is still on its way. Beyond it a
// stream is refused with gRPC's RESOURCE_EXHAUSTED instead: a status alone takes no flow-control
// window, so a client that opens streams and never lets their answers through cannot hold them.
// (Envoy, which reads its answers, gets the 503 with its OpenAI error.)
constexpr std::size_t kMaxRefusalsUnderWay = 1024;

// glibc keeps what freed streams held in its arenas instead of giving it back: 20,000 silent
// streams cancelled left a Release process at 437 MB with 3 MB in use, until malloc_trim brought it
// to 41 MB. So once what the streams hold has fallen this far below its peak and stopped falling
// for kTrimQuietTicks health ticks (gRPC frees a call's memory after its stream's end), the rest is
// trimmed: once per burst, as a trim of 400 MB of arenas takes some 200 ms.
constexpr std::size_t kTrimStep = std::size_t{32} << 20;
constexpr int kTrimQuietTicks = 4;
// What one open stream costs, for that estimate: measured 19 KB a silent stream in Release (gRPC's
// call and transport state, and the stream's own).
constexpr std::size_t kStreamBytes = std::size_t{20} << 10;

// Envoy's gRPC client takes messages up to 64 KiB unless configured otherwise: echoed body chunks
// stay below (the reference endpoint picker's limit).
constexpr std::size_t kChunkBytes = 62'000;
constexpr std::string_view kDestinationHeader = "x-gateway-destination-endpoint";
constexpr std::string_view kLbNamespace = "envoy.lb";
constexpr std::string_view kSubsetNamespace = "envoy.lb.subset_hint";
constexpr std::string_view kSubsetKey = "x-gateway-destination-endpoint-subset";
constexpr std::string_view kLiveness = "liveness";
// Services SERVING while the node can route (a worker is live and it is not draining).
constexpr std::array<std::string_view, 3> kReadinessServices = {
    "readiness", "envoy.service.ext_proc.v3.ExternalProcessor", ""};

// What Envoy sends: raw_value since 1.32 (value before).
std::string header_value(const ext::HeaderValue& header) {
  return header.raw_value().empty() ? header.value() : header.raw_value();
}

std::string lower(std::string text) {
  std::transform(text.begin(), text.end(), text.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return text;
}

std::string_view trim(std::string_view text) {
  while (!text.empty() && (text.front() == ' ' || text.front() == '\t')) text.remove_prefix(1);
  while (!text.empty() && (text.back() == ' ' || text.back() == '\t')) text.remove_suffix(1);
  return text;
}

// One entry of a subset hint: "ip:port", "[v6]:port", or an address alone (any of its ports).
struct HintedEndpoint {
  std::string host;
  std::string port;  // empty: any port
};

HintedEndpoint parse_hinted(std::string_view entry) {
  if (entry.starts_with('[')) {
    const auto close = entry.find(']');
    if (close == std::string_view::npos) return {std::string{entry.substr(1)}, {}};
    const auto rest = entry.substr(close + 1);
    return {std::string{entry.substr(1, close - 1)},
            rest.starts_with(':') ? std::string{rest.substr(1)} : std::string{}};
  }
  const auto colon = entry.find(':');
  // Two or more colons: an IPv6 address without brackets, hence without a port.
  if (colon == std::string_view::npos || entry.find(':', colon + 1) != std::string_view::npos) {
    return {std::string{entry}, {}};
  }
  return {std::string{entry.substr(0, colon)}, std::string{entry.substr(colon + 1)}};
}

void add_hinted(std::string_view joined, std::vector<HintedEndpoint>& into) {
  while (!joined.empty()) {
    const auto comma = joined.find(',');
    const auto entry = trim(joined.substr(0, comma));
    if (!entry.empty()) into.push_back(parse_hinted(entry));
    if (comma == std::string_view::npos) break;
    joined.remove_prefix(comma + 1);
  }
}

// The subset hint in Envoy's metadata: nullopt when absent (any endpoint), else the endpoints it
// lists (a list of strings, or one comma-joined string; an entry may itself hold commas).
std::optional<std::vector<HintedEndpoint>> subset_hint(const ext::Metadata& metadata) {
  const auto space = metadata.filter_metadata().find(std::string{kSubsetNamespace});
  if (space == metadata.filter_metadata().end()) return std::nullopt;
  const auto key = space->second.fields().find(std::string{kSubsetKey});
  if (key == space->second.fields().end()) return std::nullopt;
  std::vector<HintedEndpoint> endpoints;
  const google::protobuf::Value& value = key->second;
  if (value.has_string_value()) add_hinted(value.string_value(), endpoints);
  if (value.has_list_value()) {
    for (const auto& item : value.list_value().values()) {
      if (item.has_string_value()) add_hinted(item.string_value(), endpoints);
    }
  }
  return endpoints;
}

// "host:port" as Envoy's ORIGINAL_DST cluster reads it ("[v6]:port" for IPv6).
std::string endpoint_of(const HttpUrlParts& url) {
  return url.host.find(':') != std::string::npos ? fmt::format("[{}]:{}", url.host, url.port)
                                                 : fmt::format("{}:{}", url.host, url.port);
}

void set_header(ext::HeaderMutation& mutation, std::string_view key, std::string value) {
  auto* option = mutation.add_set_headers();
  option->mutable_header()->set_key(std::string{key});
  option->mutable_header()->set_raw_value(std::move(value));
  // Envoy's ext_proc honours `append` only (unset: replace); the action says the same for those
  // that read it. Replacing matters: ORIGINAL_DST takes a repeated header's first value.
  option->set_append_action(ext::HeaderValueOption::OVERWRITE_IF_EXISTS_OR_ADD);
}

bool is_2xx(unsigned status) { return status >= 200 && status < 300; }

HttpError refusal(unsigned status, std::string message, std::string code = {}) {
  return HttpError{.status = status,
                   .message = std::move(message),
                   .type = status < 500 ? "invalid_request_error" : "server_error",
                   .code = std::move(code)};
}

// A local reply: Envoy answers the client with `error` (OpenAI's error object) itself.
ext::ProcessingResponse immediate_reply(const HttpError& error, std::string_view request_id) {
  ext::ProcessingResponse reply;
  auto& immediate = *reply.mutable_immediate_response();
  immediate.mutable_status()->set_code(static_cast<ext::StatusCode>(error.status));
  auto& headers = *immediate.mutable_headers();
  set_header(headers, "content-type", "application/json");
  if (!request_id.empty()) set_header(headers, "x-kvr-request-id", std::string{request_id});
  if (error.retry_after) {
    set_header(headers, "retry-after", std::to_string(error.retry_after->count()));
  }
  immediate.set_body(error.body());
  // %RESPONSE_CODE_DETAILS% takes no whitespace.
  immediate.set_details(
      fmt::format("kvr_epp_{}", error.code.empty() ? std::to_string(error.status) : error.code));
  return reply;
}

}  // namespace

std::expected<void, std::string> EndpointPickerOptions::validate() const {
  boost::system::error_code error;
  net::ip::make_address(address, error);
  if (error)
    return std::unexpected(fmt::format("--epp-address: '{}' is not an IP address", address));
  if (max_body_bytes < 1024 || max_body_bytes > (std::size_t{1} << 30)) {
    return std::unexpected("--http-max-body-bytes: between 1 KiB and 1 GiB");
  }
  if (session_header.empty()) return std::unexpected("--http-session-header: empty");
  if (max_renders_in_flight == 0) return std::unexpected("--http-max-renders-in-flight: >= 1");
  if (render_timeout < std::chrono::milliseconds(1) ||
      health_interval < std::chrono::milliseconds(1)) {
    return std::unexpected("endpoint picker timeouts: >= 1 ms");
  }
  if (request_timeout < std::chrono::milliseconds(1) || request_timeout > std::chrono::hours(1)) {
    return std::unexpected("--epp-request-timeout-ms: between 1 ms and 1 hour");
  }
  if (response_timeout < request_timeout || response_timeout > std::chrono::hours(24 * 7)) {
    return std::unexpected(
        "--epp-response-timeout-ms: at least --epp-request-timeout-ms, at most a week");
  }
  // gRPC takes the stream limit as an int.
  if (max_streams_per_connection == 0 || max_streams_per_connection > 1'000'000) {
    return std::unexpected("--epp-max-streams-per-connection: between 1 and 1,000,000");
  }
  if (max_open_streams == 0 || max_open_streams > 10'000'000) {
    return std::unexpected("--epp-max-open-streams: between 1 and 10,000,000");
  }
  if (max_buffered_body_bytes < max_body_bytes ||
      max_buffered_body_bytes > (std::size_t{1} << 40)) {
    return std::unexpected(
        "--epp-max-buffered-body-bytes: at least --http-max-body-bytes, at most 1 TiB");
  }
  // Room for one whole BUFFERED body (a message of up to max_body_bytes + 1 MiB) and more.
  if (grpc_memory_bytes < 2 * (max_body_bytes + (std::size_t{1} << 20)) ||
      grpc_memory_bytes > (std::size_t{1} << 40)) {
    return std::unexpected(
        "--epp-grpc-memory-bytes: at least twice --http-max-body-bytes plus 2 MiB, at most 1 TiB");
  }
  if (auto depth = tokenizer::validate_max_json_depth(max_json_depth); !depth) return depth;
  return render_pool.validate();
}

namespace {

// gRPC 1.51's listener stops for good when accept4() fails (EMFILE when the process is out of
// descriptors): it logs "Failed accept4" once and never polls its socket again, so new
// connections wait in the kernel's backlog until the node restarts. Its log is the only sign;
// this counts it, then writes the line as gRPC would have.
std::atomic<std::uint64_t> grpc_accept_failures{0};

void watch_grpc_log(gpr_log_func_args* args) {
  if (std::string_view{args->message}.starts_with("Failed accept4")) {
    grpc_accept_failures.fetch_add(1);
  }
  std::fprintf(stderr, "gRPC %s %s:%d] %s\n", gpr_log_severity_string(args->severity), args->file,
               args->line, args->message);
}

}  // namespace

// ---- the server's shared state ------------------------------------------------------------------

namespace {
class PickerService;
}  // namespace

struct EndpointPicker::State {
  State(EndpointPickerOptions picker_options, std::shared_ptr<RoutingGateway> routing_gateway,
        std::shared_ptr<const FleetDirectory> fleet,
        std::shared_ptr<metrics::MetricsRegistry> registry)
      : options(std::move(picker_options)),
        gateway(std::move(routing_gateway)),
        directory(std::move(fleet)),
        metrics(std::move(registry)),
        renderer(options.tokenizer_modes, options.max_renders_in_flight, options.render_timeout,
                 metrics, options.native_tokenizers,
                 NativeRenderOptions{.pool = options.render_pool}) {}

  EndpointPickerOptions options;
  std::shared_ptr<RoutingGateway> gateway;
  std::shared_ptr<const FleetDirectory> directory;
  std::shared_ptr<metrics::MetricsRegistry> metrics;
  const std::string id_prefix = random_request_prefix();
  std::atomic<std::uint64_t> next_request{0};
  std::atomic<bool> accepting{true};
  std::atomic<bool> stopping{false};
  std::atomic<std::size_t> in_flight{0};
  metrics::ValueHandle in_flight_gauge = metrics->gauge(kInFlight);
  metrics::ValueHandle streams_gauge = metrics->gauge(kStreamsOpen);
  metrics::HistogramHandle added_latency = metrics->histogram(kAddedLatency);
  metrics::ValueHandle streams_refused = metrics->counter(kStreamsRefused);
  // Refused streams whose answer is still on its way (kMaxRefusalsUnderWay).
  std::shared_ptr<std::atomic<std::size_t>> refusals_under_way =
      std::make_shared<std::atomic<std::size_t>>(0);
  // Request body bytes the streams hold (max_buffered_body_bytes).
  std::atomic<std::size_t> buffered_body{0};
  metrics::ValueHandle buffered_body_gauge = metrics->gauge(kBufferedBody);
  metrics::ValueHandle accept_failures = metrics->counter(kAcceptFailures);
  // The accept failures already counted (grpc_accept_failures is the process's).
  std::uint64_t accept_failures_seen = grpc_accept_failures.load();
  // What the streams held at most since memory was last trimmed, and at the last health tick (see
  // trim_memory()).
  std::atomic<std::size_t> peak_held{0};
  std::size_t last_held = 0;
  int ticks_not_falling = 0;
  // Timeouts and refusals come in floods: a line per kind every 5 s, saying how many
  // were left out.
  metrics::RateLimitedLog log;
  std::uint16_t port = 0;
  // Open streams (reactors not yet destroyed): shutdown waits for them.
  std::mutex streams_mutex;
  std::condition_variable streams_gone;
  std::size_t streams = 0;
  // Gateway answers arrive on the router's threads: they reach a stream's strand only while the
  // io_context lives (they release their booking themselves once it is gone).
  std::shared_ptr<std::mutex> post_mutex = std::make_shared<std::mutex>();
  std::shared_ptr<bool> posting = std::make_shared<bool>(true);
  // Everything above outlives the io_context (declared below it, so destroyed before it): the
  // handlers the io_context still holds when destroyed release their streams into it.
  PromptRenderer renderer;
  net::io_context io{1};
  net::executor_work_guard<net::io_context::executor_type> work = net::make_work_guard(io);
  net::steady_timer health_timer{io};
  std::optional<bool> ready_reported;
  std::unique_ptr<PickerService> service;
  std::unique_ptr<grpc::Server> server;
  std::thread thread;

  void count(bool routed, unsigned status) {
    metrics->add(kRequests,
                 {{"outcome", routed ? "routed" : "refused"}, {"code", std::to_string(status)}});
  }

  void report(const std::string& booking_id, v1::LifecycleEvent event,
              v1::AbortCause cause = v1::ABORT_CAUSE_UNSPECIFIED, std::string error = {}) {
    report_booking(*gateway, booking_id, event, cause, std::move(error));
  }

  // A new stream's slot: false at max_open_streams (the stream is refused).
  bool open_stream() {
    {
      std::lock_guard lock{streams_mutex};
      if (streams < options.max_open_streams) {
        ++streams;
        streams_gauge.set(static_cast<double>(streams));
        note_held(streams);
        return true;
      }
    }
    streams_refused.add();
    log.warn("epp_streams_refused",
             fmt::format("endpoint picker: {} streams are open (--epp-max-open-streams): new "
                         "streams are answered 503",
                         options.max_open_streams));
    return false;
  }

  // Room for `bytes` more of request bodies: false (nothing taken) beyond max_buffered_body_bytes.
  bool take_body(std::size_t bytes) {
    std::size_t held = buffered_body.load();
    do {
      if (held + bytes > options.max_buffered_body_bytes) {
        log.warn("epp_bodies_refused",
                 fmt::format("endpoint picker: streams hold {} bytes of request bodies "
                             "(--epp-max-buffered-body-bytes): new body bytes are answered 503",
                             held));
        return false;
      }
    } while (!buffered_body.compare_exchange_weak(held, held + bytes));
    buffered_body_gauge.set(static_cast<double>(held + bytes));
    note_held(open_streams());
    return true;
  }

  std::size_t open_streams() {
    std::lock_guard lock{streams_mutex};
    return streams;
  }

  // What the streams hold now, estimated, raises its peak.
  void note_held(std::size_t open) {
    const std::size_t held = open * kStreamBytes + buffered_body.load();
    std::size_t peak = peak_held.load();
    while (held > peak && !peak_held.compare_exchange_weak(peak, held)) {
    }
  }

  // Gives glibc's free memory back once what the streams hold fell kTrimStep below its peak and
  // has not fallen for kTrimQuietTicks (a peak raised meanwhile by another thread may be lost:
  // that only delays a trim).
  void trim_memory() {
    const std::size_t held = open_streams() * kStreamBytes + buffered_body.load();
    ticks_not_falling = held < last_held ? 0 : std::min(ticks_not_falling + 1, kTrimQuietTicks);
    last_held = held;
    if (ticks_not_falling < kTrimQuietTicks || peak_held.load() < held + kTrimStep) return;
    peak_held.store(held);
#ifdef __GLIBC__
    ::malloc_trim(0);
#endif
  }

  void give_body(std::size_t bytes) {
    if (bytes == 0) return;
    buffered_body_gauge.set(static_cast<double>(buffered_body.fetch_sub(bytes) - bytes));
  }

  // A stream ended by its deadline: `phase` is request, routing or response.
  void timed_out(std::string_view phase, std::chrono::milliseconds limit,
                 const std::string& request_id) {
    metrics->add(kStreamTimeouts, {{"phase", std::string{phase}}});
    log.warn(fmt::format("epp_timeout_{}", phase),
             fmt::format("endpoint picker: a stream ended in its {} phase after {} ms{}{}", phase,
                         limit.count(), request_id.empty() ? "" : ", request ", request_id));
  }

  void stream_closed() {
    std::lock_guard lock{streams_mutex};
    --streams;
    streams_gauge.set(static_cast<double>(streams));
    streams_gone.notify_all();
  }

  void booked(bool open) {
    if (open) {
      in_flight.fetch_add(1);
    } else {
      in_flight.fetch_sub(1);
    }
    in_flight_gauge.set(static_cast<double>(in_flight.load()));
  }

  // The listener's failures that gRPC only logs (see watch_grpc_log).
  void check_listener() {
    const std::uint64_t failures = grpc_accept_failures.load();
    if (failures == accept_failures_seen) return;
    accept_failures.add(static_cast<double>(failures - accept_failures_seen));
    accept_failures_seen = failures;
    spdlog::error(
        "endpoint picker: gRPC could not accept a connection on port {} (out of file "
        "descriptors?) and, in gRPC 1.51, accepts none from now on: open connections are still "
        "served; restart the node to take new ones",
        port);
  }

  // Readiness: a worker is live and the picker takes requests.
  void report_health() {
    const bool ready = accepting.load() && directory->any_live();
    if (ready_reported == ready) return;
    ready_reported = ready;
    if (auto* health = server->GetHealthCheckService()) {
      for (const auto service_name : kReadinessServices) {
        health->SetServingStatus(std::string{service_name}, ready);
      }
    }
  }

  // The health service follows the directory; so do the native tokenizers' parity checks.
  void watch_health() {
    report_health();
    check_listener();
    trim_memory();
    renderer.check_new_models(*directory, io.get_executor());
    health_timer.expires_after(options.health_interval);
    health_timer.async_wait([this](boost::system::error_code error) {
      if (!error && !stopping.load()) watch_health();
    });
  }
};

namespace {

// ---- one ext_proc stream: one HTTP request ------------------------------------------------------
// Envoy's messages arrive on gRPC's threads and are handled on the stream's strand, one at a time;
// the replies leave in order, one write in flight. A deadline bounds each stream: its request must
// arrive whole within request_timeout, its answer end within response_timeout after that.

class PickerStream final : public Reactor, public std::enable_shared_from_this<PickerStream> {
 public:
  // Takes the slot State::open_stream() gave it.
  PickerStream(EndpointPicker::State& server, grpc::CallbackServerContext* context)
      : server_(server),
        context_(context),
        strand_(net::make_strand(server.io)),
        deadline_(strand_) {}

  ~PickerStream() override {
    server_.give_body(body_budget_);
    // Reached only when the stream's end was never handled (the node stopped first).
    if (!booking_id_.empty()) {
      server_.report(booking_id_, v1::LIFECYCLE_EVENT_ABORTED, v1::ABORT_CAUSE_UNSPECIFIED,
                     "the endpoint picker stopped");
      server_.booked(false);
    }
    server_.stream_closed();
  }

  void start() {
    self_ = shared_from_this();
    // On the strand before the first read's handler.
    net::post(strand_, [self = shared_from_this()] {
      if (!self->finishing_) self->arm_deadline(self->server_.options.request_timeout);
    });
    StartRead(&incoming_);
  }

  // ---- gRPC's reactions (any gRPC thread): onto the strand ------------------------------------

  void OnReadDone(bool ok) override {
    net::post(strand_, [self = shared_from_this(), ok] { self->on_read(ok); });
  }

  void OnWriteDone(bool ok) override {
    net::post(strand_, [self = shared_from_this(), ok] { self->on_written(ok); });
  }

  void OnDone() override {
    // The last reaction: whether Envoy saw the stream's status is known now.
    const bool cancelled = context_->IsCancelled();
    auto self = std::move(self_);
    net::post(strand_, [self, cancelled] { self->on_done(cancelled); });
  }

 private:
  enum class Phase : std::uint8_t { headers, body, routing, routed, refused };

  // ---- reading ----------------------------------------------------------------------------------

  void on_read(bool ok) {
    if (!ok) {
      // Envoy closed its side (the request is over) or the stream broke.
      reads_over_ = true;
      return finish(grpc::Status::OK);
    }
    ext::ProcessingRequest message = std::move(incoming_);
    incoming_.Clear();
    // One read stays pending while the stream lives: its failure is Envoy going away.
    if (!finished_) StartRead(&incoming_);
    handle(message);
  }

  void handle(const ext::ProcessingRequest& message) {
    if (message.observability_mode()) observe_only_ = true;
    if (message.has_protocol_config()) {
      request_mode_ = message.protocol_config().request_body_mode();
      response_mode_ = message.protocol_config().response_body_mode();
    }
    // Envoy expects no answer, so nothing is routed or booked either.
    if (observe_only_ || finishing_) return;
    if (message.has_metadata_context()) {
      if (auto hint = subset_hint(message.metadata_context())) subset_ = std::move(hint);
    }
    switch (message.request_case()) {
      case ext::ProcessingRequest::kRequestHeaders:
        return on_request_headers(message.request_headers());
      case ext::ProcessingRequest::kRequestBody:
        return on_request_body(message.request_body());
      case ext::ProcessingRequest::kRequestTrailers:
        return on_request_trailers();
      case ext::ProcessingRequest::kResponseHeaders:
        return on_response_headers(message.response_headers());
      case ext::ProcessingRequest::kResponseBody:
        return on_response_body(message.response_body());
      case ext::ProcessingRequest::kResponseTrailers:
        return on_response_trailers();
      case ext::ProcessingRequest::REQUEST_NOT_SET:
        return;
    }
  }

  bool full_duplex() const { return request_mode_ == ext::ProcessingMode::FULL_DUPLEX_STREAMED; }

  void on_request_headers(const ext::HttpHeaders& headers) {
    if (phase_ != Phase::headers) return protocol_error("request headers twice");
    request_id_ = fmt::format("kvr-{}-{}", server_.id_prefix, server_.next_request.fetch_add(1));
    for (const auto& header : headers.headers().headers()) {
      headers_.emplace_back(lower(header.key()), header_value(header));
    }
    if (!server_.accepting.load()) {
      return refuse(refusal(503, "the router is draining", "service_unavailable"));
    }
    if (request_mode_ && *request_mode_ != ext::ProcessingMode::BUFFERED && !full_duplex()) {
      return refuse(refusal(500,
                            fmt::format("the endpoint picker needs request_body_mode BUFFERED or "
                                        "FULL_DUPLEX_STREAMED (got {})",
                                        ext::ProcessingMode::BodySendMode_Name(*request_mode_)),
                            "endpoint_picker_misconfigured"));
    }
    const std::string path{header(":path").substr(0, header(":path").find('?'))};
    if (path == "/v1/chat/completions") {
      endpoint_ = Endpoint::chat_completions;
    } else if (path == "/v1/completions") {
      endpoint_ = Endpoint::completions;
    } else {
      return refuse(
          refusal(404, fmt::format("no endpoint {}", quote_for_error(path)), "unknown_url"));
    }
    if (const auto method = header(":method"); !method.empty() && method != "POST") {
      return refuse(refusal(405, fmt::format("{} takes POST only", quote_for_error(path))));
    }
    if (headers.end_of_stream()) {
      return refuse(bad_request("the endpoint picker routes requests with a JSON body"));
    }
    phase_ = Phase::body;
    // BUFFERED: Envoy sends the body once the headers are answered; FULL_DUPLEX_STREAMED: the
    // headers' answer waits for the body (it carries the destination).
    if (!full_duplex()) send(continue_headers(true));
  }

  void on_request_body(const ext::HttpBody& chunk) {
    if (phase_ != Phase::body) return protocol_error("a request body out of order");
    if (body_.size() + chunk.body().size() > server_.options.max_body_bytes) {
      return refuse(HttpError{.status = 413,
                              .message = fmt::format("the request body is larger than {} bytes",
                                                     server_.options.max_body_bytes),
                              .type = "invalid_request_error",
                              .code = "request_too_large"});
    }
    if (!server_.take_body(chunk.body().size())) {
      HttpError error = refusal(503, "the endpoint picker holds too many request bodies; try again",
                                "service_unavailable");
      error.retry_after = std::chrono::seconds{1};
      return refuse(error);
    }
    body_budget_ += chunk.body().size();
    body_ += chunk.body();
    // BUFFERED sends the whole body in one message (trailers, if any, come after its answer).
    if (chunk.end_of_stream() || !full_duplex()) decide();
  }

  void on_request_trailers() {
    trailers_ = true;
    if (phase_ == Phase::body) return decide();
    // BUFFERED: the body was answered (or is being routed, then the trailers' answer follows).
    if (phase_ == Phase::routed) send(trailers_reply(true));
  }

  // ---- deciding
  // -----------------------------------------------------------------------------------

  std::string_view header(std::string_view name) const {
    for (const auto& [key, value] : headers_) {
      if (key == name) return value;
    }
    return {};
  }

  // Whose turn a render of this stream waits for: the last address of x-forwarded-for (the
  // downstream client Envoy saw, when its use_remote_address appends it), else Envoy's own
  // connection.
  std::string client() const {
    const std::string_view forwarded = header("x-forwarded-for");
    if (!forwarded.empty()) {
      std::string_view last = forwarded.substr(forwarded.rfind(',') + 1);
      while (!last.empty() && last.front() == ' ') last.remove_prefix(1);
      while (!last.empty() && last.back() == ' ') last.remove_suffix(1);
      if (!last.empty()) return std::string{last.substr(0, 64)};
    }
    return context_->peer();
  }

  std::expected<RequestMetadata, HttpError> read_metadata() const {
    return read_request_metadata([this](std::string_view name) { return header(name); },
                                 lower(server_.options.session_header));
  }

  // Whether the subset hint (when given) lists the worker's engine.
  bool hinted(const DirectoryWorker& worker) const {
    if (!subset_) return true;
    const auto url = split_http_url(worker.http_url);
    if (!url) return false;
    return std::any_of(subset_->begin(), subset_->end(), [&](const HintedEndpoint& endpoint) {
      return endpoint.host == url->host && (endpoint.port.empty() || endpoint.port == url->port);
    });
  }

  // The whole request is here: parse, pick the eligible engines, render, route.
  void decide() {
    phase_ = Phase::routing;
    body_complete_ = std::chrono::steady_clock::now();
    arm_deadline(server_.options.response_timeout);
    auto parsed = parse_generation_request(endpoint_, body_, server_.renderer.text_use(),
                                           server_.options.max_json_depth);
    if (!parsed) return refuse(parsed.error());
    auto metadata = read_metadata();
    if (!metadata) return refuse(metadata.error());
    target_ = server_.directory->target(parsed->model);
    if (target_.workers.empty()) {
      return refuse(HttpError{.status = 404,
                              .message = fmt::format("The model `{}` does not exist (no live "
                                                     "worker serves it).",
                                                     parsed->model),
                              .type = "invalid_request_error",
                              .code = "model_not_found",
                              .param = "model"});
    }
    std::vector<std::string> engine_urls;
    // Only engines Envoy can reach, and of those only the hinted ones (for an adapter: only
    // those that serve it).
    for (const auto& worker : target_.workers) {
      if (worker.http_url.empty() || !hinted(worker)) continue;
      engine_urls.push_back(worker.http_url);
      eligible_.push_back(worker.worker_id);
    }
    if (engine_urls.empty()) {
      return refuse(refusal(
          503,
          subset_
              ? fmt::format("no live engine of `{}` is in the endpoint subset hint", parsed->model)
              : fmt::format("no worker of `{}` registered an HTTP URL (run the engines "
                            "behind `kvr bridge`)",
                            parsed->model),
          "service_unavailable"));
    }
    request_ = std::move(*parsed);
    metadata_ = std::move(*metadata);
    server_.renderer.render(
        strand_, request_, body_, std::move(engine_urls),
        [self = shared_from_this()](RenderResult key) {
          if (self->finishing_) return;
          if (!key) return self->refuse(key.error());
          self->route(*key);
        },
        client());
  }

  void route(const RoutingKey& key) {
    v1::RouteRequest request =
        make_route_request(request_id_, request_, metadata_, target_, eligible_, key);
    // The decision comes back on the router's threads. It holds the stream weakly and the
    // io_context not at all: once the picker is gone, it releases its booking itself.
    std::weak_ptr<PickerStream> weak = weak_from_this();
    server_.gateway->route(
        std::move(request), [weak, post_mutex = server_.post_mutex, posting = server_.posting,
                             gateway = server_.gateway](v1::RouteDecision decision) {
          {
            std::lock_guard lock{*post_mutex};
            if (*posting) {
              if (auto self = weak.lock()) {
                net::post(self->strand_, [self, decision = std::move(decision)]() mutable {
                  self->on_decision(std::move(decision));
                });
                return;
              }
            }
          }
          if (decision.has_success()) {
            report_booking(*gateway, decision.success().booking_id(), v1::LIFECYCLE_EVENT_ABORTED,
                           v1::ABORT_CAUSE_CLIENT_CANCELLED,
                           "the endpoint picker's stream ended before the decision");
          }
        });
  }

  void on_decision(v1::RouteDecision decision) {
    if (finishing_) {
      // Envoy went away, or the deadline ended the stream, while the request was routed: release
      // what was booked for it.
      if (decision.has_success()) {
        server_.report(decision.success().booking_id(), v1::LIFECYCLE_EVENT_ABORTED,
                       v1::ABORT_CAUSE_CLIENT_CANCELLED, "the stream ended before its decision");
      }
      return;
    }
    if (decision.has_error()) return refuse(error_for_route(decision.error()));
    const v1::RouteSuccess& success = decision.success();
    const auto url = split_http_url(success.worker_http_url());
    if (!url) {
      server_.report(success.booking_id(), v1::LIFECYCLE_EVENT_ABORTED, v1::ABORT_CAUSE_UNSPECIFIED,
                     "the worker has no usable HTTP URL");
      return refuse(refusal(503,
                            fmt::format("worker {} registered no usable HTTP URL ('{}')",
                                        success.worker_id(), success.worker_http_url()),
                            "service_unavailable"));
    }
    booking_id_ = success.booking_id();
    server_.booked(true);
    phase_ = Phase::routed;
    server_.count(true, 200);
    send_destination(endpoint_of(*url), success.worker_id());
    server_.added_latency.observe(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - body_complete_).count());
  }

  // The destination as the endpoint-picker protocol gives it: the header (ORIGINAL_DST reads it)
  // and the same value in the envoy.lb metadata; then, in FULL_DUPLEX_STREAMED, the body echoed
  // (Envoy forwards only what comes back).
  void send_destination(const std::string& destination, std::uint64_t worker_id) {
    ext::CommonResponse routed;
    routed.set_clear_route_cache(true);
    auto& mutation = *routed.mutable_header_mutation();
    set_header(mutation, kDestinationHeader, destination);
    set_header(mutation, "x-kvr-worker-id", std::to_string(worker_id));
    set_header(mutation, "x-kvr-request-id", request_id_);
    ext::ProcessingResponse reply;
    auto& lb = (*reply.mutable_dynamic_metadata()->mutable_fields())[std::string{kLbNamespace}];
    (*lb.mutable_struct_value()->mutable_fields())[std::string{kDestinationHeader}]
        .set_string_value(destination);
    if (!full_duplex()) {
      *reply.mutable_request_body()->mutable_response() = std::move(routed);
      send(std::move(reply));
      if (trailers_) send(trailers_reply(true));
      return;
    }
    // Envoy drops content-length when a FULL_DUPLEX body is echoed; the echo is the same bytes.
    if (!trailers_) set_header(mutation, "content-length", std::to_string(body_.size()));
    *reply.mutable_request_headers()->mutable_response() = std::move(routed);
    send(std::move(reply));
    std::size_t at = 0;
    do {
      const std::size_t size = std::min(kChunkBytes, body_.size() - at);
      const bool last = at + size == body_.size();
      send(streamed_body(true, body_.substr(at, size), last && !trailers_));
      at += size;
    } while (at < body_.size());
    if (trailers_) send(trailers_reply(true));
    drop_body();
  }

  // ---- the response phase ----------------------------------------------------------------------

  void on_response_headers(const ext::HttpHeaders& headers) {
    for (const auto& header : headers.headers().headers()) {
      if (header.key() == ":status") {
        const std::string text = header_value(header);
        std::from_chars(text.data(), text.data() + text.size(), response_status_);
      }
    }
    send(continue_headers(false));
    // Without response bodies, the headers are the first sign of an answer.
    if (response_mode_.value_or(ext::ProcessingMode::NONE) == ext::ProcessingMode::NONE) {
      first_token();
    }
    if (headers.end_of_stream()) response_over();
  }

  void on_response_body(const ext::HttpBody& chunk) {
    if (!chunk.body().empty()) first_token();
    const auto mode = response_mode_.value_or(ext::ProcessingMode::NONE);
    if (mode == ext::ProcessingMode::FULL_DUPLEX_STREAMED || mode == ext::ProcessingMode::GRPC) {
      const std::string& bytes = chunk.body();
      std::size_t at = 0;
      do {
        const std::size_t size = std::min(kChunkBytes, bytes.size() - at);
        const bool last = at + size == bytes.size();
        send(streamed_body(false, bytes.substr(at, size), last && chunk.end_of_stream()));
        at += size;
      } while (at < bytes.size());
    } else {
      ext::ProcessingResponse reply;
      reply.mutable_response_body()->mutable_response();
      send(std::move(reply));
    }
    if (chunk.end_of_stream()) response_over();
  }

  void on_response_trailers() {
    send(trailers_reply(false));
    response_over();
  }

  void first_token() {
    if (first_token_ || booking_id_.empty()) return;
    first_token_ = true;
    server_.report(booking_id_, v1::LIFECYCLE_EVENT_FIRST_TOKEN);
  }

  // The answer's last byte passed: the booking ends with it.
  void response_over() {
    if (booking_id_.empty()) return;
    if (is_2xx(response_status_)) {
      release(v1::LIFECYCLE_EVENT_COMPLETED);
    } else {
      // A failed engine (5xx, Envoy's own 503 when it cannot connect) counts against it; a
      // refused request (4xx) against nobody.
      release(v1::LIFECYCLE_EVENT_ABORTED,
              response_status_ >= 500 ? v1::ABORT_CAUSE_WORKER_FAILED : v1::ABORT_CAUSE_UNSPECIFIED,
              fmt::format("the engine answered {}", response_status_));
    }
  }

  void release(v1::LifecycleEvent event, v1::AbortCause cause = v1::ABORT_CAUSE_UNSPECIFIED,
               std::string error = {}) {
    if (booking_id_.empty()) return;
    server_.report(booking_id_, event, cause, std::move(error));
    booking_id_.clear();
    server_.booked(false);
  }

  // ---- replies ---------------------------------------------------------------------------------

  static ext::ProcessingResponse continue_headers(bool request) {
    ext::ProcessingResponse reply;
    (request ? reply.mutable_request_headers() : reply.mutable_response_headers())
        ->mutable_response();
    return reply;
  }

  static ext::ProcessingResponse trailers_reply(bool request) {
    ext::ProcessingResponse reply;
    if (request) {
      reply.mutable_request_trailers();
    } else {
      reply.mutable_response_trailers();
    }
    return reply;
  }

  static ext::ProcessingResponse streamed_body(bool request, std::string bytes, bool last) {
    ext::ProcessingResponse reply;
    auto* streamed = (request ? reply.mutable_request_body() : reply.mutable_response_body())
                         ->mutable_response()
                         ->mutable_body_mutation()
                         ->mutable_streamed_response();
    streamed->set_body(std::move(bytes));
    streamed->set_end_of_stream(last);
    return reply;
  }

  // A request refused: counted, and answered with a local reply.
  void refuse(const HttpError& error) {
    phase_ = Phase::refused;
    server_.count(false, error.status);
    local_reply(error);
  }

  // A local reply with OpenAI's error object; Envoy answers the client with it (or, once the
  // answer's head went out, resets the client's stream) and ignores the stream from then on, so
  // it ends here. Envoy takes it alike whatever its failure_mode_allow, unlike a gRPC error.
  void local_reply(const HttpError& error) {
    send(immediate_reply(error, request_id_));
    finish(grpc::Status::OK);
  }

  // Envoy sent what ext_proc does not allow here: the stream fails (Envoy answers 500).
  void protocol_error(std::string_view what) {
    spdlog::warn("endpoint picker: request {}: {}", request_id_, what);
    finish(grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, std::string{what}));
  }

  void send(ext::ProcessingResponse reply) {
    if (finishing_ || observe_only_) return;
    outbox_.push_back(std::move(reply));
    pump();
  }

  // Ends the stream once the replies already queued are written. What the request held goes now,
  // not when gRPC is done with the stream.
  void finish(grpc::Status status) {
    if (finishing_) return;
    finishing_ = true;
    status_ = std::move(status);
    arm_deadline(kFinishGrace);
    drop_body();
    headers_ = {};
    pump();
  }

  // The body is no longer needed (echoed, or the stream ends): its memory and its share of
  // max_buffered_body_bytes go back.
  void drop_body() {
    body_ = std::string{};
    server_.give_body(body_budget_);
    body_budget_ = 0;
  }

  // ---- the deadline -----------------------------------------------------------------------------

  // (Re)starts the stream's one timer; a handler of an earlier arming does nothing.
  void arm_deadline(std::chrono::milliseconds after) {
    const std::uint64_t arming = ++deadline_arming_;
    deadline_.expires_after(after);
    deadline_.async_wait([weak = weak_from_this(), arming](boost::system::error_code error) {
      if (error) return;
      // Held weakly: the timer never keeps an ended stream alive.
      if (auto self = weak.lock(); self && self->deadline_arming_ == arming) self->on_deadline();
    });
  }

  void on_deadline() {
    if (finishing_) {
      // The last replies were not taken within kFinishGrace. Finish() waits for them, so it was
      // not called, and the context is alive to cancel.
      if (!finished_) context_->TryCancel();
      return;
    }
    const auto& options = server_.options;
    switch (phase_) {
      case Phase::headers:
      case Phase::body:
        server_.timed_out("request", options.request_timeout, request_id_);
        return refuse(refusal(408,
                              fmt::format("the request's headers and body did not arrive within "
                                          "{} ms",
                                          options.request_timeout.count()),
                              "request_timeout"));
      case Phase::routing:
        // A late decision finds the stream finishing and releases its booking (on_decision).
        server_.timed_out("routing", options.response_timeout, request_id_);
        return refuse(refusal(504,
                              fmt::format("the request was not routed within {} ms",
                                          options.response_timeout.count()),
                              "timeout"));
      case Phase::routed:
        server_.timed_out("response", options.response_timeout, request_id_);
        release(v1::LIFECYCLE_EVENT_ABORTED, v1::ABORT_CAUSE_UNSPECIFIED,
                fmt::format("the answer did not end within {} ms through Envoy",
                            options.response_timeout.count()));
        return local_reply(refusal(
            504,
            fmt::format("the answer did not end within {} ms", options.response_timeout.count()),
            "timeout"));
      case Phase::refused:
        return;
    }
  }

  // One write at a time (the reactor allows no more); the stream finishes once the outbox is
  // empty.
  void pump() {
    if (writing_ || finished_) return;
    if (!outbox_.empty() && !write_broken_) {
      writing_ = true;
      StartWrite(&outbox_.front());
      return;
    }
    if (finishing_) {
      finished_ = true;
      Finish(status_);
    }
  }

  void on_written(bool ok) {
    writing_ = false;
    if (ok) {
      outbox_.pop_front();
    } else {
      write_broken_ = true;
      outbox_.clear();
      finish(grpc::Status::OK);
    }
    pump();
  }

  // After Finish: the booking, if the answer's end never came through the stream (a response
  // body mode of NONE, or Envoy cancelled), ends with the stream.
  void on_done(bool cancelled) {
    if (booking_id_.empty()) return;
    if (server_.stopping.load()) {
      return release(v1::LIFECYCLE_EVENT_ABORTED, v1::ABORT_CAUSE_UNSPECIFIED,
                     "the router is shutting down");
    }
    if (is_2xx(response_status_) && !cancelled && reads_over_) {
      return release(v1::LIFECYCLE_EVENT_COMPLETED);
    }
    release(v1::LIFECYCLE_EVENT_ABORTED, v1::ABORT_CAUSE_CLIENT_CANCELLED,
            "Envoy closed the stream before the answer ended");
  }

  EndpointPicker::State& server_;
  grpc::CallbackServerContext* context_;
  net::strand<net::io_context::executor_type> strand_;
  // Held from start() to OnDone(): gRPC needs the reactor until then.
  std::shared_ptr<PickerStream> self_;
  net::steady_timer deadline_;
  // Which arming of deadline_ is current.
  std::uint64_t deadline_arming_ = 0;
  ext::ProcessingRequest incoming_;
  std::deque<ext::ProcessingResponse> outbox_;
  grpc::Status status_;
  bool writing_ = false;
  bool write_broken_ = false;
  bool finishing_ = false;
  bool finished_ = false;
  bool reads_over_ = false;
  bool observe_only_ = false;
  // From the stream's first message; unknown (an Envoy before 1.34): treated as BUFFERED and NONE.
  std::optional<BodyMode> request_mode_;
  std::optional<BodyMode> response_mode_;
  Phase phase_ = Phase::headers;
  std::string request_id_;
  std::vector<std::pair<std::string, std::string>> headers_;
  std::optional<std::vector<HintedEndpoint>> subset_;
  Endpoint endpoint_ = Endpoint::chat_completions;
  std::string body_;
  // Bytes of body_ taken from the picker's max_buffered_body_bytes.
  std::size_t body_budget_ = 0;
  bool trailers_ = false;
  std::chrono::steady_clock::time_point body_complete_;
  GenerationRequest request_;
  RequestMetadata metadata_;
  ModelTarget target_;
  std::vector<WorkerId> eligible_;
  std::string booking_id_;
  bool first_token_ = false;
  unsigned response_status_ = 0;
};

// A stream beyond max_open_streams: answered 503 at once, without reading it; it holds nothing
// but its reply until gRPC is done with it.
class RefusedStream final : public Reactor {
 public:
  RefusedStream(std::size_t max_open_streams, std::shared_ptr<std::atomic<std::size_t>> under_way)
      : under_way_(std::move(under_way)) {
    if (under_way_->fetch_add(1) >= kMaxRefusalsUnderWay) {
      Finish(grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                          fmt::format("{} streams are open", max_open_streams)));
      return;
    }
    HttpError error = refusal(503,
                              fmt::format("the endpoint picker has {} streams open, its limit; "
                                          "try again",
                                          max_open_streams),
                              "service_unavailable");
    error.retry_after = std::chrono::seconds{1};
    reply_ = immediate_reply(error, {});
    StartWriteAndFinish(&reply_, grpc::WriteOptions{}, grpc::Status::OK);
  }

  void OnDone() override {
    under_way_->fetch_sub(1);
    delete this;
  }

 private:
  ext::ProcessingResponse reply_;
  // Shared: gRPC may be done with a refused stream after the picker's state is gone.
  std::shared_ptr<std::atomic<std::size_t>> under_way_;
};

class PickerService final : public ext::ExternalProcessor::CallbackService {
 public:
  explicit PickerService(EndpointPicker::State& state) : state_(state) {}

  Reactor* Process(grpc::CallbackServerContext* context) override {
    if (!state_.open_stream()) {
      return new RefusedStream(state_.options.max_open_streams, state_.refusals_under_way);
    }
    auto stream = std::make_shared<PickerStream>(state_, context);
    stream->start();
    return stream.get();
  }

 private:
  EndpointPicker::State& state_;
};

}  // namespace

EndpointPicker::EndpointPicker(std::shared_ptr<State> state) : state_(std::move(state)) {}

std::expected<std::unique_ptr<EndpointPicker>, std::string> EndpointPicker::start(
    EndpointPickerOptions options, std::shared_ptr<RoutingGateway> gateway,
    std::shared_ptr<const FleetDirectory> directory,
    std::shared_ptr<metrics::MetricsRegistry> metrics) {
  if (auto valid = options.validate(); !valid) return std::unexpected(valid.error());
  metrics->describe(std::string{kRequests}, metrics::MetricType::Counter,
                    "Requests Envoy's ext_proc streams brought to the endpoint picker, by outcome "
                    "(routed, refused) and HTTP status");
  metrics->describe(std::string{kStreamsOpen}, metrics::MetricType::Gauge,
                    "Open ext_proc streams of the endpoint picker");
  metrics->describe(std::string{kInFlight}, metrics::MetricType::Gauge,
                    "Requests the endpoint picker routed whose answer has not ended");
  metrics->describe(std::string{kStreamTimeouts}, metrics::MetricType::Counter,
                    "Endpoint picker streams ended by their deadline, by phase: request (no whole "
                    "request in --epp-request-timeout-ms, 408), routing (504) and response (the "
                    "answer did not end in --epp-response-timeout-ms)");
  metrics->describe(std::string{kStreamsRefused}, metrics::MetricType::Counter,
                    "New ext_proc streams answered 503 at once: --epp-max-open-streams were open");
  metrics->describe(std::string{kBufferedBody}, metrics::MetricType::Gauge,
                    "Request body bytes the endpoint picker's streams hold while their requests "
                    "arrive (--epp-max-buffered-body-bytes)");
  metrics->describe(std::string{kAcceptFailures}, metrics::MetricType::Counter,
                    "Connections gRPC failed to accept (out of file descriptors); with gRPC 1.51 "
                    "the endpoint picker accepts no new connection after the first");
  metrics->describe(
      std::string{kAddedLatency}, metrics::MetricType::Histogram,
      "Time from a request's last body byte to the endpoint picker's destination (render and "
      "route included)",
      {0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1});
  auto state = std::make_shared<State>(std::move(options), std::move(gateway), std::move(directory),
                                       std::move(metrics));
  const EndpointPickerOptions& opts = state->options;
  state->service = std::make_unique<PickerService>(*state);
  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  const std::string target = opts.address.find(':') != std::string::npos
                                 ? fmt::format("[{}]:{}", opts.address, opts.port)
                                 : fmt::format("{}:{}", opts.address, opts.port);
  int bound_port = 0;
  builder.AddListeningPort(target, grpc::InsecureServerCredentials(), &bound_port);
  builder.RegisterService(state->service.get());
  // BUFFERED mode sends the whole body in one message.
  builder.SetMaxReceiveMessageSize(static_cast<int>(opts.max_body_bytes + (std::size_t{1} << 20)));
  // gRPC shares ports by default: a port in use must stop startup.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  // HTTP/2's SETTINGS_MAX_CONCURRENT_STREAMS: a client holds its further streams until one ends.
  builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS,
                             static_cast<int>(opts.max_streams_per_connection));
  builder.AddChannelArgument(GRPC_ARG_SERVER_HANDSHAKE_TIMEOUT_MS,
                             static_cast<int>(kHandshakeTimeout.count()));
  builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_IDLE_MS,
                             static_cast<int>(kConnectionIdleLimit.count()));
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS,
                             static_cast<int>(kKeepaliveInterval.count()));
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS,
                             static_cast<int>(kKeepaliveTimeout.count()));
  // gRPC's own memory (its transports' buffers and its calls' arenas) is bounded apart from the
  // streams' state above.
  grpc::ResourceQuota quota{"kvr-endpoint-picker"};
  quota.Resize(opts.grpc_memory_bytes);
  builder.SetResourceQuota(quota);
  // The listener's failures show only in gRPC's log (once per process: the hook is global).
  static std::once_flag log_watched;
  std::call_once(log_watched, [] { gpr_set_log_function(&watch_grpc_log); });
  state->server = builder.BuildAndStart();
  if (!state->server || bound_port == 0) {
    return std::unexpected(
        fmt::format("--epp-port {}: cannot serve the endpoint picker (gRPC) on {} (in use?)",
                    opts.port, target));
  }
  state->port = static_cast<std::uint16_t>(bound_port);
  if (auto* health = state->server->GetHealthCheckService()) {
    health->SetServingStatus(std::string{kLiveness}, true);
  }
  // Every service has its status before the port is announced.
  state->report_health();
  net::post(state->io, [raw = state.get()] { raw->watch_health(); });
  state->thread = std::thread([raw = state.get()] { raw->io.run(); });
  return std::unique_ptr<EndpointPicker>(new EndpointPicker(std::move(state)));
}

EndpointPicker::~EndpointPicker() {
  State& state = *state_;
  state.accepting.store(false);
  state.stopping.store(true);
  // Streams still open get a moment, then are cancelled; their ends run on the io thread, which
  // releases their bookings, so it runs until they are gone.
  state.server->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(500));
  {
    std::unique_lock lock{state.streams_mutex};
    state.streams_gone.wait_for(lock, std::chrono::seconds(2), [&] { return state.streams == 0; });
  }
  {
    std::lock_guard lock{*state.post_mutex};
    *state.posting = false;
  }
  state.work.reset();
  state.io.stop();
  state.thread.join();
}

std::uint16_t EndpointPicker::port() const { return state_->port; }

void EndpointPicker::stop_intake() { state_->accepting.store(false); }

std::size_t EndpointPicker::in_flight() const { return state_->in_flight.load(); }

std::size_t EndpointPicker::open_streams() const { return state_->open_streams(); }

}  // namespace kvr::front_door
