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

absl::string_view MlpActivationName(MlpActivation activation) {
  switch (activation) {
    case MlpActivation::kSilu:
      return "silu";
    case MlpActivation::kGeluTanh:
      return "gelu_pytorch_tanh";
  }
  return "unknown";
}

}  // namespace pdworker
