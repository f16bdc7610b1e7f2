#include "deploy/worker/worker_publisher.hpp"

#include <spdlog/spdlog.h>

#include "kvr/v1/kv_events.pb.h"
#include "kvr/v1/worker.pb.h"
#include "messages/subjects.hpp"
#include "selection/wire/kv_event_codec.hpp"

namespace kvr::worker {
namespace {

std::uint64_t unix_ms() {
  return static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                        std::chrono::system_clock::now().time_since_epoch())
                                        .count());
}

}  // namespace

std::optional<DpRank> read_dump_request(const nats::NatsMessage& message,
                                        std::uint32_t data_parallel_size) {
  v1::KvDumpRequest request;
  if (!request.ParseFromString(message.data) || message.reply.empty() ||
      request.dp_rank() >= data_parallel_size) {
    return std::nullopt;
  }
  return request.dp_rank();
}

WorkerPublisher::WorkerPublisher(nats::NatsClient& nats, std::string ns, std::string log_prefix)
    : nats_(nats), ns_(std::move(ns)), log_prefix_(std::move(log_prefix)) {}

std::expected<std::vector<nats::NatsSubscription>, std::string> WorkerPublisher::subscribe_worker(
    WorkerId worker, WorkerSubjectHandlers handlers) {
  const std::string generate = subjects::worker_generate(ns_, worker);
  struct Route {
    std::string subject;
    std::function<void(nats::NatsMessage)> handler;
  };
  Route routes[] = {{generate, std::move(handlers.on_generate)},
                    {generate + ".cancel", std::move(handlers.on_cancel)},
                    {subjects::worker_dump(ns_, worker), std::move(handlers.on_dump)}};
  std::vector<nats::NatsSubscription> subscriptions;
  for (Route& route : routes) {
    if (!route.handler) continue;
    auto subscription = nats_.subscribe(route.subject, std::move(route.handler));
    if (!subscription) return std::unexpected(subscription.error());
    subscriptions.push_back(std::move(*subscription));
  }
  return subscriptions;
}

std::expected<nats::NatsSubscription, std::string> WorkerPublisher::subscribe_discover(
    std::function<void()> on_discover) {
  return nats_.subscribe(subjects::worker_discover(ns_), [on_discover = std::move(on_discover)](
                                                             nats::NatsMessage) { on_discover(); });
}

std::string WorkerPublisher::partition_of(WorkerId worker) const {
  const std::lock_guard lock{partitions_mutex_};
  const auto it = partitions_.find(worker);
  return it == partitions_.end() ? std::string{} : it->second;
}

void WorkerPublisher::publish_registration(const WorkerInstance& worker,
                                           const WorkerDescription& description) {
  v1::WorkerRegistration registration;
  registration.set_worker_id(worker.id);
  registration.set_incarnation(worker.incarnation);
  registration.set_model(description.model);
  {
    const std::lock_guard lock{partitions_mutex_};
    partitions_[worker.id] =
        description.model + "/" +
        (description.routing_group.empty() ? std::string{"default"} : description.routing_group);
  }
  registration.set_role(to_wire(description.role));
  registration.set_routing_group(description.routing_group);
  registration.set_block_size(description.block_size);
  registration.set_total_kv_blocks(description.total_kv_blocks.value_or(0));
  registration.set_data_parallel_size(description.data_parallel_size);
  for (const auto& taint : description.taints) registration.add_taints(taint);
  registration.set_max_num_batched_tokens(description.max_num_batched_tokens);
  registration.set_max_num_seqs(description.max_num_seqs);
  registration.set_publishes_kv_events(description.publishes_kv_events);
  registration.set_liveness_ttl_ms(static_cast<std::uint32_t>(description.liveness_ttl.count()));
  registration.set_generate_subject(subjects::worker_generate(ns_, worker.id));
  registration.set_dump_subject(subjects::worker_dump(ns_, worker.id));
  registration.set_http_url(description.http_url);
  for (const auto& adapter : description.lora_adapters) registration.add_lora_adapters(adapter);
  publish(subjects::worker_register(ns_), registration);
}

void WorkerPublisher::publish_heartbeat(const WorkerInstance& worker) {
  v1::WorkerHeartbeat heartbeat;
  heartbeat.set_worker_id(worker.id);
  heartbeat.set_incarnation(worker.incarnation);
  heartbeat.set_sent_at_unix_ms(unix_ms());
  publish(subjects::worker_heartbeat(ns_), heartbeat);
}

void WorkerPublisher::publish_load(const WorkerInstance& worker,
                                   std::span<const discovery::ConfirmedLoad> ranks) {
  v1::LoadMetrics metrics;
  metrics.set_worker_id(worker.id);
  metrics.set_incarnation(worker.incarnation);
  metrics.set_sent_at_unix_ms(unix_ms());
  for (std::size_t rank = 0; rank < ranks.size(); ++rank) {
    const discovery::ConfirmedLoad& load = ranks[rank];
    v1::RankLoad* wire = metrics.add_ranks();
    wire->set_dp_rank(static_cast<std::uint32_t>(rank));
    wire->set_active_requests(load.active_requests);
    wire->set_waiting_requests(load.waiting_requests);
    wire->set_active_decode_blocks(load.active_decode_blocks);
    wire->set_active_prefill_tokens(load.active_prefill_tokens);
    wire->set_kv_blocks_used(load.kv_blocks_used);
  }
  const std::string partition = partition_of(worker.id);
  publish(partition.empty() ? subjects::worker_load(ns_)
                            : subjects::partition_load(ns_, partition, worker.id),
          metrics);
}

void WorkerPublisher::publish_deregistration(const WorkerInstance& worker,
                                             std::string_view reason) {
  v1::WorkerDeregistration deregistration;
  deregistration.set_worker_id(worker.id);
  deregistration.set_incarnation(worker.incarnation);
  deregistration.set_reason(std::string{reason});
  publish(subjects::worker_deregister(ns_), deregistration);
}

void WorkerPublisher::publish_kv_batch(const KvEventBatch& batch) {
  const std::string partition = partition_of(batch.worker.worker_id);
  publish(partition.empty() ? subjects::kv_events(ns_, batch.worker.worker_id)
                            : subjects::partition_kv_events(ns_, partition, batch.worker.worker_id),
          encode_kv_event_batch(batch));
}

void WorkerPublisher::publish_dump(const std::string& reply_subject, const KvDump& dump) {
  publish(reply_subject, encode_kv_dump(dump));
}

void WorkerPublisher::publish(const std::string& subject,
                              const google::protobuf::MessageLite& message) {
  if (auto sent = nats_.publish(subject, message.SerializeAsString()); !sent) warn(sent.error());
}

void WorkerPublisher::flush(std::chrono::milliseconds timeout) {
  if (auto flushed = nats_.flush(timeout); !flushed) warn(flushed.error());
}

void WorkerPublisher::warn(std::string_view error) const {
  spdlog::warn("{}: {}", log_prefix_, error);
}

}  // namespace kvr::worker
