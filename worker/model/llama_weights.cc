#include "worker/model/llama_weights.h"

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/kernels/kernel_checks.h"
#include "worker/model/float16.h"
#include "worker/model/weight_upload.h"
#include "worker/runtime/stream_fence.h"
#include "worker/runtime/upload_ring.h"

namespace pdworker {
namespace {

constexpr size_t kAlignment = 256;
// Pinned staging for the upload: 3 blocks, so the host converts one chunk
// while the stream copies another (the third absorbs a copy slower than its
// conversion). 2 MiB blocks stay in cache between the conversion and the
// copy: on the CPU backend the load took 1.17 s with them against 1.59 s
// with 16 MiB ones (bench/RESULTS.md, "Model load time"); a GPU's DMA of
// 2 MiB from pinned memory is not measured yet.
constexpr size_t kStagingBlockBytes = size_t{2} << 20;
constexpr int kStagingBlocks = 3;

size_t Aligned(size_t bytes) {
  return (bytes + kAlignment - 1) / kAlignment * kAlignment;
}

// Loads one buffer of the weights arena: `parts` (name, expected shape),
// checked, converted to w.dtype and uploaded back to back (the fusions:
// q|k|v rows, gate|up rows).
struct WeightsLoad {
  const Checkpoint& checkpoint;
  Stream& stream;
  UploadRing* ring;  // null on the CPU backend: the stream converts in place
  LlamaWeights& w;
  // Prepended to every name (ModelConfig::tensor_prefix).
  std::string prefix = {};
  // Every tensor name read so far, prefix included (RefuseUnusedTensors).
  std::set<std::string> used = {};

  absl::StatusOr<DeviceBuffer> Buffer(
      std::initializer_list<std::pair<std::string, std::vector<int64_t>>> parts,
      absl::string_view label) {
    std::vector<const TensorInfo*> tensors;
    size_t bytes = 0;
    for (const auto& [short_name, shape] : parts) {
      const std::string name = prefix + short_name;
      PDW_ASSIGN_OR_RETURN(const TensorInfo* t,
                           checkpoint.FindWithShape(name, shape));
      tensors.push_back(t);
      used.insert(name);
      bytes += DeviceBytesOf(*t, w.dtype);
    }
    PDW_ASSIGN_OR_RETURN(DeviceBuffer buf, w.arena->Allocate(bytes, label));
    size_t offset = 0;
    for (const TensorInfo* t : tensors) {
      const size_t size = DeviceBytesOf(*t, w.dtype);
      if (size == 0) continue;
      PDW_RETURN_IF_ERROR(
          UploadTensor(*t, w.dtype, ring, stream, buf.Slice(offset, size)));
      offset += size;
    }
    return buf;
  }

  // A norm's weight [size]: as stored, or (NormWeight::kOnePlus) 1 + w,
  // added in fp32 as transformers does, then rounded to w.dtype.
  absl::StatusOr<DeviceBuffer> Norm(const std::string& name, int64_t size,
                                    NormWeight kind, absl::string_view label) {
    if (kind == NormWeight::kPlain) return Buffer({{name, {size}}}, label);
    PDW_ASSIGN_OR_RETURN(std::vector<float> values,
                         checkpoint.GetFloat32(prefix + name, {size}));
    used.insert(prefix + name);
    for (float& v : values) v += 1.0f;
    const size_t bytes = static_cast<size_t>(size) * DTypeSize(w.dtype);
    PDW_ASSIGN_OR_RETURN(DeviceBuffer buf, w.arena->Allocate(bytes, label));
    if (w.dtype == DType::kFloat32) {
      PDW_RETURN_IF_ERROR(stream.CopyToDevice(buf, values.data(), bytes));
      return buf;
    }
    std::vector<uint16_t> bits(values.size());
    for (size_t i = 0; i < values.size(); ++i) {
      bits[i] = FloatToBFloat16Bits(values[i]);
    }
    PDW_RETURN_IF_ERROR(stream.CopyToDevice(buf, bits.data(), bytes));
    return buf;
  }
};

absl::Status LoadInto(const ModelConfig& c, WeightsLoad& load) {
  LlamaWeights& w = load.w;
  const int64_t h = c.hidden_size, inter = c.intermediate_size;
  PDW_ASSIGN_OR_RETURN(
      w.embed_tokens,
      load.Buffer({{"model.embed_tokens.weight", {c.vocab_size, h}}},
                  "embed_tokens"));
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const std::string p = absl::StrCat("model.layers.", i, ".");
    LlamaLayerWeights L;
    const NormWeight nw = c.layer.norm_weight;
    const bool sandwich = c.layer.norm_placement == NormPlacement::kSandwich;
    PDW_ASSIGN_OR_RETURN(L.input_norm, load.Norm(p + "input_layernorm.weight",
                                                 h, nw, "input_norm"));
    if (c.layer.qkv_tensors == ProjectionTensors::kFused) {
      PDW_ASSIGN_OR_RETURN(L.qkv,
                           load.Buffer({{p + "self_attn.qkv_proj.weight",
                                         {c.q_size() + 2 * c.kv_size(), h}}},
                                       "qkv"));
    } else {
      PDW_ASSIGN_OR_RETURN(
          L.qkv,
          load.Buffer({{p + "self_attn.q_proj.weight", {c.q_size(), h}},
                       {p + "self_attn.k_proj.weight", {c.kv_size(), h}},
                       {p + "self_attn.v_proj.weight", {c.kv_size(), h}}},
                      "qkv"));
    }
    if (c.layer.qkv_bias) {
      PDW_ASSIGN_OR_RETURN(
          L.qkv_bias,
          load.Buffer({{p + "self_attn.q_proj.bias", {c.q_size()}},
                       {p + "self_attn.k_proj.bias", {c.kv_size()}},
                       {p + "self_attn.v_proj.bias", {c.kv_size()}}},
                      "qkv_bias"));
    }
    if (c.layer.qk_norm == QkNorm::kPerHeadRms) {
      // Gemma 3's q/k norms are (1 + w) like its other norms.
      PDW_ASSIGN_OR_RETURN(L.q_norm, load.Norm(p + "self_attn.q_norm.weight",
                                               c.head_dim, nw, "q_norm"));
      PDW_ASSIGN_OR_RETURN(L.k_norm, load.Norm(p + "self_attn.k_norm.weight",
                                               c.head_dim, nw, "k_norm"));
    }
    PDW_ASSIGN_OR_RETURN(
        L.o_proj,
        load.Buffer({{p + "self_attn.o_proj.weight", {h, c.q_size()}}},
                    "o_proj"));
    if (c.layer.o_proj_bias) {
      PDW_ASSIGN_OR_RETURN(
          L.o_bias,
          load.Buffer({{p + "self_attn.o_proj.bias", {h}}}, "o_bias"));
    }
    if (sandwich) {
      PDW_ASSIGN_OR_RETURN(L.post_attention_output_norm,
                           load.Norm(p + "post_attention_layernorm.weight", h,
                                     nw, "post_attention_output_norm"));
      PDW_ASSIGN_OR_RETURN(
          L.post_norm, load.Norm(p + "pre_feedforward_layernorm.weight", h, nw,
                                 "post_norm"));
      PDW_ASSIGN_OR_RETURN(L.post_mlp_output_norm,
                           load.Norm(p + "post_feedforward_layernorm.weight", h,
                                     nw, "post_mlp_output_norm"));
    } else {
      PDW_ASSIGN_OR_RETURN(
          L.post_norm,
          load.Norm(p + "post_attention_layernorm.weight", h, nw, "post_norm"));
    }
    if (c.layer.gate_up_tensors == ProjectionTensors::kFused) {
      PDW_ASSIGN_OR_RETURN(
          L.gate_up,
          load.Buffer({{p + "mlp.gate_up_proj.weight", {2 * inter, h}}},
                      "gate_up"));
    } else {
      PDW_ASSIGN_OR_RETURN(
          L.gate_up, load.Buffer({{p + "mlp.gate_proj.weight", {inter, h}},
                                  {p + "mlp.up_proj.weight", {inter, h}}},
                                 "gate_up"));
    }
    PDW_ASSIGN_OR_RETURN(
        L.down,
        load.Buffer({{p + "mlp.down_proj.weight", {h, inter}}}, "down"));
    w.layers.push_back(L);
  }
  PDW_ASSIGN_OR_RETURN(
      w.final_norm,
      load.Norm("model.norm.weight", h, c.layer.norm_weight, "final_norm"));
  if (c.tie_word_embeddings) {
    w.lm_head = w.embed_tokens;
  } else {
    PDW_ASSIGN_OR_RETURN(
        w.lm_head,
        load.Buffer({{"lm_head.weight", {c.vocab_size, h}}}, "lm_head"));
  }
  return absl::OkStatus();
}

// A tensor the layer description does not read means the checkpoint is
// something else (another family's layer, MoE experts, a vision tower,
// quantization scales): refused naming it, never ignored. Two are skipped
// as vLLM skips them: lm_head.weight of a tied checkpoint (the embedding
// serves as the head; some exports write both) and rotary_emb.inv_freq
// buffers (RoPE tables old exports saved; computed here from the config).
absl::Status RefuseUnusedTensors(const ModelConfig& c,
                                 const Checkpoint& checkpoint,
                                 const std::set<std::string>& used) {
  for (const std::string& name : checkpoint.TensorNames()) {
    if (used.count(name) > 0) continue;
    if (c.tie_word_embeddings && name == c.tensor_prefix + "lm_head.weight") {
      continue;
    }
    if (absl::EndsWith(name, "rotary_emb.inv_freq")) continue;
    // A multimodal checkpoint's other towers: served by nobody here, on
    // purpose (the text model is what pdworker serves).
    if (std::any_of(c.ignored_tensor_prefixes.begin(),
                    c.ignored_tensor_prefixes.end(),
                    [&name](const std::string& prefix) {
                      return absl::StartsWith(name, prefix);
                    })) {
      continue;
    }
    return absl::InvalidArgumentError(absl::StrCat(
        checkpoint.FileOf(name), ": tensor \"", name, "\" is not used by ",
        ArchitectureName(c.architecture),
        " as config.json describes it; pdworker refuses a checkpoint with "
        "weights it would ignore"));
  }
  return absl::OkStatus();
}

}  // namespace

size_t LlamaWeightBytes(const ModelConfig& c, DType dtype) {
  const size_t element = DTypeSize(dtype);
  auto bytes = [element](int64_t elements) {
    return Aligned(static_cast<size_t>(elements) * element);
  };
  const int64_t h = c.hidden_size, qkv = c.q_size() + 2 * c.kv_size();
  size_t per_layer = bytes(h) * 2 + bytes(qkv * h) + bytes(h * c.q_size()) +
                     bytes(2 * c.intermediate_size * h) +
                     bytes(h * c.intermediate_size);
  if (c.layer.qkv_bias) per_layer += bytes(qkv);
  if (c.layer.o_proj_bias) per_layer += bytes(h);
  if (c.layer.norm_placement == NormPlacement::kSandwich) {
    per_layer += 2 * bytes(h);
  }
  if (c.layer.qk_norm == QkNorm::kPerHeadRms)
    per_layer += 2 * bytes(c.head_dim);
  size_t total =
      per_layer * c.num_hidden_layers + bytes(c.vocab_size * h) + bytes(h);
  if (!c.tie_word_embeddings) total += bytes(c.vocab_size * h);
  return total;
}

size_t LlamaDecodeWeightBytes(const ModelConfig& c, DType dtype) {
  const size_t element = DTypeSize(dtype);
  const int64_t h = c.hidden_size, qkv = c.q_size() + 2 * c.kv_size();
  int64_t per_layer =
      2 * h + qkv * h + h * c.q_size() + 3 * c.intermediate_size * h;
  if (c.layer.qkv_bias) per_layer += qkv;
  if (c.layer.o_proj_bias) per_layer += h;
  if (c.layer.norm_placement == NormPlacement::kSandwich) per_layer += 2 * h;
  if (c.layer.qk_norm == QkNorm::kPerHeadRms) per_layer += 2 * c.head_dim;
  // Layers, the final norm, the LM head matrix and one embedding row.
  const int64_t elements =
      per_layer * c.num_hidden_layers + h + c.vocab_size * h + h;
  return static_cast<size_t>(elements) * element;
}

absl::StatusOr<LlamaWeights> LoadLlamaWeights(const ModelConfig& c,
                                              const Checkpoint& checkpoint,
                                              Device& device, Stream& stream) {
  LlamaWeights w;
  w.dtype = kernels::ModelDTypeFor(device.kind());
  absl::StatusOr<std::unique_ptr<Arena>> arena = Arena::Create(
      device, {LlamaWeightBytes(c, w.dtype), kAlignment, "weights"});
  if (!arena.ok()) return arena.status();
  w.arena = std::move(*arena);
  if (w.dtype != DType::kFloat32 && w.dtype != DType::kBFloat16) {
    return absl::InternalError(
        absl::StrCat("LoadLlamaWeights: no ", DTypeName(w.dtype), " kernels"));
  }
  // The CPU device's memory is the host's: no staging ring there.
  std::unique_ptr<UploadRing> ring;
  if (device.kind() != DeviceKind::kCpu) {
    PDW_ASSIGN_OR_RETURN(
        ring, UploadRing::Create(device, kStagingBlockBytes, kStagingBlocks));
  }
  // Destroyed before `ring` and `w`: an error below returns only once the
  // copies queued out of the ring's blocks (or, on the CPU backend, out of
  // the caller's mapping) into the arena have run, so none reads freed
  // staging or writes a freed arena.
  StreamFence uploaded(stream);
  WeightsLoad load{checkpoint, stream, ring.get(), w, c.tensor_prefix};
  PDW_RETURN_IF_ERROR(LoadInto(c, load));
  PDW_RETURN_IF_ERROR(RefuseUnusedTensors(c, checkpoint, load.used));
  PDW_RETURN_IF_ERROR(uploaded.Wait());
  return w;
}

}  // namespace pdworker
