// Mutual TLS on the peer ports (the actor port and the cluster port) through CAF's OpenSSL module.
#pragma once

#include <cstdint>

#include <caf/actor_system_config.hpp>

#include "messages/peer_tls.hpp"

namespace kvr::actors {

/// Loads CAF's OpenSSL module into `config` with `files` (checked by check_peer_tls): with a CA
/// file set, CAF's sessions require and verify the peer's certificate on both ends, the node's
/// own connections to its peers included. Also installs this process's fix of the module's
/// OpenSSL error handling (peer_tls.cpp).
void load_peer_tls(caf::actor_system_config& config, const PeerTlsFiles& files);

/// TLS handshakes the peer ports of this process refused so far (garbage, a plaintext peer, a
/// certificate of another CA, a connection closed mid-handshake).
std::uint64_t refused_peer_handshakes();

}  // namespace kvr::actors
