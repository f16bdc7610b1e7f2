#include "tests/testing/loopback_http.hpp"

#include <algorithm>
#include <fstream>
#include <random>
#include <sstream>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

namespace kvr::testing {

namespace {

// The first port of the kernel's ephemeral range (outgoing connections and bind(0) take theirs
// from it).
std::uint16_t first_ephemeral_port() {
  std::ifstream range{"/proc/sys/net/ipv4/ip_local_port_range"};
  unsigned first = 32768;
  range >> first;
  return static_cast<std::uint16_t>(std::clamp(first, 11'000U, 65'535U));
}

bool can_bind(std::uint16_t port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = htons(port);
  const bool bound = ::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0;
  ::close(fd);
  return bound;
}

}  // namespace

std::uint16_t free_port() {
  // Below the ephemeral range: a port the kernel handed out for bind(0) was often taken again by
  // another test's outgoing connection before the process meant to listen on it started. Chosen
  // at random, so that tests running side by side rarely pick the same one.
  static const std::uint16_t end = first_ephemeral_port();
  thread_local std::mt19937 random{std::random_device{}()};
  std::uniform_int_distribution<unsigned> pick{10'000, static_cast<unsigned>(end) - 1};
  for (int attempt = 0; attempt < 1000; ++attempt) {
    const auto port = static_cast<std::uint16_t>(pick(random));
    if (can_bind(port)) return port;
  }
  return 0;
}

std::string http_get(std::uint16_t port, const std::string& path) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  timeval timeout{2, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = htons(port);
  std::string response;
  if (::connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0) {
    const std::string request = "GET " + path + " HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
    if (::write(fd, request.data(), request.size()) == static_cast<ssize_t>(request.size())) {
      char buffer[4096];
      ssize_t received = 0;
      while ((received = ::read(fd, buffer, sizeof(buffer))) > 0) {
        response.append(buffer, static_cast<std::size_t>(received));
      }
    }
  }
  ::close(fd);
  return response;
}

// Sum of every sample of a metric whose name and labels start with `prefix`.
double metric(const std::string& text, const std::string& prefix) {
  double sum = 0;
  std::istringstream lines{text};
  std::string line;
  while (std::getline(lines, line)) {
    if (line.empty() || line.front() == '#' || line.rfind(prefix, 0) != 0) continue;
    const char next = line.size() > prefix.size() ? line[prefix.size()] : ' ';
    if (next != ' ' && next != '{' && next != ',' && next != '}') continue;
    sum += std::stod(line.substr(line.rfind(' ') + 1));
  }
  return sum;
}

}  // namespace kvr::testing
