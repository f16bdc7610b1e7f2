#include "selection/front_door/http_front_door.hpp"

#include <array>
#include <optional>
#include <sstream>
#include <thread>

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
#include "selection/front_door/flight_driver.hpp"
#include "selection/front_door/front_door_state.hpp"
#include "selection/front_door/openai_api.hpp"

namespace kvr::front_door {
namespace {

namespace beast = boost::beast;
namespace http = beast::http;
namespace net = boost::asio;
using tcp = net::ip::tcp;
using Json = nlohmann::json;

// The node's own parts of a request's time, in seconds: fine below 5 ms, where they should be.
const std::vector<double> kFrontDoorBuckets{0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.002,
                                            0.003,   0.005,  0.01,    0.025,  0.1,   1};

constexpr std::size_t kMaxHeaderBytes = 64 * 1024;
// Bytes a client may send while its answer streams (a pipelined next request) before the node
// stops reading it.
constexpr std::size_t kMaxPipelinedBytes = 64 * 1024;
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

std::string refusal_answer(std::string why) {
  const std::string body =
      HttpError{.status = 503, .message = std::move(why), .code = "service_unavailable"}.body();
  return fmt::format(
      "HTTP/1.1 503 Service Unavailable\r\nServer: kvr\r\nContent-Type: application/json\r\n"
      "Retry-After: 1\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{}",
      body.size(), body);
}

void HttpFrontDoor::State::watch_parity() {
  renderer.check_new_models(*directory, io.get_executor());
  parity_timer.expires_after(std::chrono::seconds(1));
  parity_timer.async_wait([this](beast::error_code error) {
    if (!error && accepting.load()) watch_parity();
  });
}

void HttpFrontDoor::State::trim_memory_when_idle() {
  memory_trim_timer.expires_after(kMemoryTrimInterval);
  memory_trim_timer.async_wait([this](beast::error_code error) {
    if (error || !accepting.load()) return;
    if (in_flight.load() == 0 && requests_since_trim.exchange(0) > 0) ::malloc_trim(0);
    trim_memory_when_idle();
  });
}

// ---- one client connection ----------------------------------------------------------------------
// Requests are served one after another (HTTP/1.1 keep-alive). While a generation request is in
// flight (its FlightDriver), one read stays pending on the client's socket: its end is the client
// going away. The connection reads requests, answers the small endpoints and writes every answer.

class Connection final : public std::enable_shared_from_this<Connection>, private FlightClient {
 public:
  Connection(HttpFrontDoor::State& server, tcp::socket socket)
      : server_(server),
        client_address_(address_of(socket)),
        stream_(std::move(socket)),
        deadline_(stream_.get_executor()),
        accepted_(std::chrono::steady_clock::now()),
        flights_(server, *this, stream_.get_executor(), client_address_, deadline_) {}

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
    if (flights_.active()) {
      flights_.fail_flight(HttpError{.status = 503,
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
      request_id_ = fmt::format("kvr-{}-{}", server_.id_prefix, server_.next_request.fetch_add(1));
      return flights_.start(endpoint, std::move(request), request_id_, body_received_);
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
    respond("/v1/models", 200, Json{{"object", "list"}, {"data", std::move(data)}}.dump(),
            "application/json", {});
  }

  void serve_health() {
    const bool ready = server_.directory->any_live();
    respond("/health", ready ? 200 : 503,
            Json{{"status", ready ? "ready" : "no live worker"}}.dump(), "application/json", {});
  }

  // ---- writing whole answers -------------------------------------------------------------------

  void respond(std::string_view endpoint, unsigned status, std::string body,
               std::string content_type, AnswerHeaders headers) override {
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

  void respond_error(std::string_view endpoint, const HttpError& error) override {
    AnswerHeaders headers;
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

  void close() override {
    if (closed_) return;
    closed_ = true;
    leave_idle();
    beast::error_code ignored;
    deadline_.cancel();
    stream_.socket().shutdown(tcp::socket::shutdown_both, ignored);
    stream_.close();
    flights_.close_engine();
  }

  // One read on the client's socket while its request is served: it ends when the client goes.
  void watch_client() override {
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
                                if (self->flights_.active()) return self->flights_.client_gone();
                                return self->close();
                              }
                              if (self->flights_.active()) self->watch_client();
                            });
  }

  // ---- writing streamed answers, for the flight ------------------------------------------------

  std::shared_ptr<void> hold() override { return shared_from_this(); }
  std::weak_ptr<void> weak_hold() override { return weak_from_this(); }
  bool writing() const override { return writing_; }

  void write_chunk(net::const_buffer bytes, const StreamHead* head,
                   std::function<void(beast::error_code)> done) override {
    auto after = [self = shared_from_this(), done = std::move(done)](beast::error_code error,
                                                                     std::size_t) {
      self->writing_ = false;
      if (error == beast::error::timeout) self->server_.count_timeout("send");
      done(error);
    };
    writing_ = true;
    // The read timer is left alone while the client watch is pending.
    stream_.expires_after(server_.options.send_timeout);
    if (head == nullptr) {
      net::async_write(stream_, http::make_chunk(bytes), std::move(after));
      return;
    }
    http::response<http::empty_body> header{http::status::ok, version_};
    header.set(http::field::content_type, head->content_type);
    header.set(http::field::cache_control, "no-cache");
    header.set(http::field::server, "kvr");
    for (const auto& [name, value] : head->headers) header.set(name, value);
    header.keep_alive(keep_alive_);
    header.chunked(true);
    std::ostringstream text;
    text << header.base();
    stream_head_ = std::move(text).str();
    // One write, head and first chunk: the client wakes once for its first token.
    net::async_write(stream_,
                     beast::buffers_cat(net::buffer(stream_head_), http::make_chunk(bytes)),
                     std::move(after));
  }

  void end_chunks(std::string tail) override {
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
  /// A streamed answer's response head, alive while it is written.
  std::string stream_head_;
  /// The generation request in flight, if any (declared last: it refers to the members above).
  FlightDriver flights_;
};

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
