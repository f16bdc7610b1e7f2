#include "selection/lifecycle/request_flight.hpp"

#include <utility>

#include <fmt/format.h>

#include "messages/check.hpp"

namespace kvr {
namespace {

// A prefill hop answers with one token: a worker that streams more is misbehaving.
constexpr std::size_t kMaxPrefillChunks = 4;

}  // namespace

RequestFlight::RequestFlight(std::string request_id, std::size_t prompt_tokens,
                             FlightOptions options)
    : lifecycle_(std::move(request_id), prompt_tokens, LifecycleOptions{options.max_retries}),
      options_(options) {}

std::optional<WorkerWithDpRank> RequestFlight::prefill_worker() const {
  if (!prefill_) return std::nullopt;
  return prefill_->worker;
}

FlightStep RequestFlight::start(FlightTime now) {
  FlightStep step;
  step.route = route_request(/*retry=*/false, now);
  return step;
}

FlightResult RequestFlight::routed(const FlightRoute& route, FlightTime now) {
  if (route.transfer_valid) transfer_valid_ = *route.transfer_valid;
  if (route.prefill_hop) {
    if (lifecycle_.ended()) {
      // Cancelled while it was being routed: the late booking is undone.
      FlightStep step;
      step.release = booking(true, discovery::BookingEnd::cancelled, AffinityAction::none, {});
      return step;
    }
    if (lifecycle_.state() != RequestState::Routing || prefill_) {
      return std::unexpected(
          LifecycleError{LifecycleError::Kind::invalid_state,
                         fmt::format("request '{}': a prefill hop routed to worker {} while {}",
                                     request_id(), route.worker.worker_id,
                                     prefill_ ? "another runs" : as_str(lifecycle_.state()))});
    }
    prefill_ = PrefillHop{.worker = route.worker,
                          .routed_at = now,
                          .predicted_cached_tokens = route.predicted_cached_tokens};
    dispatched_at_ = now;
    FlightStep step;
    step.dispatch = FlightDispatch{.worker = route.worker,
                                   .hop = FlightHop::prefill,
                                   .max_output_tokens = 1,
                                   .kv_transfer_params = std::string{kRemoteDecodeTransferParams}};
    return step;
  }
  LifecycleResult result = lifecycle_.routed(route.worker);
  if (!result) {
    if (lifecycle_.state() != RequestState::Routing) return std::unexpected(result.error());
    // Booked where the request cannot go (a worker that failed it): undo it and give up.
    FlightStep step;
    step.release = booking(true, discovery::BookingEnd::cancelled, AffinityAction::abandon, {});
    step.warning = result.error().message;
    if (auto aborted = lifecycle_.abort(Error::policy_failed, result.error().message)) {
      append(step, translate(std::move(*aborted), std::nullopt, now));
    }
    return step;
  }
  const bool dispatch = result->dispatch;
  FlightStep step = translate(std::move(*result), std::nullopt, now);
  if (dispatch) {
    predicted_cached_tokens_ = route.predicted_cached_tokens;
    if (handoff_from_) {
      step.handoff_took = now - *handoff_from_;
      handoff_from_.reset();
    }
  }
  return step;
}

FlightResult RequestFlight::route_failed(Error code, std::string_view message, FlightTime now) {
  return translate(lifecycle_.route_failed(code, message), std::nullopt, now);
}

FlightResult RequestFlight::dispatch_failed(std::string_view reason, FlightTime now) {
  if (!prefill_ && lifecycle_.state() != RequestState::Sent) {
    return std::unexpected(
        LifecycleError{LifecycleError::Kind::invalid_state,
                       fmt::format("request '{}': a dispatch failure reported while {}",
                                   request_id(), as_str(lifecycle_.state()))});
  }
  FlightResult step = attempt_failed(FailureCause::dispatch_failed, reason, now);
  if (step) step->cancel_at_worker.reset();  // it never got the request
  return step;
}

FlightResult RequestFlight::attempt_failed(std::optional<FailureCause> cause,
                                           std::string_view reason, FlightTime now) {
  if (prefill_) return fail_prefill(cause, reason, false, now);
  const auto worker = lifecycle_.worker();
  const bool at_worker =
      lifecycle_.state() == RequestState::Sent || lifecycle_.state() == RequestState::Responding;
  if (!at_worker || !worker) {
    return std::unexpected(LifecycleError{
        lifecycle_.ended() ? LifecycleError::Kind::after_end : LifecycleError::Kind::invalid_state,
        fmt::format("request '{}': a failure of its worker reported while {}", request_id(),
                    as_str(lifecycle_.state()))});
  }
  return translate(lifecycle_.worker_failed(worker->worker_id, reason), cause, now);
}

FlightResult RequestFlight::on_chunk(const StreamChunk& chunk, FlightTime now) {
  if (prefill_) return prefill_chunk(chunk, now);
  LifecycleResult result = lifecycle_.on_chunk(chunk);
  if (!result) return std::unexpected(std::move(result.error()));
  const bool first_token = result->first_token;
  FlightStep step = translate(std::move(*result), std::nullopt, now);
  if (first_token && !std::exchange(cache_outcome_recorded_, true)) {
    step.cache_outcome = CacheOutcome{predicted_cached_tokens_, chunk.cached_prompt_tokens};
  }
  if (step.forward_chunk) last_chunk_at_ = now;
  return step;
}

FlightResult RequestFlight::prefill_chunk(const StreamChunk& chunk, FlightTime now) {
  PrefillHop& hop = *prefill_;
  if (chunk.worker != hop.worker) {
    return std::unexpected(LifecycleError{
        LifecycleError::Kind::stale_worker,
        fmt::format(
            "request '{}': chunk {} from worker {} rank {}, which is not its prefill worker",
            request_id(), chunk.index, chunk.worker.worker_id, chunk.worker.dp_rank)});
  }
  if (chunk.error) return fail_prefill(FailureCause::worker_failed, *chunk.error, false, now);
  FlightStep step;
  if (!std::exchange(hop.responded, true)) {
    // The prefill worker's first chunk carries what its engine served from cache; the decode
    // hop's would count the transferred KV.
    if (!std::exchange(cache_outcome_recorded_, true)) {
      step.cache_outcome = CacheOutcome{hop.predicted_cached_tokens, chunk.cached_prompt_tokens};
    }
    step.first_token = booking(false, discovery::BookingEnd::completed, AffinityAction::none,
                               WorkerHealthReport{hop.worker.worker_id, {}});
  }
  hop.held.push_back(chunk);
  step.hold_chunk = true;
  if (!chunk.finished) {
    if (hop.held.size() > kMaxPrefillChunks) {
      append(step, fail_prefill(FailureCause::worker_failed,
                                "it streamed more than the one token of a prefill", true, now));
    }
    return step;
  }
  if (chunk.kv_transfer_params.empty() && chunk.finish_reason == "stop") {
    // Its one token ended the generation (an end-of-sequence or stop token): vLLM gives no
    // transfer parameters then, and nothing is left for a decode worker.
    append(step, serve_from_prefill(now));
    return step;
  }
  const std::optional<std::string> unusable = chunk.kv_transfer_params.empty()
                                                  ? std::optional<std::string>{"it carries none"}
                                                  : chunk.kv_transfer_params_error;
  if (unusable) {
    append(step,
           fail_prefill(FailureCause::worker_failed,
                        fmt::format("its answer has no usable kv_transfer_params: {}", *unusable),
                        false, now));
    return step;
  }
  step.prefill_hop_took = now - hop.routed_at;
  transfer_ = KvTransfer{chunk.kv_transfer_params, hop.worker.worker_id, now + transfer_valid_};
  step.release = booking(true, discovery::BookingEnd::completed, AffinityAction::none, {});
  step.discard_held = true;
  prefill_.reset();
  dispatched_at_.reset();
  handoff_from_ = now;
  step.route = route_request(/*retry=*/false, now);
  return step;
}

FlightStep RequestFlight::fail_prefill(std::optional<FailureCause> cause, std::string_view reason,
                                       bool tell_worker, FlightTime now) {
  const WorkerWithDpRank worker = prefill_->worker;
  FlightStep step;
  if (tell_worker) step.cancel_at_worker = worker;
  step.release = booking(true, discovery::BookingEnd::failed, AffinityAction::none,
                         WorkerHealthReport{worker.worker_id, cause});
  step.discard_held = true;
  failed_prefill_workers_.push_back(worker.worker_id);
  prefill_.reset();
  dispatched_at_.reset();
  if (prefill_retries_ < options_.max_retries) {
    // Planned again without the failed worker: another prefill worker, or the decode worker alone
    // when none is left.
    ++prefill_retries_;
    step.route = route_request(/*retry=*/true, now);
    return step;
  }
  if (auto failed = lifecycle_.route_failed(
          Error::worker_failed,
          fmt::format("the prefill hop failed on worker {}: {}", worker.worker_id, reason))) {
    append(step, translate(std::move(*failed), std::nullopt, now));
  }
  return step;
}

FlightStep RequestFlight::serve_from_prefill(FlightTime now) {
  PrefillHop hop = std::move(*prefill_);
  prefill_.reset();
  dispatched_at_ = hop.routed_at;
  predicted_cached_tokens_ = hop.predicted_cached_tokens;
  LifecycleResult routed = lifecycle_.routed(hop.worker);
  if (!routed) {
    // The prefill worker failed this request before (as a decode worker): nothing it sent is
    // relayed; its booking is undone.
    FlightStep step;
    step.release = booking(true, discovery::BookingEnd::cancelled, AffinityAction::none, {});
    step.discard_held = true;
    step.warning = routed.error().message;
    if (auto aborted = lifecycle_.abort(Error::policy_failed, routed.error().message)) {
      append(step, translate(std::move(*aborted), std::nullopt, now));
    }
    return step;
  }
  routed->dispatch = false;  // it has answered already
  FlightStep step = translate(std::move(*routed), std::nullopt, now);
  for (const StreamChunk& chunk : hop.held) {
    LifecycleResult result = lifecycle_.on_chunk(chunk);
    if (!result) continue;  // a chunk it repeated: relayed once
    result->forward_chunk = false;
    append(step, translate(std::move(*result), std::nullopt, now));
  }
  step.relay_held = true;
  forwarded_ += static_cast<std::uint32_t>(hop.held.size());
  last_chunk_at_ = now;
  return step;
}

FlightResult RequestFlight::worker_left(WorkerId worker, std::string_view reason, FlightTime now) {
  if (transfer_ && transfer_->source == worker) {
    transfer_->valid_until = FlightTime::min();  // the KV left with its prefill worker
  }
  if (prefill_ && prefill_->worker.worker_id == worker) {
    return fail_prefill(FailureCause::worker_failed, reason, false, now);
  }
  return translate(lifecycle_.worker_failed(worker, reason), std::nullopt, now);
}

FlightResult RequestFlight::cancel(std::string_view reason) {
  LifecycleResult result = lifecycle_.cancel(reason);
  if (!result) return std::unexpected(std::move(result.error()));
  FlightStep step = translate(std::move(*result), std::nullopt, FlightTime{});
  if (prefill_) {
    // Cancelled while its prefill hop ran: that worker stops, its booking ends.
    step.cancel_at_worker = prefill_->worker;
    step.release = booking(true, discovery::BookingEnd::cancelled, AffinityAction::none, {});
    step.discard_held = true;
    prefill_.reset();
  }
  dispatched_at_.reset();
  return step;
}

FlightResult RequestFlight::abort(Error code, std::string_view reason) {
  const std::optional<WorkerWithDpRank> prefill = prefill_worker();
  LifecycleResult result = lifecycle_.abort(code, reason);
  if (!result) return std::unexpected(std::move(result.error()));
  FlightStep step = translate(std::move(*result), std::nullopt, FlightTime{});
  if (prefill) {
    step.cancel_at_worker = *prefill;
    step.release = booking(true, discovery::BookingEnd::cancelled, AffinityAction::none, {});
    step.discard_held = true;
    prefill_.reset();
  }
  dispatched_at_.reset();
  return step;
}

FlightStep RequestFlight::tick(FlightTime now) {
  const std::optional<FlightTime> due = deadline();
  if (!due || now < *due) return {};
  FlightStep step;
  if (prefill_) {
    step = fail_prefill(FailureCause::first_token_timeout,
                        fmt::format("no answer within {} ms", options_.first_token_timeout.count()),
                        true, now);
    step.timed_out = FlightTimeout::first_token;
    return step;
  }
  const WorkerWithDpRank worker = *lifecycle_.worker();
  if (lifecycle_.state() == RequestState::Sent) {
    if (auto failed = lifecycle_.worker_failed(
            worker.worker_id,
            fmt::format("no first chunk within {} ms", options_.first_token_timeout.count()))) {
      step = translate(std::move(*failed), FailureCause::first_token_timeout, now);
    }
    step.timed_out = FlightTimeout::first_token;
    return step;
  }
  if (auto stalled = lifecycle_.abort(
          Error::timeout,
          fmt::format("worker {} sent no chunk for {} ms after chunk {}", worker.worker_id,
                      options_.stall_timeout.count(), forwarded_ - 1))) {
    step = translate(std::move(*stalled), FailureCause::stream_timeout, now);
  }
  step.timed_out = FlightTimeout::stall;
  return step;
}

std::optional<FlightTime> RequestFlight::deadline() const {
  if (lifecycle_.ended()) return std::nullopt;
  if ((prefill_ || lifecycle_.state() == RequestState::Sent) && dispatched_at_) {
    return *dispatched_at_ + options_.first_token_timeout;
  }
  if (lifecycle_.state() == RequestState::Responding)
    return last_chunk_at_ + options_.stall_timeout;
  return std::nullopt;
}

FlightRouteRequest RequestFlight::route_request(bool retry, FlightTime now) {
  FlightRouteRequest request;
  const auto excluded = lifecycle_.excluded_workers();
  request.excluded.assign(excluded.begin(), excluded.end());
  request.excluded.insert(request.excluded.end(), failed_prefill_workers_.begin(),
                          failed_prefill_workers_.end());
  if (transfer_ && now >= transfer_->valid_until) transfer_.reset();  // too old: prefilled again
  request.decode_after_transfer = transfer_.has_value();
  request.retry = retry;
  return request;
}

FlightResult RequestFlight::translate(LifecycleResult result, std::optional<FailureCause> cause,
                                      FlightTime now) {
  if (!result) return std::unexpected(std::move(result.error()));
  return translate(std::move(*result), cause, now);
}

FlightStep RequestFlight::translate(LifecycleStep step, std::optional<FailureCause> cause,
                                    FlightTime now) {
  FlightStep out;
  const std::optional<WorkerWithDpRank> worker = lifecycle_.worker();
  if (step.cancel_at_worker && worker) out.cancel_at_worker = *worker;
  if (step.first_token) {
    out.first_token =
        booking(false, discovery::BookingEnd::completed,
                step.commit_affinity ? AffinityAction::commit : AffinityAction::none,
                worker ? std::optional{WorkerHealthReport{worker->worker_id, {}}} : std::nullopt);
  }
  if (step.release) {
    out.release =
        booking(true, *step.release,
                step.abandon_affinity  ? AffinityAction::abandon
                : step.finish_affinity ? AffinityAction::finish
                                       : AffinityAction::none,
                cause && worker ? std::optional{WorkerHealthReport{worker->worker_id, cause}}
                                : std::nullopt);
    out.completed = *step.release == discovery::BookingEnd::completed;
  }
  out.context_tokens = step.context_tokens;
  out.classifier_events = std::move(step.classifier_events);
  if (step.forward_chunk) {
    out.forward_chunk = true;
    ++forwarded_;
  }
  out.end_stream = std::move(step.end_stream);
  if (step.dispatch && worker) {
    out.dispatch = FlightDispatch{.worker = *worker,
                                  .hop = transfer_ ? FlightHop::decode : FlightHop::single,
                                  .max_output_tokens = std::nullopt,
                                  .kv_transfer_params = transfer_ ? transfer_->params : ""};
    dispatched_at_ = now;
  }
  if (step.reroute) {
    out.route = route_request(/*retry=*/true, now);
    dispatched_at_.reset();
  }
  return out;
}

void RequestFlight::append(FlightStep& step, FlightStep next) {
  if (next.cancel_at_worker) step.cancel_at_worker = next.cancel_at_worker;
  // A second first token of the same booking (the prefill worker serving the whole request)
  // carries the session affinity's commit: it replaces the first.
  if (next.first_token) step.first_token = std::move(next.first_token);
  if (next.release) {
    KVR_ASSERT(!step.release);
    step.release = std::move(next.release);
  }
  if (next.context_tokens) step.context_tokens = next.context_tokens;
  for (auto& event : next.classifier_events) step.classifier_events.push_back(std::move(event));
  if (next.cache_outcome) step.cache_outcome = next.cache_outcome;
  step.hold_chunk = step.hold_chunk || next.hold_chunk;
  step.relay_held = step.relay_held || next.relay_held;
  step.discard_held = step.discard_held || next.discard_held;
  step.forward_chunk = step.forward_chunk || next.forward_chunk;
  if (next.end_stream) step.end_stream = std::move(next.end_stream);
  if (next.dispatch) step.dispatch = std::move(next.dispatch);
  if (next.route) step.route = std::move(next.route);
  if (next.timed_out) step.timed_out = next.timed_out;
  step.completed = step.completed || next.completed;
  if (next.prefill_hop_took) step.prefill_hop_took = next.prefill_hop_took;
  if (next.handoff_took) step.handoff_took = next.handoff_took;
  if (next.warning) step.warning = std::move(next.warning);
}

BookingChange RequestFlight::booking(bool release, discovery::BookingEnd end,
                                     AffinityAction affinity,
                                     std::optional<WorkerHealthReport> health) const {
  return BookingChange{.request_id = request_id(),
                       .release = release,
                       .end = end,
                       .affinity = affinity,
                       .health = std::move(health)};
}

}  // namespace kvr
