// Writes deterministic tiny Llama-family checkpoints (Hugging Face format) for
// tests and demos:
//
//   make_tiny_model --out_dir=/tmp/tiny --shape=gqa --dtype=bfloat16 --shards=3
//   make_tiny_model --out_dir=/tmp/tiny --shape=all   # /tmp/tiny/<shape>/...
//   make_tiny_model --out_dir=/tmp/l1b --shape=llama_1b --dtype=bfloat16
//
// Same flags -> byte-identical output on every machine.
#include <cstdint>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "glog/logging.h"
#include "tools/make_tiny_model/tiny_model.h"

ABSL_FLAG(std::string, out_dir, "",
          "Model directory to write (created if missing). With --shape=all, "
          "one subdirectory per shape.");
ABSL_FLAG(
    std::string, shape, "all",
    "gqa | tied | qkv_bias | head_dim | llama3_rope | qwen3 | linear_rope | "
    "yarn_rope | phi3 | gemma2 | mistral_window | gemma3 | gemma3_multimodal | "
    "phi4_mini | all (the test "
    "shapes), or a benchmark shape: small | llama_1b (Llama-3.2-1B "
    "dimensions, random weights, 2.5 GB with --dtype=bfloat16) | "
    "llama_0p5b (Qwen2.5-0.5B dimensions as a Llama, 1 GB), or the "
    "GPU tests' head_dim_64.");
ABSL_FLAG(uint64_t, seed, 0, "Weight generator seed.");
ABSL_FLAG(std::string, dtype, "float32",
          "Storage dtype: float32 | bfloat16 | float16.");
ABSL_FLAG(int, shards, 1,
          "Number of safetensors shards; > 1 also writes "
          "model.safetensors.index.json.");

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Writes deterministic tiny Llama-family checkpoints in Hugging Face "
      "format.");
  absl::ParseCommandLine(argc, argv);
  google::InitGoogleLogging(argv[0]);
  FLAGS_logtostderr = true;

  const std::string out_dir = absl::GetFlag(FLAGS_out_dir);
  if (out_dir.empty()) {
    LOG(ERROR) << "--out_dir is required";
    return 2;
  }
  auto dtype = pdworker::ParseTorchDType(absl::GetFlag(FLAGS_dtype));
  if (!dtype.ok()) {
    LOG(ERROR) << "--dtype: " << dtype.status().message();
    return 2;
  }
  const std::string shape_flag = absl::GetFlag(FLAGS_shape);
  std::vector<pdworker::TinyShape> shapes;
  if (shape_flag == "all") {
    shapes = pdworker::AllTinyShapes();
  } else {
    auto shape = pdworker::ParseTinyShape(shape_flag);
    if (!shape.ok()) {
      LOG(ERROR) << "--shape: " << shape.status().message();
      return 2;
    }
    shapes.push_back(*shape);
  }

  for (const pdworker::TinyShape shape : shapes) {
    pdworker::TinyModelOptions options;
    options.shape = shape;
    options.seed = absl::GetFlag(FLAGS_seed);
    options.dtype = *dtype;
    options.num_shards = absl::GetFlag(FLAGS_shards);
    const std::string dir =
        shape_flag == "all"
            ? absl::StrCat(out_dir, "/", pdworker::TinyShapeName(shape))
            : out_dir;
    if (absl::Status status = pdworker::WriteTinyModel(options, dir);
        !status.ok()) {
      LOG(ERROR) << status;
      return 1;
    }
    LOG(INFO) << "wrote " << pdworker::TinyShapeName(shape) << " ("
              << pdworker::DTypeName(options.dtype) << ", "
              << options.num_shards << " shard(s)) to " << dir;
  }
  return 0;
}
