// The project error a failed CAF request stands for, for actors that answer clients with a
// kvr::Error: a kvr error as it is, a request timeout as Error::timeout, anything else (an actor
// gone, a dropped message) as Error::unavailable.
#pragma once

#include <cstdint>

#include <caf/atom.hpp>
#include <caf/error.hpp>
#include <caf/sec.hpp>

#include "actors/caf_error.hpp"

namespace kvr::actors {

inline Error request_error(const caf::error& error) {
  if (error.category() == caf::atom("kvr")) return static_cast<Error>(error.code());
  if (error.category() == caf::atom("system") &&
      error.code() == static_cast<std::uint8_t>(caf::sec::request_timeout)) {
    return Error::timeout;
  }
  return Error::unavailable;
}

}  // namespace kvr::actors
