#include "actors/node/router_node.hpp"

#include <random>
#include <thread>

#include <caf/actor_system.hpp>
#include <caf/actor_system_config.hpp>
#include <caf/event_based_actor.hpp>
#include <caf/io/middleman.hpp>
#include <caf/send.hpp>
#include <caf/typed_event_based_actor.hpp>
#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include "actors/actor_types.hpp"
#include "actors/directory/directory_actor.hpp"
#include "actors/ingress/ingress_actor.hpp"
#include "actors/lifecycle/lifecycle_actor.hpp"
#include "actors/metrics/metrics_http.hpp"
#include "actors/metrics/node_metrics.hpp"
#include "actors/nats/nats_bridge.hpp"
#include "actors/reservation/reservation_actor.hpp"

namespace kvr::actors {
namespace {

std::string random_lease_prefix() {
  std::random_device device;
  const std::uint64_t bits =
      (std::uint64_t{device()} << 32) ^ device() ^ static_cast<std::uint64_t>(::getpid());
  return fmt::format("{:012x}", bits & 0xFFFF'FFFF'FFFFULL);
}

}  // namespace

std::expected<void, std::string> NodeOptions::validate() const {
  if (ns.empty()) return std::unexpected("--namespace: empty");
  // A block size of 0 is learnt per partition from its workers; the rest is checked as given.
  plugins::worker_selection::RouterConfig checked = router;
  if (checked.block_size == 0) checked.block_size = 1;
  if (auto router_ok = checked.validate(); !router_ok) return std::unexpected(router_ok.error());
  if (lease_ttl < std::chrono::milliseconds(100) || lease_ttl > std::chrono::hours(24)) {
    return std::unexpected("--router-lease-ttl-secs: between 0.1 s and 24 h");
  }
  if (tick_interval <= std::chrono::milliseconds(0)) return std::unexpected("tick interval: > 0");
  if (selector_timeout <= std::chrono::milliseconds(0)) {
    return std::unexpected("selector timeout: > 0");
  }
  if (first_token_timeout < std::chrono::milliseconds(1) ||
      first_token_timeout > std::chrono::hours(24)) {
    return std::unexpected("--router-first-token-timeout-ms: between 1 ms and 24 h");
  }
  if (auto affinity = session_affinity.validate(); !affinity) {
    return std::unexpected(affinity.error());
  }
  return {};
}

struct RouterNode::Impl {
  NodeOptions options;
  plugins::RouterPlugins plugins;
  std::shared_ptr<metrics::MetricsRegistry> registry = std::make_shared<metrics::MetricsRegistry>();
  std::shared_ptr<metrics::RateLimitedLog> log = std::make_shared<metrics::RateLimitedLog>();
  std::shared_ptr<NatsBridge> bridge;
  std::unique_ptr<metrics::MetricsHttpServer> http;
  // The configuration must outlive the system, which is destroyed first (declared last).
  caf::actor_system_config config;
  std::unique_ptr<caf::actor_system> system;
  directory_actor directory;
  reservation_actor reservation;
  lifecycle_actor lifecycle;
  ingress_actor ingress;
  std::uint16_t actor_port = 0;

  void shutdown() {
    if (bridge) bridge->stop();
    http.reset();
    if (system) {
      if (actor_port != 0) (void)system->middleman().unpublish(ingress, actor_port);
      // The lifecycle actor first: it ends every client's stream with an explicit error.
      caf::anon_send_exit(lifecycle, caf::exit_reason::user_shutdown);
      caf::anon_send_exit(directory, caf::exit_reason::user_shutdown);
      caf::anon_send_exit(reservation, caf::exit_reason::user_shutdown);
      caf::anon_send_exit(ingress, caf::exit_reason::user_shutdown);
      lifecycle = nullptr;
      directory = nullptr;
      reservation = nullptr;
      ingress = nullptr;
      system->await_all_actors_done();
      system.reset();
    }
    bridge.reset();
  }
};

RouterNode::RouterNode(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

RouterNode::~RouterNode() { impl_->shutdown(); }

std::uint16_t RouterNode::actor_port() const { return impl_->actor_port; }

std::uint16_t RouterNode::metrics_port() const {
  return impl_->http ? impl_->http->port() : std::uint16_t{0};
}

const metrics::MetricsRegistry& RouterNode::metrics() const { return *impl_->registry; }

std::expected<std::unique_ptr<RouterNode>, std::string> RouterNode::start(
    NodeOptions options, plugins::RouterPlugins plugins) {
  if (auto valid = options.validate(); !valid) return std::unexpected(valid.error());
  auto impl = std::make_unique<Impl>();
  impl->options = std::move(options);
  impl->plugins = std::move(plugins);
  const NodeOptions& opts = impl->options;
  metrics::NodeMetrics::describe(*impl->registry);

  BridgeOptions bridge_options;
  bridge_options.ns = opts.ns;
  // The reservation actor answers bursts of requests: one write per burst (socket_loop.hpp).
  nats::NatsOptions nats_options = opts.nats;
  nats_options.deferred_publish = true;
  auto bridge = NatsBridge::connect(nats_options, bridge_options, impl->registry, impl->log);
  if (!bridge) return std::unexpected(bridge.error());
  impl->bridge = std::move(*bridge);

  // One scheduler thread per core: the default max(4, cores) oversubscribes small machines.
  const std::size_t threads = opts.scheduler_threads != 0
                                  ? opts.scheduler_threads
                                  : std::max<std::size_t>(1, std::thread::hardware_concurrency());
  impl->config.set("scheduler.max-threads", threads);
  // An idle worker skips CAF's second polling phase (500 sleeps of 50 µs, each woken by a
  // timer, not by new work) and waits on its condition variable, which a NATS callback's enqueue
  // signals. Requests arrive from NATS threads, so this halves a lone request's time in the node
  // (about 180 → 80 µs, tests/bench/node) and stops idle workers from burning timer wake-ups.
  impl->config.set("work-stealing.moderate-poll-attempts", 0);
  impl->config.load<caf::io::middleman>();
  impl->config.add_message_types<caf::id_block::kvr_actors>();
  impl->system = std::make_unique<caf::actor_system>(impl->config);
  caf::actor_system& system = *impl->system;

  SelectorActorConfig selector;
  selector.options.router = opts.router;
  selector.options.lease_ttl = opts.lease_ttl;
  selector.plugins = &impl->plugins;
  selector.publisher = impl->bridge;
  selector.metrics = impl->registry;
  selector.log = impl->log;
  selector.tick_interval = opts.tick_interval;
  selector.affinity = opts.session_affinity;
  impl->directory = system.spawn(directory_behavior, DirectoryActorConfig{selector, {}});

  ReservationActorConfig reservation;
  reservation.directory = impl->directory;
  reservation.publisher = impl->bridge;
  reservation.metrics = impl->registry;
  reservation.log = impl->log;
  reservation.lease_prefix = random_lease_prefix();
  reservation.lease_ttl = opts.lease_ttl;
  reservation.selector_timeout = opts.selector_timeout;
  reservation.tick_interval = opts.tick_interval;
  impl->reservation = system.spawn(reservation_behavior, std::move(reservation));

  LifecycleActorConfig lifecycle;
  lifecycle.directory = impl->directory;
  lifecycle.publisher = impl->bridge;
  lifecycle.metrics = impl->registry;
  lifecycle.log = impl->log;
  lifecycle.stream_inbox_prefix = impl->bridge->stream_inbox_prefix();
  lifecycle.selector_timeout = opts.selector_timeout;
  lifecycle.first_token_timeout = opts.first_token_timeout;
  impl->lifecycle = system.spawn(lifecycle_behavior, std::move(lifecycle));

  impl->ingress =
      system.spawn(ingress_behavior, IngressActorConfig{.reservation = impl->reservation,
                                                        .lifecycle = impl->lifecycle,
                                                        .limits = {},
                                                        .metrics = impl->registry});
  if (opts.actor_port != 0) {
    auto published =
        system.middleman().publish(impl->ingress, opts.actor_port, opts.bind_host.c_str());
    if (!published) {
      std::string reason = system.render(published.error());
      impl->shutdown();
      return std::unexpected(fmt::format("cannot publish the ingress actor on {}:{}: {}",
                                         opts.bind_host, opts.actor_port, reason));
    }
    impl->actor_port = *published;
  }

  // Callbacks only decode (in the bridge) and hand over to the actors.
  BridgeSinks sinks;
  const directory_actor directory = impl->directory;
  const reservation_actor reservation_handle = impl->reservation;
  sinks.registration = [directory](discovery::WorkerRegistration registration) {
    caf::anon_send(directory, worker_up_atom::value, std::move(registration));
  };
  sinks.heartbeat = [directory](WorkerLiveness heartbeat) {
    caf::anon_send(directory, heartbeat_atom::value, heartbeat);
  };
  sinks.deregistration = [directory](WorkerLiveness deregistration) {
    caf::anon_send(directory, worker_down_atom::value, deregistration);
  };
  sinks.load = [directory](WorkerLoadReport report) {
    caf::anon_send(directory, load_atom::value, std::move(report));
  };
  sinks.kv_events = [directory](KvEventBatch batch) {
    caf::anon_send(directory, kv_events_atom::value, std::move(batch));
  };
  sinks.kv_dump = [directory](KvDump dump) {
    caf::anon_send(directory, kv_dump_atom::value, std::move(dump));
  };
  sinks.route = [reservation_handle](RouteRequest request, std::string reply,
                                     std::chrono::steady_clock::time_point received) {
    caf::anon_send(reservation_handle, route_atom::value,
                   RouteEnvelope{std::move(request), std::move(reply), received});
  };
  sinks.report = [reservation_handle](LifecycleReportData report, std::string reply) {
    caf::anon_send(reservation_handle, report_atom::value,
                   ReportEnvelope{std::move(report), std::move(reply)});
  };
  const lifecycle_actor lifecycle_handle = impl->lifecycle;
  sinks.generate = [lifecycle_handle](GenerateRequestData request, std::string reply,
                                      std::chrono::steady_clock::time_point received) {
    caf::anon_send(lifecycle_handle, generate_atom::value,
                   GenerateEnvelope{std::move(request), std::move(reply), received});
  };
  sinks.generate_cancel = [lifecycle_handle](std::string request_id) {
    caf::anon_send(lifecycle_handle, cancel_atom::value, std::move(request_id));
  };
  sinks.chunk = [lifecycle_handle](std::uint64_t stream_id, v1::GenerateChunk chunk) {
    caf::anon_send(lifecycle_handle, chunk_atom::value, ChunkEnvelope{stream_id, std::move(chunk)});
  };
  sinks.reconnected = [directory] { caf::anon_send(directory, resync_atom::value); };
  if (auto started = impl->bridge->start(std::move(sinks)); !started) {
    impl->shutdown();
    return std::unexpected(started.error());
  }

  if (opts.metrics_port != 0) {
    std::weak_ptr<NatsBridge> weak_bridge = impl->bridge;
    auto http = metrics::MetricsHttpServer::start(
        opts.bind_host, opts.metrics_port, impl->registry, [weak_bridge]() -> std::string {
          auto connection = weak_bridge.lock();
          if (!connection) return "stopping";
          return connection->connected() ? std::string{} : "NATS disconnected";
        });
    if (!http) {
      impl->shutdown();
      return std::unexpected(http.error());
    }
    impl->http = std::move(*http);
  }
  // Workers that registered before this node started announce themselves again.
  caf::anon_send(directory, resync_atom::value);
  spdlog::info(
      "kvr node: namespace '{}', block size {}, lease ttl {} ms, first-token timeout {} ms, "
      "session affinity {}, {} scheduler threads; NATS {}; metrics {}; actor port {}",
      opts.ns,
      opts.router.block_size != 0 ? std::to_string(opts.router.block_size)
                                  : std::string{"learnt per partition"},
      opts.lease_ttl.count(), opts.first_token_timeout.count(),
      opts.session_affinity.ttl ? fmt::format("{} (ttl {} s)", as_str(opts.session_affinity.mode),
                                              opts.session_affinity.ttl->count())
                                : std::string{"off"},
      threads, opts.nats.url,
      impl->http ? fmt::format("http://{}:{}/metrics", opts.bind_host, impl->http->port())
                 : std::string{"off"},
      impl->actor_port);
  return std::unique_ptr<RouterNode>(new RouterNode(std::move(impl)));
}

}  // namespace kvr::actors
