// The router node (`kvr node`): a CAF actor system fed by NATS, serving route mode (decisions
// with leases) and generate mode (proxied generation). It connects the NATS bridge, spawns the
// discovery actor (which spawns one selector actor per partition), the reservation actor, the
// lifecycle actor (generate mode) and the ingress actor (published through CAF's middleman when
// asked), and serves /metrics and /healthz. Plain interface (no CAF in this header), so that the
// command line and tests include it cheaply.
#pragma once

#include <chrono>
#include <cstdint>
#include <expected>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "messages/clock.hpp"
#include "messages/metrics/hit_rate_ceilings.hpp"
#include "messages/metrics/metrics_registry.hpp"
#include "messages/nats/nats_client.hpp"
#include "messages/peer_tls.hpp"
#include "selection/cluster/sharding.hpp"
#include "selection/front_door/endpoint_picker.hpp"
#include "selection/front_door/http_front_door.hpp"
#include "selection/partition/booking_caps.hpp"
#include "selection/partition/session_affinity.hpp"
#include "selection/plugin_registry.hpp"
#include "selection/router_config.hpp"

namespace kvr::actors {

/// Cluster mode (`--cluster`): membership and partition leases in NATS JetStream, requests for
/// partitions other nodes own forwarded to them over CAF's middleman.
struct ClusterNodeOptions {
  bool enabled = false;
  /// Stable across restarts (placement hashes it); empty: "<hostname>-<pid>".
  std::string node_id;
  /// The middleman binds here; peers forward requests to it (PeerPortOptions says how they
  /// authenticate).
  std::string address = "127.0.0.1";
  /// 0: any free port (the member record carries the one bound).
  std::uint16_t port = 0;
  /// Placement weight: a node of capacity 2 owns about twice the partitions.
  double capacity = 1.0;
  /// A lease not renewed for this long ages out; renewals every third of it, and a node stops
  /// serving a partition two thirds of it after its last successful renewal.
  std::chrono::milliseconds lease_ttl{3000};
  /// The models split into shards (`--partition-shards`), each shard leased as a partition.
  std::map<std::string, cluster::ShardingConfig, std::less<>> sharding;
};

/// How the peer ports (the actor port and the cluster port, both CAF's middleman) admit a peer
/// (docs/security.md). Either mutual TLS, where every peer presents a certificate the CA signed
/// and a connection fails its handshake before a byte of it is read as a message, or plaintext by
/// explicit choice and only on loopback addresses, where every local process is trusted and each
/// frame is bounded (actors/node/peer_frames.hpp).
struct PeerPortOptions {
  PeerTlsFiles tls;
  bool plaintext = false;
  /// What a plaintext peer may send in one frame (`--peer-max-message-bytes`); a larger frame
  /// closes its connection before it is allocated.
  PeerFrameLimits frames;
};

/// The most retries --router-max-retries allows: each excludes another worker, and a request
/// that failed on this many is not the workers' fault.
inline constexpr std::uint32_t kMaxRetries = 8;

/// Default caps on what unreported bookings may hold (`--router-max-open-bookings`,
/// `--router-max-booked-blocks`): each open booking costs about 1 KB plus 27 to 47 bytes per prompt
/// block (docs/protocol.md), so the defaults bound the bookings to a few hundred MB.
inline constexpr std::uint64_t kDefaultMaxOpenBookings = 100'000;
inline constexpr std::uint64_t kDefaultMaxBookedBlocks = 8'000'000;
/// Default caps per client (`--router-max-open-bookings-per-client`,
/// `--router-max-booked-blocks-per-client`): half of the node's, so that one client that routes and
/// never reports leaves the other half to the rest, while a deployment with a single client (one
/// gateway) still has half the node before it raises them.
inline constexpr std::uint64_t kDefaultMaxOpenBookingsPerClient = 50'000;
inline constexpr std::uint64_t kDefaultMaxBookedBlocksPerClient = 4'000'000;
/// The largest cap accepted.
inline constexpr std::uint64_t kMaxBookingCap = 1'000'000'000;
/// Default bounds on what registrations may make a node hold (`--router-max-workers-per-partition`,
/// `--router-max-rank-entries`): a worker registers up to 1,024 data-parallel ranks, each costing
/// its partition about 0.6 KB (docs/reliability.md), so 16,384 rank entries bound a node's fleet
/// state near 11 MB while covering fleets of thousands of engines.
inline constexpr std::size_t kDefaultMaxWorkersPerPartition = 4096;
inline constexpr std::uint64_t kDefaultMaxRankEntries = 16'384;
/// The largest workload cache of the hit-rate ceilings (`--hit-rate-workload-tokens`).
inline constexpr std::uint64_t kMaxHitRateWorkloadTokens = std::uint64_t{1} << 36;

/// Everything a node is configured with (command line, environment, policy YAML).
struct NodeOptions {
  nats::NatsOptions nats;
  /// Subject namespace: kvr.<namespace>.…
  std::string ns = "default";
  /// Router settings handed to every policy factory (block size, kv-cost defaults ...).
  plugins::worker_selection::RouterConfig router;
  /// An unreported booking is released after this long.
  std::chrono::milliseconds booking_ttl{120'000};
  /// Caps on open bookings (route-mode bookings and generate requests in flight) over all of the
  /// node's partitions: a route beyond one is refused with ROUTE_ERROR_OVERLOADED.
  BookingCaps node_caps{kDefaultMaxOpenBookings, kDefaultMaxBookedBlocks};
  /// The same caps per partition (`--router-partition-max-*`); 0: only the node's apply.
  BookingCaps partition_caps;
  /// The same caps per client over all partitions (`--router-max-*-per-client`; 0: none): a
  /// NATS connection or a remote actor client; the node's own front door and endpoint picker
  /// are not capped per client (their bookings end with their streams).
  BookingCaps client_caps{kDefaultMaxOpenBookingsPerClient, kDefaultMaxBookedBlocksPerClient};
  /// Registrations beyond these are refused, counted and logged: new workers of a partition, and
  /// data-parallel rank entries over all of the node's partitions.
  std::size_t max_workers_per_partition = kDefaultMaxWorkersPerPartition;
  std::uint64_t max_rank_entries = kDefaultMaxRankEntries;
  /// Loopback port of /metrics and /healthz; 0: no HTTP endpoint.
  std::uint16_t metrics_port = 0;
  /// Port the ingress actor is published on (a peer port); 0: not published.
  std::uint16_t actor_port = 0;
  /// Address the ingress actor is published on.
  std::string actor_address = "127.0.0.1";
  /// TLS or plaintext on the actor port and the cluster port.
  PeerPortOptions peers;
  /// Address the metrics endpoint binds to.
  std::string bind_host = "127.0.0.1";
  /// CAF scheduler threads; 0: the number of cores.
  std::size_t scheduler_threads = 0;
  /// How long a selector may take to answer a route or booking request.
  std::chrono::milliseconds selector_timeout{2'000};
  /// Period of the selectors' and the ledger's expiry timers.
  std::chrono::milliseconds tick_interval{100};
  /// Generate mode: a dispatched request without a first chunk after this long counts as a
  /// failure of its worker (retried elsewhere: max_retries).
  std::chrono::milliseconds first_token_timeout{30'000};
  /// Generate mode: a response with no chunk for this long ends with an explicit error.
  std::chrono::milliseconds stream_stall_timeout{30'000};
  /// Generate mode and the HTTP front door: retries of a request whose worker failed before its
  /// first token, each on another worker (at most kMaxRetries).
  std::uint32_t max_retries = 1;
  /// On SIGTERM: how long the streams in flight may run on while no new request is taken.
  std::chrono::milliseconds drain_timeout{20'000};
  /// The default class's busy threshold (`--router-queue-threshold`): a fraction in (0, 1] of a
  /// worker's max batched tokens; empty: the class `default` never queues. Requests queue only
  /// when some class (this one, or one of the router-policy YAML's policy_classes) has a busy
  /// threshold; a queued request waits at most first_token_timeout.
  std::optional<double> queue_threshold;
  ClusterNodeOptions cluster;
  /// The OpenAI-compatible HTTP API (`--http-port`); absent: not served.
  std::optional<front_door::FrontDoorOptions> http;
  /// The endpoint picker for Envoy's ext_proc (`--epp-port`); absent: not served.
  std::optional<front_door::EndpointPickerOptions> epp;
  /// Session affinity (`--router-session-affinity-*`); off unless a TTL is set.
  SessionAffinityOptions session_affinity;
  /// The hit-rate ceilings (`--hit-rate-workload-tokens`, docs/hit-rate.md): the size of each
  /// partition's workload cache in tokens (at least its fleet's KV); 0: not measured.
  std::uint64_t hit_rate_workload_tokens = metrics::kDefaultWorkloadTokens;
  /// Where the node's actors read the time (leases, deadlines, latencies); tests inject one.
  std::shared_ptr<const Clock> clock = Clock::steady();

  /// Checks ranges; the error names the option.
  std::expected<void, std::string> validate() const;
  /// TLS credentials that load and match, or plaintext on loopback addresses only.
  std::expected<void, std::string> validate_peer_ports() const;
};

/// A running node; stops (unsubscribes, ends its actors, closes NATS) when destroyed.
class RouterNode {
 public:
  /// Connects to NATS, starts the actors and endpoints, and asks the workers to register.
  /// `plugins` are the resolved policies. `before_answering` runs once NATS and the cluster are
  /// joined, just before the node first answers anyone (its subscriptions and /healthz): what
  /// must hold by the time a client can see the node (kvr node's graceful stop) starts there.
  /// The error says what failed.
  static std::expected<std::unique_ptr<RouterNode>, std::string> start(
      NodeOptions options, plugins::RouterPlugins plugins,
      const std::function<void()>& before_answering = {});

  ~RouterNode();
  RouterNode(const RouterNode&) = delete;
  RouterNode& operator=(const RouterNode&) = delete;

  /// Stops taking new requests (the router's NATS subjects, the actor port, the HTTP API and the
  /// endpoint picker) while the requests in flight go on: worker messages, reports, cancels,
  /// generate streams, HTTP answers and the answers of requests Envoy was sent to an engine. Waits
  /// until none is left or `timeout` passed; returns how many are left (destroying the node ends
  /// them with an explicit error). A cluster member does not drain: it hands its partitions back
  /// when destroyed, since peers would go on forwarding it requests.
  std::size_t drain(std::chrono::milliseconds timeout);

  /// The port the ingress actor is published on (0: not published).
  std::uint16_t actor_port() const;
  /// The port of the OpenAI-compatible HTTP API (0: not served).
  std::uint16_t http_port() const;
  /// The port of the endpoint picker (0: not served).
  std::uint16_t epp_port() const;
  /// The port of /metrics and /healthz (0: none).
  std::uint16_t metrics_port() const;
  const metrics::MetricsRegistry& metrics() const;

 private:
  struct Impl;
  explicit RouterNode(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvr::actors
