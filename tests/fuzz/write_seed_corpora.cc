// Writes the fuzz targets' seed corpora (tests/fuzz/corpus/<target>/): one
// well-formed input per case a target should reach, so that libFuzzer
// mutates from inputs that pass the parsers instead of rediscovering them.
// The files are checked in; run again after a format changes:
//
//   bazel run //tests/fuzz:write_seed_corpora -- $PWD/tests/fuzz/corpus
#include <sys/stat.h>

#include <cstdint>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "glog/logging.h"
#include "google/protobuf/message.h"
#include "google/protobuf/text_format.h"
#include "proto/smg_common.pb.h"
#include "proto/vllm_engine.pb.h"
#include "proto/worker.pb.h"
#include "worker/model/safetensors_writer.h"
#include "worker/transfer/kv_transfer_params.h"

namespace pdworker {
namespace {

std::string root;

void Write(const std::string& target, const std::string& name,
           const std::string& bytes) {
  const std::string dir = root + "/" + target;
  mkdir(dir.c_str(), 0755);
  std::ofstream(dir + "/" + name, std::ios::binary) << bytes;
}

template <typename M>
std::string Proto(const std::string& text) {
  M message;
  CHECK(google::protobuf::TextFormat::ParseFromString(text, &message)) << text;
  std::string bytes;
  CHECK(message.SerializeToString(&bytes));
  return bytes;
}

std::string Byte(int b) { return std::string(1, static_cast<char>(b)); }

void WriteSafetensors() {
  const std::vector<float> values = {1.0f, -2.5f, 0.0f, 3.25f, 7.0f, -1.0f};
  const std::string f32 = EncodeFromFloat32(DType::kFloat32, values);
  const std::string bf16 = EncodeFromFloat32(DType::kBFloat16, values);
  const std::string f16 = EncodeFromFloat32(DType::kFloat16, values);
  const std::string header = absl::StrCat(
      R"({"__metadata__":{"format":"pt"},)",
      R"("a":{"dtype":"F32","shape":[2,3],"data_offsets":[0,)", f32.size(),
      R"(]},"b":{"dtype":"BF16","shape":[6],"data_offsets":[)", f32.size(), ",",
      f32.size() + bf16.size(),
      R"(]},"c":{"dtype":"F16","shape":[3,2],"data_offsets":[)",
      f32.size() + bf16.size(), ",", f32.size() + bf16.size() + f16.size(),
      R"(]},"s":{"dtype":"F32","shape":[],"data_offsets":[)",
      f32.size() + bf16.size() + f16.size(), ",",
      f32.size() + bf16.size() + f16.size() + 4, "]}}");
  Write("safetensors_fuzz", "three_dtypes_and_scalar",
        SerializeSafetensors(header, f32 + bf16 + f16 + f32.substr(0, 4)));
  Write("safetensors_fuzz", "empty_tensor",
        SerializeSafetensors(
            R"({"e":{"dtype":"F32","shape":[0,4],"data_offsets":[0,0]}})", ""));
  Write("safetensors_fuzz", "no_tensors", SerializeSafetensors("{}", ""));
}

void WriteModelConfig() {
  const std::string llama = R"({
  "architectures": ["LlamaForCausalLM"], "model_type": "llama",
  "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
  "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
  "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "vocab_size": 256,
  "max_position_embeddings": 512, "tie_word_embeddings": true,
  "attention_bias": false, "torch_dtype": "bfloat16",
  "bos_token_id": 1, "eos_token_id": [2, 3], "pad_token_id": null,
  "rope_scaling": {"rope_type": "llama3", "factor": 32.0,
    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192}})";
  const std::string qwen = R"({
  "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
  "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
  "num_attention_heads": 8, "num_key_value_heads": 1, "rms_norm_eps": 1e-06,
  "rope_theta": 1000000.0, "vocab_size": 300, "max_position_embeddings": 1024,
  "tie_word_embeddings": true, "torch_dtype": "bfloat16", "eos_token_id": 5,
  "use_sliding_window": false, "sliding_window": 1024})";
  const std::string mistral = R"({
  "architectures": ["MistralForCausalLM"], "model_type": "mistral",
  "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
  "num_attention_heads": 4, "num_key_value_heads": 4, "rms_norm_eps": 1e-05,
  "vocab_size": 100, "max_position_embeddings": 256, "sliding_window": 128,
  "dtype": "float16"})";
  const std::string qwen3 = R"({
  "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
  "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
  "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
  "rms_norm_eps": 1e-06, "rope_theta": 1000000, "vocab_size": 300,
  "max_position_embeddings": 1024, "attention_bias": false,
  "use_sliding_window": false, "sliding_window": null,
  "max_window_layers": 2, "quantization_config": null})";
  Write("model_config_fuzz", "llama3", Byte(0) + llama);
  Write("model_config_fuzz", "qwen3", Byte(0) + qwen3);
  // The families with their own keys: Gemma 2's caps and defaults, Gemma 3's
  // nested multimodal config and per-layer-type RoPE, Phi-3's window,
  // Qwen2.5's YaRN.
  Write("model_config_fuzz", "gemma2", Byte(0) + R"({
  "architectures": ["Gemma2ForCausalLM"], "hidden_size": 64,
  "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
  "num_key_value_heads": 2, "head_dim": 32, "rms_norm_eps": 1e-06,
  "vocab_size": 300, "max_position_embeddings": 1024,
  "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 24,
  "attn_logit_softcapping": 50.0, "final_logit_softcapping": null,
  "sliding_window": 16})");
  Write("model_config_fuzz", "gemma3_multimodal", Byte(0) + R"({
  "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
  "text_config": {"hidden_size": 64, "intermediate_size": 96,
    "num_hidden_layers": 3, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 300,
    "layer_types": ["sliding_attention", "full_attention",
                    "sliding_attention"],
    "rope_parameters": {"full_attention": {"rope_type": "linear",
      "factor": 8.0, "rope_theta": 1000000.0}, "sliding_attention": {
      "rope_type": "default", "rope_theta": 10000.0}}},
  "eos_token_id": [1, 106]})");
  Write("model_config_fuzz", "phi3_yarn", Byte(0) + R"({
  "architectures": ["Phi3ForCausalLM"], "hidden_size": 64,
  "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
  "num_key_value_heads": 2, "rms_norm_eps": 1e-05, "vocab_size": 300,
  "max_position_embeddings": 4096, "sliding_window": 2047,
  "rope_scaling": {"type": "yarn", "factor": 4.0,
    "original_max_position_embeddings": 1024, "beta_fast": 16}})");
  Write("model_config_fuzz", "qwen2", Byte(0) + qwen);
  Write("model_config_fuzz", "mistral", Byte(0) + mistral);
  Write("model_config_fuzz", "generation_list",
        Byte(1) + R"({"bos_token_id": 1, "eos_token_id": [128001, 128009],
                      "do_sample": true, "temperature": 0.6, "top_p": 0.9})");
  Write("model_config_fuzz", "generation_id",
        Byte(1) + R"({"eos_token_id": 2})");
  Write("model_config_fuzz", "generation_null",
        Byte(1) + R"({"eos_token_id": null})");
}

void WriteCompilationConfig() {
  const char* configs[] = {
      R"({"cudagraph_mode":"FULL_AND_PIECEWISE","cudagraph_capture_sizes":[1,2,4,8,16]})",
      R"({"cudagraph_mode":"FULL_DECODE_ONLY","max_cudagraph_capture_size":64})",
      R"({"cudagraph_mode":"PIECEWISE"})",
      R"({"cudagraph_mode":"NONE"})",
      R"({"cudagraph_mode":"FULL"})",
      R"({"cudagraph_mode":"FULL_AND_PIECEWISE","cudagraph_capture_sizes":[1,2,4],"max_cudagraph_capture_size":4})",
      "",
  };
  int i = 0;
  for (const char* c : configs) {
    Write("compilation_config_fuzz", absl::StrCat("config_", i++), c);
  }
}

// A handle as the tiny models' workers issue it (kv_handle_fuzz checks
// against this fingerprint and layout).
constexpr char kHandle[] = R"(
  source_address: "10.0.0.7:50051" lease_id: "0123456789abcdef0123456789abcdef"
  sequence_id: "req-1" num_tokens: 6 lease_expiry_unix_micros: 1790000000000000
  model_fingerprint: "a1b2c3d4e5f60718-0123456789abcdef"
  layout { num_layers: 2 num_kv_heads: 2 head_dim: 8 dtype: "float32" }
  transports: "cuda_ipc" transports: "grpc" source_host_id: "boot-1"
  version: 2 prompt_token_ids: [5, 6, 7, 8, 9, 10]
  source_epoch: "fedcba9876543210fedcba9876543210")";

void WriteKvHandle() {
  const std::string handle = Proto<v1::KvHandle>(kHandle);
  Write("kv_handle_fuzz", "binary", Byte(0) + handle);
  KvTransferParams params;
  CHECK(params.handle.ParseFromString(handle));
  params.first_token.token_id = 11;
  params.first_token.logprob = -0.25f;
  params.first_token.top_logprobs = {{11, -0.25f}, {3, -1.5f}};
  Write("kv_handle_fuzz", "json", Byte(1) + ToKvTransferParamsJson(params));
  params.first_token.top_logprobs.clear();
  Write("kv_handle_fuzz", "json_no_top",
        Byte(1) + ToKvTransferParamsJson(params));
}

void WriteCudaIpcExport() {
  // 2 layers of 16 blocks of 4 tokens x 64 bytes (4 KiB per layer part),
  // laid out K0 V0 K1 V1; a lease of 6 tokens in blocks 9 and 2.
  Write("cuda_ipc_export_fuzz", "six_tokens",
        Byte(5) + Proto<v1::CudaIpcExport>(R"(
          mem_handle: "0123456789012345678901234567890123456789012345678901234567890123"
          allocation_bytes: 16384 key_offsets: [0, 8192]
          value_offsets: [4096, 12288] cache_bytes_per_layer: 4096
          block_size: 4 blocks: [9, 2] num_tokens: 6)"));
  Write("cuda_ipc_export_fuzz", "one_token_block_16",
        Byte(0) + Proto<v1::CudaIpcExport>(R"(
          allocation_bytes: 65536 key_offsets: [0, 32768]
          value_offsets: [16384, 49152] cache_bytes_per_layer: 16384
          block_size: 16 blocks: [15] num_tokens: 1)"));
}

// kv_stream_fuzz's input: [num_tokens - 1][first_token][block order]
// [status code][message length][message], then [length: 2 bytes][message].
void WriteKvStream() {
  auto stream = [](int num_tokens, int first_token, int tokens_per_chunk,
                   int code, const std::string& message) {
    std::string out = Byte(num_tokens - 1) + Byte(first_token) + Byte(3) +
                      Byte(code) + Byte(static_cast<int>(message.size())) +
                      message;
    for (int layer = 0; layer < 2; ++layer) {
      for (int part : {1, 2}) {
        for (int t = first_token; t < num_tokens; t += tokens_per_chunk) {
          v1::KvChunk chunk;
          chunk.set_layer(layer);
          chunk.set_part(static_cast<v1::KvChunk::Part>(part));
          chunk.set_first_token(t);
          const int n = std::min(tokens_per_chunk, num_tokens - t);
          chunk.set_num_tokens(n);
          chunk.set_data(
              std::string(n * 64, static_cast<char>(layer * 2 + part)));
          std::string bytes;
          CHECK(chunk.SerializeToString(&bytes));
          out += Byte(bytes.size() & 0xff) + Byte(bytes.size() >> 8) + bytes;
        }
      }
    }
    return out;
  };
  Write("kv_stream_fuzz", "whole_6_tokens", stream(6, 0, 4, 0, ""));
  Write("kv_stream_fuzz", "from_token_5_of_9", stream(9, 5, 4, 0, ""));
  Write("kv_stream_fuzz", "one_token_chunks", stream(5, 0, 1, 0, ""));
  Write("kv_stream_fuzz", "cut_off",
        stream(8, 0, 4, 14, "Socket closed").substr(0, 200));
  Write("kv_stream_fuzz", "lease_expired",
        stream(4, 0, 4, 5, "lease 0123 expired").substr(0, 25));
  // Token spans: every layer's K and V of a run of tokens per chunk.
  auto spans = [](int num_tokens, int first_token, int tokens_per_chunk) {
    std::string out = Byte(num_tokens - 1) + Byte(first_token) + Byte(3) +
                      Byte(0x80) + Byte(0);
    for (int t = first_token; t < num_tokens; t += tokens_per_chunk) {
      v1::KvChunk chunk;
      chunk.set_chunk_layout(v1::KV_CHUNK_LAYOUT_TOKEN_SPAN);
      chunk.set_first_token(t);
      const int n = std::min(tokens_per_chunk, num_tokens - t);
      chunk.set_num_tokens(n);
      chunk.set_data(std::string(n * 64 * 4, static_cast<char>(t)));
      std::string bytes;
      CHECK(chunk.SerializeToString(&bytes));
      out += Byte(bytes.size() & 0xff) + Byte(bytes.size() >> 8) + bytes;
    }
    return out;
  };
  Write("kv_stream_fuzz", "spans_whole_7_tokens", spans(7, 0, 3));
  Write("kv_stream_fuzz", "spans_from_token_5_of_9", spans(9, 5, 2));
  Write("kv_stream_fuzz", "spans_larger_than_the_staging", spans(12, 0, 8));
  // A puller that asked for spans from a source that sends layer runs.
  std::string old_source = stream(6, 0, 4, 0, "");
  old_source[3] = static_cast<char>(0x80);
  Write("kv_stream_fuzz", "spans_asked_layer_runs_sent", old_source);
}

// The model fingerprint of rpc_request_fuzz's worker (the gqa tiny model,
// seed 7), so that handles and pulls get past the compatibility checks.
constexpr char kTinyFingerprint[] =
    "eb1b2d89fa194917079d995c1aa8790393a31b8e442dab2db9198f045ccd70a5";

void WriteRpcRequests() {
  auto seed = [](const std::string& name, int method, const std::string& body) {
    Write("rpc_request_fuzz", name, Byte(method) + body);
  };
  seed("forward_start", 0, Proto<v1::ForwardRequest>(R"(
    sequences { sequence_id: "a" token_ids: [1, 2, 3, 4, 5] start: true
                sampling { temperature: 0 } }
    sequences { sequence_id: "b" token_ids: [7] start: true release_after_step: true
                sampling { temperature: 0.8 top_k: 5 top_p: 0.9 seed: 3 } })"));
  seed("forward_hold", 0, Proto<v1::ForwardRequest>(R"(
    sequences { sequence_id: "h" token_ids: [9, 8, 7, 6, 5, 4] start: true
                hold_for_handoff: true })"));
  seed("forward_unknown", 0, Proto<v1::ForwardRequest>(R"(
    sequences { sequence_id: "x" token_ids: [1] })"));
  seed("release", 1, Proto<v1::ReleaseRequest>(R"(sequence_ids: ["a", "b"])"));
  seed("get_status", 2, "");
  seed("get_graph_stats", 3, "");
  seed(
      "import_kv", 4,
      Proto<v1::ImportKvRequest>(absl::StrCat(
          R"(sequence_id: "d" handle {)",
          R"(source_address: "127.0.0.1:1" lease_id: "0123456789abcdef0123456789abcdef"
              num_tokens: 6 layout { num_layers: 2 num_kv_heads: 2 head_dim: 8
              dtype: "float32" } transports: "grpc" version: 2
              prompt_token_ids: [5, 6, 7, 8, 9, 10] model_fingerprint: ")",
          kTinyFingerprint, "\" }")));
  seed("flush_cache", 5, "");
  seed("pull_kv", 6,
       Proto<v1::PullKvRequest>(absl::StrCat(
           R"(lease_id: "0123456789abcdef0123456789abcdef" transport: "grpc"
              num_tokens: 6 layout { num_layers: 2 num_kv_heads: 2 head_dim: 8
              dtype: "float32" } model_fingerprint: ")",
           kTinyFingerprint, "\"")));
  seed("release_kv", 7, Proto<v1::ReleaseKvRequest>(R"(lease_id: "0123")"));
  seed("renew_kv", 8, Proto<v1::RenewKvRequest>(R"(lease_id: "0123")"));
  seed("generate", 9, Proto<vllm::grpc::engine::GenerateRequest>(R"(
    request_id: "g1" tokenized { input_ids: [1, 2, 3, 4, 5, 6, 7] }
    sampling_params { temperature: 0 max_tokens: 4 logprobs: 2
                      stop_token_ids: [250] min_tokens: 1 }
    stream: true)"));
  seed("generate_sampled", 9, Proto<vllm::grpc::engine::GenerateRequest>(R"(
    request_id: "g2" tokenized { input_ids: [9, 9, 9] }
    sampling_params { temperature: 0.7 top_k: 20 top_p: 0.95 min_p: 0.05
                      max_tokens: 3 seed: 11 })"));
  {
    KvTransferParams params;
    CHECK(params.handle.ParseFromString(Proto<v1::KvHandle>(kHandle)));
    params.handle.set_source_address("127.0.0.1:1");
    params.handle.set_model_fingerprint(kTinyFingerprint);
    params.first_token.token_id = 11;
    vllm::grpc::engine::GenerateRequest request;
    request.set_request_id("g3");
    for (int t : {5, 6, 7, 8, 9, 10})
      request.mutable_tokenized()->add_input_ids(t);
    request.mutable_sampling_params()->set_max_tokens(3);
    request.set_kv_transfer_params_json(ToKvTransferParamsJson(params));
    std::string bytes;
    CHECK(request.SerializeToString(&bytes));
    seed("generate_decode_leg", 9, bytes);
  }
  seed("embed", 10,
       Proto<vllm::grpc::engine::EmbedRequest>(R"(request_id: "e")"));
  seed("health_check", 11, "");
  seed("abort", 12,
       Proto<vllm::grpc::engine::AbortRequest>(R"(request_ids: ["g1"])"));
  seed("get_model_info", 13, "");
  seed("get_server_info", 14, "");
  seed("get_loads", 15,
       Proto<vllm::grpc::engine::GetLoadsRequest>(R"(include: ["all"])"));
  seed("get_tokenizer", 16, "");
  seed("subscribe_kv_events", 17, "");
}

}  // namespace
}  // namespace pdworker

int main(int argc, char** argv) {
  CHECK_EQ(argc, 2) << "usage: write_seed_corpora DIR";
  pdworker::root = argv[1];
  mkdir(argv[1], 0755);
  pdworker::WriteSafetensors();
  pdworker::WriteModelConfig();
  pdworker::WriteCompilationConfig();
  pdworker::WriteKvHandle();
  pdworker::WriteCudaIpcExport();
  pdworker::WriteKvStream();
  pdworker::WriteRpcRequests();
  return 0;
}
