// The wire's worker role (kvr.v1.WorkerRole) and the router's WorkerType, both ways, in one place
// for the registration decoder, the route-request decoder and the simulated workers.
#pragma once

#include <optional>

#include "kvr/v1/worker.pb.h"
#include "messages/ids.hpp"

namespace kvr {

/// The role a worker or request names; none for WORKER_ROLE_UNSPECIFIED and unknown values
/// (each caller decides what an unspecified role means for it).
std::optional<WorkerType> worker_type_from_wire(v1::WorkerRole role);

/// The wire form of a worker type.
v1::WorkerRole to_wire(WorkerType type);

}  // namespace kvr
