#include "tests/model/config_layouts.h"

namespace pdworker::model_testing {

nlohmann::json ToTransformers5Layout(nlohmann::json config) {
  nlohmann::json rope = {{"rope_type", "default"}};
  if (config.contains("rope_scaling") && !config["rope_scaling"].is_null()) {
    rope = config["rope_scaling"];
  }
  // transformers' default base when a config leaves it out.
  rope["rope_theta"] = config.value("rope_theta", 10000.0);
  config.erase("rope_scaling");
  config.erase("rope_theta");
  config["rope_parameters"] = rope;
  if (config.contains("torch_dtype")) {
    config["dtype"] = config["torch_dtype"];
    config.erase("torch_dtype");
  }
  return config;
}

}  // namespace pdworker::model_testing
