// Bounded frames on plaintext peer ports (docs/security.md). CAF 0.17's own transport reads a BASP
// frame's length from the peer's bytes and allocates it before anything checks it: 64 bytes sent
// to a plaintext peer port took a node to 3-4 GB. The middleman loaded here refuses such a frame
// before its buffer exists and closes the connection.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>

#include <caf/actor_system.hpp>
#include <caf/actor_system_config.hpp>

#include "messages/peer_tls.hpp"

namespace kvr::actors {

/// What the bounded connections of one process refused so far.
struct PeerFrameCounts {
  /// Frames over their limit: the connection was closed before the frame was allocated.
  std::uint64_t frames_refused = 0;
  /// Plaintext connections that ended before their handshake was read: garbage, a port scan, a
  /// frame over the handshake limit, a peer that hung up.
  std::uint64_t handshakes_refused = 0;
};

/// Loads CAF's middleman into `config` with a network backend whose plaintext connections
/// (accepted and opened) refuse a frame over the limits. CAF's OpenSSL module, when loaded too,
/// keeps its own connections: their frames are read only after a mutual TLS handshake.
void load_bounded_middleman(caf::actor_system_config& config);

/// Sets the limits of the bounded backend of `system` (loaded by load_bounded_middleman); call
/// before the first port is published or connection opened.
void set_peer_frame_limits(caf::actor_system& system, PeerFrameLimits limits);

/// Reads what the bounded backend of `system` refused so far; it may outlive the system.
std::function<PeerFrameCounts()> peer_frame_counter(caf::actor_system& system);

}  // namespace kvr::actors
