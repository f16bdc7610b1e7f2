#include "selection/lifecycle/request_lifecycle.hpp"

#include <algorithm>
#include <utility>

#include <fmt/format.h>

namespace kvr {
namespace {

namespace rc = plugins::request_classifier;

}  // namespace

std::string_view as_str(RequestState state) {
  switch (state) {
    case RequestState::Routing:
      return "routing";
    case RequestState::Sent:
      return "sent";
    case RequestState::Responding:
      return "responding";
    case RequestState::Completed:
      return "completed";
    case RequestState::Aborted:
      return "aborted";
  }
  return "routing";
}

bool LifecycleStep::empty() const {
  return !cancel_at_worker && !first_token && !commit_affinity && !release && !abandon_affinity &&
         !finish_affinity && !context_tokens && classifier_events.empty() && !forward_chunk &&
         !end_stream && !dispatch && !reroute;
}

RequestLifecycle::RequestLifecycle(std::string request_id, std::size_t prompt_tokens,
                                   LifecycleOptions options)
    : request_id_(std::move(request_id)), prompt_tokens_(prompt_tokens), options_(options) {}

LifecycleError RequestLifecycle::refuse(LifecycleError::Kind kind, std::string message) const {
  return LifecycleError{
      kind, fmt::format("request '{}' ({}): {}", request_id_, as_str(state_), std::move(message))};
}

LifecycleResult RequestLifecycle::routed(WorkerWithDpRank worker) {
  if (state_ == RequestState::Aborted) {
    // Cancelled or aborted while the route was in flight: undo the booking, never dispatch.
    LifecycleStep step;
    step.release = discovery::BookingEnd::cancelled;
    step.abandon_affinity = true;
    return step;
  }
  if (state_ != RequestState::Routing) {
    return std::unexpected(refuse(state_ == RequestState::Completed
                                      ? LifecycleError::Kind::after_end
                                      : LifecycleError::Kind::invalid_state,
                                  fmt::format("routed to worker {} rank {} while not routing",
                                              worker.worker_id, worker.dp_rank)));
  }
  if (std::ranges::find(excluded_, worker.worker_id) != excluded_.end()) {
    return std::unexpected(
        refuse(LifecycleError::Kind::invalid_state,
               fmt::format("routed to worker {}, which failed this request before and is excluded "
                           "(release the booking)",
                           worker.worker_id)));
  }
  worker_ = worker;
  state_ = RequestState::Sent;
  next_index_ = 0;
  output_tokens_ = 0;
  LifecycleStep step;
  step.classifier_events.emplace_back(rc::Sent{request_id_, worker});
  step.dispatch = true;
  return step;
}

LifecycleResult RequestLifecycle::route_failed(Error code, std::string_view message) {
  if (state_ == RequestState::Aborted) return LifecycleStep{};  // cancelled meanwhile
  if (state_ != RequestState::Routing) {
    return std::unexpected(
        refuse(state_ == RequestState::Completed ? LifecycleError::Kind::after_end
                                                 : LifecycleError::Kind::invalid_state,
               fmt::format("route failure reported while not routing: {}", message)));
  }
  if (!worker_) {
    return end_aborted(
        discovery::BookingEnd::failed,
        StreamEnd{"error", code,
                  fmt::format("request '{}' could not be routed: {}", request_id_, message)},
        /*tell_worker=*/false);
  }
  return end_aborted(
      discovery::BookingEnd::failed,
      StreamEnd{"error", Error::worker_failed,
                fmt::format("worker {} failed request '{}' before its first token ({}); the retry "
                            "found no other worker: {}",
                            worker_->worker_id, request_id_, last_failure_, message)},
      /*tell_worker=*/false);
}

std::expected<void, LifecycleError> RequestLifecycle::check_chunk(const StreamChunk& chunk) const {
  if (ended()) {
    return std::unexpected(refuse(LifecycleError::Kind::after_end,
                                  fmt::format("chunk {} from worker {} after the request ended",
                                              chunk.index, chunk.worker.worker_id)));
  }
  if (state_ == RequestState::Routing || !worker_ || chunk.worker != *worker_) {
    return std::unexpected(
        refuse(LifecycleError::Kind::stale_worker,
               fmt::format("chunk {} from worker {} rank {}, which is not serving the request",
                           chunk.index, chunk.worker.worker_id, chunk.worker.dp_rank)));
  }
  // An error chunk is taken at any index: a failure must not be lost. A chunk ahead of the next
  // one is a gap (on_chunk); one behind it was seen already.
  if (!chunk.error && chunk.index < next_index_) {
    return std::unexpected(refuse(LifecycleError::Kind::out_of_order,
                                  fmt::format("chunk {} from worker {} where chunk {} was expected",
                                              chunk.index, chunk.worker.worker_id, next_index_)));
  }
  return {};
}

LifecycleResult RequestLifecycle::on_chunk(const StreamChunk& chunk) {
  if (auto valid = check_chunk(chunk); !valid) return std::unexpected(std::move(valid.error()));
  if (chunk.error) return fail_attempt(*chunk.error, /*failed_by_worker=*/true);
  if (chunk.index > next_index_) {
    // Chunks were lost on the way (a dropped connection, a slow consumer): the client's stream
    // can no longer be whole, so the attempt fails (retried before its first token) and the
    // worker is told to stop.
    return fail_attempt(fmt::format("chunks {} to {} of worker {} were lost", next_index_,
                                    chunk.index - 1, chunk.worker.worker_id),
                        /*failed_by_worker=*/false);
  }

  ++next_index_;
  output_tokens_ += chunk.tokens;
  LifecycleStep step;
  if (chunk.tokens > 0) step.context_tokens = prompt_tokens_ + output_tokens_;
  if (state_ == RequestState::Sent) {
    state_ = RequestState::Responding;
    step.first_token = true;
    step.commit_affinity = true;
    step.classifier_events.emplace_back(rc::Responding{request_id_, *worker_});
  }
  step.forward_chunk = true;
  if (chunk.finished) {
    state_ = RequestState::Completed;
    step.release = discovery::BookingEnd::completed;
    step.finish_affinity = true;
    step.classifier_events.emplace_back(
        rc::Completed{request_id_, *worker_, prompt_tokens_ + output_tokens_});
  }
  return step;
}

LifecycleResult RequestLifecycle::worker_failed(WorkerId worker, std::string_view reason) {
  // Removals are told to every request; only the one the worker holds reacts.
  const bool holds = (state_ == RequestState::Sent || state_ == RequestState::Responding) &&
                     worker_ && worker_->worker_id == worker;
  if (!holds) return LifecycleStep{};
  return fail_attempt(reason, /*failed_by_worker=*/false);
}

LifecycleStep RequestLifecycle::fail_attempt(std::string_view reason, bool failed_by_worker) {
  const WorkerWithDpRank failed = *worker_;
  if (state_ == RequestState::Responding) {
    // Tokens already reached the client: a retry would repeat or contradict them.
    return end_aborted(
        discovery::BookingEnd::failed,
        StreamEnd{"error", Error::worker_failed,
                  fmt::format("worker {} failed request '{}' after the response started: {}",
                              failed.worker_id, request_id_, reason)},
        /*tell_worker=*/!failed_by_worker);
  }
  if (std::ranges::find(excluded_, failed.worker_id) == excluded_.end()) {
    excluded_.push_back(failed.worker_id);
  }
  last_failure_ = std::string{reason};
  if (retries_ >= options_.max_retries) {
    return end_aborted(
        discovery::BookingEnd::failed,
        StreamEnd{"error", Error::worker_failed,
                  fmt::format("worker {} failed request '{}' before its first token ({}) and no "
                              "retry is left ({} made)",
                              failed.worker_id, request_id_, reason, retries_)},
        /*tell_worker=*/!failed_by_worker);
  }
  ++retries_;
  state_ = RequestState::Routing;
  LifecycleStep step;
  step.cancel_at_worker = !failed_by_worker;
  step.release = discovery::BookingEnd::failed;
  step.abandon_affinity = true;
  step.reroute = excluded_;
  return step;
}

LifecycleResult RequestLifecycle::cancel(std::string_view reason) {
  if (ended()) {
    return std::unexpected(
        refuse(LifecycleError::Kind::after_end, fmt::format("cancel ({}) after the end", reason)));
  }
  return end_aborted(discovery::BookingEnd::cancelled,
                     StreamEnd{"cancelled", std::nullopt,
                               fmt::format("request '{}' cancelled: {}", request_id_, reason)},
                     /*tell_worker=*/true);
}

LifecycleResult RequestLifecycle::abort(Error code, std::string_view reason) {
  if (ended()) {
    return std::unexpected(
        refuse(LifecycleError::Kind::after_end, fmt::format("abort ({}) after the end", reason)));
  }
  return end_aborted(
      discovery::BookingEnd::failed,
      StreamEnd{"error", code, fmt::format("request '{}' aborted: {}", request_id_, reason)},
      /*tell_worker=*/true);
}

LifecycleStep RequestLifecycle::end_aborted(discovery::BookingEnd end, StreamEnd stream_end,
                                            bool tell_worker) {
  LifecycleStep step;
  // Only an attempt at a worker holds a booking and an affinity proposal; while routing, the
  // failed attempt's were already released.
  if (state_ == RequestState::Sent || state_ == RequestState::Responding) {
    step.cancel_at_worker = tell_worker;
    step.release = end;
    if (state_ == RequestState::Sent) {
      step.abandon_affinity = true;
    } else {
      step.finish_affinity = true;
    }
  }
  state_ = RequestState::Aborted;
  step.classifier_events.emplace_back(rc::Aborted{request_id_, worker_, stream_end.message});
  step.end_stream = std::move(stream_end);
  return step;
}

}  // namespace kvr
