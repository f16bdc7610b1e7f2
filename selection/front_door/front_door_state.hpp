// The HTTP front door's shared state (HttpFrontDoor::State) and its metric names: what every client
// connection, flight and engine relay of one front door reaches. Private to kvr_front_door.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <vector>

#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/strand.hpp>
#include <boost/beast/core/error.hpp>
#include <unistd.h>

#include "messages/metrics/cache_mismatch_detector.hpp"
#include "messages/metrics/metrics_registry.hpp"
#include "messages/metrics/rate_limited_log.hpp"
#include "selection/front_door/engine_connections.hpp"
#include "selection/front_door/http_front_door.hpp"
#include "selection/front_door/prompt_renderer.hpp"
#include "selection/front_door/request_routing.hpp"

namespace kvr::front_door {

// The front door's metric families (described in HttpFrontDoor::start).
inline constexpr std::string_view kRequests = "kvr_http_requests_total";
inline constexpr std::string_view kInFlight = "kvr_http_requests_in_flight";
inline constexpr std::string_view kConnections = "kvr_http_connections_open";
inline constexpr std::string_view kConnectionsAccepted = "kvr_http_connections_accepted_total";
inline constexpr std::string_view kEngineFailures = "kvr_http_engine_failures_total";
inline constexpr std::string_view kRetries = "kvr_http_retries_total";
inline constexpr std::string_view kClientsGone = "kvr_http_clients_gone_total";
inline constexpr std::string_view kAddedLatency = "kvr_http_added_latency_seconds";
inline constexpr std::string_view kEngineFirstByte = "kvr_http_engine_first_byte_seconds";
inline constexpr std::string_view kRelayFirstByte = "kvr_http_relay_first_byte_seconds";
inline constexpr std::string_view kEngineConnections = "kvr_http_engine_connections_total";
inline constexpr std::string_view kClientTimeouts = "kvr_http_client_timeouts_total";
inline constexpr std::string_view kConnectionsRefused = "kvr_http_connections_refused_total";
inline constexpr std::string_view kIdleReclaimed = "kvr_http_idle_connections_reclaimed_total";
inline constexpr std::string_view kAcceptErrors = "kvr_http_accept_errors_total";
inline constexpr std::string_view kStreamsOverflowed = "kvr_http_streams_overflowed_total";

class Connection;

/// The whole answer to a client refused at accept: a 503 that closes the connection.
std::string refusal_answer(std::string why);

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
        acceptor(boost::asio::make_strand(io)) {}

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
  boost::asio::io_context io;
  boost::asio::ip::tcp::acceptor acceptor;
  // On the acceptor's strand: the pause after an accept failed for want of descriptors.
  boost::asio::steady_timer accept_backoff{acceptor.get_executor()};
  // Starts the native tokenizers' parity checks as models' first engines register.
  boost::asio::steady_timer parity_timer{io};
  boost::asio::steady_timer memory_trim_timer{io};
  std::atomic<std::uint64_t> requests_since_trim{0};
  std::vector<std::thread> threads;

  template <class Handler>
  void post(const boost::asio::any_io_executor& executor, Handler handler) {
    std::lock_guard lock{post_mutex};
    if (posting) boost::asio::post(executor, std::move(handler));
  }

  ~State() {
    if (spare_descriptor >= 0) ::close(spare_descriptor);
  }

  void accept();
  void accept_failed(const boost::beast::error_code& error);
  // A new client: served, given an idle connection's slot at the cap, or refused.
  void admit(boost::asio::ip::tcp::socket socket);
  // Closes the connection idle the longest (on its strand); false when none is idle.
  bool reclaim_idle();
  // Sends `socket` its refusal `answer` and closes it once its client has read it (or at once when
  // `linger` is false or too many refusals linger).
  void refuse(boost::asio::ip::tcp::socket socket, std::string_view reason, std::string_view answer,
              bool linger);
  // Built ahead: with no descriptor left, the refusal neither allocates nor formats.
  const std::string out_of_descriptors_answer =
      refusal_answer("the router has no file descriptor left");
  void count_timeout(std::string_view phase) {
    metrics->add(kClientTimeouts, {{"phase", std::string{phase}}});
  }
  // Starts the native tokenizers' parity checks as models' first engines register, once a second.
  void watch_parity();
  // glibc keeps what a burst of large bodies freed in its arenas (hundreds of MB after an
  // attack); once no request is in flight after some were served, it is returned.
  void trim_memory_when_idle();
  void count(std::string_view endpoint, unsigned status) {
    metrics->add(kRequests,
                 {{"endpoint", std::string{endpoint}}, {"code", std::to_string(status)}});
  }
};

}  // namespace kvr::front_door
