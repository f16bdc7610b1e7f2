// The NATS subjects of the kvr protocol. Every subject lives under kvr.<namespace>.
// Used by the NATS bridge, the simulated worker and any client that speaks kvr over NATS.
#pragma once

#include <string>
#include <string_view>

#include "messages/ids.hpp"

namespace kvr::subjects {

/// A partition key ("<model>/<routing group>") as one subject token: every byte outside
/// [-/_A-Za-z0-9] written as =XX (hex).
std::string partition_token(std::string_view partition);

/// WorkerRegistration, published by each worker at start and on request.
std::string worker_register(std::string_view ns);
/// WorkerHeartbeat.
std::string worker_heartbeat(std::string_view ns);
/// WorkerDeregistration, on clean shutdown.
std::string worker_deregister(std::string_view ns);
/// A worker's KvEventBatch: kvr.<ns>.kv.<partition token>.<worker_id>, so that a node subscribes
/// only to the partitions (or, for a sharded partition, the workers) it serves.
std::string partition_kv_events(std::string_view ns, std::string_view partition, WorkerId worker);
/// Wildcard matching the KV events of every worker of `partition`.
std::string partition_kv_events_all(std::string_view ns, std::string_view partition);
/// A worker's LoadMetrics: kvr.<ns>.load.<partition token>.<worker_id>.
std::string partition_load(std::string_view ns, std::string_view partition, WorkerId worker);
/// Wildcard matching the load of every worker of `partition`.
std::string partition_load_all(std::string_view ns, std::string_view partition);
/// Wildcards matching every worker's load (kvr.<ns>.load.>) and KV events (kvr.<ns>.kv.>, the
/// previous release's subjects included), whatever its partition: for tools watching a namespace.
std::string every_load(std::string_view ns);
std::string every_kv_events(std::string_view ns);
/// The previous release's LoadMetrics subject, shared by every worker: still received (every node
/// decodes it), each worker that uses it logged once; it goes in the next release.
std::string worker_load(std::string_view ns);
/// The previous release's KvEventBatch subject, kvr.<ns>.kv.<worker_id>: still received like
/// worker_load().
std::string kv_events(std::string_view ns, WorkerId worker);
/// Wildcard matching every worker's KV events on the previous release's subjects.
std::string kv_events_all(std::string_view ns);
/// Routers publish an empty message here to ask every worker to register again (router start).
std::string worker_discover(std::string_view ns);
/// RouteRequest → RouteDecision (request/reply, queue group "kvr-router").
std::string router_route(std::string_view ns);
/// kvr.<ns>.router.<partition>.route: a partition's own route subject, served by its owner in a
/// cluster, so that a client that knows the model skips the forwarding hop. `partition` is
/// "<model>/<routing group>" with every byte outside [-/_A-Za-z0-9] written as =XX (hex).
std::string router_partition_route(std::string_view ns, std::string_view partition);
/// ShardLoad: kvr.<ns>.router.shard_load, published by the owner of each shard of a sharded
/// partition and read by every node (no queue group).
std::string router_shard_load(std::string_view ns);
/// GenerateRequest → stream of GenerateChunk on the request's stream subject (request/reply, queue
/// group "kvr-router"; the reply is the first RouteDecision, whose booking id is empty because the
/// node manages the booking itself).
std::string router_generate(std::string_view ns);
/// GenerateCancel{request_id}: kvr.<ns>.router.generate.cancel, published (no reply) by a client
/// to stop its generate request; every node receives it (no queue group) and the node serving
/// the request cancels it at the worker and ends the client's stream with "cancelled".
std::string router_generate_cancel(std::string_view ns);
/// LifecycleReport → LifecycleAck.
std::string router_report(std::string_view ns);
/// Default worker generate subject: kvr.<ns>.worker.<worker_id>.generate; a worker serves
/// GenerateCancel on its generate subject + ".cancel".
std::string worker_generate(std::string_view ns, WorkerId worker);
/// Default worker dump subject: kvr.<ns>.worker.<worker_id>.dump.
std::string worker_dump(std::string_view ns, WorkerId worker);

/// Queue group shared by every router node, so that each request reaches one node.
inline constexpr std::string_view kRouterQueueGroup = "kvr-router";

/// True when `ns` is a valid namespace token: non-empty, [A-Za-z0-9_-] only.
bool is_valid_namespace(std::string_view ns);

/// Why `subject` cannot be one a node publishes requests to (a worker's generate or dump
/// subject), or empty when it can: it must be a literal NATS subject (non-empty tokens separated
/// by '.', no whitespace, control characters or wildcards '*' '>'), and outside what routers
/// serve or own: kvr.<any namespace>.router.…, .workers.…, .kv.… and .load.… (where a node's own
/// requests would come back to it or to the workers' announcements), reply inboxes (_INBOX.…, where
/// the node's streams and dumps arrive) and system subjects ($…).
std::string invalid_worker_subject(std::string_view subject);

}  // namespace kvr::subjects
