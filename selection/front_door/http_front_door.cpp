#include "selection/front_door/http_front_door.hpp"

#include <array>
#include <condition_variable>
#include <limits>
#include <map>
#include <optional>
#include <sstream>
#include <thread>
#include <unordered_map>

#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/strand.hpp>
#include <boost/asio/write.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <fcntl.h>
#include <fmt/format.h>
#include <malloc.h>
#include <spdlog/spdlog.h>
#include <sys/socket.h>
#include <unistd.h>

#include "messages/descriptor_limit.hpp"
#include "messages/http_url.hpp"
#include "messages/metrics/cache_mismatch_detector.hpp"
#include "messages/metrics/node_metrics.hpp"
#include "messages/metrics/rate_limited_log.hpp"
#include "selection/front_door/generated_answer.hpp"
#include "selection/front_door/openai_api.hpp"
#include "selection/front_door/prompt_renderer.hpp"
#include "selection/front_door/request_routing.hpp"
#include "selection/front_door/tcp_options.hpp"
#include "selection/lifecycle/request_flight.hpp"

namespace kvr::front_door {
namespace {

namespace beast = boost::beast;
namespace http = beast::http;
namespace net = boost::asio;
using tcp = net::ip::tcp;
using Json = nlohmann::json;

constexpr std::string_view kRequests = "kvr_http_requests_total";
constexpr std::string_view kInFlight = "kvr_http_requests_in_flight";
constexpr std::string_view kConnections = "kvr_http_connections_open";
constexpr std::string_view kConnectionsAccepted = "kvr_http_connections_accepted_total";
constexpr std::string_view kEngineFailures = "kvr_http_engine_failures_total";
constexpr std::string_view kRetries = "kvr_http_retries_total";
constexpr std::string_view kClientsGone = "kvr_http_clients_gone_total";
constexpr std::string_view kAddedLatency = "kvr_http_added_latency_seconds";
constexpr std::string_view kEngineFirstByte = "kvr_http_engine_first_byte_seconds";
constexpr std::string_view kRelayFirstByte = "kvr_http_relay_first_byte_seconds";
constexpr std::string_view kEngineConnections = "kvr_http_engine_connections_total";
constexpr std::string_view kClientTimeouts = "kvr_http_client_timeouts_total";
constexpr std::string_view kConnectionsRefused = "kvr_http_connections_refused_total";
constexpr std::string_view kIdleReclaimed = "kvr_http_idle_connections_reclaimed_total";
constexpr std::string_view kAcceptErrors = "kvr_http_accept_errors_total";
constexpr std::string_view kStreamsOverflowed = "kvr_http_streams_overflowed_total";
// The node's own parts of a request's time, in seconds: fine below 5 ms, where they should be.
const std::vector<double> kFrontDoorBuckets{0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.002,
                                            0.003,   0.005,  0.01,    0.025,  0.1,   1};

constexpr std::size_t kMaxHeaderBytes = 64 * 1024;
// Bytes a client may send while its answer streams (a pipelined next request) before the node
// stops reading it.
constexpr std::size_t kMaxPipelinedBytes = 64 * 1024;
constexpr std::size_t kChunkBytes = 16 * 1024;
// The first read of a request: a whole head of most clients.
constexpr std::size_t kFirstReadBytes = 4096;
// Refusals (503 at the cap) still reading what their client sent, so that the answer is not
// lost to a reset: beyond these, a refused client is closed at once.
constexpr std::size_t kMaxLingeringRefusals = 64;
// The longest pause between accepts while the process has no descriptor left.
constexpr std::chrono::milliseconds kMaxAcceptBackoff{1000};
// How often an idle front door gives the memory a burst of requests freed back to the system.
constexpr std::chrono::seconds kMemoryTrimInterval{10};
// Beast's largest single read (http::read's read_size limit).
constexpr std::uint64_t kMaxReadBytes = 64 * 1024;

std::string str(beast::string_view view) { return {view.data(), view.size()}; }

std::string address_of(const tcp::socket& socket) {
  beast::error_code error;
  const auto remote = socket.remote_endpoint(error);
  return error ? std::string{} : remote.address().to_string();
}

}  // namespace

std::expected<void, std::string> FrontDoorOptions::validate() const {
  if (threads == 0 || threads > 64) return std::unexpected("--http-threads: between 1 and 64");
  if (max_body_bytes < 1024 || max_body_bytes > (std::size_t{1} << 30)) {
    return std::unexpected("--http-max-body-bytes: between 1 KiB and 1 GiB");
  }
  if (session_header.empty()) return std::unexpected("--http-session-header: empty");
  if (max_renders_in_flight == 0) return std::unexpected("--http-max-renders-in-flight: >= 1");
  if (auto depth = tokenizer::validate_max_json_depth(max_json_depth); !depth) return depth;
  if (auto pool = render_pool.validate(); !pool) return pool;
  if (max_connections == 0) return std::unexpected("--http-max-connections: >= 1");
  for (const auto timeout : {render_timeout, first_byte_timeout, stall_timeout, idle_timeout,
                             header_timeout, body_timeout, send_timeout}) {
    if (timeout < std::chrono::milliseconds(1)) return std::unexpected("HTTP timeouts: >= 1 ms");
  }
  if (min_body_bytes_per_second == 0) {
    return std::unexpected("--http-min-body-rate: >= 1 byte per second");
  }
  if (max_pending_stream_bytes < 4096) {
    return std::unexpected("--http-max-pending-stream-bytes: >= 4096");
  }
  if (engine_connections.per_engine > 100'000) {
    return std::unexpected("--http-engine-idle-connections: at most 100000");
  }
  if (engine_connections.idle_limit < std::chrono::milliseconds(1)) {
    return std::unexpected("--http-engine-idle-ms: >= 1 ms");
  }
  return {};
}

// ---- the server's shared state ------------------------------------------------------------------

namespace {
class Connection;

// The whole answer to a client refused at accept: a 503 that closes the connection.
std::string refusal_answer(std::string why) {
  const std::string body =
      HttpError{.status = 503, .message = std::move(why), .code = "service_unavailable"}.body();
  return fmt::format(
      "HTTP/1.1 503 Service Unavailable\r\nServer: kvr\r\nContent-Type: application/json\r\n"
      "Retry-After: 1\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{}",
      body.size(), body);
}
}  // namespace

struct HttpFrontDoor::State {
  State(FrontDoorOptions front_options, std::shared_ptr<RoutingGateway> routing_gateway,
        std::shared_ptr<const FleetDirectory> fleet,
        std::shared_ptr<metrics::MetricsRegistry> registry)
      : options(std::move(front_options)),
        gateway(std::move(routing_gateway)),
        directory(std::move(fleet)),
        metrics(std::move(registry)),
        engine_connections(options.engine_connections),
        renderer(options.tokenizer_modes, options.max_renders_in_flight, options.render_timeout,
                 metrics, options.native_tokenizers,
                 NativeRenderOptions{.pool = options.render_pool}),
        io(static_cast<int>(options.threads)),
        acceptor(net::make_strand(io)) {}

  FrontDoorOptions options;
  std::shared_ptr<RoutingGateway> gateway;
  std::shared_ptr<const FleetDirectory> directory;
  std::shared_ptr<metrics::MetricsRegistry> metrics;
  const std::string id_prefix = random_request_prefix();
  const std::int64_t started_unix = std::chrono::duration_cast<std::chrono::seconds>(
                                        std::chrono::system_clock::now().time_since_epoch())
                                        .count();
  std::atomic<std::uint64_t> next_request{0};
  std::atomic<std::size_t> in_flight{0};
  std::atomic<std::size_t> connection_count{0};
  std::atomic<bool> accepting{true};
  metrics::ValueHandle in_flight_gauge = metrics->gauge(kInFlight);
  metrics::ValueHandle connections_gauge = metrics->gauge(kConnections);
  metrics::ValueHandle connections_accepted = metrics->counter(kConnectionsAccepted);
  // The engine connections requests go out on, by outcome.
  metrics::ValueHandle engine_connection_new =
      metrics->counter(kEngineConnections, {{"outcome", "new"}});
  metrics::ValueHandle engine_connection_reused =
      metrics->counter(kEngineConnections, {{"outcome", "reused"}});
  metrics::ValueHandle engine_connection_resent =
      metrics->counter(kEngineConnections, {{"outcome", "resent"}});
  metrics::ValueHandle idle_reclaimed = metrics->counter(kIdleReclaimed);
  metrics::ValueHandle streams_overflowed = metrics->counter(kStreamsOverflowed);
  metrics::HistogramHandle added_latency = metrics->histogram(kAddedLatency);
  metrics::HistogramHandle engine_first_byte = metrics->histogram(kEngineFirstByte);
  metrics::HistogramHandle relay_first_byte = metrics->histogram(kRelayFirstByte);
  // The hit-rate ladder's measured rungs: each answer's usage against the route's prediction.
  metrics::CacheMismatchDetector cache_mismatch;
  metrics::RateLimitedLog cache_log;
  std::uint16_t port = 0;
  // Gateway answers arrive on CAF's threads: they post to a connection's strand only while the
  // io_context lives.
  std::mutex post_mutex;
  bool posting = true;
  // Live connections, so that shutdown can end each one's request with an explicit error.
  std::mutex connections_mutex;
  std::condition_variable connections_gone;
  std::unordered_map<Connection*, std::weak_ptr<Connection>> connections;
  // Connections waiting for a request's first byte, the longest-waiting first (by when they
  // began): at the cap, the first gives its slot to a new client. Under connections_mutex.
  std::map<std::uint64_t, std::weak_ptr<Connection>> idle;
  std::uint64_t next_idle_key = 1;
  // The cap in force: options.max_connections, clamped under the descriptor limit at start.
  std::size_t max_connections = 0;
  std::atomic<std::size_t> lingering_refusals{0};
  // Held back for the moment the process has no descriptor left: closed, it lets one waiting
  // client be accepted and answered 503 instead of left in the listen queue; then opened again.
  int spare_descriptor = -1;
  std::chrono::milliseconds accept_delay{0};
  metrics::RateLimitedLog accept_log{std::chrono::seconds(30)};
  metrics::RateLimitedLog client_log;
  EngineConnections engine_connections;
  // Everything above outlives the io_context (declared last, destroyed first): the connections
  // and renders its unrun handlers still hold release themselves into it.
  PromptRenderer renderer;
  net::io_context io;
  tcp::acceptor acceptor;
  // On the acceptor's strand: the pause after an accept failed for want of descriptors.
  net::steady_timer accept_backoff{acceptor.get_executor()};
  // Starts the native tokenizers' parity checks as models' first engines register.
  net::steady_timer parity_timer{io};
  net::steady_timer memory_trim_timer{io};
  std::atomic<std::uint64_t> requests_since_trim{0};
  std::vector<std::thread> threads;

  template <class Handler>
  void post(const net::any_io_executor& executor, Handler handler) {
    std::lock_guard lock{post_mutex};
    if (posting) net::post(executor, std::move(handler));
  }

  ~State() {
    if (spare_descriptor >= 0) ::close(spare_descriptor);
  }

  void accept();
  void accept_failed(const beast::error_code& error);
  // A new client: served, given an idle connection's slot at the cap, or refused.
  void admit(tcp::socket socket);
  // Closes the connection idle the longest (on its strand); false when none is idle.
  bool reclaim_idle();
  // Sends `socket` its refusal `answer` and closes it once its client has read it (or at once when
  // `linger` is false or too many refusals linger).
  void refuse(tcp::socket socket, std::string_view reason, std::string_view answer, bool linger);
  // Built ahead: with no descriptor left, the refusal neither allocates nor formats.
  const std::string out_of_descriptors_answer =
      refusal_answer("the router has no file descriptor left");
  void count_timeout(std::string_view phase) {
    metrics->add(kClientTimeouts, {{"phase", std::string{phase}}});
  }
  void watch_parity() {
    renderer.check_new_models(*directory, io.get_executor());
    parity_timer.expires_after(std::chrono::seconds(1));
    parity_timer.async_wait([this](beast::error_code error) {
      if (!error && accepting.load()) watch_parity();
    });
  }
  // glibc keeps what a burst of large bodies freed in its arenas (hundreds of MB after an
  // attack); once no request is in flight after some were served, it is returned.
  void trim_memory_when_idle() {
    memory_trim_timer.expires_after(kMemoryTrimInterval);
    memory_trim_timer.async_wait([this](beast::error_code error) {
      if (error || !accepting.load()) return;
      if (in_flight.load() == 0 && requests_since_trim.exchange(0) > 0) ::malloc_trim(0);
      trim_memory_when_idle();
    });
  }
  void count(std::string_view endpoint, unsigned status) {
    metrics->add(kRequests,
                 {{"endpoint", std::string{endpoint}}, {"code", std::to_string(status)}});
  }
};

namespace {

// ---- one client connection ----------------------------------------------------------------------
// Requests are served one after another (HTTP/1.1 keep-alive). While a generation request is in
// flight, one read stays pending on the client's socket: its end is the client going away.

// One attempt's engine connection. Each attempt has its own, held by the handlers of its
// operations as well: a retry never reuses a stream whose aborted operations have not yet
// completed (Beast asserts one pending read or write per stream), and a late completion never
// touches a buffer or parser that is gone.
struct Upstream {
  explicit Upstream(const net::any_io_executor& executor) : stream(executor), resolver(executor) {}

  beast::tcp_stream stream;
  tcp::resolver resolver;
  // Bounded: the answer's bytes pass through it into `chunk`.
  beast::flat_buffer buffer{kChunkBytes};
  std::optional<http::request<http::string_body>> request;
  std::optional<http::response_parser<http::buffer_body>> parser;
  std::string host;
  std::string port;
  /// The connection served an earlier request (taken from the kept-alive ones).
  bool reused = false;
  /// The engine's answer is read through it; held only while a request is in flight, so that an
  /// idle keep-alive connection costs a few hundred bytes.
  std::unique_ptr<char[]> chunk;
};

/// The key of an engine's kept-alive connections.
std::string engine_address(const Upstream& upstream) { return upstream.host + ":" + upstream.port; }

class Connection : public std::enable_shared_from_this<Connection> {
 public:
  Connection(HttpFrontDoor::State& server, tcp::socket socket)
      : server_(server),
        client_address_(address_of(socket)),
        stream_(std::move(socket)),
        deadline_(stream_.get_executor()),
        accepted_(std::chrono::steady_clock::now()) {}

  ~Connection() {
    std::lock_guard lock{server_.connections_mutex};
    server_.connections.erase(this);
    if (idle_key_ != 0) server_.idle.erase(idle_key_);
    server_.connection_count.fetch_sub(1);
    server_.connections_gauge.set(static_cast<double>(server_.connection_count.load()));
    server_.connections_gone.notify_all();
  }

  net::any_io_executor executor() { return stream_.get_executor(); }

  void start() {
    {
      std::lock_guard lock{server_.connections_mutex};
      server_.connections.emplace(this, weak_from_this());
    }
    read_request();
  }

  // From shutdown: the request in flight ends with an explicit error, then the connection closes.
  void shut_down() {
    closing_ = true;
    if (flight_) {
      fail_flight(HttpError{.status = 503,
                            .message = "the router is shutting down",
                            .code = "service_unavailable"},
                  v1::ABORT_CAUSE_UNSPECIFIED);
    } else if (!writing_) {
      close();
    }
  }

  // At the cap: a new client takes this connection's slot if it still waits for a request.
  void reclaim(std::uint64_t idle_key) {
    if (idle_key_ != idle_key || closed_) return;
    server_.idle_reclaimed.add();
    close();
  }

 private:
  // ---- reading requests ----------------------------------------------------------------------
  // Each phase has its deadline, after which the connection closes: a new connection's first
  // head within the header timeout of its accept; a kept-alive one's next request's first byte
  // within the idle timeout, its head within the header timeout of that byte; a body at the
  // minimum rate after a grace.

  enum class ReadPhase : std::uint8_t { first_byte, header, body };

  void read_request() {
    if (closing_ || !server_.accepting.load()) return close();
    const auto now = std::chrono::steady_clock::now();
    // A pipelined request's bytes are here already.
    if (buffer_.size() > 0) {
      head_started_ = now;
      return read_header();
    }
    phase_ = ReadPhase::first_byte;
    stream_.expires_at(requests_ == 0 ? accepted_ + server_.options.header_timeout
                                      : now + server_.options.idle_timeout);
    enter_idle();
    stream_.async_read_some(buffer_.prepare(kFirstReadBytes),
                            [self = shared_from_this()](beast::error_code error, std::size_t n) {
                              self->leave_idle();
                              if (error) return self->read_failed(error);
                              self->buffer_.commit(n);
                              self->head_started_ = self->requests_ == 0
                                                        ? self->accepted_
                                                        : std::chrono::steady_clock::now();
                              self->read_header();
                            });
  }

  void read_header() {
    phase_ = ReadPhase::header;
    parser_.emplace();
    parser_->header_limit(kMaxHeaderBytes);
    parser_->body_limit(server_.options.max_body_bytes);
    stream_.expires_at(head_started_ + server_.options.header_timeout);
    http::async_read_header(stream_, buffer_, *parser_,
                            [self = shared_from_this()](beast::error_code error, std::size_t) {
                              self->on_header(error);
                            });
  }

  void enter_idle() {
    std::lock_guard lock{server_.connections_mutex};
    idle_key_ = server_.next_idle_key++;
    server_.idle.emplace(idle_key_, weak_from_this());
  }

  void leave_idle() {
    if (idle_key_ == 0) return;
    std::lock_guard lock{server_.connections_mutex};
    server_.idle.erase(idle_key_);
    idle_key_ = 0;
  }

  void on_header(beast::error_code error) {
    if (error) return read_failed(error);
    // curl and others wait for "100 Continue" before sending a large body.
    const auto& header = parser_->get();
    const auto expect = header[http::field::expect];
    if (beast::iequals(expect, "100-continue")) {
      auto interim = std::make_shared<http::response<http::empty_body>>(http::status::continue_,
                                                                        header.version());
      writing_ = true;
      http::async_write(
          stream_, *interim,
          [self = shared_from_this(), interim](beast::error_code write_error, std::size_t) {
            self->writing_ = false;
            if (write_error) return self->close();
            self->read_body();
          });
      return;
    }
    read_body();
  }

  void read_body() {
    phase_ = ReadPhase::body;
    body_started_ = std::chrono::steady_clock::now();
    body_bytes_ = 0;
    // A fresh buffer reads 512 bytes at a time: an 80 KB prompt would take 160 reads.
    if (const auto length = parser_->content_length(); length && *length > buffer_.size()) {
      buffer_.reserve(std::min<std::uint64_t>(*length, kMaxReadBytes));
    }
    read_body_part();
  }

  // Reads the body on, each part under a deadline that grows with the bytes already read: a body
  // may take the body timeout plus its bytes at the minimum rate.
  void read_body_part() {
    if (parser_->is_done()) return body_done();
    const auto allowance =
        server_.options.body_timeout +
        std::chrono::milliseconds(body_bytes_ * 1000 / server_.options.min_body_bytes_per_second);
    stream_.expires_at(body_started_ + allowance);
    http::async_read_some(stream_, buffer_, *parser_,
                          [self = shared_from_this()](beast::error_code error, std::size_t n) {
                            if (error) return self->read_failed(error);
                            self->body_bytes_ += n;
                            self->read_body_part();
                          });
  }

  void body_done() {
    body_received_ = std::chrono::steady_clock::now();
    stream_.expires_never();
    ++requests_;
    server_.requests_since_trim.fetch_add(1, std::memory_order_relaxed);
    // A large body's capacity is not kept for the connection's lifetime.
    buffer_.shrink_to_fit();
    serve(parser_->release());
  }

  void read_failed(beast::error_code error) {
    if (error == beast::error::timeout) {
      // A kept-alive connection idle past its timeout ends as expected; any other phase is a
      // client too slow with its request.
      const bool idle = phase_ == ReadPhase::first_byte && requests_ > 0;
      const std::string_view phase = idle ? "idle" : phase_ == ReadPhase::body ? "body" : "header";
      server_.count_timeout(phase);
      return close();
    }
    if (error == http::error::body_limit) {
      keep_alive_ = false;
      return respond_error(
          "", HttpError{.status = 413,
                        .message = fmt::format("the request body is larger than {} bytes",
                                               server_.options.max_body_bytes),
                        .type = "invalid_request_error",
                        .code = "request_too_large"});
    }
    if (error == http::error::header_limit) {
      keep_alive_ = false;
      return respond_error("", HttpError{.status = 431,
                                         .message = "the request headers are too large",
                                         .type = "invalid_request_error"});
    }
    if (error != http::error::end_of_stream && error != net::error::operation_aborted &&
        error != beast::error::timeout && error != net::error::connection_reset &&
        error != net::error::eof && parser_ && parser_->got_some()) {
      keep_alive_ = false;
      return respond_error("", bad_request("malformed HTTP request: " + error.message()));
    }
    close();
  }

  // ---- routing a request to its endpoint -------------------------------------------------------

  void serve(http::request<http::string_body> request) {
    keep_alive_ = request.keep_alive();
    version_ = request.version();
    const beast::string_view target = request.target();
    const std::string_view path{target.data(), target.find('?') == beast::string_view::npos
                                                   ? target.size()
                                                   : target.find('?')};
    const auto method = request.method();
    const auto only = [&](http::verb allowed) {
      if (method == allowed) return true;
      respond_error(path,
                    HttpError{.status = 405,
                              .message = fmt::format("{} takes {} only", quote_for_error(path),
                                                     str(http::to_string(allowed))),
                              .type = "invalid_request_error"});
      return false;
    };
    if (path == "/v1/chat/completions" || path == "/v1/completions") {
      if (!only(http::verb::post)) return;
      const Endpoint endpoint =
          path == "/v1/completions" ? Endpoint::completions : Endpoint::chat_completions;
      return start_flight(endpoint, std::move(request));
    }
    if (path == "/v1/models") {
      if (only(http::verb::get)) serve_models();
      return;
    }
    if (path == "/health") {
      if (only(http::verb::get)) serve_health();
      return;
    }
    // Counted as "other": a label per unknown path would let a client grow the metrics at will.
    respond_error("", HttpError{.status = 404,
                                .message = fmt::format("no endpoint {}", quote_for_error(path)),
                                .type = "invalid_request_error",
                                .code = "unknown_url"});
  }

  void serve_models() {
    Json data = Json::array();
    for (const std::string& model : server_.directory->models()) {
      data.push_back(Json{{"id", model},
                          {"object", "model"},
                          {"created", server_.started_unix},
                          {"owned_by", "kvr"},
                          {"parent", nullptr}});
    }
    // LoRA adapters as vLLM lists them: models whose parent is the base model.
    for (const ServedAdapter& adapter : server_.directory->adapters()) {
      data.push_back(Json{{"id", adapter.name},
                          {"object", "model"},
                          {"created", server_.started_unix},
                          {"owned_by", "kvr"},
                          {"parent", adapter.model}});
    }
    respond("/v1/models", 200, Json{{"object", "list"}, {"data", std::move(data)}}.dump());
  }

  void serve_health() {
    const bool ready = server_.directory->any_live();
    respond("/health", ready ? 200 : 503,
            Json{{"status", ready ? "ready" : "no live worker"}}.dump());
  }

  // ---- writing whole answers -------------------------------------------------------------------

  void respond(std::string_view endpoint, unsigned status, std::string body,
               std::string content_type = "application/json",
               std::vector<std::pair<std::string, std::string>> headers = {}) {
    server_.count(endpoint.empty() ? "other" : endpoint, status);
    auto response = std::make_shared<http::response<http::string_body>>(
        static_cast<http::status>(status), version_);
    response->set(http::field::content_type, content_type);
    response->set(http::field::server, "kvr");
    for (auto& [name, value] : headers) response->set(name, value);
    response->body() = std::move(body);
    response->keep_alive(keep_alive_ && !closing_);
    response->prepare_payload();
    writing_ = true;
    stream_.expires_after(server_.options.send_timeout);
    http::async_write(stream_, *response,
                      [self = shared_from_this(), response](beast::error_code error, std::size_t) {
                        self->writing_ = false;
                        self->stream_.expires_never();
                        if (error == beast::error::timeout) self->server_.count_timeout("send");
                        if (error) return self->close();
                        if (!response->keep_alive()) return self->close_after_reading();
                        self->next_request();
                      });
  }

  void respond_error(std::string_view endpoint, const HttpError& error) {
    std::vector<std::pair<std::string, std::string>> headers;
    if (!request_id_.empty()) headers.emplace_back("x-kvr-request-id", request_id_);
    if (error.retry_after) {
      headers.emplace_back("retry-after", std::to_string(error.retry_after->count()));
    }
    respond(endpoint, error.status, error.body(), "application/json", std::move(headers));
  }

  // After an answer: the next request, once a pending watch read (if any) has completed.
  void next_request() {
    request_id_.clear();
    if (watching_) {
      awaiting_next_ = true;
      if (buffer_.size() > 0) {
        // A pipelined request is buffered already: the watch read gives way to it (its
        // completion, aborted or with more bytes, starts the next request).
        beast::error_code ignored;
        stream_.socket().cancel(ignored);
        return;
      }
      // The watch read stays pending: its bytes start the next request, its end closes.
      enter_idle();
      deadline_.expires_after(server_.options.idle_timeout);
      deadline_.async_wait([self = shared_from_this()](beast::error_code error) {
        if (!error && self->awaiting_next_) {
          self->server_.count_timeout("idle");
          self->close();
        }
      });
      return;
    }
    read_request();
  }

  // Closes after the answer reached the client: a close with unread request bytes (a body over
  // the limit) would reset the connection and could discard the answer, so the node first stops
  // sending and reads what the client still sends, for a second at most.
  void close_after_reading() {
    if (closed_ || watching_) return close();
    beast::error_code ignored;
    stream_.socket().shutdown(tcp::socket::shutdown_send, ignored);
    stream_.expires_after(std::chrono::seconds(1));
    buffer_.clear();
    stream_.async_read_some(buffer_.prepare(16 * 1024),
                            [self = shared_from_this()](beast::error_code error, std::size_t) {
                              if (error) return self->close();
                              self->close_after_reading();
                            });
  }

  void close() {
    if (closed_) return;
    closed_ = true;
    leave_idle();
    beast::error_code ignored;
    deadline_.cancel();
    stream_.socket().shutdown(tcp::socket::shutdown_both, ignored);
    stream_.close();
    close_upstream();
  }

  // ---- a generation request
  // ----------------------------------------------------------------------

  struct Flight {
    Endpoint endpoint = Endpoint::chat_completions;
    std::string endpoint_path;
    GenerationRequest request;
    std::string body;
    std::string authorization;
    std::string accept;
    RequestMetadata metadata;
    RoutingKey key;
    std::chrono::steady_clock::time_point received;
    // The attempt's forwarding began (its engine connection opened, the request sent from then).
    std::chrono::steady_clock::time_point forwarded;
    // Decides the forwarded request's flight (retries, deadlines, one release per booking); the
    // connection carries out its steps. Absent for a request served through the generate API,
    // whose flight the node's lifecycle actor runs.
    std::optional<RequestFlight> core;
    // When the deadline timer wakes for the core.
    std::optional<FlightTime> deadline_at;
    // The byte runs relayed from the attempt's engine: the core's chunk indexes.
    std::uint32_t runs = 0;
    // The attempt under way: its booking and worker.
    std::string booking_id;
    std::uint64_t worker_id = 0;
    std::string worker_url;
    std::uint64_t predicted_cached_tokens = 0;
    bool first_byte = false;
    std::chrono::steady_clock::time_point engine_first_byte;
    // What the client has been sent of the answer.
    bool header_sent = false;
    bool streaming = false;
    std::string answer;       // a non-streamed answer, gathered
    std::string stream_tail;  // a streamed answer's last bytes: its usage, when it has one
    unsigned answer_status = 200;
    std::string answer_type;
    // A model whose workers registered no HTTP URL is served through the node's generate API:
    // tokenized and answered with its tokenizer.
    std::shared_ptr<const tokenizer::PromptTokenizer> tokenizer;
    std::shared_ptr<GenerateStream> generation;
    std::optional<GeneratedAnswer> generated;
    // Server-Sent Events waiting for the client while a write is under way.
    std::string events;
    bool events_end = false;
  };

  // A callback, on any thread, that hands its value to `handle` on this connection's strand
  // while the connection lives (a value for an older flight is then ignored by `epoch`).
  template <typename Value>
  std::function<void(Value)> on_strand(void (Connection::*handle)(std::uint64_t, Value)) {
    return [weak = weak_from_this(), epoch = epoch_, handle](Value value) {
      if (auto self = weak.lock()) {
        self->server_.post(self->stream_.get_executor(),
                           [self, epoch, handle, value = std::move(value)]() mutable {
                             ((*self).*handle)(epoch, std::move(value));
                           });
      }
    };
  }

  void start_flight(Endpoint endpoint, http::request<http::string_body> request) {
    request_id_ = fmt::format("kvr-{}-{}", server_.id_prefix, server_.next_request.fetch_add(1));
    const std::string_view path = path_of(endpoint);
    auto parsed = parse_generation_request(endpoint, request.body(), server_.renderer.text_use(),
                                           server_.options.max_json_depth);
    if (!parsed) return respond_error(path, parsed.error());
    auto metadata = read_request_metadata(
        [&request](std::string_view name) -> std::string_view {
          const auto found = request.find(beast::string_view{name.data(), name.size()});
          if (found == request.end()) return {};
          return {found->value().data(), found->value().size()};
        },
        server_.options.session_header);
    if (!metadata) return respond_error(path, metadata.error());
    const ModelTarget target = server_.directory->target(parsed->model);
    if (target.workers.empty()) {
      return respond_error(
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
        return respond_error(path, bad_request("n: a positive integer is required", "n"));
      }
      if (choices > 1) {
        return respond_error(
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
        return respond_error(
            path,
            HttpError{
                .status = 503,
                .message = fmt::format(
                    "{0}, and the node has no tokenizer for `{1}` to serve it through "
                    "kvr's generate API (token ids in, token ids out): give the node one "
                    "(--tokenizer {1}=DIR, or `tokenizers` in the router-policy YAML){2}",
                    why, parsed->model, two_hops ? "" : ", or run the engines behind `kvr bridge`"),
                .code = "service_unavailable"});
      }
    }
    flight_.emplace();
    flight_->tokenizer = std::move(tokenizer);
    flight_->endpoint = endpoint;
    flight_->endpoint_path = std::string{path};
    // The node's part starts with the whole body (how fast it comes is the client's part), so
    // parsing it is the node's.
    flight_->received = body_received_;
    flight_->body = std::move(request.body());
    flight_->request = std::move(*parsed);
    flight_->metadata = std::move(*metadata);
    if (const auto found = request.find(http::field::authorization); found != request.end()) {
      flight_->authorization = str(found->value());
    }
    if (const auto found = request.find(http::field::accept); found != request.end()) {
      flight_->accept = str(found->value());
    }
    server_.in_flight.fetch_add(1);
    server_.in_flight_gauge.set(static_cast<double>(server_.in_flight.load()));
    watch_client();
    const std::uint64_t epoch = ++epoch_;
    server_.renderer.render(
        stream_.get_executor(), flight_->request, flight_->body, std::move(engine_urls),
        [self = shared_from_this(), epoch](RenderResult key) {
          if (epoch != self->epoch_ || !self->flight_) return;
          if (!key) return self->fail_flight(key.error(), {});
          self->flight_->key = std::move(*key);
          self->route();
        },
        client_address_);
  }

  // One read on the client's socket while its request is served: it ends when the client goes.
  void watch_client() {
    if (watching_ || closed_) return;
    if (buffer_.size() >= kMaxPipelinedBytes) return;
    watching_ = true;
    stream_.expires_never();
    stream_.async_read_some(buffer_.prepare(4096),
                            [self = shared_from_this()](beast::error_code error, std::size_t n) {
                              self->watching_ = false;
                              if (!error) self->buffer_.commit(n);
                              if (self->awaiting_next_) {
                                self->awaiting_next_ = false;
                                self->leave_idle();
                                self->deadline_.cancel();
                                // Cancelled by next_request() for a pipelined request.
                                const bool gave_way = error == net::error::operation_aborted &&
                                                      self->buffer_.size() > 0 && !self->closed_;
                                if (error && !gave_way) return self->close();
                                return self->read_request();
                              }
                              if (error) {
                                if (self->flight_) return self->client_gone();
                                return self->close();
                              }
                              if (self->flight_) self->watch_client();
                            });
  }

  // True when prefill and decode workers serve the model and no aggregated worker does.
  static bool disaggregated(const ModelTarget& target) {
    const auto has = [&](WorkerType role) {
      return std::ranges::any_of(
          target.workers, [&](const DirectoryWorker& worker) { return worker.role == role; });
    };
    return !has(WorkerType::Aggregated) && has(WorkerType::Decode);
  }

  void route() {
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
  void request_route(const FlightRouteRequest& route) {
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
    routing_ = shared_from_this();
    server_.gateway->route(
        std::move(request), [weak = weak_from_this(), epoch = epoch_,
                             gateway = server_.gateway](v1::RouteDecision decision) {
          if (auto self = weak.lock()) {
            self->server_.post(self->stream_.get_executor(),
                               [self, epoch, decision = std::move(decision)]() mutable {
                                 self->on_decision(epoch, std::move(decision));
                               });
          } else if (decision.has_success()) {
            report_booking(*gateway, decision.success().booking_id(), v1::LIFECYCLE_EVENT_ABORTED,
                           v1::ABORT_CAUSE_CLIENT_CANCELLED, "the client went away");
          }
        });
  }

  void on_decision(std::uint64_t epoch, v1::RouteDecision decision) {
    if (epoch != epoch_ || !flight_) {
      // The client went away while the request was routed: release what was booked for it.
      if (decision.has_success()) {
        report(decision.success().booking_id(), v1::LIFECYCLE_EVENT_ABORTED,
               v1::ABORT_CAUSE_CLIENT_CANCELLED, "the client went away");
      }
      return;
    }
    routing_.reset();  // decided: the posted handler holds this connection now
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
  void carry_out(FlightResult result, const HttpError* failure = nullptr,
                 std::string_view why = {}) {
    if (!result) return;  // an input the core refused (a late one) changes nothing
    FlightStep& step = *result;
    Flight& flight = *flight_;
    std::string timeout;
    if (step.timed_out) {
      const bool first = step.timed_out == FlightTimeout::first_token;
      timeout = first ? fmt::format("no first byte within {} ms",
                                    server_.options.first_byte_timeout.count())
                      : fmt::format("the answer stalled for {} ms",
                                    server_.options.stall_timeout.count());
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
  void arm_deadline() {
    if (!flight_ || !flight_->core) return;
    Flight& flight = *flight_;
    const auto due = flight.core->deadline();
    if (!due || (flight.deadline_at && *flight.deadline_at <= *due)) return;
    flight.deadline_at = *due;
    deadline_.expires_at(*due);
    deadline_.async_wait([self = shared_from_this()](beast::error_code error) {
      if (error || !self->flight_ || !self->flight_->core) return;
      self->flight_->deadline_at.reset();
      self->carry_out(self->flight_->core->tick(std::chrono::steady_clock::now()));
    });
  }

  // The answer of a request the core ended: a timeout in the front door's words, else the core's.
  HttpError error_for(const StreamEnd& end, std::optional<FlightTimeout> timed_out,
                      std::string_view timeout) const {
    const bool first_byte = timed_out == FlightTimeout::first_token;
    return HttpError{.status = first_byte ? 504u : 502u,
                     .message = fmt::format("worker {} failed: {}", flight_->worker_id,
                                            timed_out ? timeout : std::string_view{end.message}),
                     .code = first_byte ? "timeout" : "worker_failed"};
  }

  // Reports the end of the attempt's booking. An engine's refusal (a 4xx answer, relayed as it
  // is) blames nobody; a failure names its cause.
  void report_release(const BookingChange& release, std::string_view why,
                      v1::AbortCause otherwise = v1::ABORT_CAUSE_UNSPECIFIED) {
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
  void end_attempt() {
    if (upstream_ && upstream_->request) flight_->body = std::move(upstream_->request->body());
    close_upstream();
  }

  // ---- through the node's generate API
  // ----------------------------------------------------------- The node routes, dispatches to the
  // worker over NATS, retries a worker failure before the first token and ends the booking; the
  // front door turns the chunks into OpenAI's answer.

  // Output tokens when the request names none: OpenAI's default for completions; a chat, which
  // OpenAI lets run to the end of the context, gets a bound.
  static constexpr std::uint32_t kDefaultCompletionTokens = 16;
  static constexpr std::uint32_t kDefaultChatTokens = 256;

  void generate() {
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
        GenerateCallbacks{.decision = on_strand(&Connection::on_generate_decision),
                          .chunk = on_strand(&Connection::on_generate_chunk)});
  }

  void on_generate_decision(std::uint64_t epoch, v1::RouteDecision decision) {
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

  void on_generate_chunk(std::uint64_t epoch, v1::GenerateChunk chunk) {
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
      return respond(endpoint, 200, std::move(whole), "application/json", std::move(headers));
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
      return close();
    }
    write_events();
  }

  // Writes the events gathered while the last write was under way, in one chunk.
  void write_events() {
    Flight& flight = *flight_;
    if (writing_ || flight.events.empty()) return;
    const bool last = flight.events_end;
    auto events = std::make_shared<std::string>(std::move(flight.events));
    flight.events.clear();
    const net::const_buffer bytes = net::buffer(*events);
    send_chunk(bytes, std::move(events), last, &Connection::write_events);
  }

  // ---- forwarding to the engine ----------------------------------------------------------------

  void forward() {
    Flight& flight = *flight_;
    const auto url = split_http_url(flight.worker_url);
    if (!url || url->https) {
      return engine_failed(fmt::format("cannot reach '{}' (the front door forwards over http:// "
                                       "only)",
                                       flight.worker_url),
                           std::nullopt);  // unreachable here: not the worker's fault
    }
    upstream_ = std::make_shared<Upstream>(stream_.get_executor());
    auto& request = upstream_->request;
    request.emplace(http::verb::post, url->path + flight.endpoint_path, 11);
    request->set(http::field::host, url->host + ":" + url->port);
    request->set(http::field::content_type, "application/json");
    request->set(http::field::user_agent, "kvr");
    request->set("x-request-id", request_id_);
    if (!flight.accept.empty()) request->set(http::field::accept, flight.accept);
    if (!flight.authorization.empty()) {
      request->set(http::field::authorization, flight.authorization);
    }
    // Moved, not copied (prompts run to megabytes); a retry takes it back.
    request->body() = std::move(flight.body);
    request->prepare_payload();
    upstream_->host = url->host;
    upstream_->port = url->port;
    // The node's part ends here: connecting and sending are what a client reaching the engine
    // directly pays as well, so they count as the engine's.
    flight.forwarded = std::chrono::steady_clock::now();
    server_.added_latency.observe(
        std::chrono::duration<double>(flight.forwarded - flight.received).count());
    if (auto parked = server_.engine_connections.take(engine_address(*upstream_))) {
      beast::error_code error;
      upstream_->stream.socket().assign(parked->protocol, parked->handle, error);
      if (!error) {
        upstream_->reused = true;
        server_.engine_connection_reused.add();
        return send_upstream();
      }
      ::close(parked->handle);
    }
    connect_upstream(server_.engine_connection_new);
  }

  void connect_upstream(const metrics::ValueHandle& outcome) {
    outcome.add();
    connect_engine(
        upstream_->stream, upstream_->resolver, upstream_->host, upstream_->port,
        [self = shared_from_this(), up = upstream_, epoch = epoch_](beast::error_code error,
                                                                    std::string_view what) {
          if (epoch != self->epoch_) return;
          if (error) {
            return self->engine_failed(fmt::format("cannot {}: {}", what, error.message()));
          }
          self->send_upstream();
        });
  }

  // A kept-alive connection the engine closed as the request went out fails before any answer
  // byte: the request is sent again on a new connection, and the engine is not to blame.
  bool resend_on_new_connection() {
    Upstream& up = *upstream_;
    if (!up.reused) return false;
    up.reused = false;
    beast::error_code ignored;
    up.stream.socket().close(ignored);
    up.buffer.clear();
    up.parser.reset();
    connect_upstream(server_.engine_connection_resent);
    return true;
  }

  void send_upstream() {
    const std::uint64_t epoch = epoch_;
    http::async_write(
        upstream_->stream, *upstream_->request,
        [self = shared_from_this(), up = upstream_, epoch](beast::error_code error, std::size_t) {
          if (epoch != self->epoch_) return;
          if (error) {
            if (self->resend_on_new_connection()) return;
            return self->engine_failed("cannot send: " + error.message());
          }
          self->read_upstream_header();
        });
  }

  // Keeps the engine connection for the next request when its answer ended cleanly and the engine
  // keeps it alive; otherwise it is closed with the attempt.
  void park_upstream() {
    if (!upstream_) return;
    Upstream& up = *upstream_;
    if (!up.parser || !up.parser->is_done() || !up.parser->keep_alive() || up.buffer.size() != 0) {
      return;
    }
    beast::error_code error;
    const auto protocol = up.stream.socket().local_endpoint(error).protocol();
    if (error) return;
    const auto handle = up.stream.socket().release(error);
    if (error) return;
    server_.engine_connections.park(engine_address(up), {protocol, handle});
    upstream_.reset();
  }

  void read_upstream_header() {
    auto& parser = upstream_->parser;
    parser.emplace();
    // No limit here (a stream may run long; a gathered answer has its own). Not boost::none:
    // Beast 1.74 compares a Content-Length with an empty limit as exceeding it.
    parser->body_limit(std::numeric_limits<std::uint64_t>::max());
    const std::uint64_t epoch = epoch_;
    http::async_read_header(
        upstream_->stream, upstream_->buffer, *parser,
        [self = shared_from_this(), up = upstream_, epoch](beast::error_code error, std::size_t) {
          if (epoch != self->epoch_) return;
          if (error) {
            if (!up->parser->got_some() && self->resend_on_new_connection()) return;
            return self->engine_failed("no answer: " + error.message());
          }
          self->on_upstream_header();
        });
  }

  void on_upstream_header() {
    Flight& flight = *flight_;
    const auto& header = upstream_->parser->get();
    flight.answer_status = header.result_int();
    flight.answer_type = str(header[http::field::content_type]);
    if (flight.answer_status >= 500) {
      return engine_failed(fmt::format("the engine answered {}", flight.answer_status));
    }
    flight.streaming = flight.answer_status == 200 &&
                       beast::string_view{flight.answer_type}.starts_with("text/event-stream");
    read_upstream_body();
  }

  // Relays the engine's answer: decodes whatever is already read, reads from the engine only when
  // nothing is left to decode, so that one client write carries every event one read brought.
  void read_upstream_body() {
    Upstream& up = *upstream_;
    if (!up.chunk) {
      up.chunk = std::make_unique<char[]>(kChunkBytes);
      up.buffer.reserve(kChunkBytes);  // one read takes every event waiting in the socket
    }
    const auto decoded = decode_upstream();
    if (!decoded) return;
    if (*decoded > 0 || up.parser->is_done()) return on_upstream_bytes(*decoded);
    read_engine_bytes();
  }

  // The answer's body bytes decoded from what is buffered into `chunk`; nullopt when the answer
  // is not valid HTTP (the attempt has failed then).
  std::optional<std::size_t> decode_upstream() {
    Upstream& up = *upstream_;
    auto& parser = *up.parser;
    std::size_t decoded = 0;
    while (!parser.is_done() && up.buffer.size() > 0 && decoded < kChunkBytes) {
      auto& body = parser.get().body();
      body.data = up.chunk.get() + decoded;
      body.size = kChunkBytes - decoded;
      beast::error_code error;
      const std::size_t used = parser.put(up.buffer.data(), error);
      up.buffer.consume(used);
      decoded = kChunkBytes - body.size;
      if (error == http::error::need_more || error == http::error::need_buffer) break;
      if (error) {
        engine_failed("the answer is not valid HTTP: " + error.message(),
                      FailureCause::worker_failed);
        return std::nullopt;
      }
      if (used == 0) break;
    }
    return decoded;
  }

  void read_engine_bytes() {
    Upstream& up = *upstream_;
    const std::size_t room = beast::read_size(up.buffer, kChunkBytes);
    if (room == 0) {
      return engine_failed(
          fmt::format("the answer's framing needs more than {} bytes", kChunkBytes),
          FailureCause::worker_failed);
    }
    const std::uint64_t epoch = epoch_;
    up.stream.async_read_some(
        up.buffer.prepare(room),
        [self = shared_from_this(), up = upstream_, epoch](beast::error_code error, std::size_t n) {
          if (epoch != self->epoch_) return;
          up->buffer.commit(n);
          if (error == net::error::eof && up->parser->need_eof()) {
            up->parser->put_eof(error);  // an answer delimited by the connection's end
          }
          if (error) {
            return self->engine_failed(self->flight_->first_byte
                                           ? "the answer broke off: " + error.message()
                                           : "no answer: " + error.message(),
                                       FailureCause::worker_failed);
          }
          self->read_upstream_body();
        });
  }

  void on_upstream_bytes(std::size_t bytes) {
    Flight& flight = *flight_;
    Upstream& up = *upstream_;
    const bool done = up.parser->is_done();
    const auto now = std::chrono::steady_clock::now();
    bool first = false;
    if (bytes > 0 && !flight.first_byte) {
      first = true;
      flight.first_byte = true;
      flight.engine_first_byte = now;
      server_.engine_first_byte.observe(
          std::chrono::duration<double>(now - flight.forwarded).count());
      // No retry after the first byte: a long stream keeps neither its prompt nor its body.
      up.request.reset();
      flight.key = {};
    }
    if (!flight.streaming) {
      if (first) carry_out(flight.core->on_chunk(engine_run(false), now));
      if (flight.answer.size() + bytes > server_.options.max_response_bytes) {
        return engine_failed(fmt::format("the engine's answer is larger than {} bytes",
                                         server_.options.max_response_bytes),
                             FailureCause::worker_failed);
      }
      flight.answer.append(up.chunk.get(), bytes);
      if (!done) return read_upstream_body();
      return finish_whole_answer();
    }
    if (bytes == 0) return finish_stream();  // done: nothing decoded means nothing is left
    keep_stream_tail(flight, std::string_view{up.chunk.get(), bytes});
    // Written straight from `chunk`, which nothing refills before the write completes.
    send_chunk(net::buffer(up.chunk.get(), bytes), upstream_, done,
               &Connection::read_upstream_body);
    // After the write went out: the first token's report wakes an actor thread, which must not
    // delay the client's first token (the end is fed when the last write completed).
    carry_out(flight.core->on_chunk(engine_run(false), now));
  }

  // The next run of the engine's answer bytes, as the core counts a worker's chunks.
  StreamChunk engine_run(bool last) {
    Flight& flight = *flight_;
    return StreamChunk{.worker = *flight.core->worker(), .index = flight.runs++, .finished = last};
  }

  std::vector<std::pair<std::string, std::string>> kvr_headers() const {
    const Flight& flight = *flight_;
    std::vector<std::pair<std::string, std::string>> headers{
        {"x-kvr-request-id", request_id_},
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

  // The usage event ends a stream (when the client asked for it): 4 KiB hold it whole.
  static void keep_stream_tail(Flight& flight, std::string_view bytes) {
    constexpr std::size_t kTail = 4096;
    if (bytes.size() >= kTail) {
      flight.stream_tail.assign(bytes.substr(bytes.size() - kTail));
      return;
    }
    flight.stream_tail.append(bytes);
    if (flight.stream_tail.size() > 2 * kTail)
      flight.stream_tail.erase(0, flight.stream_tail.size() - kTail);
  }

  // Counts the answer's cache outcome (its usage against the route's prediction) in the node's
  // hit-rate ladder; answers without usage are not counted.
  void record_cache_outcome(const Flight& flight, std::string_view answer) {
    const auto usage = answer_usage(answer);
    if (!usage) return;
    metrics::record_cache_outcome(
        metrics::NodeMetrics{*server_.metrics}, server_.cache_mismatch, server_.cache_log,
        server_.directory->target(flight.request.model).model, usage->prompt_tokens,
        flight.predicted_cached_tokens, usage->cached_tokens);
  }

  void finish_whole_answer() {
    Flight& flight = *flight_;
    park_upstream();
    const unsigned status = flight.answer_status;
    // A refusal (4xx) goes back as it is, blaming nobody (report_release).
    carry_out(flight.core->on_chunk(engine_run(true), std::chrono::steady_clock::now()));
    if (status == 200) record_cache_outcome(flight, flight.answer);
    auto headers = kvr_headers();
    std::string answer = std::move(flight.answer);
    std::string type = flight.answer_type.empty() ? "application/json" : flight.answer_type;
    const std::string endpoint = flight.endpoint_path;
    end_flight();
    respond(endpoint, status, std::move(answer), std::move(type), std::move(headers));
  }

  // Streams `bytes` (kept alive by `holder`) to the client, its response header first; then
  // `then` runs, unless it was the last chunk or the client went away.
  template <class Holder>
  void send_chunk(net::const_buffer bytes, Holder holder, bool last, void (Connection::*then)()) {
    Flight& flight = *flight_;
    const std::uint64_t epoch = epoch_;
    auto after = [self = shared_from_this(), epoch, holder = std::move(holder), last, then](
                     beast::error_code error, std::size_t) {
      self->writing_ = false;
      if (error == beast::error::timeout) self->server_.count_timeout("send");
      if (epoch != self->epoch_ || !self->flight_) return;
      if (error) return self->client_gone();
      if (last) return self->finish_stream();
      ((*self).*then)();
    };
    writing_ = true;
    // The read timer is left alone while the client watch is pending.
    stream_.expires_after(server_.options.send_timeout);
    if (!flight.header_sent) {
      flight.header_sent = true;
      http::response<http::empty_body> header{http::status::ok, version_};
      header.set(http::field::content_type, flight.answer_type);
      header.set(http::field::cache_control, "no-cache");
      header.set(http::field::server, "kvr");
      for (auto& [name, value] : kvr_headers()) header.set(name, value);
      header.keep_alive(keep_alive_);
      header.chunked(true);
      std::ostringstream head;
      head << header.base();
      stream_head_ = std::move(head).str();
      // The relay's part of the time to first token: from the engine's first byte to the client's
      // first event written (the node's other part ends where forwarding starts).
      auto first_written = [self = shared_from_this(), epoch, after = std::move(after)](
                               beast::error_code error, std::size_t written) mutable {
        if (!error && epoch == self->epoch_ && self->flight_ && self->flight_->first_byte) {
          self->server_.relay_first_byte.observe(
              std::chrono::duration<double>(std::chrono::steady_clock::now() -
                                            self->flight_->engine_first_byte)
                  .count());
        }
        after(error, written);
      };
      // One write, head and first chunk: the client wakes once for its first token.
      net::async_write(stream_,
                       beast::buffers_cat(net::buffer(stream_head_), http::make_chunk(bytes)),
                       std::move(first_written));
      return;
    }
    net::async_write(stream_, http::make_chunk(bytes), std::move(after));
  }

  void finish_stream() {
    Flight& flight = *flight_;
    park_upstream();
    carry_out(flight.core->on_chunk(engine_run(true), std::chrono::steady_clock::now()));
    record_cache_outcome(flight, flight.stream_tail);
    server_.count(flight.endpoint_path, 200);
    end_stream();
  }

  // Ends a chunked answer (with an error event first, when `error` is set).
  void end_stream(const HttpError* failure = nullptr) {
    std::string tail;
    if (failure != nullptr) {
      tail = fmt::format("data: {}\n\ndata: [DONE]\n\n", failure->body());
    }
    end_flight();
    auto pending = std::make_shared<std::string>(std::move(tail));
    writing_ = true;
    const auto finish = [self = shared_from_this(), pending](beast::error_code error, std::size_t) {
      self->writing_ = false;
      if (error == beast::error::timeout) self->server_.count_timeout("send");
      if (error || !self->keep_alive_ || self->closing_) return self->close();
      self->next_request();
    };
    stream_.expires_after(server_.options.send_timeout);
    if (pending->empty()) {
      net::async_write(stream_, http::make_chunk_last(), finish);
      return;
    }
    net::async_write(stream_, http::make_chunk(net::buffer(*pending)),
                     [self = shared_from_this(), finish](beast::error_code error, std::size_t n) {
                       if (error) return finish(error, n);
                       net::async_write(self->stream_, http::make_chunk_last(), finish);
                     });
  }

  // ---- failures ------------------------------------------------------------------------------

  // The engine failed the attempt: the core retries it elsewhere while nothing reached the
  // client (max_retries times), else the request ends with an explicit error.
  void engine_failed(std::string why,
                     std::optional<FailureCause> cause = FailureCause::worker_failed) {
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

  // Ends the request in flight with `error`: an error answer, or an error event when the
  // answer's header went out already. Releases its booking with `cause`.
  void fail_flight(const HttpError& error, v1::AbortCause cause) {
    Flight& flight = *flight_;
    if (flight.core) {
      // Ended by the connection (shutdown, a render or write failure): the booking, if one is
      // open, ends with it. After the core's own end this is refused and releases nothing.
      auto aborted = flight.core->abort(Error::unavailable, error.message);
      if (aborted && aborted->release) report_release(*aborted->release, error.message, cause);
    }
    close_upstream();
    if (flight.header_sent) {
      server_.count(flight.endpoint_path, error.status);
      if (writing_) {
        // A chunk is on its way: the connection cannot carry a clean end.
        end_flight();
        return close();
      }
      return end_stream(&error);
    }
    const std::string endpoint = flight.endpoint_path;
    end_flight();
    if (writing_) return close();
    respond_error(endpoint, error);
  }

  void client_gone() {
    server_.metrics->add(kClientsGone);
    if (flight_ && flight_->core) {
      auto cancelled = flight_->core->cancel("the client went away");
      if (cancelled && cancelled->release) {
        report_release(*cancelled->release, "the client went away");
      }
    }
    end_flight();
    close();
  }

  void end_flight() {
    if (!flight_) return;
    // Ended before its answer did (the client went away, a write failed, the node stops).
    if (flight_->generation && !(flight_->generated && flight_->generated->finished())) {
      flight_->generation->cancel();
    }
    flight_.reset();
    routing_.reset();
    ++epoch_;
    deadline_.cancel();
    close_upstream();
    server_.in_flight.fetch_sub(1);
    server_.in_flight_gauge.set(static_cast<double>(server_.in_flight.load()));
  }

  void close_upstream() {
    if (!upstream_) return;
    upstream_->resolver.cancel();
    if (upstream_->stream.socket().is_open()) {
      beast::error_code ignored;
      upstream_->stream.socket().shutdown(tcp::socket::shutdown_both, ignored);
      upstream_->stream.close();
    }
    upstream_.reset();
  }

  void report(const std::string& booking_id, v1::LifecycleEvent event,
              v1::AbortCause cause = v1::ABORT_CAUSE_UNSPECIFIED, std::string error = {}) {
    report_booking(*server_.gateway, booking_id, event, cause, std::move(error));
  }

  HttpFrontDoor::State& server_;
  // The client's IP address: its renders wait their turn behind those of other clients, however
  // many connections it opens.
  const std::string client_address_;
  beast::tcp_stream stream_;
  beast::flat_buffer buffer_;
  std::optional<http::request_parser<http::string_body>> parser_;
  net::steady_timer deadline_;
  unsigned version_ = 11;
  bool keep_alive_ = true;
  bool writing_ = false;
  bool watching_ = false;
  bool awaiting_next_ = false;
  bool closing_ = false;
  bool closed_ = false;
  std::string request_id_;
  const std::chrono::steady_clock::time_point accepted_;
  ReadPhase phase_ = ReadPhase::first_byte;
  /// Requests read whole on this connection.
  std::uint64_t requests_ = 0;
  /// When the request being read began (its head's deadline counts from it), and its body.
  std::chrono::steady_clock::time_point head_started_;
  std::chrono::steady_clock::time_point body_started_;
  std::uint64_t body_bytes_ = 0;
  /// The connection's key among the idle ones while it waits for a request's first byte; 0 else.
  std::uint64_t idle_key_ = 0;
  /// When the body of the request being served was read whole.
  std::chrono::steady_clock::time_point body_received_;
  /// Advanced whenever an attempt or flight ends: a late handler of an older one does nothing.
  std::uint64_t epoch_ = 0;
  std::optional<Flight> flight_;
  /// The engine connection of the attempt under way; none between attempts.
  std::shared_ptr<Upstream> upstream_;
  /// A streamed answer's response head, alive while it is written.
  std::string stream_head_;
  // This connection while its route request waits for the decision (see route()).
  std::shared_ptr<Connection> routing_;
};

}  // namespace

// A refused client's 503, read whole before the close (see refuse()).
struct Refusal {
  explicit Refusal(tcp::socket socket) : stream(std::move(socket)) {}
  beast::tcp_stream stream;
  std::array<char, 4096> discard{};
};

void drain_refusal(std::shared_ptr<Refusal> refusal, std::atomic<std::size_t>& lingering) {
  auto& stream = refusal->stream;
  stream.async_read_some(net::buffer(refusal->discard),
                         [refusal, &lingering](beast::error_code error, std::size_t) mutable {
                           if (!error) return drain_refusal(std::move(refusal), lingering);
                           beast::error_code ignored;
                           refusal->stream.socket().close(ignored);
                           lingering.fetch_sub(1);
                         });
}

void HttpFrontDoor::State::accept() {
  acceptor.async_accept(net::make_strand(io), [this](beast::error_code error, tcp::socket socket) {
    if (error == net::error::operation_aborted || !acceptor.is_open()) return;
    if (error) return accept_failed(error);
    accept_delay = {};
    admit(std::move(socket));
    accept();
  });
}

void HttpFrontDoor::State::accept_failed(const beast::error_code& error) {
  // A client that gave up in the listen queue: nothing to wait for.
  if (error == net::error::connection_aborted) return accept();
  const bool out_of_descriptors =
      error == net::error::no_descriptors || error == std::errc::too_many_files_open_in_system;
  metrics->add(kAcceptErrors, {{"error", out_of_descriptors ? "descriptors" : "other"}});
  if (out_of_descriptors && spare_descriptor >= 0) {
    // One waiting client is told, not left to time out in the listen queue.
    ::close(spare_descriptor);
    spare_descriptor = -1;
    tcp::socket socket{io};
    beast::error_code accept_error;
    acceptor.accept(socket, accept_error);
    if (!accept_error) {
      refuse(std::move(socket), "descriptors", out_of_descriptors_answer, /*linger=*/false);
    }
    spare_descriptor = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  }
  // Accepting again at once would spin while the descriptors stay used up: the pause doubles
  // up to a second, and the episode is logged once.
  if (accept_delay.count() == 0) {
    accept_log.warn("accept",
                    fmt::format("front door: cannot accept connections: {} (open "
                                "client connections: {}, cap {}); retrying",
                                error.message(), connection_count.load(), max_connections));
  }
  accept_delay = std::clamp(accept_delay * 2, std::chrono::milliseconds(10), kMaxAcceptBackoff);
  accept_backoff.expires_after(accept_delay);
  accept_backoff.async_wait([this](beast::error_code wait_error) {
    if (!wait_error && acceptor.is_open()) accept();
  });
}

void HttpFrontDoor::State::admit(tcp::socket socket) {
  if (!accepting.load()) {
    return refuse(std::move(socket), "draining", refusal_answer("the router is draining"),
                  /*linger=*/true);
  }
  // Above the cap by a margin while reclaimed connections close on their strands.
  const std::size_t margin = std::max<std::size_t>(1, max_connections / 16);
  const std::size_t open = connection_count.load();
  if (open >= max_connections && (open >= max_connections + margin || !reclaim_idle())) {
    return refuse(
        std::move(socket), "limit",
        refusal_answer(fmt::format("the router serves {} client connections, its limit", open)),
        /*linger=*/true);
  }
  connection_count.fetch_add(1);
  connections_gauge.set(static_cast<double>(connection_count.load()));
  connections_accepted.add();
  beast::error_code ignored;
  socket.set_option(tcp::no_delay(true), ignored);
  std::make_shared<Connection>(*this, std::move(socket))->start();
}

bool HttpFrontDoor::State::reclaim_idle() {
  std::lock_guard lock{connections_mutex};
  while (!idle.empty()) {
    const auto oldest = idle.begin();
    const std::uint64_t key = oldest->first;
    auto connection = oldest->second.lock();
    idle.erase(oldest);
    if (!connection) continue;
    net::post(connection->executor(), [connection, key] { connection->reclaim(key); });
    return true;
  }
  return false;
}

void HttpFrontDoor::State::refuse(tcp::socket socket, std::string_view reason,
                                  std::string_view answer, bool linger) {
  metrics->add(kConnectionsRefused, {{"reason", std::string{reason}}});
  beast::error_code error;
  // A new socket's send buffer takes the whole answer: the write does not wait.
  socket.non_blocking(true, error);
  if (!error) socket.write_some(net::buffer(answer), error);
  if (!error) socket.shutdown(tcp::socket::shutdown_send, error);
  if (error || !linger || lingering_refusals.fetch_add(1) >= kMaxLingeringRefusals) {
    if (!error && linger) lingering_refusals.fetch_sub(1);
    beast::error_code ignored;
    socket.close(ignored);
    return;
  }
  // Closed with the client's request unread, the socket would reset and the client could lose
  // the answer: its bytes are read (a second at most) first.
  auto refusal = std::make_shared<Refusal>(std::move(socket));
  refusal->stream.expires_after(std::chrono::seconds(1));
  drain_refusal(std::move(refusal), lingering_refusals);
}

HttpFrontDoor::HttpFrontDoor(std::shared_ptr<State> state) : state_(std::move(state)) {}

std::expected<std::unique_ptr<HttpFrontDoor>, std::string> HttpFrontDoor::start(
    FrontDoorOptions options, std::shared_ptr<RoutingGateway> gateway,
    std::shared_ptr<const FleetDirectory> directory,
    std::shared_ptr<metrics::MetricsRegistry> metrics) {
  if (auto valid = options.validate(); !valid) return std::unexpected(valid.error());
  metrics->describe(std::string{kRequests}, metrics::MetricType::Counter,
                    "HTTP requests answered by the front door, by endpoint and status code");
  metrics->describe(std::string{kInFlight}, metrics::MetricType::Gauge,
                    "Generation requests between their body and their answer's last byte");
  metrics->describe(std::string{kConnections}, metrics::MetricType::Gauge,
                    "Open client connections of the front door");
  metrics->describe(std::string{kConnectionsAccepted}, metrics::MetricType::Counter,
                    "Client connections the front door accepted (kept alive, one serves many "
                    "requests)");
  metrics->describe(std::string{kEngineFailures}, metrics::MetricType::Counter,
                    "Forwarded requests an engine failed, before its first byte or after");
  metrics->describe(std::string{kRetries}, metrics::MetricType::Counter,
                    "Requests routed again after their engine failed before its first byte");
  metrics->describe(std::string{kClientsGone}, metrics::MetricType::Counter,
                    "Requests whose client went away before the answer ended");
  metrics->describe(std::string{kClientTimeouts}, metrics::MetricType::Counter,
                    "Client connections closed for a timeout, by phase: header (a request's "
                    "head), body (below the minimum rate), idle (kept alive, no next request) "
                    "or send (the client did not take an answer's bytes)");
  metrics->describe(std::string{kConnectionsRefused}, metrics::MetricType::Counter,
                    "Client connections answered 503 and closed when accepted, by reason: limit "
                    "(the connection cap, no idle connection to reclaim), descriptors (the "
                    "process had none left) or draining");
  metrics->describe(std::string{kIdleReclaimed}, metrics::MetricType::Counter,
                    "Idle client connections closed at the cap to give their slot to a new "
                    "client");
  metrics->describe(std::string{kAcceptErrors}, metrics::MetricType::Counter,
                    "Failed accepts of client connections, by error (descriptors: the process "
                    "or system had no file descriptor left)");
  metrics->describe(std::string{kStreamsOverflowed}, metrics::MetricType::Counter,
                    "Streams through kvr's generate API ended because their client lagged more "
                    "than the pending-bytes limit behind");
  metrics->describe(std::string{kEngineConnections}, metrics::MetricType::Counter,
                    "Engine connections requests were forwarded on: new, reused (kept alive), "
                    "or resent (a reused one the engine had closed; sent again on a new one)");
  metrics->describe(
      std::string{kAddedLatency}, metrics::MetricType::Histogram,
      "Time from a request's whole body to the start of its forwarding to the engine (parse, "
      "render and route included)",
      kFrontDoorBuckets);
  metrics->describe(std::string{kRelayFirstByte}, metrics::MetricType::Histogram,
                    "Time from a streamed answer's first byte from the engine to its first "
                    "event written to the client",
                    kFrontDoorBuckets);
  metrics->describe(std::string{kEngineFirstByte}, metrics::MetricType::Histogram,
                    "Time from the start of a request's forwarding (connecting to the engine, "
                    "sending it) to the engine's first answer byte: the engine's own time to "
                    "first token, as the node sees it",
                    {0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10});
  auto state = std::make_shared<State>(std::move(options), std::move(gateway), std::move(directory),
                                       std::move(metrics));
  const FrontDoorOptions& opts = state->options;
  // Each client connection may hold an engine connection while its request is forwarded.
  const DescriptorLimit limit = descriptor_limit();
  state->max_connections = connections_within_limit(opts.max_connections, limit.soft, 2);
  if (state->max_connections < opts.max_connections) {
    spdlog::warn(
        "front door: at most {} client connections, not {} (--http-max-connections): the "
        "descriptor limit is {}, each client connection may hold an engine connection too, "
        "and {} are kept for NATS, engines, peers and files; raise `ulimit -n` for more",
        state->max_connections, opts.max_connections, limit.soft, descriptor_reserve(limit.soft));
  }
  state->spare_descriptor = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  beast::error_code error;
  const auto address = net::ip::make_address(opts.address, error);
  if (error)
    return std::unexpected(fmt::format("--http-address: '{}' is not an IP address", opts.address));
  const tcp::endpoint endpoint{address, opts.port};
  state->acceptor.open(endpoint.protocol(), error);
  if (!error) state->acceptor.set_option(net::socket_base::reuse_address(true), error);
  if (!error) state->acceptor.bind(endpoint, error);
  if (!error) state->acceptor.listen(net::socket_base::max_listen_connections, error);
  // The accept that refuses a client when descriptors ran out must not wait.
  if (!error) state->acceptor.non_blocking(true, error);
  if (error) {
    return std::unexpected(
        fmt::format("cannot serve HTTP on {}:{}: {}", opts.address, opts.port, error.message()));
  }
  state->port = state->acceptor.local_endpoint().port();
  state->accept();
  net::post(state->io, [raw = state.get()] { raw->trim_memory_when_idle(); });
  if (opts.native_tokenizers && !opts.native_tokenizers->empty()) {
    net::post(state->io, [raw = state.get()] { raw->watch_parity(); });
  }
  for (std::size_t i = 0; i < opts.threads; ++i) {
    state->threads.emplace_back([raw = state.get()] { raw->io.run(); });
  }
  return std::unique_ptr<HttpFrontDoor>(new HttpFrontDoor(std::move(state)));
}

HttpFrontDoor::~HttpFrontDoor() {
  State& state = *state_;
  stop_intake();
  {
    std::unique_lock lock{state.connections_mutex};
    for (auto& [raw, weak] : state.connections) {
      if (auto connection = weak.lock()) {
        net::post(connection->executor(), [connection] { connection->shut_down(); });
      }
    }
    // Each connection writes its error and closes; bounded, for clients that do not read.
    state.connections_gone.wait_for(lock, std::chrono::seconds(2),
                                    [&] { return state.connections.empty(); });
  }
  {
    std::lock_guard lock{state.post_mutex};
    state.posting = false;
  }
  state.io.stop();
  for (auto& thread : state.threads) thread.join();
}

std::uint16_t HttpFrontDoor::port() const { return state_->port; }

void HttpFrontDoor::stop_intake() {
  State& state = *state_;
  state.accepting.store(false);
  net::post(state.acceptor.get_executor(), [raw = state_.get()] {
    beast::error_code ignored;
    raw->acceptor.close(ignored);
  });
}

std::size_t HttpFrontDoor::in_flight() const { return state_->in_flight.load(); }

std::size_t HttpFrontDoor::connections() const { return state_->connection_count.load(); }

std::size_t HttpFrontDoor::max_connections() const { return state_->max_connections; }

std::size_t HttpFrontDoor::idle_connections() const {
  std::lock_guard lock{state_->connections_mutex};
  return state_->idle.size();
}

}  // namespace kvr::front_door
