#include "messages/nats/socket_loop.hpp"

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <optional>

#include <pthread.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

namespace kvr::nats {
namespace {

constexpr std::uint64_t kSocketTag = 1;
constexpr std::uint64_t kWakeTag = 2;

// A deferred message whose publisher never flushed is written by the loop after about this long
// (at most twice it).
constexpr int kStaleWriteMs = 50;

}  // namespace

thread_local SocketLoop* SocketLoop::t_flushing_loop = nullptr;

std::expected<std::unique_ptr<SocketLoop>, std::string> SocketLoop::start() {
  const int epoll_fd = epoll_create1(EPOLL_CLOEXEC);
  if (epoll_fd < 0) return std::unexpected(std::string{"epoll_create1: "} + std::strerror(errno));
  const int wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (wake_fd < 0) {
    const int error = errno;
    close(epoll_fd);
    return std::unexpected(std::string{"eventfd: "} + std::strerror(error));
  }
  epoll_event wake{};
  wake.events = EPOLLIN;
  wake.data.u64 = kWakeTag;
  if (epoll_ctl(epoll_fd, EPOLL_CTL_ADD, wake_fd, &wake) != 0) {
    const int error = errno;
    close(wake_fd);
    close(epoll_fd);
    return std::unexpected(std::string{"epoll_ctl: "} + std::strerror(error));
  }
  std::unique_ptr<SocketLoop> loop{new SocketLoop(epoll_fd, wake_fd)};
  loop->thread_ = std::thread([raw = loop.get()] { raw->run(); });
  return loop;
}

SocketLoop::SocketLoop(int epoll_fd, int wake_fd) : epoll_fd_(epoll_fd), wake_fd_(wake_fd) {}

SocketLoop::~SocketLoop() {
  stop();
  close(wake_fd_);
  close(epoll_fd_);
}

void SocketLoop::stop() {
  if (!stopping_.exchange(true)) {
    const std::uint64_t one = 1;
    [[maybe_unused]] const auto written = write(wake_fd_, &one, sizeof(one));
  }
  if (thread_.joinable()) thread_.join();
}

natsStatus SocketLoop::install(natsOptions* options) {
  return natsOptions_SetEventLoop(options, this, &SocketLoop::on_attach, &SocketLoop::on_read,
                                  &SocketLoop::on_write, &SocketLoop::on_detach);
}

bool SocketLoop::write_buffered(natsConnection* connection) {
  // nats.c takes a send() of an empty buffer (it returns 0) for a closed connection and
  // reconnects, so write only what is there; the lock keeps another writer from emptying the
  // buffer between the check and the write.
  std::lock_guard lock{write_mutex_};
  if (natsConnection_Buffered(connection) <= 0) return false;
  natsConnection_ProcessWriteEvent(connection);
  return true;
}

void SocketLoop::flush(natsConnection* connection) {
  if (!write_pending_.load(std::memory_order_acquire)) return;
  write_buffered(connection);
  if (write_pending_.load(std::memory_order_acquire)) {
    // The socket took only part of the buffer (or the connection is between sockets): the loop
    // thread writes the rest when the socket can take it.
    std::lock_guard lock{mutex_};
    want_write_ = true;
    update_interest();
  }
}

void SocketLoop::run() {
  pthread_setname_np(pthread_self(), "kvr.nats.io");
  epoll_event events[4];
  // When the loop first saw bytes waiting in the buffer (none: nothing seen waiting).
  std::optional<std::chrono::steady_clock::time_point> pending_since;
  while (!stopping_.load(std::memory_order_acquire)) {
    const int ready = epoll_wait(epoll_fd_, events, 4, kStaleWriteMs);
    natsConnection* connection = connection_.load(std::memory_order_acquire);
    for (int i = 0; i < ready; ++i) {
      if (events[i].data.u64 == kWakeTag) {
        std::uint64_t count = 0;
        [[maybe_unused]] const auto drained = read(wake_fd_, &count, sizeof(count));
        continue;
      }
      if (connection == nullptr) continue;
      // Errors and hang-ups surface through the read, which starts nats.c's reconnect.
      if ((events[i].events & (EPOLLIN | EPOLLERR | EPOLLHUP)) != 0) {
        natsConnection_ProcessReadEvent(connection);
      }
      if ((events[i].events & EPOLLOUT) != 0 && !write_buffered(connection)) {
        // Another thread wrote the rest first: stop watching a socket that is always writable.
        std::lock_guard lock{mutex_};
        if (!write_pending_.load(std::memory_order_acquire) && want_write_) {
          want_write_ = false;
          update_interest();
        }
      }
    }
    if (connection == nullptr) continue;
    // Bytes seen waiting now and still waiting a period later: a deferred publish nobody
    // flushed (or a new one: writing it early costs nothing). Write it rather than hold it.
    if (!write_pending_.load(std::memory_order_acquire)) {
      pending_since.reset();
    } else if (const auto now = std::chrono::steady_clock::now(); !pending_since) {
      pending_since = now;
    } else if (now - *pending_since >= std::chrono::milliseconds(kStaleWriteMs)) {
      write_buffered(connection);
      pending_since.reset();
    }
  }
}

void SocketLoop::update_interest() {
  std::uint32_t events = (want_read_ ? EPOLLIN : 0U) | (want_write_ ? EPOLLOUT : 0U);
  if (socket_ < 0) return;
  if (events == 0) {
    // Unregistered, not just muted: epoll reports errors and hang-ups even for no events.
    if (registered_) epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, socket_, nullptr);
    registered_ = false;
    return;
  }
  epoll_event interest{};
  interest.events = events;
  interest.data.u64 = kSocketTag;
  if (registered_) {
    epoll_ctl(epoll_fd_, EPOLL_CTL_MOD, socket_, &interest);
  } else {
    registered_ = epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, socket_, &interest) == 0 ||
                  (errno == EEXIST && epoll_ctl(epoll_fd_, EPOLL_CTL_MOD, socket_, &interest) == 0);
  }
}

natsStatus SocketLoop::on_attach(void** user_data, void* loop, natsConnection* connection,
                                 natsSock socket) {
  auto* self = static_cast<SocketLoop*>(loop);
  {
    std::lock_guard lock{self->mutex_};
    // A reconnect brings a new socket; the old one is closed (and so left epoll) or is dropped
    // here. Its number may be reused by the new one.
    if (self->registered_) epoll_ctl(self->epoll_fd_, EPOLL_CTL_DEL, self->socket_, nullptr);
    self->registered_ = false;
    self->socket_ = socket;
    self->want_read_ = true;
    self->want_write_ = false;
    self->update_interest();
    if (!self->registered_) return NATS_ERR;
  }
  self->connection_.store(connection, std::memory_order_release);
  *user_data = self;
  return NATS_OK;
}

natsStatus SocketLoop::on_read(void* user_data, bool add) {
  auto* self = static_cast<SocketLoop*>(user_data);
  std::lock_guard lock{self->mutex_};
  self->want_read_ = add;
  self->update_interest();
  return NATS_OK;
}

natsStatus SocketLoop::on_write(void* user_data, bool add) {
  auto* self = static_cast<SocketLoop*>(user_data);
  self->write_pending_.store(add, std::memory_order_release);
  // A publishing thread that flushes itself needs no help from the loop.
  if (add && t_flushing_loop == self) return NATS_OK;
  std::lock_guard lock{self->mutex_};
  if (self->want_write_ != add) {
    self->want_write_ = add;
    self->update_interest();
  }
  return NATS_OK;
}

natsStatus SocketLoop::on_detach(void* user_data) {
  auto* self = static_cast<SocketLoop*>(user_data);
  std::lock_guard lock{self->mutex_};
  self->want_read_ = false;
  self->want_write_ = false;
  self->update_interest();
  self->socket_ = -1;
  return NATS_OK;
}

}  // namespace kvr::nats
