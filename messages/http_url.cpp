#include "messages/http_url.hpp"

#include <algorithm>
#include <charconv>
#include <cstdint>

namespace kvr {
namespace {

bool is_host_char(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' ||
         c == '.' || c == '_';
}

// Why `authority` ("host[:port]") is not one, or empty.
std::string invalid_authority(std::string_view authority) {
  if (authority.empty()) return "has no host";
  if (authority.find('@') != std::string_view::npos) return "carries user info";
  std::string_view host = authority;
  std::string_view port;
  if (authority.front() == '[') {
    const auto close = authority.find(']');
    if (close == std::string_view::npos) return "has an unclosed IPv6 address";
    host = authority.substr(1, close - 1);
    const std::string_view rest = authority.substr(close + 1);
    if (!rest.empty()) {
      if (rest.front() != ':') return "has bytes after its IPv6 address";
      port = rest.substr(1);
    }
    const bool hex_or_colon = std::ranges::all_of(host, [](char c) {
      return c == ':' || c == '.' || (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') ||
             (c >= 'A' && c <= 'F');
    });
    if (host.empty() || !hex_or_colon) return "has a malformed IPv6 address";
  } else {
    if (const auto colon = authority.rfind(':'); colon != std::string_view::npos) {
      host = authority.substr(0, colon);
      port = authority.substr(colon + 1);
    }
    if (host.empty()) return "has no host";
    if (!std::ranges::all_of(host, is_host_char)) return "has a malformed host";
  }
  if (authority.find(':') != std::string_view::npos && authority.back() == ':') {
    return "has an empty port";
  }
  if (!port.empty()) {
    std::uint32_t value = 0;
    const auto [end, error] = std::from_chars(port.data(), port.data() + port.size(), value);
    if (error != std::errc{} || end != port.data() + port.size() || value == 0 || value > 65535) {
      return "has a port outside 1..65535";
    }
  }
  return {};
}

}  // namespace

std::string invalid_http_url(std::string_view url) {
  if (std::ranges::any_of(url, [](char c) {
        const auto byte = static_cast<unsigned char>(c);
        return byte <= 0x20 || byte == 0x7F;
      })) {
    return "contains whitespace or control characters";
  }
  std::string_view rest;
  if (url.starts_with("http://")) {
    rest = url.substr(7);
  } else if (url.starts_with("https://")) {
    rest = url.substr(8);
  } else {
    return "is not an http:// or https:// URL";
  }
  if (rest.find_first_of("?#") != std::string_view::npos) return "carries a query or fragment";
  return invalid_authority(rest.substr(0, rest.find('/')));
}

std::optional<HttpUrlParts> split_http_url(std::string_view url) {
  if (!invalid_http_url(url).empty()) return std::nullopt;
  HttpUrlParts parts;
  parts.https = url.starts_with("https://");
  const std::string_view rest = url.substr(parts.https ? 8 : 7);
  const std::size_t slash = rest.find('/');
  const std::string_view authority = rest.substr(0, slash);
  if (slash != std::string_view::npos) parts.path = trim_trailing_slash(rest.substr(slash));
  std::string_view host = authority;
  std::string_view port;
  if (authority.front() == '[') {
    const auto close = authority.find(']');
    host = authority.substr(1, close - 1);
    if (close + 1 < authority.size()) port = authority.substr(close + 2);
  } else if (const auto colon = authority.rfind(':'); colon != std::string_view::npos) {
    host = authority.substr(0, colon);
    port = authority.substr(colon + 1);
  }
  parts.host = host;
  parts.port = port.empty() ? (parts.https ? "443" : "80") : std::string{port};
  return parts;
}

std::string_view trim_trailing_slash(std::string_view url) {
  while (url.ends_with('/')) url.remove_suffix(1);
  return url;
}

}  // namespace kvr
