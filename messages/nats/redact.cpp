#include "messages/nats/redact.hpp"

#include <cstddef>

namespace kvr::nats {
namespace {

constexpr std::string_view kMask = "***";

// The user info of one URL ("user:secret" in "nats://user:secret@host"): its offset in `url` and
// its length, or npos when the URL has none.
std::pair<std::size_t, std::size_t> user_info(std::string_view url) {
  const std::size_t scheme = url.find("://");
  const std::size_t start = scheme == std::string_view::npos ? 0 : scheme + 3;
  const std::size_t authority_end = url.find_first_of("/?#", start);
  const std::string_view authority = url.substr(start, authority_end - start);
  const std::size_t at = authority.rfind('@');
  if (at == std::string_view::npos) return {std::string_view::npos, 0};
  return {start, at};
}

// Calls `on_url` with each comma-separated URL of `urls`.
template <class OnUrl>
void for_each_url(std::string_view urls, OnUrl on_url) {
  while (true) {
    const std::size_t comma = urls.find(',');
    on_url(urls.substr(0, comma));
    if (comma == std::string_view::npos) return;
    urls.remove_prefix(comma + 1);
  }
}

}  // namespace

std::string redact_urls(std::string_view urls) {
  std::string out;
  bool first = true;
  for_each_url(urls, [&](std::string_view url) {
    if (!first) out += ',';
    first = false;
    const auto [start, length] = user_info(url);
    if (start == std::string_view::npos) {
      out += url;
      return;
    }
    const std::string_view info = url.substr(start, length);
    const std::size_t colon = info.find(':');
    out += url.substr(0, start);
    if (colon != std::string_view::npos) out += info.substr(0, colon + 1);  // keep the user
    out += kMask;
    out += url.substr(start + length);
  });
  return out;
}

std::vector<std::string> url_secrets(std::string_view urls) {
  std::vector<std::string> secrets;
  for_each_url(urls, [&](std::string_view url) {
    const auto [start, length] = user_info(url);
    if (start == std::string_view::npos) return;
    const std::string_view info = url.substr(start, length);
    const std::size_t colon = info.find(':');
    const std::string_view secret = colon == std::string_view::npos ? info : info.substr(colon + 1);
    if (!secret.empty()) secrets.emplace_back(secret);
  });
  return secrets;
}

std::string redact(std::string text, std::span<const std::string> secrets) {
  for (const std::string& secret : secrets) {
    if (secret.empty()) continue;
    for (std::size_t at = text.find(secret); at != std::string::npos;
         at = text.find(secret, at + kMask.size())) {
      text.replace(at, secret.size(), kMask);
    }
  }
  return text;
}

}  // namespace kvr::nats
