#include "actors/node/router_node.hpp"

#include <array>
#include <cmath>
#include <limits>
#include <random>
#include <thread>

#include <caf/actor_system.hpp>
#include <caf/actor_system_config.hpp>
#include <caf/event_based_actor.hpp>
#include <caf/function_view.hpp>
#include <caf/io/middleman.hpp>
#include <caf/openssl/manager.hpp>
#include <caf/openssl/publish.hpp>
#include <caf/send.hpp>
#include <caf/spawn_options.hpp>
#include <caf/typed_event_based_actor.hpp>
#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include "actors/actor_types.hpp"
#include "actors/classifier/classifier_actor.hpp"
#include "actors/cluster/cluster_actor.hpp"
#include "actors/cluster/forwarder_actor.hpp"
#include "actors/discovery/discovery_actor.hpp"
#include "actors/front_door/gateway_actor.hpp"
#include "actors/ingress/ingress_actor.hpp"
#include "actors/lifecycle/lifecycle_actor.hpp"
#include "actors/node/peer_frames.hpp"
#include "actors/node/peer_tls.hpp"
#include "actors/reservation/reservation_actor.hpp"
#include "messages/metrics/metrics_http.hpp"
#include "messages/metrics/node_metrics.hpp"
#include "messages/nats/redact.hpp"
#include "messages/subjects.hpp"
#include "selection/wire/nats_bridge.hpp"

namespace kvr::actors {
namespace {

std::string random_booking_id_prefix() {
  std::random_device device;
  const std::uint64_t bits =
      (std::uint64_t{device()} << 32) ^ device() ^ static_cast<std::uint64_t>(::getpid());
  return fmt::format("{:012x}", bits & 0xFFFF'FFFF'FFFFULL);
}

// The bridge's callbacks only decode (in the bridge) and hand over to the actors.
// With a classifier actor, route and generate requests and cancels go to it first.
// The NATS bridge's decoded messages: worker messages to the discovery actor, requests to the
// node's entry, chunks to the lifecycle actor.
// The front door's fleet directory (when the node serves HTTP or the endpoint picker) sees the
// worker messages too.
BridgeSinks make_bridge_sinks(const discovery_actor& discovery, const RequestEntry& entry,
                              const lifecycle_actor& lifecycle,
                              const std::shared_ptr<front_door::FleetDirectory>& directory,
                              const forwarder_actor& shard_chooser) {
  BridgeSinks sinks;
  // Sharded partitions: the shards' loads go to the forwarder, which chooses shards.
  if (shard_chooser) {
    sinks.shard_load = [shard_chooser](ShardLoadData load) {
      caf::anon_send(shard_chooser, shard_load_atom::value, std::move(load));
    };
  }
  sinks.registration = [discovery, directory](discovery::WorkerRegistration registration) {
    if (directory) directory->registered(registration);
    caf::anon_send(discovery, worker_up_atom::value, std::move(registration));
  };
  sinks.heartbeat = [discovery, directory](WorkerLiveness heartbeat) {
    if (directory) directory->heartbeat(heartbeat);
    caf::anon_send(discovery, heartbeat_atom::value, heartbeat);
  };
  sinks.deregistration = [discovery, directory](WorkerLiveness deregistration) {
    if (directory) directory->deregistered(deregistration);
    caf::anon_send(discovery, worker_down_atom::value, deregistration);
  };
  sinks.load = [discovery](WorkerLoadReport report) {
    caf::anon_send(discovery, load_atom::value, std::move(report));
  };
  sinks.kv_events = [discovery](KvEventBatch batch) {
    caf::anon_send(discovery, kv_events_atom::value, std::move(batch));
  };
  sinks.kv_dump = [discovery](KvDump dump) {
    caf::anon_send(discovery, kv_dump_atom::value, std::move(dump));
  };
  sinks.route = [target = entry.route](RouteRequest request, std::string reply,
                                       std::chrono::steady_clock::time_point received) {
    caf::anon_send(target, route_atom::value,
                   RouteEnvelope{std::move(request), std::move(reply), received});
  };
  sinks.report = [target = entry.report](LifecycleReportData report, std::string reply) {
    caf::anon_send(target, report_atom::value, ReportEnvelope{std::move(report), std::move(reply)});
  };
  if (entry.generate) {
    sinks.generate = [target = entry.generate](GenerateRequestData request, std::string reply,
                                               std::chrono::steady_clock::time_point received) {
      caf::anon_send(target, generate_atom::value,
                     GenerateEnvelope{std::move(request), std::move(reply), received});
    };
    sinks.generate_cancel = [target = entry.generate](std::string request_id) {
      caf::anon_send(target, cancel_atom::value, std::move(request_id));
    };
  }
  sinks.chunk = [lifecycle](std::uint64_t stream_id, v1::GenerateChunk chunk) {
    caf::anon_send(lifecycle, chunk_atom::value, ChunkEnvelope{stream_id, std::move(chunk)});
  };
  // From the connection's thread, in order: the discovery actor holds every worker's liveness while
  // the node is cut off, then renews them and asks the workers to register and dump again.
  // The lifecycle actor ends every stream in flight: their chunks are lost meanwhile.
  sinks.disconnected = [discovery, lifecycle, directory] {
    if (directory) directory->nats_link(false);
    caf::anon_send(discovery, nats_link_atom::value, false);
    caf::anon_send(lifecycle, nats_link_atom::value, false);
  };
  sinks.reconnected = [discovery, directory] {
    if (directory) directory->nats_link(true);
    caf::anon_send(discovery, nats_link_atom::value, true);
  };
  return sinks;
}

}  // namespace

std::expected<void, std::string> NodeOptions::validate_peer_ports() const {
  if (actor_port == 0 && !cluster.enabled) return {};
  if (actor_port != 0 && actor_address.empty()) return std::unexpected("--actor-address: empty");
  if (peers.frames.message_bytes < PeerFrameLimits::kMinMessageBytes ||
      peers.frames.message_bytes > std::numeric_limits<std::uint32_t>::max()) {
    return std::unexpected(
        fmt::format("--peer-max-message-bytes: {} is outside [{}, {}]", peers.frames.message_bytes,
                    PeerFrameLimits::kMinMessageBytes, std::numeric_limits<std::uint32_t>::max()));
  }
  if (peers.plaintext) {
    if (!peers.tls.empty()) {
      return std::unexpected(
          "--plaintext-peers: not with --peer-tls-cert, --peer-tls-key, --peer-tls-ca");
    }
    if (actor_port != 0 && !is_loopback_address(actor_address)) {
      return std::unexpected(fmt::format(
          "--plaintext-peers: only on loopback addresses; --actor-address is {}", actor_address));
    }
    if (cluster.enabled && !is_loopback_address(cluster.address)) {
      return std::unexpected(
          fmt::format("--plaintext-peers: only on loopback addresses; --cluster-address is {}",
                      cluster.address));
    }
    return {};
  }
  if (peers.tls.empty()) {
    return std::unexpected(fmt::format(
        "{}: the peer ports need --peer-tls-cert, --peer-tls-key and --peer-tls-ca (mutual TLS, "
        "docs/security.md), or --plaintext-peers on a loopback address",
        actor_port != 0 ? "--actor-port" : "--cluster"));
  }
  return check_peer_tls(peers.tls);
}

std::expected<void, std::string> NodeOptions::validate() const {
  if (ns.empty()) return std::unexpected("--namespace: empty");
  // A block size of 0 is learnt per partition from its workers; the rest is checked as given.
  plugins::worker_selection::RouterConfig checked = router;
  if (checked.block_size == 0) checked.block_size = 1;
  if (auto router_ok = checked.validate(); !router_ok) return std::unexpected(router_ok.error());
  if (booking_ttl < std::chrono::milliseconds(100) || booking_ttl > std::chrono::hours(24)) {
    return std::unexpected("--router-booking-ttl-secs: between 0.1 s and 24 h");
  }
  const std::pair<std::string_view, std::uint64_t> caps[] = {
      {"--router-max-open-bookings", node_caps.max_bookings},
      {"--router-max-booked-blocks", node_caps.max_blocks},
      {"--router-partition-max-open-bookings", partition_caps.max_bookings},
      {"--router-partition-max-booked-blocks", partition_caps.max_blocks},
      {"--router-max-open-bookings-per-client", client_caps.max_bookings},
      {"--router-max-booked-blocks-per-client", client_caps.max_blocks}};
  for (const auto& [flag, value] : caps) {
    // A node always has its caps; a partition's and a client's are optional (0).
    const bool node_cap = !flag.starts_with("--router-partition") && !flag.ends_with("-per-client");
    if ((node_cap && value == 0) || value > kMaxBookingCap) {
      return std::unexpected(
          fmt::format("{}: between {} and {}", flag, node_cap ? 1 : 0, kMaxBookingCap));
    }
  }
  if (max_workers_per_partition < 1 || max_workers_per_partition > 1'000'000) {
    return std::unexpected("--router-max-workers-per-partition: between 1 and 1000000");
  }
  if (max_rank_entries < 1 || max_rank_entries > 100'000'000) {
    return std::unexpected("--router-max-rank-entries: between 1 and 100000000");
  }
  if (hit_rate_workload_tokens > kMaxHitRateWorkloadTokens) {
    return std::unexpected(
        fmt::format("--hit-rate-workload-tokens: between 0 and {}", kMaxHitRateWorkloadTokens));
  }
  if (tick_interval <= std::chrono::milliseconds(0)) return std::unexpected("tick interval: > 0");
  if (selector_timeout <= std::chrono::milliseconds(0)) {
    return std::unexpected("selector timeout: > 0");
  }
  if (first_token_timeout < std::chrono::milliseconds(1) ||
      first_token_timeout > std::chrono::hours(24)) {
    return std::unexpected("--router-first-token-timeout-ms: between 1 ms and 24 h");
  }
  if (stream_stall_timeout < std::chrono::milliseconds(1) ||
      stream_stall_timeout > std::chrono::hours(24)) {
    return std::unexpected("--router-stream-stall-timeout-ms: between 1 ms and 24 h");
  }
  if (max_retries > kMaxRetries) {
    return std::unexpected(fmt::format("--router-max-retries: between 0 and {}", kMaxRetries));
  }
  if (drain_timeout < std::chrono::milliseconds(0) || drain_timeout > std::chrono::hours(1)) {
    return std::unexpected("--drain-timeout-ms: between 0 and 1 h");
  }
  if (queue_threshold && !(*queue_threshold > 0 && *queue_threshold <= 1)) {
    return std::unexpected("--router-queue-threshold: a fraction in (0, 1]");
  }
  if (cluster.enabled) {
    if (cluster.lease_ttl < std::chrono::milliseconds(300) ||
        cluster.lease_ttl > std::chrono::minutes(1)) {
      return std::unexpected("--cluster-lease-ttl-ms: between 300 ms and 60 s");
    }
    if (!(cluster.capacity > 0) || !std::isfinite(cluster.capacity)) {
      return std::unexpected("--node-capacity: a positive number");
    }
    if (cluster.address.empty()) return std::unexpected("--cluster-address: empty");
  }
  if (auto peers_ok = validate_peer_ports(); !peers_ok) return std::unexpected(peers_ok.error());
  if (auto affinity = session_affinity.validate(); !affinity) {
    return std::unexpected(affinity.error());
  }
  if (http) {
    if (auto http_ok = http->validate(); !http_ok) return std::unexpected(http_ok.error());
  }
  if (epp) {
    if (auto epp_ok = epp->validate(); !epp_ok) return std::unexpected(epp_ok.error());
  }
  return {};
}

struct RouterNode::Impl {
  Impl(NodeOptions node_options, plugins::RouterPlugins node_plugins)
      : options(std::move(node_options)), plugins(std::move(node_plugins)) {}

  NodeOptions options;
  plugins::RouterPlugins plugins;
  std::shared_ptr<metrics::MetricsRegistry> registry = std::make_shared<metrics::MetricsRegistry>();
  std::shared_ptr<metrics::RateLimitedLog> log = std::make_shared<metrics::RateLimitedLog>();
  std::shared_ptr<NatsBridge> bridge;
  std::unique_ptr<metrics::MetricsHttpServer> http;
  std::size_t scheduler_threads = 0;
  // The configuration must outlive the system, which is destroyed first (declared last).
  caf::actor_system_config config;
  std::unique_ptr<caf::actor_system> system;
  discovery_actor discovery;
  reservation_actor reservation;
  lifecycle_actor lifecycle;
  /// Null unless plugins.request_classifier is set.
  classifier_actor classifier;
  ingress_actor ingress;
  std::uint16_t actor_port = 0;
  /// Cluster mode only.
  std::shared_ptr<ClusterLink> cluster_link;
  cluster_actor cluster;
  forwarder_actor forwarder;
  /// What peers forward to: an ingress without the forwarder.
  ingress_actor peer_ingress;
  std::uint64_t incarnation = 0;
  std::string cluster_address;
  /// The HTTP API (--http-port) and the endpoint picker (--epp-port) only.
  std::shared_ptr<front_door::FleetDirectory> directory;
  gateway_actor gateway;
  std::unique_ptr<front_door::HttpFrontDoor> http_api;
  std::unique_ptr<front_door::EndpointPicker> epp;

  // What every actor config starts from.
  NodeServices services() const { return NodeServices{bridge, registry, log, options.clock}; }

  // This node's own first stages (spawned by then: classifier, reservation, lifecycle).
  RequestEntry local_entry() const {
    return RequestEntry::local(classifier, reservation, lifecycle);
  }

  // Where every request enters this node, chosen here once: in cluster mode the forwarder (any
  // node accepts any request and serves it here or at its partition's owner).
  RequestEntry entry() const {
    return forwarder ? RequestEntry::forwarding(forwarder) : local_entry();
  }

  // ---- the steps of RouterNode::start, in order ----------------------------------------------

  std::expected<void, std::string> connect_nats() {
    BridgeOptions bridge_options;
    bridge_options.ns = options.ns;
    bridge_options.clock = options.clock;
    // The reservation actor answers bursts of requests: one write per burst (socket_loop.hpp).
    nats::NatsOptions nats_options = options.nats;
    nats_options.deferred_publish = true;
    auto connected = NatsBridge::connect(nats_options, bridge_options, registry, log);
    if (!connected) return std::unexpected(connected.error());
    bridge = std::move(*connected);
    return {};
  }

  // Cluster mode: its own NATS connection and the two buckets (created when missing), so that a
  // server without JetStream stops startup here with a clear error.
  std::expected<void, std::string> join_cluster() {
    if (!options.cluster.enabled) return {};
    std::random_device device;
    do {
      incarnation = (std::uint64_t{device()} << 32) ^ device();
    } while (incarnation == 0);
    auto link = std::make_shared<ClusterLink>();
    auto client = nats::NatsClient::connect(options.nats);
    if (!client) return std::unexpected("cluster: " + client.error());
    link->client = std::move(*client);
    const auto bucket = [&](std::string name) {
      return cluster::JetStreamKv::open_or_create(
          link->client->native_handle(),
          cluster::KvBucketOptions{.bucket = std::move(name),
                                   .ttl = options.cluster.lease_ttl,
                                   .timeout = options.cluster.lease_ttl / 6});
    };
    auto members = bucket(cluster::members_bucket(options.ns));
    if (!members) return std::unexpected("cluster: " + members.error().message);
    auto partitions = bucket(cluster::partitions_bucket(options.ns));
    if (!partitions) return std::unexpected("cluster: " + partitions.error().message);
    link->members = std::move(*members);
    link->partitions = std::move(*partitions);
    const auto ttl = options.cluster.lease_ttl;
    link->leases = cluster::PartitionLeaseOptions{
        .ttl = ttl, .renew_interval = ttl / 3, .renew_deadline = ttl * 2 / 3};
    std::string node_id = options.cluster.node_id;
    if (node_id.empty()) {
      char host[256] = {};
      (void)::gethostname(host, sizeof(host) - 1);
      node_id = fmt::format("{}-{}", host, ::getpid());
    }
    link->self = cluster::MemberRecord{
        .node_id = std::move(node_id),
        .incarnation = incarnation,
        .address = {},
        .capacity = options.cluster.capacity,
        .started_at_unix_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                                  std::chrono::system_clock::now().time_since_epoch())
                                  .count()};
    cluster_link = std::move(link);
    return {};
  }

  // Detached: every step blocks on KV calls.
  void spawn_cluster() {
    if (!cluster_link) return;
    ClusterActorConfig settings{services()};
    settings.link = cluster_link;
    cluster = system->spawn<caf::detached>(cluster_behavior, std::move(settings));
  }

  void spawn_forwarder() {
    if (!cluster_link) return;
    ForwarderActorConfig settings{services()};
    settings.node_id = cluster_link->self.node_id;
    settings.booking_id_prefix = booking_id_prefix(incarnation);
    settings.local = local_entry();
    settings.bridge = bridge;
    settings.ns = options.ns;
    // A forwarded request may wait in its owner's queue as long as a local one would.
    settings.forward_timeout = selector_answer_timeout() + std::chrono::seconds(1);
    settings.sharding = options.cluster.sharding;
    forwarder = system->spawn(forwarder_behavior, std::move(settings));
    // It chooses the shards of sharded models: the discovery actor tells it their fleets.
    if (!options.cluster.sharding.empty()) {
      caf::anon_send(discovery, watch_atom::value, shard_watcher_actor{forwarder});
    }
  }

  // Publishes the ingress actor on the cluster address (peers forward to it) and starts the
  // cluster actor's steps.
  std::expected<void, std::string> start_cluster() {
    if (!cluster_link) return {};
    auto published =
        publish_on_peer_port(peer_ingress, options.cluster.port, options.cluster.address, true);
    if (!published) {
      return std::unexpected(fmt::format("cluster: cannot publish on {}:{}: {}",
                                         options.cluster.address, options.cluster.port,
                                         system->render(published.error())));
    }
    cluster_address = fmt::format("{}:{}", options.cluster.address, *published);
    caf::anon_send(cluster, targets_atom::value, discovery, forwarder, cluster_address);
    return {};
  }

  void start_actor_system() {
    // One scheduler thread per core: the default max(4, cores) oversubscribes small machines.
    scheduler_threads = options.scheduler_threads != 0
                            ? options.scheduler_threads
                            : std::max<std::size_t>(1, std::thread::hardware_concurrency());
    config.set("scheduler.max-threads", scheduler_threads);
    // An idle worker skips CAF's second polling phase (500 sleeps of 50 µs, each woken by a
    // timer, not by new work) and waits on its condition variable, which a NATS callback's
    // enqueue signals. Requests arrive from NATS threads, so this halves a lone request's time in
    // the node (about 180 → 80 µs, tests/bench/node) and stops idle workers from burning timer
    // wake-ups.
    config.set("work-stealing.moderate-poll-attempts", 0);
    // An actor yields its thread after each message. A decision travels the reservation and
    // gateway actors, which the selector's answer queues on the same thread: unbounded (CAF's
    // default), they wait until the selector has emptied its mailbox (KV events, its own deferred
    // work) first.
    config.set("scheduler.max-throughput", 1);
    load_bounded_middleman(config);
    if (options.cluster.enabled) {
      // A hung peer (SIGSTOP) is detected within a second instead of never (CAF 0.17 has no
      // request timeout towards a dead node by itself).
      config.set("middleman.heartbeat-interval", caf::timespan{std::chrono::milliseconds(200)});
      config.set("middleman.connection-timeout", caf::timespan{std::chrono::seconds(1)});
    }
    if (peer_tls_loaded()) load_peer_tls(config, options.peers.tls);
    config.add_message_types<caf::id_block::kvr_actors>();
    system = std::make_unique<caf::actor_system>(config);
    set_peer_frame_limits(*system, options.peers.frames);
  }

  /// The queue's classes: the configured ones and `default` with the node's threshold.
  std::vector<classifiers::PolicyClassConfig> policy_classes() const {
    return classifiers::resolve_policy_classes(
        plugins.policy_classes, classifiers::default_policy_class(options.queue_threshold));
  }

  /// How long the reservation and lifecycle actors wait for a selector's answer: a queued
  /// request's wait limit on top of the selection itself.
  std::chrono::milliseconds selector_answer_timeout() const {
    return queues_requests(policy_classes())
               ? options.selector_timeout + options.first_token_timeout
               : options.selector_timeout;
  }

  void spawn_discovery() {
    SelectorActorConfig selector{{}, services()};
    selector.policy_classes = policy_classes();
    // A request waits for a worker no longer than the node waits for a worker's first token.
    selector.queue_max_wait = options.first_token_timeout;
    selector.options.router = options.router;
    selector.options.booking_ttl = options.booking_ttl;
    selector.options.health = plugins.worker_health;
    selector.options.partition_caps = options.partition_caps;
    selector.options.node_totals = std::make_shared<NodeBookingTotals>(options.node_caps);
    if (options.client_caps.max_bookings != 0 || options.client_caps.max_blocks != 0) {
      selector.options.client_totals = std::make_shared<ClientBookingTotals>(options.client_caps);
    }
    {
      const metrics::NodeMetrics metrics{*registry};
      std::array<metrics::ValueHandle, kBookingCapKinds> refusals;
      for (const auto kind : {BookingCapKind::node_bookings, BookingCapKind::node_blocks,
                              BookingCapKind::partition_bookings, BookingCapKind::partition_blocks,
                              BookingCapKind::client_bookings, BookingCapKind::client_blocks}) {
        refusals[static_cast<std::size_t>(kind)] =
            metrics.booking_cap_refusals(cap_scope(kind), cap_resource(kind));
      }
      selector.options.on_cap_refusal = [refusals](BookingCapKind kind) {
        refusals[static_cast<std::size_t>(kind)].add();
      };
      // A policy that cannot be built is counted and logged by its selector (selector_actor.hpp).
    }
    selector.plugins = &plugins;
    selector.tick_interval = options.tick_interval;
    selector.affinity = options.session_affinity;
    if (options.hit_rate_workload_tokens > 0) {
      selector.hit_rate_ceilings =
          metrics::HitRateCeilingsOptions{.workload_tokens = options.hit_rate_workload_tokens,
                                          .resolution_tokens = metrics::kNodeResolutionTokens};
    }
    selector.max_workers = options.max_workers_per_partition;
    selector.rank_budget = std::make_shared<RankBudget>(options.max_rank_entries);
    selector.classifier = classifier;  // the selectors feed its fleet load
    selector.fenced = options.cluster.enabled;
    // A handover takes one step of the successor, a takeover the lease TTL and a step.
    selector.ownership_wait = options.cluster.lease_ttl;
    // The re-registration throttle keeps its default: a flood of messages from unknown workers
    // asks the fleet to register again at most once per throttle.
    discovery = system->spawn(
        discovery_behavior,
        DiscoveryActorConfig{.selector = selector,
                             .cluster = cluster,
                             .sharding = options.cluster.sharding,
                             .shard_load_subject = subjects::router_shard_load(options.ns),
                             .feed = bridge});
  }

  // Admission in front of the reservation and lifecycle actors, only with a configured
  // request_classifier. Spawned before them and the discovery actor (they tell it lifecycle events,
  // the selectors their KV usage), it learns their handles in its first message
  // (hand_classifier_targets), before any request can reach it.
  void spawn_classifier() {
    if (!plugins.request_classifier) return;
    ClassifierActorConfig settings{services()};
    settings.factory = plugins.request_classifier->factory;
    // A request that waits for admission longer than the node waits for a worker's first token
    // is refused (timeout) rather than booked for a client that has likely given up.
    settings.max_wait = options.first_token_timeout;
    classifier = system->spawn(classifier_behavior, std::move(settings));
  }

  void hand_classifier_targets() {
    if (classifier) caf::anon_send(classifier, targets_atom::value, reservation, lifecycle);
  }

  void spawn_reservation() {
    ReservationActorConfig settings{services()};
    settings.discovery = discovery;
    // In a cluster, a booking id names its node (by incarnation), so any node can forward a report.
    settings.booking_id_prefix =
        cluster_link ? booking_id_prefix(incarnation) : random_booking_id_prefix();
    settings.booking_ttl = options.booking_ttl;
    settings.selector_timeout = selector_answer_timeout();
    settings.tick_interval = options.tick_interval;
    settings.classifier = classifier;
    reservation = system->spawn(reservation_behavior, std::move(settings));
  }

  void spawn_lifecycle() {
    LifecycleActorConfig settings{services()};
    settings.discovery = discovery;
    settings.stream_inbox_prefix = bridge->stream_inbox_prefix();
    settings.selector_timeout = selector_answer_timeout();
    settings.first_token_timeout = options.first_token_timeout;
    settings.stream_stall_timeout = options.stream_stall_timeout;
    settings.max_retries = options.max_retries;
    settings.classifier = classifier;
    lifecycle = system->spawn(lifecycle_behavior, std::move(settings));
  }

  // The ingress actor clients use; in cluster mode it goes through the forwarder, and peers
  // forward to a second one (peer_ingress) that serves this node's partitions only.
  void spawn_ingress() {
    const auto make = [&](RequestEntry entry) {
      IngressActorConfig settings{services()};
      settings.entry = std::move(entry);
      return system->spawn(ingress_behavior, std::move(settings));
    };
    ingress = make(entry());
    if (cluster_link) peer_ingress = make(local_entry());
  }

  // The peer ports speak TLS through CAF's OpenSSL module when it is loaded (start_actor_system).
  caf::expected<std::uint16_t> publish_on_peer_port(const ingress_actor& whom, std::uint16_t port,
                                                    const std::string& address,
                                                    bool reuse = false) {
    if (system->has_openssl_manager()) {
      return caf::openssl::publish(whom, port, address.c_str(), reuse);
    }
    return system->middleman().publish(whom, port, address.c_str(), reuse);
  }

  void unpublish_peer_port(const ingress_actor& whom, std::uint16_t port) {
    if (system->has_openssl_manager()) {
      // Asked directly: caf/openssl/unpublish.hpp sends a message its actor does not accept.
      auto unpublish = caf::make_function_view(system->openssl_manager().actor_handle());
      (void)unpublish(caf::unpublish_atom::value, whom.address(), port);
    } else {
      (void)system->middleman().unpublish(whom, port);
    }
  }

  // Publishes the ingress actor through CAF's middleman, when asked (--actor-port).
  std::expected<void, std::string> publish_ingress() {
    if (options.actor_port == 0) return {};
    auto published = publish_on_peer_port(ingress, options.actor_port, options.actor_address);
    if (!published) {
      return std::unexpected(fmt::format("cannot publish the ingress actor on {}:{}: {}",
                                         options.actor_address, options.actor_port,
                                         system->render(published.error())));
    }
    actor_port = *published;
    return {};
  }

  // Hands the bridge's decoded messages to the actors and subscribes.
  std::expected<void, std::string> start_bridge() {
    if (options.http || options.epp) {
      directory = std::make_shared<front_door::FleetDirectory>(options.clock);
    }
    const bool sharded = options.cluster.enabled && !options.cluster.sharding.empty();
    return bridge->start(make_bridge_sinks(discovery, entry(), lifecycle, directory,
                                           sharded ? forwarder : forwarder_actor{}));
  }

  // Serves the OpenAI-compatible API (--http-port) and the endpoint picker (--epp-port), when
  // asked: their requests enter through the ingress actor, as an actor client's do.
  std::expected<void, std::string> start_front_door() {
    if (!options.http && !options.epp) return {};
    GatewayActorConfig settings{services()};
    settings.ingress = ingress;
    // A queued request may wait as long as the reservation actor waits for its selector.
    settings.route_timeout = selector_answer_timeout() + std::chrono::seconds(5);
    gateway = system->spawn(gateway_behavior, std::move(settings));
    const auto routing_gateway = make_actor_gateway(gateway);
    if (options.http) {
      auto started =
          front_door::HttpFrontDoor::start(*options.http, routing_gateway, directory, registry);
      if (!started) return std::unexpected(started.error());
      http_api = std::move(*started);
    }
    if (options.epp) {
      auto started =
          front_door::EndpointPicker::start(*options.epp, routing_gateway, directory, registry);
      if (!started) return std::unexpected(started.error());
      epp = std::move(*started);
    }
    return {};
  }

  // The peer ports serve mutual TLS.
  bool peer_tls_loaded() const {
    return (options.actor_port != 0 || options.cluster.enabled) && !options.peers.plaintext;
  }

  // Serves /metrics and /healthz, when asked (--metrics-port).
  std::expected<void, std::string> start_metrics_endpoint() {
    if (options.metrics_port == 0) return {};
    std::weak_ptr<NatsBridge> weak_bridge = bridge;
    auto started = metrics::MetricsHttpServer::start(
        options.bind_host, options.metrics_port, registry,
        [weak_bridge]() -> std::string {
          auto connection = weak_bridge.lock();
          if (!connection) return "stopping";
          return connection->connected() ? std::string{} : "NATS disconnected";
        },
        [weak_bridge, tls = peer_tls_loaded(), frame_counts = peer_frame_counter(*system),
         refused_handshakes = metrics::NodeMetrics{*registry}.peer_handshakes_refused(),
         refused_frames = metrics::NodeMetrics{*registry}.peer_frames_refused()] {
          if (auto connection = weak_bridge.lock()) connection->refresh_drop_counts();
          const PeerFrameCounts plaintext = frame_counts();
          refused_handshakes.set(static_cast<double>(plaintext.handshakes_refused +
                                                     (tls ? refused_peer_handshakes() : 0)));
          refused_frames.set(static_cast<double>(plaintext.frames_refused));
        });
    if (!started) return std::unexpected(started.error());
    http = std::move(*started);
    return {};
  }

  // Workers that registered before this node started announce themselves again.
  void request_registrations() { caf::anon_send(discovery, reregister_atom::value); }

  // "off", or the classes and their busy thresholds.
  std::string describe_queue() const {
    const auto classes = policy_classes();
    if (!queues_requests(classes)) return "off";
    std::string described;
    for (const auto& policy_class : classes) {
      if (!described.empty()) described += ", ";
      described += policy_class.name;
      if (policy_class.prefill_busy_threshold) {
        described += fmt::format(" >{} tokens", *policy_class.prefill_busy_threshold);
      }
      if (policy_class.prefill_busy_threshold_frac) {
        described +=
            fmt::format(" >{:g} of max batched", *policy_class.prefill_busy_threshold_frac);
      }
      if (policy_class.kv_busy_threshold) {
        described += fmt::format(" >{:g} of KV", *policy_class.kv_busy_threshold);
      }
    }
    return described;
  }

  std::string describe_caps() const {
    const auto cap = [](std::uint64_t value) {
      return value == 0 ? std::string{"node's"} : std::to_string(value);
    };
    const auto client_cap = [](std::uint64_t value) {
      return value == 0 ? std::string{"none"} : std::to_string(value);
    };
    return fmt::format(
        "{} bookings / {} blocks per node, {} / {} per partition, {} / {} per client",
        options.node_caps.max_bookings, options.node_caps.max_blocks,
        cap(options.partition_caps.max_bookings), cap(options.partition_caps.max_blocks),
        client_cap(options.client_caps.max_bookings), client_cap(options.client_caps.max_blocks));
  }

  void log_summary() const {
    spdlog::info(
        "kvr node: namespace '{}', block size {}, booking ttl {} ms, booking caps {}, first-token "
        "timeout {} ms, session affinity {}, request classifier {}, queue {}, {} scheduler "
        "threads; NATS {}; metrics {}; actor port {}; HTTP API {}; endpoint picker {}; cluster {}",
        options.ns,
        options.router.block_size != 0 ? std::to_string(options.router.block_size)
                                       : std::string{"learnt per partition"},
        options.booking_ttl.count(), describe_caps(), options.first_token_timeout.count(),
        options.session_affinity.ttl
            ? fmt::format("{} (ttl {} s)", as_str(options.session_affinity.mode),
                          options.session_affinity.ttl->count())
            : std::string{"off"},
        plugins.request_classifier ? plugins.request_classifier->type : std::string{"none"},
        describe_queue(), scheduler_threads, nats::redact_urls(options.nats.url),
        http ? fmt::format("http://{}:{}/metrics", options.bind_host, http->port())
             : std::string{"off"},
        actor_port,
        http_api ? fmt::format("http://{}:{}/v1", options.http->address, http_api->port())
                 : std::string{"off"},
        epp ? fmt::format("grpc://{}:{}", options.epp->address, epp->port()) : std::string{"off"},
        cluster_link ? fmt::format("node {} at {}, lease ttl {} ms", cluster_link->self.node_id,
                                   cluster_address, options.cluster.lease_ttl.count())
                     : std::string{"off"});
  }

  std::size_t drain(std::chrono::milliseconds timeout) {
    const auto in_flight = [this] {
      return static_cast<std::size_t>(registry->value(metrics::NodeMetrics::kGenerateInFlight)) +
             (http_api ? http_api->in_flight() : 0) + (epp ? epp->in_flight() : 0);
    };
    // A cluster member hands its partitions back at once instead: peers would go on forwarding
    // it their requests while it drained.
    if (cluster_link) return in_flight();
    if (system && actor_port != 0) {
      unpublish_peer_port(ingress, actor_port);
      actor_port = 0;
    }
    if (bridge) bridge->stop_intake();
    if (http_api) http_api->stop_intake();
    if (epp) epp->stop_intake();
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    // The main thread waits here while the actors serve: a short poll of one gauge.
    while (in_flight() > 0 && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return in_flight();
  }

  void shutdown() {
    // The front door and the endpoint picker first: they end their requests in flight and release
    // their bookings while the actors still run.
    http_api.reset();
    epp.reset();
    if (bridge) bridge->stop();
    http.reset();
    if (system) {
      if (actor_port != 0) unpublish_peer_port(ingress, actor_port);
      // The cluster actor first: it hands its leases back, so the others take over at once.
      if (cluster) caf::anon_send_exit(cluster, caf::exit_reason::user_shutdown);
      if (forwarder) caf::anon_send_exit(forwarder, caf::exit_reason::user_shutdown);
      if (peer_ingress) caf::anon_send_exit(peer_ingress, caf::exit_reason::user_shutdown);
      cluster = nullptr;
      forwarder = nullptr;
      peer_ingress = nullptr;
      // The lifecycle actor next: it ends every client's stream with an explicit error.
      caf::anon_send_exit(lifecycle, caf::exit_reason::user_shutdown);
      caf::anon_send_exit(discovery, caf::exit_reason::user_shutdown);
      caf::anon_send_exit(reservation, caf::exit_reason::user_shutdown);
      caf::anon_send_exit(ingress, caf::exit_reason::user_shutdown);
      if (gateway) caf::anon_send_exit(gateway, caf::exit_reason::user_shutdown);
      gateway = nullptr;
      if (classifier) caf::anon_send_exit(classifier, caf::exit_reason::user_shutdown);
      classifier = nullptr;
      lifecycle = nullptr;
      discovery = nullptr;
      reservation = nullptr;
      ingress = nullptr;
      system->await_all_actors_done();
      system.reset();
    }
    cluster_link.reset();
    bridge.reset();
  }
};

RouterNode::RouterNode(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

RouterNode::~RouterNode() { impl_->shutdown(); }

std::size_t RouterNode::drain(std::chrono::milliseconds timeout) { return impl_->drain(timeout); }

std::uint16_t RouterNode::actor_port() const { return impl_->actor_port; }

std::uint16_t RouterNode::http_port() const {
  return impl_->http_api ? impl_->http_api->port() : std::uint16_t{0};
}

std::uint16_t RouterNode::epp_port() const {
  return impl_->epp ? impl_->epp->port() : std::uint16_t{0};
}

std::uint16_t RouterNode::metrics_port() const {
  return impl_->http ? impl_->http->port() : std::uint16_t{0};
}

const metrics::MetricsRegistry& RouterNode::metrics() const { return *impl_->registry; }

std::expected<std::unique_ptr<RouterNode>, std::string> RouterNode::start(
    NodeOptions options, plugins::RouterPlugins plugins,
    const std::function<void()>& before_answering) {
  if (auto valid = options.validate(); !valid) return std::unexpected(valid.error());
  auto impl = std::make_unique<Impl>(std::move(options), std::move(plugins));
  metrics::NodeMetrics::describe(*impl->registry);
  if (auto connected = impl->connect_nats(); !connected) return std::unexpected(connected.error());
  if (auto joined = impl->join_cluster(); !joined) return std::unexpected(joined.error());
  impl->start_actor_system();
  impl->spawn_classifier();  // first: the selectors tell it their KV usage
  impl->spawn_cluster();     // before the discovery actor, which tells it every partition
  impl->spawn_discovery();
  impl->spawn_reservation();
  impl->spawn_lifecycle();
  impl->hand_classifier_targets();
  impl->spawn_forwarder();  // before the ingress, which hands it actor clients' requests
  impl->spawn_ingress();
  // From here on a failed step stops what the steps before it started.
  const auto fail = [&impl](std::string error) {
    impl->shutdown();
    return std::unexpected(std::move(error));
  };
  if (auto published = impl->publish_ingress(); !published) return fail(published.error());
  if (auto joined = impl->start_cluster(); !joined) return fail(joined.error());
  if (before_answering) before_answering();
  if (auto started = impl->start_bridge(); !started) return fail(started.error());
  // The front doors before /healthz: a node that answers /healthz serves every port it was given.
  if (auto serving = impl->start_front_door(); !serving) return fail(serving.error());
  if (auto serving = impl->start_metrics_endpoint(); !serving) return fail(serving.error());
  impl->request_registrations();
  impl->log_summary();
  return std::unique_ptr<RouterNode>(new RouterNode(std::move(impl)));
}

}  // namespace kvr::actors
