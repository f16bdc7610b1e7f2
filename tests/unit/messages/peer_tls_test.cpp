// The peer ports' credentials are checked at startup, each fault naming its option.
#include "messages/peer_tls.hpp"

#include <string>

#include <gtest/gtest.h>

namespace kvr {
namespace {

std::string tls_file(const std::string& name) {
  return std::string{KVR_SOURCE_DIR} + "/tests/data/tls/" + name;
}

PeerTlsFiles node_a() {
  return {tls_file("node-a.pem"), tls_file("node-a.key"), tls_file("cluster-ca.pem")};
}

TEST(PeerTlsTest, ACertificateItsKeyAndTheCaThatSignedItPass) {
  EXPECT_TRUE(check_peer_tls(node_a()).has_value());
}

TEST(PeerTlsTest, AMissingFileNamesItsOption) {
  PeerTlsFiles files = node_a();
  files.key = tls_file("absent.key");
  auto checked = check_peer_tls(files);
  ASSERT_FALSE(checked.has_value());
  EXPECT_NE(checked.error().find("--peer-tls-key: cannot read"), std::string::npos)
      << checked.error();
  files = node_a();
  files.ca.clear();
  checked = check_peer_tls(files);
  ASSERT_FALSE(checked.has_value());
  EXPECT_EQ(checked.error(), "--peer-tls-ca: missing");
}

TEST(PeerTlsTest, AFileThatIsNotPemIsRefused) {
  PeerTlsFiles files = node_a();
  files.certificate = tls_file("README.md");
  const auto checked = check_peer_tls(files);
  ASSERT_FALSE(checked.has_value());
  EXPECT_NE(checked.error().find("--peer-tls-cert:"), std::string::npos) << checked.error();
  EXPECT_NE(checked.error().find("holds no PEM certificate"), std::string::npos);
}

TEST(PeerTlsTest, AKeyOfAnotherCertificateIsRefused) {
  PeerTlsFiles files = node_a();
  files.key = tls_file("node-b.key");
  const auto checked = check_peer_tls(files);
  ASSERT_FALSE(checked.has_value());
  EXPECT_NE(checked.error().find("--peer-tls-key:"), std::string::npos) << checked.error();
  EXPECT_NE(checked.error().find("is not the key of the certificate"), std::string::npos);
}

TEST(PeerTlsTest, ACertificateAnotherCaSignedIsRefused) {
  const PeerTlsFiles files{tls_file("rogue.pem"), tls_file("rogue.key"),
                           tls_file("cluster-ca.pem")};
  const auto checked = check_peer_tls(files);
  ASSERT_FALSE(checked.has_value());
  EXPECT_NE(checked.error().find("--peer-tls-cert:"), std::string::npos) << checked.error();
  EXPECT_NE(checked.error().find("is not signed by the CA"), std::string::npos);
}

TEST(PeerTlsTest, TheOptionNamesCanBeOthers) {
  PeerTlsFiles files = node_a();
  files.certificate.clear();
  const auto checked = check_peer_tls(files, {.certificate = "peer_tls.certificate"});
  ASSERT_FALSE(checked.has_value());
  EXPECT_EQ(checked.error(), "peer_tls.certificate: missing");
}

TEST(PeerTlsTest, OnlyLoopbackAddressesAreLoopback) {
  for (const char* address : {"127.0.0.1", "127.3.2.1", "::1", "localhost"}) {
    EXPECT_TRUE(is_loopback_address(address)) << address;
  }
  for (const char* address : {"0.0.0.0", "10.0.0.1", "::", "128.0.0.1", "example.com", "",
                              "127.0.0.1 ", "::ffff:10.0.0.1"}) {
    EXPECT_FALSE(is_loopback_address(address)) << address;
  }
}

}  // namespace
}  // namespace kvr
