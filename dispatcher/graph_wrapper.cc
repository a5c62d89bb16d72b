#include "dispatcher/graph_wrapper.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "glog/logging.h"

namespace pdworker {

GraphWrapper::GraphWrapper(Params params)
    : runnable_(std::move(params.runnable)),
      mode_(params.mode),
      backend_(params.backend),
      capture_lifecycle_(params.capture_lifecycle),
      options_(std::move(params.options)) {
  CHECK(mode_ == RuntimeMode::kFull || mode_ == RuntimeMode::kPiecewise)
      << "GraphWrapper '" << options_.name
      << "' must be bound to FULL or PIECEWISE, got " << mode_;
  CHECK(runnable_ != nullptr)
      << "GraphWrapper '" << options_.name << "' needs a runnable";
  CHECK(backend_ != nullptr)
      << "GraphWrapper '" << options_.name << "' needs a graph backend";
  CHECK(capture_lifecycle_ != nullptr)
      << "GraphWrapper '" << options_.name << "' needs a capture lifecycle";
}

size_t GraphWrapper::NumNodes(const BatchDescriptor& key) const {
  auto it = entries_.find(key);
  return it == entries_.end() ? 0 : it->second.graph->num_nodes();
}

absl::Status GraphWrapper::Replay(const BatchDescriptor& key) const {
  auto it = entries_.find(key);
  if (it == entries_.end()) {
    return absl::NotFoundError(absl::StrCat(options_.name, ": no ",
                                            RuntimeModeName(mode_),
                                            " graph for ", key.ToString()));
  }
  return it->second.graph->Replay();
}

absl::Status GraphWrapper::Run(const ForwardContext& context,
                               absl::Span<const void* const> input_addresses) {
  if (context.runtime_mode == RuntimeMode::kNone ||
      context.runtime_mode != mode_) {
    // Warm-up, eager fallback, or the other wrapper level's turn.
    ++counters_.passthroughs;
    return runnable_(context);
  }
  auto it = entries_.find(context.batch_descriptor);
  if (it == entries_.end()) return Capture(context, input_addresses);

  if (options_.input_address_check == InputAddressCheck::kOn) {
    absl::Status check =
        CheckInputAddresses(context, it->second, input_addresses);
    if (!check.ok()) return check;
  }
  absl::Status replayed = it->second.graph->Replay();
  if (!replayed.ok()) return Annotate(replayed, context);
  ++counters_.replays;
  return absl::OkStatus();
}

absl::Status GraphWrapper::Capture(
    const ForwardContext& context,
    absl::Span<const void* const> input_addresses) {
  if (options_.capture_policy == CapturePolicy::kCapturePhaseOnly &&
      !capture_lifecycle_->CaptureAllowed()) {
    return Annotate(
        absl::FailedPreconditionError(
            "no graph was captured for this key and capture is only allowed "
            "during the capture phase; the dispatcher must only return keys "
            "that were captured at startup (or use CapturePolicy::kLazy)"),
        context);
  }

  absl::Status begun = backend_->BeginCapture();
  if (!begun.ok()) return Annotate(begun, context);
  absl::Status ran = runnable_(context);
  // End the capture even when the runnable failed, so the stream is usable.
  absl::StatusOr<std::unique_ptr<CapturedGraph>> graph = backend_->EndCapture();
  if (!ran.ok()) {
    return Annotate(ran, context);
  }
  if (!graph.ok()) return Annotate(graph.status(), context);

  // Recording did not execute anything; run it once so this call's outputs
  // are what an eager run would have produced.
  absl::Status replayed = (*graph)->Replay();
  if (!replayed.ok()) return Annotate(replayed, context);

  Entry entry;
  entry.graph = *std::move(graph);
  if (options_.input_address_check == InputAddressCheck::kOn) {
    entry.input_addresses.assign(input_addresses.begin(),
                                 input_addresses.end());
  }
  entries_.emplace(context.batch_descriptor, std::move(entry));
  ++counters_.captures;
  VLOG(1) << "GraphWrapper '" << options_.name << "' captured "
          << RuntimeModeName(mode_) << " graph for "
          << context.batch_descriptor;
  return absl::OkStatus();
}

absl::Status GraphWrapper::CheckInputAddresses(
    const ForwardContext& context, const Entry& entry,
    absl::Span<const void* const> actual) const {
  const std::vector<const void*>& expected = entry.input_addresses;
  if (actual.size() != expected.size()) {
    return Annotate(absl::FailedPreconditionError(absl::StrFormat(
                        "replay got %d input buffers, capture recorded %d",
                        actual.size(), expected.size())),
                    context);
  }
  for (size_t i = 0; i < actual.size(); ++i) {
    if (actual[i] != expected[i]) {
      return Annotate(
          absl::FailedPreconditionError(absl::StrFormat(
              "input %d moved: captured at %p, replayed with %p; a graph "
              "reads the buffers it was captured with, so inputs must be "
              "written into the same static buffers before replay",
              i, expected[i], actual[i])),
          context);
    }
  }
  return absl::OkStatus();
}

absl::Status GraphWrapper::Annotate(const absl::Status& status,
                                    const ForwardContext& context) const {
  return absl::Status(status.code(),
                      absl::StrCat("GraphWrapper '", options_.name, "' (",
                                   RuntimeModeName(mode_), ", ",
                                   context.batch_descriptor.ToString(),
                                   "): ", status.message()));
}

}  // namespace pdworker
