// What an actor publishes over NATS while it works through its mailbox, written together: each
// message is published deferred (RouterPublisher::publish_deferred), and the first one since the
// last write queues a flush_atom message to the actor itself, behind the backlog it has now. When
// the actor reaches that message, its handler calls write(): one send() for the whole burst. The
// wait is for messages already queued, never for a timer.
#pragma once

#include <string_view>

#include "actors/actor_types.hpp"
#include "selection/wire/nats_bridge.hpp"

namespace kvr::actors {

class BurstWriter {
 public:
  /// Publishes `data` on `subject` deferred; false when it could not be published.
  template <typename Actor>
  bool publish(Actor* self, RouterPublisher& publisher, std::string_view subject,
               std::string_view data) {
    const bool published = publisher.publish_deferred(subject, data);
    if (!write_queued_) {
      write_queued_ = true;
      self->send(self, flush_atom::value);
    }
    return published;
  }

  /// The actor's flush_atom handler: writes everything published since the last write.
  void write(RouterPublisher& publisher) {
    write_queued_ = false;
    publisher.flush_deferred();
  }

 private:
  bool write_queued_ = false;
};

}  // namespace kvr::actors
