#include "messages/worker_role.hpp"

namespace kvr {

std::optional<WorkerType> worker_type_from_wire(v1::WorkerRole role) {
  switch (role) {
    case v1::WORKER_ROLE_AGGREGATED:
      return WorkerType::Aggregated;
    case v1::WORKER_ROLE_PREFILL:
      return WorkerType::Prefill;
    case v1::WORKER_ROLE_DECODE:
      return WorkerType::Decode;
    case v1::WORKER_ROLE_ENCODE:
      return WorkerType::Encode;
    default:
      return std::nullopt;
  }
}

v1::WorkerRole to_wire(WorkerType type) {
  switch (type) {
    case WorkerType::Aggregated:
      return v1::WORKER_ROLE_AGGREGATED;
    case WorkerType::Prefill:
      return v1::WORKER_ROLE_PREFILL;
    case WorkerType::Decode:
      return v1::WORKER_ROLE_DECODE;
    case WorkerType::Encode:
      return v1::WORKER_ROLE_ENCODE;
  }
  return v1::WORKER_ROLE_UNSPECIFIED;
}

}  // namespace kvr
