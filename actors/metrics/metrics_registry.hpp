// A small Prometheus metrics registry: counters, gauges and histograms with labels, written by
// the router node's actors and the NATS bridge, read (rendered as Prometheus text) by the HTTP
// thread. Plain C++, thread-safe behind one mutex; no CAF.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace kvr::actors::metrics {

/// Label pairs of one series, e.g. {{"worker", "17"}}; order is kept as given.
using Labels = std::vector<std::pair<std::string, std::string>>;

/// What a metric family is; decides the `# TYPE` line and the rendering.
enum class MetricType : std::uint8_t { Counter, Gauge, Histogram };

/// Metric families by name, each with its labelled series. Every method is thread-safe.
class MetricsRegistry {
 public:
  /// Declares a family; `buckets` (ascending upper bounds) only for histograms. Writing to an
  /// undeclared family declares it as a counter (add) or gauge (set) without help text.
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
  struct Series {
    double value = 0;                   // counters and gauges
    std::vector<std::uint64_t> counts;  // histograms: per bucket, not cumulative, +Inf last
    double sum = 0;
    std::uint64_t count = 0;
  };
  struct Family {
    MetricType type = MetricType::Counter;
    std::string help;
    std::vector<double> buckets;
    std::map<Labels, Series> series;
  };

  Family& family_locked(std::string_view name, MetricType default_type);

  mutable std::mutex mutex_;
  std::map<std::string, Family, std::less<>> families_;
};

/// Escapes a label value for the text format (backslash, double quote, newline).
std::string escape_label_value(std::string_view value);

}  // namespace kvr::actors::metrics
