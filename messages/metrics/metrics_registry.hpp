// A small Prometheus metrics registry: counters, gauges and histograms with labels, written by
// the router node's actors and the NATS bridge, read (rendered as Prometheus text) by the HTTP
// thread. Plain C++, no CAF. Series are created and found behind one mutex; their values are
// atomics, so a hot path resolves a series once (counter(), gauge(), histogram()) and then
// updates it without a lock or an allocation.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace kvr::metrics {

/// Label pairs of one series, e.g. {{"worker", "17"}}; order is kept as given.
using Labels = std::vector<std::pair<std::string, std::string>>;

/// What a metric family is; decides the `# TYPE` line and the rendering.
enum class MetricType : std::uint8_t { Counter, Gauge, Histogram };

/// The type's name on a family's `# TYPE` line ("counter", "gauge", "histogram").
std::string_view as_str(MetricType type);

class MetricsRegistry;

/// A counter or gauge series resolved once. Lock-free; a default handle does nothing.
class ValueHandle {
 public:
  ValueHandle() = default;
  void add(double delta = 1) const {
    if (value_ != nullptr) value_->fetch_add(delta, std::memory_order_relaxed);
  }
  void set(double value) const {
    if (value_ != nullptr) value_->store(value, std::memory_order_relaxed);
  }

 private:
  friend class MetricsRegistry;
  explicit ValueHandle(std::atomic<double>* value) : value_(value) {}
  std::atomic<double>* value_ = nullptr;
};

/// A histogram series resolved once. Lock-free; a default handle does nothing. A render that
/// races an observation may show it in the count but not yet in the buckets (or the sum).
class HistogramHandle {
 public:
  HistogramHandle() = default;
  void observe(double value) const;

 private:
  friend class MetricsRegistry;
  struct Cells;
  HistogramHandle(Cells* cells, const std::vector<double>* buckets)
      : cells_(cells), buckets_(buckets) {}
  Cells* cells_ = nullptr;
  const std::vector<double>* buckets_ = nullptr;
};

/// Metric families by name, each with its labelled series. Every method is thread-safe.
class MetricsRegistry {
 public:
  /// The series of a counter family (declared as one when new); stays valid with the registry.
  ValueHandle counter(std::string_view name, const Labels& labels = {});
  /// The series of a gauge family (declared as one when new).
  ValueHandle gauge(std::string_view name, const Labels& labels = {});
  /// The series of a histogram family; a no-op handle when `name` is not a described histogram.
  HistogramHandle histogram(std::string_view name, const Labels& labels = {});

  /// Declares a family; `buckets` (ascending upper bounds) only for histograms. Writing to an
  /// undeclared family declares it as a counter (add) or gauge (set) without help text. A
  /// histogram that has series keeps its type and buckets (handles point at them).
  void describe(std::string name, MetricType type, std::string help,
                std::vector<double> buckets = {});

  /// Adds `delta` to a counter (or gauge) series.
  void add(std::string_view name, const Labels& labels = {}, double delta = 1);
  /// Sets a gauge series.
  void set(std::string_view name, const Labels& labels, double value);
  /// Records one observation in a histogram series; ignored when the family is not a histogram.
  void observe(std::string_view name, const Labels& labels, double value);

  /// The current value of a counter or gauge series (0 when absent); for tests and logs.
  double value(std::string_view name, const Labels& labels = {}) const;
  /// The sum of every series of a counter or gauge family.
  double total(std::string_view name) const;

  /// Every family in the Prometheus text exposition format (version 0.0.4).
  std::string render() const;

 private:
  // Map nodes do not move, so handles point into them; histogram cells are allocated once.
  struct Series {
    std::atomic<double> value{0};                   // counters and gauges
    std::unique_ptr<HistogramHandle::Cells> cells;  // histograms
  };
  struct Family {
    MetricType type = MetricType::Counter;
    std::string help;
    std::vector<double> buckets;
    std::map<Labels, Series> series;
  };

  Family& family_locked(std::string_view name, MetricType default_type);
  ValueHandle value_handle(std::string_view name, const Labels& labels, MetricType default_type);

  mutable std::mutex mutex_;
  std::map<std::string, Family, std::less<>> families_;
};

/// A histogram series' cells: per bucket (not cumulative, +Inf last), the sum and the count.
struct HistogramHandle::Cells {
  explicit Cells(std::size_t buckets)
      : counts(std::make_unique<std::atomic<std::uint64_t>[]>(buckets + 1)) {}
  std::unique_ptr<std::atomic<std::uint64_t>[]> counts;
  std::atomic<double> sum{0};
  std::atomic<std::uint64_t> count{0};
};

/// Escapes a label value for the text format (backslash, double quote, newline).
std::string escape_label_value(std::string_view value);

}  // namespace kvr::metrics
