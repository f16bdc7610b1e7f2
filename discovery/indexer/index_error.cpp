#include "discovery/indexer/index_error.hpp"

namespace kvr::discovery {

std::string_view as_str(IndexError error) {
  switch (error) {
    case IndexError::unknown_worker:
      return "unknown_worker";
    case IndexError::duplicate_worker:
      return "duplicate_worker";
    case IndexError::invalid_capacity:
      return "invalid_capacity";
    case IndexError::incarnation_mismatch:
      return "incarnation_mismatch";
    case IndexError::duplicate_event_id:
      return "duplicate_event_id";
    case IndexError::out_of_order_event_id:
      return "out_of_order_event_id";
    case IndexError::unknown_parent:
      return "unknown_parent";
    case IndexError::parent_mismatch:
      return "parent_mismatch";
    case IndexError::duplicate_block:
      return "duplicate_block";
    case IndexError::chain_too_long:
      return "chain_too_long";
    case IndexError::capacity_exceeded:
      return "capacity_exceeded";
    case IndexError::unknown_block:
      return "unknown_block";
  }
  return "unknown";
}

}  // namespace kvr::discovery
