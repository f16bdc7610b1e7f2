// The socket loop of a NATS connection that batches its writes (NatsOptions::deferred_publish).
//
// nats.c normally reads on its own thread and, with SendAsap, writes every publish to the socket
// at once: a send() per message, which on loopback also runs the receiver's network stack and
// wakes the server. Through nats.c's external event-loop interface this loop reads instead (one
// epoll thread per connection), and writes happen where kvr decides: an immediate publish writes
// from the publishing thread (as SendAsap does), a deferred publish leaves its message in the
// connection's buffer until its publisher calls flush(), so an actor answering a burst of
// requests writes the burst with one send(). Writes nats.c starts itself (PING, PONG, SUB,
// resending after a reconnect) and the rest of a partial write are done by the loop thread.
#pragma once

#include <atomic>
#include <expected>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include <nats/nats.h>

namespace kvr::nats {

class SocketLoop {
 public:
  /// Creates the loop and starts its thread; an error when epoll or eventfd are unavailable.
  static std::expected<std::unique_ptr<SocketLoop>, std::string> start();
  /// Stops and joins the thread. Only after the connection was closed (its detach callback ran).
  ~SocketLoop();
  SocketLoop(const SocketLoop&) = delete;
  SocketLoop& operator=(const SocketLoop&) = delete;

  /// Hands the loop to nats.c: call on the options before connecting.
  natsStatus install(natsOptions* options);

  /// Publishes through `send` (a nats.c publish call) and writes the buffer now, from this
  /// thread. `deferred`: leave the message buffered until flush().
  template <typename Send>
  natsStatus publish(natsConnection* connection, bool deferred, Send&& send) {
    t_flushing_loop = this;
    const natsStatus status = send();
    t_flushing_loop = nullptr;
    if (!deferred) flush(connection);
    return status;
  }

  /// Writes what the connection has buffered, from this thread; a partial write (the socket is
  /// full) is finished by the loop thread.
  void flush(natsConnection* connection);

  /// Stops the thread; idempotent. The destructor calls it.
  void stop();

 private:
  SocketLoop(int epoll_fd, int wake_fd);
  void run();
  // Writes what the connection has buffered; false when nothing was. Every write goes through
  // here.
  bool write_buffered(natsConnection* connection);
  // Registers the socket for the events wanted now; the caller holds mutex_.
  void update_interest();

  // nats.c's event-loop callbacks (userData is the loop).
  static natsStatus on_attach(void** user_data, void* loop, natsConnection* connection,
                              natsSock socket);
  static natsStatus on_read(void* user_data, bool add);
  static natsStatus on_write(void* user_data, bool add);
  static natsStatus on_detach(void* user_data);

  // Set while this thread publishes and flushes itself: nats.c's "start writing" callback then
  // needs no loop wake-up.
  static thread_local SocketLoop* t_flushing_loop;

  const int epoll_fd_;
  const int wake_fd_;
  std::thread thread_;
  std::atomic<bool> stopping_{false};
  std::atomic<natsConnection*> connection_{nullptr};
  // True from nats.c's "start writing" to its "stop writing": bytes wait in the buffer.
  std::atomic<bool> write_pending_{false};

  std::mutex write_mutex_;  // one writer at a time (taken before nats.c's connection lock)
  std::mutex mutex_;  // guards the socket's registration; a leaf lock (no nats.c calls inside)
  int socket_ = -1;
  bool registered_ = false;
  bool want_read_ = false;
  bool want_write_ = false;
};

}  // namespace kvr::nats
