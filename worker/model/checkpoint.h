// A Hugging Face model directory's weights: either one model.safetensors or
// shards listed by model.safetensors.index.json ({"weight_map": {tensor name:
// shard file name}}). Tensor names are HF's, e.g.
//   model.embed_tokens.weight                      [vocab, hidden]
//   model.layers.{i}.self_attn.q_proj.weight       [heads * head_dim, hidden]
//   model.layers.{i}.mlp.down_proj.weight          [hidden, intermediate]
//   lm_head.weight                                 [vocab, hidden] (untied)
// nn.Linear weights are [out_features, in_features], row-major.
#ifndef PDWORKER_WORKER_MODEL_CHECKPOINT_H_
#define PDWORKER_WORKER_MODEL_CHECKPOINT_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "worker/model/safetensors.h"

namespace pdworker {

class Checkpoint {
 public:
  // Opens <model_dir>/model.safetensors when it exists (preferred, as
  // transformers does), otherwise <model_dir>/model.safetensors.index.json
  // and every shard it names. Errors: NotFound when neither exists or a shard
  // is missing; InvalidArgument for a malformed index, a shard name that is
  // not a plain file name, or a tensor the index places in a shard that does
  // not contain it; any SafetensorsFile::Open error of a shard.
  static absl::StatusOr<std::unique_ptr<Checkpoint>> Open(
      const std::string& model_dir);

  Checkpoint(const Checkpoint&) = delete;
  Checkpoint& operator=(const Checkpoint&) = delete;

  const std::string& model_dir() const { return model_dir_; }
  bool Has(const std::string& name) const;
  // nullptr when absent. The info's bytes live as long as the Checkpoint.
  const TensorInfo* Find(const std::string& name) const;
  // Every tensor name, sorted.
  std::vector<std::string> TensorNames() const;
  // For errors: the file that holds `name`, or that should (the single
  // file, or the index of a sharded checkpoint).
  std::string FileOf(const std::string& name) const;
  // Number of safetensors files backing the checkpoint (1 unless sharded).
  size_t num_files() const { return files_.size(); }

  // The tensor, after checking its shape equals `expected_shape`: NotFound
  // naming the file (or index) for a missing tensor, InvalidArgument naming
  // file, tensor and both shapes on a mismatch.
  absl::StatusOr<const TensorInfo*> FindWithShape(
      const std::string& name,
      const std::vector<int64_t>& expected_shape) const;

  // The tensor converted to float32 (row-major), after checking its shape
  // equals `expected_shape`: NotFound for a missing tensor, InvalidArgument
  // naming both shapes on a mismatch.
  absl::StatusOr<std::vector<float>> GetFloat32(
      const std::string& name,
      const std::vector<int64_t>& expected_shape) const;

 private:
  explicit Checkpoint(std::string model_dir)
      : model_dir_(std::move(model_dir)) {}

  std::string model_dir_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  // Name -> info inside one of files_ (pointers into their maps).
  std::map<std::string, const TensorInfo*> tensors_;
};

}  // namespace pdworker

#endif  // PDWORKER_WORKER_MODEL_CHECKPOINT_H_
