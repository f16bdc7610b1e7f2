// Decoders for the worker → router NATS messages (registration, heartbeat, deregistration, load
// metrics, KV event batches, dump replies): parse the protobuf bytes, validate, and return the
// plain form the discovery actor forwards. Used by the NATS bridge; plain C++, unit-tested.
#pragma once

#include <cstdint>
#include <expected>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "discovery/catalog/worker_registration.hpp"
#include "discovery/load/predicted_load.hpp"
#include "discovery/worker_reports.hpp"
#include "messages/ids.hpp"
#include "messages/kv_event.hpp"
#include "selection/wire/kv_event_codec.hpp"

namespace kvr {

using discovery::WorkerLiveness;
using discovery::WorkerLoadReport;

/// Bounds of the worker-message decoders.
struct WorkerMessageLimits {
  discovery::RegistrationLimits registration;
  KvCodecLimits kv;
  std::uint32_t max_ranks = 1024;  ///< entries and rank values of a load report
};

/// Every decoder fails with a one-line reason naming the field.
std::expected<discovery::WorkerRegistration, std::string> decode_worker_registration(
    std::string_view bytes, const WorkerMessageLimits& limits);
std::expected<WorkerLiveness, std::string> decode_worker_heartbeat(std::string_view bytes);
std::expected<WorkerLiveness, std::string> decode_worker_deregistration(std::string_view bytes);
std::expected<WorkerLoadReport, std::string> decode_worker_load(std::string_view bytes,
                                                                const WorkerMessageLimits& limits);
std::expected<KvEventBatch, std::string> decode_kv_events(std::string_view bytes,
                                                          const WorkerMessageLimits& limits);
std::expected<KvDump, std::string> decode_kv_dump_reply(std::string_view bytes,
                                                        const WorkerMessageLimits& limits);

}  // namespace kvr
