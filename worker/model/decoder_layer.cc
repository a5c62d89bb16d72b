#include "worker/model/decoder_layer.h"

namespace pdworker {

absl::string_view QkNormName(QkNorm qk_norm) {
  switch (qk_norm) {
    case QkNorm::kNone:
      return "none";
    case QkNorm::kPerHeadRms:
      return "per_head_rms";
  }
  return "unknown";
}

}  // namespace pdworker
