// The bytes a stranger sends to a peer port (the actor port or the cluster port), read the way
// the node reads them: CAF's OpenSSL session accepting a connection with the node's mutual-TLS
// settings (load_peer_tls, the test certificates of tests/data/tls). The input arrives on a
// socket pair, then the stranger hangs up; the session handshakes and reads until it fails.
// Properties: no byte of the input ever reaches the reader (only a peer holding a key the
// cluster's CA certified completes the handshake), and the session ends instead of waiting.
#include <array>
#include <memory>
#include <optional>

#include <caf/actor_system.hpp>
#include <caf/actor_system_config.hpp>
#include <caf/io/middleman.hpp>
#include <caf/openssl/session.hpp>
#include <sys/socket.h>
#include <unistd.h>

#include "actors/node/peer_tls.hpp"
#include "tests/fuzz/harness.hpp"

namespace kvr::fuzz {
namespace {

std::string tls_file(const char* name) { return std::string{KVR_FUZZ_TLS_DIR} + "/" + name; }

// One actor system for every input: CAF's OpenSSL module needs one for its settings.
struct PeerPort {
  PeerPort() {
    config.load<caf::io::middleman>();
    config.set("scheduler.max-threads", 1);
    actors::load_peer_tls(config, PeerTlsFiles{.certificate = tls_file("node-a.pem"),
                                               .key = tls_file("node-a.key"),
                                               .ca = tls_file("cluster-ca.pem")});
    system.emplace(config);
  }
  caf::actor_system_config config;
  std::optional<caf::actor_system> system;
};

struct SocketPair {
  SocketPair() {
    if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK, 0, fds.data()) != 0) fds = {-1, -1};
  }
  ~SocketPair() {
    for (const int fd : fds) {
      if (fd >= 0) ::close(fd);
    }
  }
  std::array<int, 2> fds{};
};

// OpenSSL and CAF are not instrumented: what the session answered is the fuzzer's only view of
// how far an input got. Each kind of answer is a branch of its own, so that libFuzzer keeps the
// inputs that reach a new one (a server hello, or an alert of another kind).
void observe_answer(const std::uint8_t* answer, std::size_t size) {
  static volatile unsigned kinds_seen = 0;
  if (size == 0) return;
  if (answer[0] == 0x16) {  // a handshake record: the ClientHello was taken
    kinds_seen = kinds_seen + 1;
    return;
  }
  if (answer[0] != 0x15 || size < 7) return;
  switch (answer[6]) {  // the alert's description
    case 10:
      kinds_seen = kinds_seen + 10;
      break;  // unexpected_message
    case 20:
      kinds_seen = kinds_seen + 20;
      break;  // bad_record_mac
    case 22:
      kinds_seen = kinds_seen + 22;
      break;  // record_overflow
    case 40:
      kinds_seen = kinds_seen + 40;
      break;  // handshake_failure
    case 42:
      kinds_seen = kinds_seen + 42;
      break;  // bad_certificate
    case 47:
      kinds_seen = kinds_seen + 47;
      break;  // illegal_parameter
    case 50:
      kinds_seen = kinds_seen + 50;
      break;  // decode_error
    case 51:
      kinds_seen = kinds_seen + 51;
      break;  // decrypt_error
    case 70:
      kinds_seen = kinds_seen + 70;
      break;  // protocol_version
    case 109:
      kinds_seen = kinds_seen + 109;
      break;  // missing_extension
    case 110:
      kinds_seen = kinds_seen + 110;
      break;  // unsupported_extension
    case 116:
      kinds_seen = kinds_seen + 116;
      break;  // certificate_required
    default:
      kinds_seen = kinds_seen + 1000;
      break;
  }
}

// Reads what the session wrote back (its hello, alerts), so that it never blocks on a full pipe.
void drain(int fd) {
  std::array<std::uint8_t, 16384> answer{};
  for (ssize_t got; (got = ::read(fd, answer.data(), answer.size())) > 0;) {
    observe_answer(answer.data(), static_cast<std::size_t>(got));
  }
}

}  // namespace

void peer_port_handshake(Input input) {
  // Never destroyed: at exit CAF's own statics may be gone before it.
  static PeerPort* const port = new PeerPort;
  SocketPair pair;
  KVR_FUZZ_CHECK(pair.fds[0] >= 0);
  const int stranger = pair.fds[0];
  const int node = pair.fds[1];
  // Inputs are small (libFuzzer's default bound is 4 KB); a socket pair holds well over that.
  std::size_t sent = 0;
  while (sent < input.size()) {
    const ssize_t wrote = ::write(stranger, input.data() + sent, input.size() - sent);
    if (wrote <= 0) break;
    sent += static_cast<std::size_t>(wrote);
  }
  ::shutdown(stranger, SHUT_WR);
  caf::openssl::session_ptr session = caf::openssl::make_session(*port->system, node, true);
  drain(stranger);
  if (!session) return;  // refused at the first read, as CAF's doorman drops it
  std::array<char, 4096> buffer{};
  // Each round either fails, or consumes input or the hang-up: a bounded number of rounds ends
  // every session (the input is at most a few KB).
  bool ended = false;
  for (int round = 0; round < 4096 && !ended; ++round) {
    drain(stranger);
    std::size_t received = 0;
    const auto state = session->read_some(received, node, buffer.data(), buffer.size());
    KVR_FUZZ_CHECK(received == 0);
    ended = state != caf::io::network::rw_state::success;
  }
  KVR_FUZZ_CHECK(ended);
}

}  // namespace kvr::fuzz
