// config.json layout conversions for tests: the same model as transformers 4
// and transformers 5 write it.
#ifndef PDWORKER_TESTS_MODEL_CONFIG_LAYOUTS_H_
#define PDWORKER_TESTS_MODEL_CONFIG_LAYOUTS_H_

#include "nlohmann/json.hpp"

namespace pdworker::model_testing {

// Rewrites a transformers 4 config.json (top-level "rope_theta" and
// "rope_scaling", "torch_dtype") into the transformers 5 layout: both RoPE
// fields inside "rope_parameters" ({"rope_type": "default"} when there is no
// scaling), "dtype" for the storage type.
nlohmann::json ToTransformers5Layout(nlohmann::json config);

}  // namespace pdworker::model_testing

#endif  // PDWORKER_TESTS_MODEL_CONFIG_LAYOUTS_H_
