// The front door's view of the fleet: which models have live workers and where their engines
// serve HTTP. Fed from the NATS bridge's validated worker messages (registrations, heartbeats,
// deregistrations) beside the selectors, because the front door answers /v1/models, /health and
// "unknown model" before any partition is asked, and a cluster node sees every model while its
// selectors run only for the partitions it owns. Thread-safe: the bridge's thread writes, the
// HTTP threads read.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "discovery/catalog/worker_registration.hpp"
#include "discovery/worker_reports.hpp"
#include "messages/clock.hpp"

namespace kvr::front_door {

/// One live worker of a model, as the front door needs it.
struct DirectoryWorker {
  WorkerId worker_id = 0;
  std::string routing_group;
  WorkerType role = WorkerType::Aggregated;
  std::uint32_t block_size = 0;
  /// The engine's HTTP base URL; empty: the worker serves only kvr's NATS generate API.
  std::string http_url;
  /// LoRA adapters the engine serves on top of its model.
  std::vector<std::string> lora_adapters;
};

/// Where the requests naming one model go.
struct ModelTarget {
  /// The model whose partitions route them: the name itself, or a LoRA adapter's base model.
  std::string model;
  /// The LoRA adapter named (the requests' cache namespace); empty: the model itself.
  std::string adapter;
  /// The live workers that serve the name (for an adapter, those that list it); empty: unknown.
  std::vector<DirectoryWorker> workers;
};

/// A LoRA adapter some live worker serves, and its base model.
struct ServedAdapter {
  std::string name;
  std::string model;
  friend bool operator==(const ServedAdapter&, const ServedAdapter&) = default;
};

class FleetDirectory {
 public:
  explicit FleetDirectory(std::shared_ptr<const Clock> clock = Clock::steady());

  void registered(const discovery::WorkerRegistration& registration);
  void heartbeat(const discovery::WorkerLiveness& liveness);
  void deregistered(const discovery::WorkerLiveness& liveness);
  /// The node's NATS connection went down (false: liveness is held, as the selectors hold it) or
  /// came back (true: every worker gets one liveness TTL from now).
  void nats_link(bool connected);

  /// The models with at least one live worker, sorted.
  std::vector<std::string> models() const;
  /// The live workers of `model` (any group and role); empty: the model is unknown or dead.
  std::vector<DirectoryWorker> workers(const std::string& model) const;
  /// The LoRA adapters of live workers, sorted by name.
  std::vector<ServedAdapter> adapters() const;
  /// Where requests naming `name` go: a model with live workers, else a LoRA adapter of one
  /// (routed in its base model's partition, among the workers that serve it).
  ModelTarget target(const std::string& name) const;
  /// Whether any worker is live.
  bool any_live() const;

 private:
  struct Entry {
    DirectoryWorker worker;
    std::string model;
    Incarnation incarnation = 0;
    std::chrono::milliseconds liveness_ttl{0};
    std::chrono::steady_clock::time_point expires_at;
  };
  bool live(const Entry& entry, std::chrono::steady_clock::time_point now) const;
  /// Forgets the workers whose liveness ran out (at most once a second: registrations are
  /// frequent, the dead few).
  void prune(std::chrono::steady_clock::time_point now);

  std::shared_ptr<const Clock> clock_;
  mutable std::mutex mutex_;
  std::map<WorkerId, Entry> workers_;
  /// While the NATS connection is down, nobody's liveness runs out.
  bool held_ = false;
  std::chrono::steady_clock::time_point next_prune_{};
};

}  // namespace kvr::front_door
