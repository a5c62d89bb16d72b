// CompositeRegistry: a prometheus::Registry that also serializes extra
// Collectables whose samples are computed at scrape time.
//
// Why a subclass: the exposer (and every test) collects one Registry, and the
// statistics table must be read from GraphStats when Prometheus scrapes, not
// mirrored into counters on the step path. Subclassing keeps the public type a
// plain prometheus::Registry, so callers hand it to MetricsServer (or their
// own exposer) and still get the scrape-time families.
#ifndef PDWORKER_METRICS_COMPOSITE_REGISTRY_H_
#define PDWORKER_METRICS_COMPOSITE_REGISTRY_H_

#include <memory>
#include <mutex>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "prometheus/collectable.h"
#include "prometheus/metric_family.h"
#include "prometheus/registry.h"

namespace pdworker {

// Thread-safe: Collect() may run on exposer threads while families are added
// or collectables appended.
class CompositeRegistry : public prometheus::Registry {
 public:
  CompositeRegistry() = default;

  // Collect() appends `collectable`'s families after the registry's own, in
  // the order collectables were added. Family names must not clash with the
  // registry's families (nothing checks it; a clash breaks the exposition).
  void AddCollectable(
      std::shared_ptr<const prometheus::Collectable> collectable)
      ABSL_LOCKS_EXCLUDED(mu_);

  std::vector<prometheus::MetricFamily> Collect() const override
      ABSL_LOCKS_EXCLUDED(mu_);

 private:
  mutable std::mutex mu_;
  std::vector<std::shared_ptr<const prometheus::Collectable>> extra_
      ABSL_GUARDED_BY(mu_);
};

}  // namespace pdworker

#endif  // PDWORKER_METRICS_COMPOSITE_REGISTRY_H_
