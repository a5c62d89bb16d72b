#include "worker/model/checkpoint.h"

#include <sys/stat.h>

#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "glog/logging.h"
#include "nlohmann/json.hpp"
#include "worker/model/float16.h"

namespace pdworker {
namespace {

using Json = nlohmann::json;

constexpr char kSingleFile[] = "model.safetensors";
constexpr char kIndexFile[] = "model.safetensors.index.json";

bool FileExists(const std::string& path) {
  struct stat info {};
  return ::stat(path.c_str(), &info) == 0;
}

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  if (!file) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  std::ostringstream text;
  text << file.rdbuf();
  if (file.bad())
    return absl::DataLossError(absl::StrCat("error reading ", path));
  return text.str();
}

// A shard named by the index must sit in the model directory itself: no
// directories, no "..", so an index cannot point outside it.
bool IsPlainFileName(const std::string& name) {
  return !name.empty() && name != "." && name != ".." &&
         name.find('/') == std::string::npos &&
         name.find('\0') == std::string::npos;
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

}  // namespace

absl::StatusOr<std::unique_ptr<Checkpoint>> Checkpoint::Open(
    const std::string& model_dir) {
  std::unique_ptr<Checkpoint> checkpoint(new Checkpoint(model_dir));
  const std::string single_path = absl::StrCat(model_dir, "/", kSingleFile);
  if (FileExists(single_path)) {
    auto file = SafetensorsFile::Open(single_path);
    if (!file.ok()) return file.status();
    for (const auto& [name, info] : (*file)->tensors()) {
      checkpoint->tensors_[name] = &info;
    }
    checkpoint->files_.push_back(*std::move(file));
    return checkpoint;
  }

  const std::string index_path = absl::StrCat(model_dir, "/", kIndexFile);
  if (!FileExists(index_path)) {
    return absl::NotFoundError(absl::StrCat("no ", kSingleFile, " or ",
                                            kIndexFile, " in ", model_dir));
  }
  auto index_text = ReadFile(index_path);
  if (!index_text.ok()) return index_text.status();
  Json index;
  try {
    index = Json::parse(*index_text);
  } catch (const Json::exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat(index_path, " is not valid JSON: ", e.what()));
  }
  if (!index.is_object() || !index.contains("weight_map") ||
      !index["weight_map"].is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(index_path, ": weight_map must be an object"));
  }

  // Open each shard once, in name order, then resolve every indexed tensor.
  std::map<std::string, SafetensorsFile*> shards;
  for (const auto& [tensor, shard_json] : index["weight_map"].items()) {
    if (!shard_json.is_string() ||
        !IsPlainFileName(shard_json.get<std::string>())) {
      return absl::InvalidArgumentError(
          absl::StrCat(index_path, ": weight_map[\"", tensor,
                       "\"] must be a file name in the model directory, got ",
                       shard_json.dump()));
    }
    shards.emplace(shard_json.get<std::string>(), nullptr);
  }
  for (auto& [shard_name, shard] : shards) {
    const std::string shard_path = absl::StrCat(model_dir, "/", shard_name);
    auto file = SafetensorsFile::Open(shard_path);
    if (!file.ok()) {
      return absl::Status(
          file.status().code(),
          absl::StrCat("shard ", shard_name, " listed in ", kIndexFile, ": ",
                       file.status().message()));
    }
    shard = file->get();
    checkpoint->files_.push_back(*std::move(file));
  }
  for (const auto& [tensor, shard_json] : index["weight_map"].items()) {
    const std::string shard_name = shard_json.get<std::string>();
    const TensorInfo* info = shards.at(shard_name)->Find(tensor);
    if (info == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat(index_path, " places tensor \"", tensor, "\" in ",
                       shard_name, ", which does not contain it"));
    }
    checkpoint->tensors_[tensor] = info;
  }
  VLOG(1) << "opened " << checkpoint->tensors_.size() << " tensors from "
          << shards.size() << " shards in " << model_dir;
  return checkpoint;
}

bool Checkpoint::Has(const std::string& name) const {
  return tensors_.count(name) != 0;
}

const TensorInfo* Checkpoint::Find(const std::string& name) const {
  const auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : it->second;
}

std::vector<std::string> Checkpoint::TensorNames() const {
  std::vector<std::string> names;
  names.reserve(tensors_.size());
  for (const auto& [name, info] : tensors_) names.push_back(name);
  return names;
}

absl::StatusOr<const TensorInfo*> Checkpoint::FindWithShape(
    const std::string& name, const std::vector<int64_t>& expected_shape) const {
  const TensorInfo* info = Find(name);
  if (info == nullptr) {
    return absl::NotFoundError(
        absl::StrCat(FileOf(name), ": no tensor \"", name, "\""));
  }
  if (info->shape != expected_shape) {
    return absl::InvalidArgumentError(absl::StrCat(
        FileOf(name), ": tensor \"", name, "\" has shape ",
        ShapeString(info->shape), ", expected ", ShapeString(expected_shape)));
  }
  return info;
}

std::string Checkpoint::FileOf(const std::string& name) const {
  for (const auto& file : files_) {
    if (files_.size() == 1 || file->Find(name) != nullptr) return file->path();
  }
  // Sharded and not in any shard: the index is what lacks it.
  return absl::StrCat(model_dir_, "/", kIndexFile);
}

absl::StatusOr<std::vector<float>> Checkpoint::GetFloat32(
    const std::string& name, const std::vector<int64_t>& expected_shape) const {
  auto info = FindWithShape(name, expected_shape);
  if (!info.ok()) return info.status();
  std::vector<float> values(static_cast<size_t>((*info)->NumElements()));
  ConvertToFloat32((*info)->dtype, (*info)->bytes.data(),
                   (*info)->NumElements(), values.data());
  return values;
}

}  // namespace pdworker
