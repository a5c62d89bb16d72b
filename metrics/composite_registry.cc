#include "metrics/composite_registry.h"

#include <iterator>
#include <utility>

namespace pdworker {

void CompositeRegistry::AddCollectable(
    std::shared_ptr<const prometheus::Collectable> collectable) {
  std::lock_guard<std::mutex> lock(mu_);
  extra_.push_back(std::move(collectable));
}

std::vector<prometheus::MetricFamily> CompositeRegistry::Collect() const {
  std::vector<prometheus::MetricFamily> families = Registry::Collect();
  std::vector<std::shared_ptr<const prometheus::Collectable>> extra;
  {
    // Collect outside the lock: a collectable may take its own locks.
    std::lock_guard<std::mutex> lock(mu_);
    extra = extra_;
  }
  for (const auto& collectable : extra) {
    std::vector<prometheus::MetricFamily> more = collectable->Collect();
    families.insert(families.end(), std::make_move_iterator(more.begin()),
                    std::make_move_iterator(more.end()));
  }
  return families;
}

}  // namespace pdworker
