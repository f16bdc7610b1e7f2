// Credentials in NATS URLs are masked before anything prints them.
#include "messages/nats/redact.hpp"

#include <string>
#include <vector>

#include <gtest/gtest.h>

namespace kvr::nats {
namespace {

TEST(RedactTest, MasksPasswordsAndTokensKeepingUsersAndHosts) {
  EXPECT_EQ(redact_urls("nats://127.0.0.1:4222"), "nats://127.0.0.1:4222");
  EXPECT_EQ(redact_urls("nats://kvr:s3cret@10.0.0.1:4222"), "nats://kvr:***@10.0.0.1:4222");
  EXPECT_EQ(redact_urls("tls://t0ken@nats.example:4222"), "tls://***@nats.example:4222");
  EXPECT_EQ(redact_urls("nats://a:p@ss@h1:4222,nats://h2:4222,nats://tok@h3"),
            "nats://a:***@h1:4222,nats://h2:4222,nats://***@h3")
      << "a password may hold an '@'; each URL of a list is masked";
  EXPECT_EQ(redact_urls("kvr:s3cret@h:4222"), "kvr:***@h:4222") << "no scheme";
}

TEST(RedactTest, FindsTheSecretsAndMasksThemAnywhereInAText) {
  const std::vector<std::string> secrets = url_secrets("nats://a:pw1@h1,nats://tok2@h2,nats://h3");
  EXPECT_EQ(secrets, (std::vector<std::string>{"pw1", "tok2"}));
  EXPECT_EQ(redact("cannot connect to nats://a:pw1@h1 (auth pw1 refused); tok2", secrets),
            "cannot connect to nats://a:***@h1 (auth *** refused); ***");
  const std::vector<std::string> with_empty{"", "x"};
  EXPECT_EQ(redact("xx y", with_empty), "****** y") << "an empty secret masks nothing";
}

}  // namespace
}  // namespace kvr::nats
