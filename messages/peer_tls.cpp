#include "messages/peer_tls.hpp"

#include <cstdio>
#include <memory>

#include <arpa/inet.h>
#include <fmt/format.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>
#include <openssl/x509_vfy.h>

namespace kvr {
namespace {

template <class T, void (*Free)(T*)>
struct Deleter {
  void operator()(T* value) const { Free(value); }
};
using X509Ptr = std::unique_ptr<X509, Deleter<X509, X509_free>>;
using KeyPtr = std::unique_ptr<EVP_PKEY, Deleter<EVP_PKEY, EVP_PKEY_free>>;
using StorePtr = std::unique_ptr<X509_STORE, Deleter<X509_STORE, X509_STORE_free>>;
using StoreContextPtr =
    std::unique_ptr<X509_STORE_CTX, Deleter<X509_STORE_CTX, X509_STORE_CTX_free>>;

struct FileCloser {
  void operator()(std::FILE* file) const { std::fclose(file); }
};

// OpenSSL's reason for the last failure, and its error queue emptied.
std::string openssl_reason() {
  const unsigned long code = ERR_get_error();
  ERR_clear_error();
  if (code == 0) return "not PEM";
  char text[256] = {};
  ERR_error_string_n(code, text, sizeof(text));
  return text;
}

template <class T, class Read>
std::expected<T, std::string> read_pem(const std::string& path, std::string_view option,
                                       std::string_view what, Read read) {
  if (path.empty()) return std::unexpected(fmt::format("{}: missing", option));
  std::unique_ptr<std::FILE, FileCloser> file{std::fopen(path.c_str(), "r")};
  if (!file) return std::unexpected(fmt::format("{}: cannot read {}", option, path));
  T value{read(file.get())};
  if (!value) {
    return std::unexpected(
        fmt::format("{}: {} holds no PEM {} ({})", option, path, what, openssl_reason()));
  }
  return value;
}

X509* read_certificate(std::FILE* file) { return PEM_read_X509(file, nullptr, nullptr, nullptr); }
EVP_PKEY* read_key(std::FILE* file) {
  // No passphrase callback: an encrypted key fails here rather than prompting on the terminal.
  return PEM_read_PrivateKey(
      file, nullptr, [](char*, int, int, void*) { return 0; }, nullptr);
}

}  // namespace

std::expected<void, std::string> check_peer_tls(const PeerTlsFiles& files,
                                                const PeerTlsOptionNames& names) {
  auto certificate =
      read_pem<X509Ptr>(files.certificate, names.certificate, "certificate", read_certificate);
  if (!certificate) return std::unexpected(certificate.error());
  auto key = read_pem<KeyPtr>(files.key, names.key, "unencrypted private key", read_key);
  if (!key) return std::unexpected(key.error());
  if (X509_check_private_key(certificate->get(), key->get()) != 1) {
    ERR_clear_error();
    return std::unexpected(fmt::format("{}: {} is not the key of the certificate {}", names.key,
                                       files.key, files.certificate));
  }
  if (files.ca.empty()) return std::unexpected(fmt::format("{}: missing", names.ca));
  StorePtr store{X509_STORE_new()};
  if (X509_STORE_load_file(store.get(), files.ca.c_str()) != 1) {
    return std::unexpected(fmt::format("{}: {} holds no PEM CA certificate ({})", names.ca,
                                       files.ca, openssl_reason()));
  }
  // Peers check this certificate against the same CA: one it did not sign would fail every
  // handshake, so it fails startup instead.
  StoreContextPtr context{X509_STORE_CTX_new()};
  if (X509_STORE_CTX_init(context.get(), store.get(), certificate->get(), nullptr) != 1 ||
      X509_verify_cert(context.get()) != 1) {
    const int error = X509_STORE_CTX_get_error(context.get());
    ERR_clear_error();
    return std::unexpected(fmt::format("{}: {} is not signed by the CA {} ({})", names.certificate,
                                       files.certificate, files.ca,
                                       X509_verify_cert_error_string(error)));
  }
  return {};
}

bool is_loopback_address(std::string_view address) {
  if (address == "localhost") return true;
  const std::string text{address};
  in_addr v4{};
  if (inet_pton(AF_INET, text.c_str(), &v4) == 1) {
    return (ntohl(v4.s_addr) >> 24) == 127;
  }
  in6_addr v6{};
  return inet_pton(AF_INET6, text.c_str(), &v6) == 1 && IN6_IS_ADDR_LOOPBACK(&v6);
}

}  // namespace kvr
