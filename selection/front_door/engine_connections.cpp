#include "selection/front_door/engine_connections.hpp"

#include <cerrno>

#include <sys/socket.h>
#include <unistd.h>

namespace kvr::front_door {
namespace {

// Whether the engine could take a request on the connection: it has not closed it (a read would
// see the end) nor written anything unasked (which would be read as the next answer's start).
bool quiet(EngineConnections::Handle handle) {
  char byte = 0;
  const ssize_t got = ::recv(handle, &byte, 1, MSG_PEEK | MSG_DONTWAIT);
  return got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK);
}

}  // namespace

EngineConnections::EngineConnections(EngineConnectionsOptions options,
                                     std::shared_ptr<const Clock> clock)
    : options_(options), clock_(std::move(clock)) {}

EngineConnections::~EngineConnections() {
  for (auto& [address, connections] : idle_) {
    for (const Idle& idle : connections) ::close(idle.connection.handle);
  }
}

std::optional<EngineConnections::Parked> EngineConnections::take(const std::string& address) {
  std::vector<Handle> stale;
  std::optional<Parked> taken;
  {
    std::lock_guard lock{mutex_};
    const auto found = idle_.find(address);
    if (found == idle_.end()) return std::nullopt;
    auto& connections = found->second;
    const auto now = clock_->now();
    // Newest first: it is the least likely to have been closed by the engine.
    while (!connections.empty() && !taken) {
      Idle idle = connections.back();
      connections.pop_back();
      if (now - idle.since < options_.idle_limit && quiet(idle.connection.handle)) {
        taken = idle.connection;
      } else {
        stale.push_back(idle.connection.handle);
      }
    }
    // Older ones have been idle even longer.
    std::erase_if(connections, [&](const Idle& idle) {
      if (now - idle.since < options_.idle_limit) return false;
      stale.push_back(idle.connection.handle);
      return true;
    });
    if (connections.empty()) idle_.erase(found);
  }
  for (const Handle handle : stale) ::close(handle);
  return taken;
}

void EngineConnections::park(const std::string& address, Parked connection) {
  {
    std::lock_guard lock{mutex_};
    auto& connections = idle_[address];
    if (connections.size() < options_.per_engine) {
      connections.push_back(Idle{connection, clock_->now()});
      return;
    }
  }
  ::close(connection.handle);
}

std::size_t EngineConnections::idle() const {
  std::lock_guard lock{mutex_};
  std::size_t count = 0;
  for (const auto& [address, connections] : idle_) count += connections.size();
  return count;
}

}  // namespace kvr::front_door
