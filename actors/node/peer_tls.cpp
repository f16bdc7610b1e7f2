#include "actors/node/peer_tls.hpp"

#include <atomic>
#include <cstdint>

#include <caf/io/middleman.hpp>
#include <caf/openssl/manager.hpp>
#include <dlfcn.h>
#include <openssl/err.h>
#include <openssl/ssl.h>

// CAF 0.17's OpenSSL sessions call SSL_accept, SSL_connect, SSL_read and SSL_write without
// emptying the thread's OpenSSL error queue first, and leave a failed handshake's errors in it
// (a peer that connects and hangs up, or sends anything but TLS). OpenSSL requires an empty queue
// before each of these calls: otherwise SSL_get_error reports the stale error, and the next
// healthy session the same middleman thread serves was taken for broken (measured: one port
// scan stalled every established peer session until it timed out). The definitions below
// interpose on libssl's for every caller in this process (an executable's definitions come
// first; load_peer_tls keeps this file linked into every binary that can load the module): each
// empties the queue, as OpenSSL asks of its callers, and calls libssl's own.
namespace {

template <class Function>
Function libssl(const char* name) {
  // RTLD_NEXT: the next definition after this executable's, libssl's.
  return reinterpret_cast<Function>(dlsym(RTLD_NEXT, name));
}

// Handshakes a peer port refused: CAF closes such a connection without a word to the node.
std::atomic<std::uint64_t> refused_handshakes{0};

}  // namespace

extern "C" {

int SSL_accept(SSL* ssl) {
  static const auto real = libssl<int (*)(SSL*)>("SSL_accept");
  ERR_clear_error();
  const int result = real(ssl);
  if (result <= 0) {
    // Not yet done (waiting for the peer's bytes) is no refusal; anything else ends the
    // connection: garbage, a plaintext client, a certificate of another CA, a hang-up.
    const int error = SSL_get_error(ssl, result);
    if (error != SSL_ERROR_WANT_READ && error != SSL_ERROR_WANT_WRITE) {
      refused_handshakes.fetch_add(1, std::memory_order_relaxed);
    }
  }
  return result;
}

int SSL_connect(SSL* ssl) {
  static const auto real = libssl<int (*)(SSL*)>("SSL_connect");
  ERR_clear_error();
  return real(ssl);
}

int SSL_read(SSL* ssl, void* buffer, int size) {
  static const auto real = libssl<int (*)(SSL*, void*, int)>("SSL_read");
  ERR_clear_error();
  return real(ssl, buffer, size);
}

int SSL_write(SSL* ssl, const void* buffer, int size) {
  static const auto real = libssl<int (*)(SSL*, const void*, int)>("SSL_write");
  ERR_clear_error();
  return real(ssl, buffer, size);
}

}  // extern "C"

namespace kvr::actors {

std::uint64_t refused_peer_handshakes() {
  return refused_handshakes.load(std::memory_order_relaxed);
}

void load_peer_tls(caf::actor_system_config& config, const PeerTlsFiles& files) {
  config.load<caf::openssl::manager>();
  config.set("openssl.certificate", files.certificate);
  config.set("openssl.key", files.key);
  config.set("openssl.cafile", files.ca);
}

}  // namespace kvr::actors
