// The credentials of the node's peer ports (the actor port and the cluster port): mutual TLS with
// one private CA, through CAF's OpenSSL transport. Checked here, at startup, because CAF only
// reads the files when the first peer connects. Also the frame limits of a plaintext peer port
// (enforced by actors/node/peer_frames). Plain C++ on OpenSSL; no CAF.
#pragma once

#include <cstddef>
#include <expected>
#include <string>
#include <string_view>

namespace kvr {

/// PEM files: this process's certificate chain, its unencrypted private key, and the CA that signs
/// every peer's certificate (a peer without one it signed is refused).
struct PeerTlsFiles {
  std::string certificate;
  std::string key;
  std::string ca;

  bool empty() const { return certificate.empty() && key.empty() && ca.empty(); }
};

/// The command-line names of the three files, for errors naming the option.
struct PeerTlsOptionNames {
  std::string_view certificate = "--peer-tls-cert";
  std::string_view key = "--peer-tls-key";
  std::string_view ca = "--peer-tls-ca";
};

/// Why `files` cannot serve as peer credentials, naming the option: a file missing or unreadable,
/// not PEM, a key that does not match the certificate, or a certificate the CA did not sign.
std::expected<void, std::string> check_peer_tls(const PeerTlsFiles& files,
                                                const PeerTlsOptionNames& names = {});

/// The most a plaintext peer connection may make the node allocate for one frame: CAF reads a
/// frame's length from the peer's bytes and allocates it before anything checks it.
struct PeerFrameLimits {
  /// Each frame until the connection's handshake is read: a stranger's first bytes. A handshake
  /// carries the peer's identity and the published actor's interface, a few KB.
  static constexpr std::size_t kHandshakeBytes = 64 * 1024;
  /// The smallest message limit accepted: a header and a small message always fit.
  static constexpr std::size_t kMinMessageBytes = 64 * 1024;

  /// Each frame after the handshake (`--peer-max-message-bytes`).
  std::size_t message_bytes = 64 * 1024 * 1024;
};

/// Whether `address` is a loopback address (127.0.0.0/8, ::1 or "localhost"): the only addresses
/// a peer port may serve without TLS.
bool is_loopback_address(std::string_view address);

}  // namespace kvr
