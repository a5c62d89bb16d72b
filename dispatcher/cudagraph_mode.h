// CUDA graph modes, as in vLLM v1's CUDAGraphMode.
//
// A *runtime mode* is what one step actually executes with (eager, piecewise
// graphs around the non-attention pieces, or one full graph). A *configured
// mode* (CudaGraphMode) is a pair of runtime modes: one for uniform-decode
// batches (the "decode routine") and one for everything else (the "mixed
// routine"). The five named configured modes are the only valid pairs.
#ifndef PDWORKER_DISPATCHER_CUDAGRAPH_MODE_H_
#define PDWORKER_DISPATCHER_CUDAGRAPH_MODE_H_

#include <array>
#include <ostream>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace pdworker {

// Concrete mode a single forward step runs with.
enum class RuntimeMode { kNone, kPiecewise, kFull };

// Number of RuntimeMode values; handy for arrays indexed by mode.
inline constexpr int kNumRuntimeModes = 3;

// "NONE", "PIECEWISE" or "FULL".
absl::string_view RuntimeModeName(RuntimeMode mode);
std::ostream& operator<<(std::ostream& os, RuntimeMode mode);

// Configured CUDA graph mode: (decode routine, mixed routine).
class CudaGraphMode {
 public:
  // The five valid configurations.
  static constexpr CudaGraphMode None() {
    return CudaGraphMode(RuntimeMode::kNone, RuntimeMode::kNone);
  }
  static constexpr CudaGraphMode Piecewise() {
    return CudaGraphMode(RuntimeMode::kPiecewise, RuntimeMode::kPiecewise);
  }
  static constexpr CudaGraphMode Full() {
    return CudaGraphMode(RuntimeMode::kFull, RuntimeMode::kFull);
  }
  static constexpr CudaGraphMode FullDecodeOnly() {
    return CudaGraphMode(RuntimeMode::kFull, RuntimeMode::kNone);
  }
  static constexpr CudaGraphMode FullAndPiecewise() {
    return CudaGraphMode(RuntimeMode::kFull, RuntimeMode::kPiecewise);
  }

  // All five named modes, in declaration order (NONE first).
  static std::array<CudaGraphMode, 5> All();

  // Default-constructed mode is NONE.
  constexpr CudaGraphMode() = default;

  // Runtime mode used for uniform-decode batches.
  constexpr RuntimeMode decode_mode() const { return decode_; }
  // Runtime mode used for all other (mixed / prefill) batches.
  constexpr RuntimeMode mixed_mode() const { return mixed_; }

  // True when decode and mixed batches use different runtime modes, i.e.
  // uniform-decode batches get their own (FULL) graphs.
  constexpr bool separate_routine() const { return decode_ != mixed_; }
  // True when either routine uses `mode`.
  constexpr bool has_mode(RuntimeMode mode) const {
    return decode_ == mode || mixed_ == mode;
  }
  constexpr bool has_full_cudagraphs() const {
    return has_mode(RuntimeMode::kFull);
  }
  // True when piecewise compilation (splitting the forward at attention) is
  // needed, i.e. some routine runs PIECEWISE graphs.
  constexpr bool requires_piecewise() const {
    return has_mode(RuntimeMode::kPiecewise);
  }

  // "NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY" or "FULL_AND_PIECEWISE".
  std::string ToString() const;

  friend constexpr bool operator==(CudaGraphMode a, CudaGraphMode b) {
    return a.decode_ == b.decode_ && a.mixed_ == b.mixed_;
  }
  friend constexpr bool operator!=(CudaGraphMode a, CudaGraphMode b) {
    return !(a == b);
  }
  friend std::ostream& operator<<(std::ostream& os, CudaGraphMode mode) {
    return os << mode.ToString();
  }

 private:
  constexpr CudaGraphMode(RuntimeMode decode, RuntimeMode mixed)
      : decode_(decode), mixed_(mixed) {}

  RuntimeMode decode_ = RuntimeMode::kNone;
  RuntimeMode mixed_ = RuntimeMode::kNone;
};

// Parses one of the five uppercase names (case-insensitive). Unknown names
// give InvalidArgument listing the valid names.
absl::StatusOr<CudaGraphMode> ParseCudaGraphMode(absl::string_view name);

// Same as CudaGraphMode::ToString(); free function for symmetry with Parse.
std::string ToString(CudaGraphMode mode);

}  // namespace pdworker

#endif  // PDWORKER_DISPATCHER_CUDAGRAPH_MODE_H_
