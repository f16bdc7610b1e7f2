// A worker's HTTP base URL: what a registration may carry.
#include "messages/http_url.hpp"

#include <string>

#include <gtest/gtest.h>

namespace kvr {
namespace {

TEST(HttpUrlTest, AcceptsHttpAndHttpsBaseUrls) {
  for (const std::string url :
       {"http://127.0.0.1:8000", "https://engine-0.vllm.svc.cluster.local", "http://10.0.0.7:8000/",
        "http://[::1]:8000", "http://[fe80::1]", "https://gateway.example:443/models/qwen3"}) {
    EXPECT_EQ(invalid_http_url(url), "") << url;
  }
}

TEST(HttpUrlTest, NamesWhatIsWrong) {
  const std::pair<std::string, std::string> cases[] = {
      {"", "is not an http:// or https:// URL"},
      {"ftp://host", "is not an http:// or https:// URL"},
      {"127.0.0.1:8000", "is not an http:// or https:// URL"},
      {"http://", "has no host"},
      {"http:///v1", "has no host"},
      {"http://:8000", "has no host"},
      {"http://host:", "has an empty port"},
      {"http://host:0", "has a port outside 1..65535"},
      {"http://host:65536", "has a port outside 1..65535"},
      {"http://host:80a", "has a port outside 1..65535"},
      {"http://user:secret@host", "carries user info"},
      {"http://host/v1?key=1", "carries a query or fragment"},
      {"http://host#top", "carries a query or fragment"},
      {"http://ho st", "contains whitespace or control characters"},
      {"http://host\n", "contains whitespace or control characters"},
      {"http://ho%st", "has a malformed host"},
      {"http://[::1", "has an unclosed IPv6 address"},
      {"http://[::1]x", "has bytes after its IPv6 address"},
      {"http://[zz::1]:80", "has a malformed IPv6 address"},
  };
  for (const auto& [url, why] : cases) EXPECT_EQ(invalid_http_url(url), why) << url;
}

TEST(HttpUrlTest, TrimsTrailingSlashes) {
  EXPECT_EQ(trim_trailing_slash("http://host:8000/"), "http://host:8000");
  EXPECT_EQ(trim_trailing_slash("http://host/base//"), "http://host/base");
  EXPECT_EQ(trim_trailing_slash("http://host"), "http://host");
}

}  // namespace
}  // namespace kvr
