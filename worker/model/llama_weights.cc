#include "worker/model/llama_weights.h"

#include <cstdint>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/kernels/kernel_checks.h"
#include "worker/runtime/stream_fence.h"

namespace pdworker {
namespace {

constexpr size_t kAlignment = 256;

size_t Aligned(size_t bytes) {
  return (bytes + kAlignment - 1) / kAlignment * kAlignment;
}

// Host element type of each device dtype: fp32 values, or bf16 bits.
template <typename T>
absl::StatusOr<std::vector<T>> GetTensor(const Checkpoint& checkpoint,
                                         const std::string& name,
                                         const std::vector<int64_t>& shape);
template <>
absl::StatusOr<std::vector<float>> GetTensor<float>(
    const Checkpoint& checkpoint, const std::string& name,
    const std::vector<int64_t>& shape) {
  return checkpoint.GetFloat32(name, shape);
}
template <>
absl::StatusOr<std::vector<uint16_t>> GetTensor<uint16_t>(
    const Checkpoint& checkpoint, const std::string& name,
    const std::vector<int64_t>& shape) {
  return checkpoint.GetBFloat16(name, shape);
}

// Uploads host tensors (concatenated in order) into one new arena buffer.
template <typename T>
class Uploader {
 public:
  Uploader(Arena& arena, Stream& stream) : arena_(arena), stream_(stream) {}

  absl::StatusOr<DeviceBuffer> Upload(
      const std::vector<const std::vector<T>*>& parts,
      absl::string_view label) {
    size_t elements = 0;
    for (const auto* p : parts) elements += p->size();
    absl::StatusOr<DeviceBuffer> buf =
        arena_.Allocate(elements * sizeof(T), label);
    if (!buf.ok()) return buf.status();
    size_t offset = 0;
    for (const auto* p : parts) {
      const size_t bytes = p->size() * sizeof(T);
      if (bytes == 0) continue;
      absl::Status s =
          stream_.CopyToDevice(buf->Slice(offset, bytes), p->data(), bytes);
      if (!s.ok()) return s;
      offset += bytes;
    }
    return *buf;
  }

 private:
  Arena& arena_;
  Stream& stream_;
};

// Loads, fuses and uploads every tensor with host element type T (float for
// fp32, uint16_t bf16 bits for bf16) into `w`, whose arena is allocated.
template <typename T>
absl::Status LoadInto(const ModelConfig& c, const Checkpoint& checkpoint,
                      Stream& stream, LlamaWeights& w) {
  Uploader<T> up(*w.arena, stream);
  const int64_t h = c.hidden_size, inter = c.intermediate_size;
  // Loads one tensor (shape-checked) into host memory.
  auto get = [&](const std::string& name, const std::vector<int64_t>& shape,
                 std::vector<T>* out) -> absl::Status {
    absl::StatusOr<std::vector<T>> t = GetTensor<T>(checkpoint, name, shape);
    if (!t.ok()) return t.status();
    *out = std::move(*t);
    return absl::OkStatus();
  };
  std::vector<T> embed;
  PDW_RETURN_IF_ERROR(
      get("model.embed_tokens.weight", {c.vocab_size, h}, &embed));
  PDW_ASSIGN_OR_RETURN(w.embed_tokens, up.Upload({&embed}, "embed_tokens"));
  // The table can be a few hundred MB; do not keep a host copy around.
  std::vector<T>().swap(embed);

  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const std::string p = absl::StrCat("model.layers.", i, ".");
    LlamaLayerWeights L;
    std::vector<T> a, b, d;
    PDW_RETURN_IF_ERROR(get(p + "input_layernorm.weight", {h}, &a));
    PDW_ASSIGN_OR_RETURN(L.input_norm, up.Upload({&a}, "input_norm"));
    PDW_RETURN_IF_ERROR(
        get(p + "self_attn.q_proj.weight", {c.q_size(), h}, &a));
    PDW_RETURN_IF_ERROR(
        get(p + "self_attn.k_proj.weight", {c.kv_size(), h}, &b));
    PDW_RETURN_IF_ERROR(
        get(p + "self_attn.v_proj.weight", {c.kv_size(), h}, &d));
    PDW_ASSIGN_OR_RETURN(L.qkv, up.Upload({&a, &b, &d}, "qkv"));
    if (c.qkv_bias) {
      PDW_RETURN_IF_ERROR(get(p + "self_attn.q_proj.bias", {c.q_size()}, &a));
      PDW_RETURN_IF_ERROR(get(p + "self_attn.k_proj.bias", {c.kv_size()}, &b));
      PDW_RETURN_IF_ERROR(get(p + "self_attn.v_proj.bias", {c.kv_size()}, &d));
      PDW_ASSIGN_OR_RETURN(L.qkv_bias, up.Upload({&a, &b, &d}, "qkv_bias"));
    }
    PDW_RETURN_IF_ERROR(
        get(p + "self_attn.o_proj.weight", {h, c.q_size()}, &a));
    PDW_ASSIGN_OR_RETURN(L.o_proj, up.Upload({&a}, "o_proj"));
    if (c.o_proj_bias) {
      PDW_RETURN_IF_ERROR(get(p + "self_attn.o_proj.bias", {h}, &a));
      PDW_ASSIGN_OR_RETURN(L.o_bias, up.Upload({&a}, "o_bias"));
    }
    PDW_RETURN_IF_ERROR(get(p + "post_attention_layernorm.weight", {h}, &a));
    PDW_ASSIGN_OR_RETURN(L.post_norm, up.Upload({&a}, "post_norm"));
    PDW_RETURN_IF_ERROR(get(p + "mlp.gate_proj.weight", {inter, h}, &a));
    PDW_RETURN_IF_ERROR(get(p + "mlp.up_proj.weight", {inter, h}, &b));
    PDW_ASSIGN_OR_RETURN(L.gate_up, up.Upload({&a, &b}, "gate_up"));
    PDW_RETURN_IF_ERROR(get(p + "mlp.down_proj.weight", {h, inter}, &a));
    PDW_ASSIGN_OR_RETURN(L.down, up.Upload({&a}, "down"));
    w.layers.push_back(L);
  }
  std::vector<T> norm;
  PDW_RETURN_IF_ERROR(get("model.norm.weight", {h}, &norm));
  PDW_ASSIGN_OR_RETURN(w.final_norm, up.Upload({&norm}, "final_norm"));
  if (c.tie_word_embeddings) {
    w.lm_head = w.embed_tokens;
  } else {
    std::vector<T> head;
    PDW_RETURN_IF_ERROR(get("lm_head.weight", {c.vocab_size, h}, &head));
    PDW_ASSIGN_OR_RETURN(w.lm_head, up.Upload({&head}, "lm_head"));
  }
  // CopyToDevice from pageable memory returns once the source is staged,
  // so the host vectors may go; the arena is written until the copies ran.
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
  if (c.qkv_bias) per_layer += bytes(qkv);
  if (c.o_proj_bias) per_layer += bytes(h);
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
  if (c.qkv_bias) per_layer += qkv;
  if (c.o_proj_bias) per_layer += h;
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
  // Destroyed before `w`: an error below returns only once the copies
  // queued into the arena have run, so none writes it after it is freed.
  StreamFence uploaded(stream);
  switch (w.dtype) {
    case DType::kFloat32:
      PDW_RETURN_IF_ERROR(LoadInto<float>(c, checkpoint, stream, w));
      break;
    case DType::kBFloat16:
      PDW_RETURN_IF_ERROR(LoadInto<uint16_t>(c, checkpoint, stream, w));
      break;
    case DType::kFloat16:
      return absl::InternalError("LoadLlamaWeights: no fp16 kernels");
  }
  PDW_RETURN_IF_ERROR(uploaded.Wait());
  return w;
}

}  // namespace pdworker
