// The table of families (model_family.h); each lives in its own file here.
#include "worker/model/model_family.h"

namespace pdworker {

absl::Span<const ModelFamily* const> ModelFamilies() {
  // Addresses of constants: constant-initialized, nothing runs at startup.
  static const ModelFamily* const kFamilies[] = {
      &kLlamaFamily, &kQwen2Family,  &kMistralFamily, &kQwen3Family,
      &kPhi3Family,  &kGemma2Family, &kGemma3Family};
  return kFamilies;
}

const ModelFamily* FindModelFamily(absl::string_view architecture_name) {
  for (const ModelFamily* family : ModelFamilies()) {
    if (family->architecture_name == architecture_name) return family;
  }
  return nullptr;
}

const TextModelWrapper* FindTextModelWrapper(
    absl::string_view architecture_name) {
  static const TextModelWrapper* const kWrappers[] = {
      &kGemma3MultimodalWrapper};
  for (const TextModelWrapper* wrapper : kWrappers) {
    if (wrapper->architecture_name == architecture_name) return wrapper;
  }
  return nullptr;
}

const ModelFamily& FamilyOf(Architecture architecture) {
  for (const ModelFamily* family : ModelFamilies()) {
    if (family->architecture == architecture) return *family;
  }
  return kLlamaFamily;  // unreachable: every Architecture has a family
}

}  // namespace pdworker
