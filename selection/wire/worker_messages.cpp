#include "selection/wire/worker_messages.hpp"

#include <algorithm>

#include <fmt/format.h>

#include "kvr/v1/kv_events.pb.h"
#include "kvr/v1/worker.pb.h"

namespace kvr {
namespace {

template <class Proto>
std::expected<Proto, std::string> parse(std::string_view bytes, std::string_view what) {
  Proto proto;
  if (!proto.ParseFromArray(bytes.data(), static_cast<int>(bytes.size()))) {
    return std::unexpected(fmt::format("{}: not a valid protobuf message", what));
  }
  return proto;
}

template <class Proto>
std::expected<WorkerLiveness, std::string> decode_liveness(std::string_view bytes,
                                                           std::string_view what) {
  auto proto = parse<Proto>(bytes, what);
  if (!proto) return std::unexpected(proto.error());
  if (proto->worker_id() == 0) return std::unexpected(fmt::format("{}: worker_id is 0", what));
  return WorkerLiveness{proto->worker_id(), proto->incarnation()};
}

}  // namespace

std::expected<discovery::WorkerRegistration, std::string> decode_worker_registration(
    std::string_view bytes, const WorkerMessageLimits& limits) {
  auto proto = parse<v1::WorkerRegistration>(bytes, "WorkerRegistration");
  if (!proto) return std::unexpected(proto.error());
  auto registration = discovery::registration_from_proto(*proto, limits.registration);
  if (!registration) {
    return std::unexpected(fmt::format("WorkerRegistration of worker {}: {}", proto->worker_id(),
                                       registration.error().message()));
  }
  return std::move(*registration);
}

std::expected<WorkerLiveness, std::string> decode_worker_heartbeat(std::string_view bytes) {
  return decode_liveness<v1::WorkerHeartbeat>(bytes, "WorkerHeartbeat");
}

std::expected<WorkerLiveness, std::string> decode_worker_deregistration(std::string_view bytes) {
  return decode_liveness<v1::WorkerDeregistration>(bytes, "WorkerDeregistration");
}

std::expected<WorkerLoadReport, std::string> decode_worker_load(std::string_view bytes,
                                                                const WorkerMessageLimits& limits) {
  auto proto = parse<v1::LoadMetrics>(bytes, "LoadMetrics");
  if (!proto) return std::unexpected(proto.error());
  if (proto->worker_id() == 0) return std::unexpected("LoadMetrics: worker_id is 0");
  if (static_cast<std::uint32_t>(proto->ranks_size()) > limits.max_ranks) {
    return std::unexpected(
        fmt::format("LoadMetrics: {} ranks exceed {}", proto->ranks_size(), limits.max_ranks));
  }
  WorkerLoadReport report{proto->worker_id(), proto->incarnation(), {}};
  report.ranks.reserve(static_cast<std::size_t>(proto->ranks_size()));
  for (const v1::RankLoad& rank : proto->ranks()) {
    if (rank.dp_rank() >= limits.max_ranks) {
      return std::unexpected(fmt::format("LoadMetrics: dp_rank {} out of range", rank.dp_rank()));
    }
    if (rank.waiting_requests() > rank.active_requests()) {
      return std::unexpected(
          fmt::format("LoadMetrics: rank {} has more waiting ({}) than active ({}) requests",
                      rank.dp_rank(), rank.waiting_requests(), rank.active_requests()));
    }
    if (rank.kv_blocks_used() > limits.registration.max_kv_blocks_per_rank ||
        rank.active_decode_blocks() > limits.registration.max_kv_blocks_per_rank) {
      return std::unexpected(fmt::format(
          "LoadMetrics: rank {} reports more blocks than any rank holds", rank.dp_rank()));
    }
    const bool duplicate = std::ranges::any_of(
        report.ranks, [&](const auto& entry) { return entry.first == rank.dp_rank(); });
    if (duplicate) {
      return std::unexpected(fmt::format("LoadMetrics: rank {} reported twice", rank.dp_rank()));
    }
    report.ranks.emplace_back(rank.dp_rank(),
                              discovery::ConfirmedLoad{
                                  .active_requests = rank.active_requests(),
                                  .waiting_requests = rank.waiting_requests(),
                                  .active_decode_blocks = rank.active_decode_blocks(),
                                  .active_prefill_tokens = rank.active_prefill_tokens(),
                                  .kv_blocks_used = rank.kv_blocks_used(),
                              });
  }
  return report;
}

std::expected<KvEventBatch, std::string> decode_kv_events(std::string_view bytes,
                                                          const WorkerMessageLimits& limits) {
  auto proto = parse<v1::KvEventBatch>(bytes, "KvEventBatch");
  if (!proto) return std::unexpected(proto.error());
  if (proto->dp_rank() >= limits.max_ranks) {
    return std::unexpected(fmt::format("KvEventBatch: dp_rank {} out of range", proto->dp_rank()));
  }
  auto batch = decode_kv_event_batch(*proto, limits.kv);
  if (!batch) {
    return std::unexpected(
        fmt::format("KvEventBatch of worker {}: {}", proto->worker_id(), batch.error().message()));
  }
  return std::move(*batch);
}

std::expected<KvDump, std::string> decode_kv_dump_reply(std::string_view bytes,
                                                        const WorkerMessageLimits& limits) {
  auto proto = parse<v1::KvDumpReply>(bytes, "KvDumpReply");
  if (!proto) return std::unexpected(proto.error());
  if (proto->dp_rank() >= limits.max_ranks) {
    return std::unexpected(fmt::format("KvDumpReply: dp_rank {} out of range", proto->dp_rank()));
  }
  auto dump = decode_kv_dump(*proto, limits.kv);
  if (!dump) {
    return std::unexpected(
        fmt::format("KvDumpReply of worker {}: {}", proto->worker_id(), dump.error().message()));
  }
  return std::move(*dump);
}

}  // namespace kvr
