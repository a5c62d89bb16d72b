// pdworker started on a broken checkpoint, as an operator would start it
// (--device=cpu, the threaded CPU stream: weight uploads run after the
// loader enqueued them, as on a GPU). Every defect of every kind of weight
// must stop the worker with exit code 2 and a message naming the file and
// the tensor: never a crash, never a worker that serves. Under ASan (CI's
// sanitizer run) an upload that outlives the buffers of a failed load is a
// heap-use-after-free report and a failed test.
#include <sys/stat.h>

#include <csignal>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/server/subprocess.h"
#include "tools/make_tiny_model/tiny_model.h"
#include "worker/model/safetensors_writer.h"

namespace pdworker {
namespace {

using Json = nlohmann::json;
using server_testing::RunfilePath;
using server_testing::Subprocess;
using ::testing::HasSubstr;
using ::testing::Not;

std::string TmpDir() {
  const char* tmp = std::getenv("TEST_TMPDIR");
  return tmp != nullptr ? tmp : "/tmp";
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream bytes;
  bytes << in.rdbuf();
  return bytes.str();
}

// One tensor of a safetensors file: its header entry and its bytes.
struct Tensor {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;
  std::string bytes;
};

// The tensors of the well-formed file at `path`, in data order.
std::vector<Tensor> ReadTensors(const std::string& path) {
  const std::string file = ReadFile(path);
  uint64_t header_bytes = 0;
  std::memcpy(&header_bytes, file.data(), sizeof(header_bytes));
  const Json header = Json::parse(file.substr(8, header_bytes));
  const std::string data = file.substr(8 + header_bytes);
  std::map<uint64_t, Tensor> by_offset;
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") continue;
    const uint64_t begin = entry["data_offsets"][0].get<uint64_t>();
    const uint64_t end = entry["data_offsets"][1].get<uint64_t>();
    by_offset[begin] = Tensor{name, entry["dtype"].get<std::string>(),
                              entry["shape"].get<std::vector<int64_t>>(),
                              data.substr(begin, end - begin)};
  }
  std::vector<Tensor> tensors;
  for (auto& [offset, tensor] : by_offset) tensors.push_back(tensor);
  return tensors;
}

enum class Defect {
  kNone,  // the harness itself: the rewritten checkpoint loads
  kMissing,
  kWrongShape,       // one row (element) short, bytes to match
  kWrongDtype,       // I32: the same bytes, a type no kernel reads
  kTruncated,        // the file ends inside the tensor's bytes
  kOffsetsPastEnd,   // data_offsets end beyond the data section
  kOffsetsReversed,  // data_offsets [end, begin]
};

const char* DefectName(Defect d) {
  switch (d) {
    case Defect::kNone:
      return "none";
    case Defect::kMissing:
      return "missing";
    case Defect::kWrongShape:
      return "wrong_shape";
    case Defect::kWrongDtype:
      return "wrong_dtype";
    case Defect::kTruncated:
      return "truncated";
    case Defect::kOffsetsPastEnd:
      return "offsets_past_end";
    case Defect::kOffsetsReversed:
      return "offsets_reversed";
  }
  return "?";
}

// Writes `tensors` as a safetensors file with `defect` applied to `target`,
// which goes last in the data section (so truncating the file cuts only
// it, and every other tensor is read and uploaded before it).
std::string BrokenFile(std::vector<Tensor> tensors, const std::string& target,
                       Defect defect) {
  std::vector<Tensor> ordered;
  Tensor broken;
  bool found = false;
  for (Tensor& t : tensors) {
    if (t.name == target) {
      broken = std::move(t);
      found = true;
    } else {
      ordered.push_back(std::move(t));
    }
  }
  EXPECT_TRUE(found) << target;
  if (defect == Defect::kWrongShape) {
    const int64_t row = broken.bytes.size() / broken.shape[0];
    broken.shape[0] -= 1;
    broken.bytes.resize(broken.bytes.size() - row);
  }
  if (defect == Defect::kWrongDtype) broken.dtype = "I32";
  if (defect != Defect::kMissing) ordered.push_back(std::move(broken));

  Json header = Json::object();
  std::string data;
  for (const Tensor& t : ordered) {
    uint64_t begin = data.size();
    uint64_t end = begin + t.bytes.size();
    if (t.name == target && defect == Defect::kOffsetsPastEnd) end += 4;
    if (t.name == target && defect == Defect::kOffsetsReversed) {
      std::swap(begin, end);
    }
    header[t.name] = {
        {"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {begin, end}}};
    data += t.bytes;
  }
  if (defect == Defect::kTruncated) {
    data.resize(data.size() - ordered.back().bytes.size() / 2);
  }
  return SerializeSafetensors(header.dump(), data);
}

struct Case {
  std::string tensor;
  Defect defect;
  TinyShape shape = TinyShape::kGqa;
};

std::string CaseName(const ::testing::TestParamInfo<Case>& info) {
  std::string tensor = absl::StrReplaceAll(
      info.param.tensor, {{"model.", ""}, {".weight", ""}, {".", "_"}});
  return absl::StrCat(info.param.shape == TinyShape::kGqa
                          ? ""
                          : absl::StrCat(TinyShapeName(info.param.shape), "_"),
                      tensor, "_", DefectName(info.param.defect));
}

// Every kind of weight the Llama loader reads, for the gqa tiny shape (2
// layers, untied LM head): the embedding, the untied LM head, the final
// norm, layer 0's norms, attention projections and MLP, and tensors of the
// last layer.
std::vector<std::string> Tensors() {
  return {
      "model.embed_tokens.weight",
      "lm_head.weight",
      "model.norm.weight",
      "model.layers.0.input_layernorm.weight",
      "model.layers.0.post_attention_layernorm.weight",
      "model.layers.0.self_attn.q_proj.weight",
      "model.layers.0.self_attn.k_proj.weight",
      "model.layers.0.self_attn.v_proj.weight",
      "model.layers.0.self_attn.o_proj.weight",
      "model.layers.0.mlp.gate_proj.weight",
      "model.layers.0.mlp.up_proj.weight",
      "model.layers.0.mlp.down_proj.weight",
      "model.layers.1.self_attn.q_proj.weight",
      "model.layers.1.post_attention_layernorm.weight",
      "model.layers.1.mlp.down_proj.weight",
  };
}

std::vector<Case> Cases() {
  std::vector<Case> cases;
  const Defect defects[] = {Defect::kMissing,        Defect::kWrongShape,
                            Defect::kWrongDtype,     Defect::kTruncated,
                            Defect::kOffsetsPastEnd, Defect::kOffsetsReversed};
  for (const std::string& tensor : Tensors()) {
    for (Defect d : defects) cases.push_back({tensor, d});
  }
  // The tensors a family adds to the layer: Qwen3's q/k norms.
  for (const char* tensor : {"model.layers.0.self_attn.q_norm.weight",
                             "model.layers.1.self_attn.k_norm.weight"}) {
    for (Defect d : defects) cases.push_back({tensor, d, TinyShape::kQwen3});
  }
  // Phi-3's fused projections.
  for (const char* tensor : {"model.layers.0.self_attn.qkv_proj.weight",
                             "model.layers.1.mlp.gate_up_proj.weight"}) {
    for (Defect d : defects) cases.push_back({tensor, d, TinyShape::kPhi3});
  }
  // Gemma 2's sandwich norms (folded as 1 + w on the host).
  for (Defect d : defects) {
    cases.push_back({"model.layers.1.post_feedforward_layernorm.weight", d,
                     TinyShape::kGemma2});
  }
  return cases;
}

// The tiny model of `shape`, written once per test binary.
std::string BaseModelDir(TinyShape shape) {
  const std::string path =
      absl::StrCat(TmpDir(), "/base_model_", TinyShapeName(shape));
  static std::set<TinyShape>* written = new std::set<TinyShape>();
  if (written->insert(shape).second) {
    TinyModelOptions options;
    options.shape = shape;
    const absl::Status status = WriteTinyModel(options, path);
    EXPECT_TRUE(status.ok()) << status;
  }
  return path;
}

// A model directory: the base config.json of `shape` and `safetensors` as
// model.safetensors.
std::string ModelDir(const std::string& name, const std::string& safetensors,
                     TinyShape shape = TinyShape::kGqa) {
  const std::string dir = absl::StrCat(TmpDir(), "/", name);
  EXPECT_EQ(mkdir(dir.c_str(), 0755), 0) << dir;
  EXPECT_TRUE(WriteStringToFile(dir + "/config.json",
                                ReadFile(BaseModelDir(shape) + "/config.json"))
                  .ok());
  EXPECT_TRUE(WriteStringToFile(dir + "/model.safetensors", safetensors).ok());
  return dir;
}

std::unique_ptr<Subprocess> StartWorker(const std::string& model_dir,
                                        const std::string& log_name) {
  auto worker = Subprocess::Start(
      {RunfilePath("worker/pdworker"), "--model=" + model_dir, "--device=cpu",
       "--cpu_stream=threaded", "--role=both", "--host=127.0.0.1", "--port=0",
       "--metrics_port=0", "--max_num_seqs=4", "--max_num_batched_tokens=32",
       "--max_model_len=64", "--kv_cache_bytes=65536", "--block_size=4"},
      absl::StrCat(TmpDir(), "/", log_name, ".log"));
  EXPECT_TRUE(worker.ok()) << worker.status();
  return worker.ok() ? *std::move(worker) : nullptr;
}

// The rewrite keeps a good checkpoint good: the worker serves it and
// drains on SIGTERM. Otherwise the cases below would pass on any harness
// bug.
TEST(BrokenCheckpointTest, RewrittenCheckpointServes) {
  for (const TinyShape shape : {TinyShape::kGqa, TinyShape::kQwen3,
                                TinyShape::kPhi3, TinyShape::kGemma2}) {
    SCOPED_TRACE(TinyShapeName(shape));
    const std::string name = absl::StrCat("intact_", TinyShapeName(shape));
    const std::vector<Tensor> tensors =
        ReadTensors(BaseModelDir(shape) + "/model.safetensors");
    const std::string dir = ModelDir(
        name, BrokenFile(tensors, tensors.front().name, Defect::kNone), shape);
    std::unique_ptr<Subprocess> worker = StartWorker(dir, name);
    ASSERT_NE(worker, nullptr);
    auto listening = worker->WaitForOutput("listening on", absl::Seconds(120));
    ASSERT_TRUE(listening.ok()) << listening.status() << worker->Output();
    worker->Signal(SIGTERM);
    auto code = worker->Wait(absl::Seconds(60));
    ASSERT_TRUE(code.ok()) << code.status();
    EXPECT_EQ(*code, 0) << worker->Output();
  }
}

// A tensor the config's layer does not read (MoE experts in a dense
// checkpoint, Qwen3's q_norm under a Llama config) is refused naming it;
// lm_head.weight beside tied embeddings is what some exports write, and
// serves.
TEST(BrokenCheckpointTest, AnUnusedTensorExitsTwoNamingIt) {
  const std::vector<Tensor> base =
      ReadTensors(BaseModelDir(TinyShape::kGqa) + "/model.safetensors");
  const Tensor& norm =
      base.front().name == "lm_head.weight" ? base[1] : base.front();
  int index = 0;
  for (const char* extra : {"model.layers.0.mlp.experts.0.w1.weight",
                            "model.layers.1.self_attn.q_norm.weight",
                            "model.vision_tower.patch_embed.weight"}) {
    SCOPED_TRACE(extra);
    std::vector<Tensor> tensors = base;
    Tensor added = norm;
    added.name = extra;
    tensors.push_back(added);
    const std::string name = absl::StrCat("unused_", index++);
    const std::string dir = ModelDir(
        name, BrokenFile(tensors, tensors.front().name, Defect::kNone));
    std::unique_ptr<Subprocess> worker = StartWorker(dir, name);
    ASSERT_NE(worker, nullptr);
    auto code = worker->Wait(absl::Seconds(120));
    ASSERT_TRUE(code.ok()) << code.status();
    const std::string output = worker->Output();
    EXPECT_EQ(*code, 2) << output;
    EXPECT_THAT(output, HasSubstr(dir + "/model.safetensors")) << output;
    EXPECT_THAT(output, HasSubstr(absl::StrCat("\"", extra, "\"")));
    EXPECT_THAT(output, HasSubstr("is not used by LlamaForCausalLM"));
    EXPECT_THAT(output, Not(HasSubstr("listening on")));
  }

  std::vector<Tensor> tied =
      ReadTensors(BaseModelDir(TinyShape::kTied) + "/model.safetensors");
  for (const Tensor& t : tied) ASSERT_NE(t.name, "lm_head.weight");
  Tensor head = tied.front();
  for (const Tensor& t : tied) {
    if (t.name == "model.embed_tokens.weight") head = t;
  }
  head.name = "lm_head.weight";
  tied.push_back(head);
  const std::string dir = ModelDir(
      "tied_with_head", BrokenFile(tied, tied.front().name, Defect::kNone),
      TinyShape::kTied);
  std::unique_ptr<Subprocess> worker = StartWorker(dir, "tied_with_head");
  ASSERT_NE(worker, nullptr);
  auto listening = worker->WaitForOutput("listening on", absl::Seconds(120));
  ASSERT_TRUE(listening.ok()) << listening.status() << worker->Output();
  worker->Signal(SIGTERM);
  auto code = worker->Wait(absl::Seconds(60));
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 0) << worker->Output();
}

class BrokenCheckpointTest : public ::testing::TestWithParam<Case> {};

TEST_P(BrokenCheckpointTest, ExitsTwoNamingFileAndTensor) {
  const Case& c = GetParam();
  const std::string name = CaseName({c, 0});
  const std::vector<Tensor> tensors =
      ReadTensors(BaseModelDir(c.shape) + "/model.safetensors");
  const std::string dir =
      ModelDir(name, BrokenFile(tensors, c.tensor, c.defect), c.shape);
  std::unique_ptr<Subprocess> worker = StartWorker(dir, name);
  ASSERT_NE(worker, nullptr);
  auto code = worker->Wait(absl::Seconds(120));
  ASSERT_TRUE(code.ok()) << code.status();
  const std::string output = worker->Output();
  EXPECT_EQ(*code, 2) << output;
  EXPECT_THAT(output, HasSubstr(dir + "/model.safetensors")) << output;
  EXPECT_THAT(output, HasSubstr(absl::StrCat("\"", c.tensor, "\""))) << output;
  EXPECT_THAT(output, Not(HasSubstr("listening on")));
  EXPECT_THAT(output, Not(HasSubstr("AddressSanitizer")));
}

INSTANTIATE_TEST_SUITE_P(EveryWeightEveryDefect, BrokenCheckpointTest,
                         ::testing::ValuesIn(Cases()), CaseName);

}  // namespace
}  // namespace pdworker
