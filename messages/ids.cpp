#include "messages/ids.hpp"

namespace kvr {

std::string_view as_str(WorkerType type) {
  switch (type) {
    case WorkerType::Aggregated:
      return "aggregated";
    case WorkerType::Prefill:
      return "prefill";
    case WorkerType::Decode:
      return "decode";
    case WorkerType::Encode:
      return "encode";
  }
  return "unknown";
}

std::optional<WorkerType> parse_worker_type(std::string_view name) {
  for (WorkerType type : kAllWorkerTypes) {
    if (as_str(type) == name) return type;
  }
  return std::nullopt;
}

std::string_view as_str(StorageTier tier) {
  switch (tier) {
    case StorageTier::Device:
      return "device";
    case StorageTier::Host:
      return "host";
    case StorageTier::Disk:
      return "disk";
  }
  return "unknown";
}

}  // namespace kvr
