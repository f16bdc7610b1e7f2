#include "messages/metrics/metrics_registry.hpp"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>

namespace kvr::metrics {

std::string_view as_str(MetricType type) {
  switch (type) {
    case MetricType::Counter:
      return "counter";
    case MetricType::Gauge:
      return "gauge";
    case MetricType::Histogram:
      return "histogram";
  }
  return "untyped";
}

namespace {

std::string format_value(double value) {
  if (std::isnan(value)) return "NaN";
  if (std::isinf(value)) return value > 0 ? "+Inf" : "-Inf";
  return fmt::format("{}", value);
}

// `{a="1",b="2"}` with an optional extra label (histogram `le`); empty when there are none.
std::string format_labels(const Labels& labels, std::string_view extra_name = {},
                          std::string_view extra_value = {}) {
  if (labels.empty() && extra_name.empty()) return {};
  std::string out = "{";
  bool first = true;
  for (const auto& [name, value] : labels) {
    if (!first) out += ',';
    first = false;
    out += fmt::format("{}=\"{}\"", name, escape_label_value(value));
  }
  if (!extra_name.empty()) {
    if (!first) out += ',';
    out += fmt::format("{}=\"{}\"", extra_name, extra_value);
  }
  out += '}';
  return out;
}

}  // namespace

std::string escape_label_value(std::string_view value) {
  std::string out;
  out.reserve(value.size());
  for (char c : value) {
    switch (c) {
      case '\\':
        out += "\\\\";
        break;
      case '"':
        out += "\\\"";
        break;
      case '\n':
        out += "\\n";
        break;
      default:
        out += c;
    }
  }
  return out;
}

void MetricsRegistry::describe(std::string name, MetricType type, std::string help,
                               std::vector<double> buckets) {
  std::lock_guard lock{mutex_};
  Family& family = families_[std::move(name)];
  family.help = std::move(help);
  // Handles point at a histogram's buckets and cells: once it has series, its shape stays.
  if (family.type == MetricType::Histogram && !family.series.empty()) return;
  family.type = type;
  std::ranges::sort(buckets);
  family.buckets = std::move(buckets);
}

MetricsRegistry::Family& MetricsRegistry::family_locked(std::string_view name,
                                                        MetricType default_type) {
  auto it = families_.find(name);
  if (it == families_.end()) {
    it = families_.emplace(std::string{name}, Family{}).first;
    it->second.type = default_type;
  }
  return it->second;
}

ValueHandle MetricsRegistry::value_handle(std::string_view name, const Labels& labels,
                                          MetricType default_type) {
  std::lock_guard lock{mutex_};
  Family& family = family_locked(name, default_type);
  if (family.type == MetricType::Histogram) return {};
  return ValueHandle{&family.series[labels].value};
}

ValueHandle MetricsRegistry::counter(std::string_view name, const Labels& labels) {
  return value_handle(name, labels, MetricType::Counter);
}

ValueHandle MetricsRegistry::gauge(std::string_view name, const Labels& labels) {
  return value_handle(name, labels, MetricType::Gauge);
}

HistogramHandle MetricsRegistry::histogram(std::string_view name, const Labels& labels) {
  std::lock_guard lock{mutex_};
  auto it = families_.find(name);
  if (it == families_.end() || it->second.type != MetricType::Histogram) return {};
  Family& family = it->second;
  Series& series = family.series[labels];
  if (!series.cells) {
    series.cells = std::make_unique<HistogramHandle::Cells>(family.buckets.size());
  }
  return HistogramHandle{series.cells.get(), &family.buckets};
}

void HistogramHandle::observe(double value) const {
  if (cells_ == nullptr) return;
  const auto bucket = std::ranges::lower_bound(*buckets_, value) - buckets_->begin();
  cells_->counts[static_cast<std::size_t>(bucket)].fetch_add(1, std::memory_order_relaxed);
  cells_->sum.fetch_add(value, std::memory_order_relaxed);
  cells_->count.fetch_add(1, std::memory_order_relaxed);
}

void MetricsRegistry::add(std::string_view name, const Labels& labels, double delta) {
  value_handle(name, labels, MetricType::Counter).add(delta);
}

void MetricsRegistry::set(std::string_view name, const Labels& labels, double value) {
  value_handle(name, labels, MetricType::Gauge).set(value);
}

void MetricsRegistry::observe(std::string_view name, const Labels& labels, double value) {
  histogram(name, labels).observe(value);
}

double MetricsRegistry::value(std::string_view name, const Labels& labels) const {
  std::lock_guard lock{mutex_};
  const auto it = families_.find(name);
  if (it == families_.end()) return 0;
  const auto series = it->second.series.find(labels);
  return series == it->second.series.end() ? 0
                                           : series->second.value.load(std::memory_order_relaxed);
}

double MetricsRegistry::total(std::string_view name) const {
  std::lock_guard lock{mutex_};
  const auto it = families_.find(name);
  if (it == families_.end()) return 0;
  double sum = 0;
  for (const auto& [labels, series] : it->second.series) {
    sum += series.value.load(std::memory_order_relaxed);
  }
  return sum;
}

std::string MetricsRegistry::render() const {
  std::lock_guard lock{mutex_};
  std::string out;
  for (const auto& [name, family] : families_) {
    if (!family.help.empty()) out += fmt::format("# HELP {} {}\n", name, family.help);
    out += fmt::format("# TYPE {} {}\n", name, as_str(family.type));
    for (const auto& [labels, series] : family.series) {
      if (family.type != MetricType::Histogram) {
        out += fmt::format("{}{} {}\n", name, format_labels(labels),
                           format_value(series.value.load(std::memory_order_relaxed)));
        continue;
      }
      if (!series.cells) continue;
      const HistogramHandle::Cells& cells = *series.cells;
      std::uint64_t cumulative = 0;
      for (std::size_t i = 0; i < family.buckets.size(); ++i) {
        cumulative += cells.counts[i].load(std::memory_order_relaxed);
        out +=
            fmt::format("{}_bucket{} {}\n", name,
                        format_labels(labels, "le", format_value(family.buckets[i])), cumulative);
      }
      cumulative += cells.counts[family.buckets.size()].load(std::memory_order_relaxed);
      out += fmt::format("{}_bucket{} {}\n", name, format_labels(labels, "le", "+Inf"), cumulative);
      out += fmt::format("{}_sum{} {}\n", name, format_labels(labels),
                         format_value(cells.sum.load(std::memory_order_relaxed)));
      out += fmt::format("{}_count{} {}\n", name, format_labels(labels),
                         cells.count.load(std::memory_order_relaxed));
    }
  }
  return out;
}

}  // namespace kvr::metrics
