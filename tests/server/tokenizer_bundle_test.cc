// The tokenizer bundle GetTokenizer streams: which files go in, in which
// order, and that libzip and Python's zipfile both read the archive back.
#include "worker/server/tokenizer_bundle.h"

#include <fcntl.h>
#include <stdio.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <unistd.h>
#include <zip.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace pdworker {
namespace {

using ::testing::ElementsAre;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;
using ::testing::MatchesRegex;

namespace fs = std::filesystem;

// A fresh, empty directory under $TEST_TMPDIR.
std::string MakeModelDir(const std::string& name) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const fs::path dir = fs::path(tmp != nullptr ? tmp : "/tmp") / name;
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir.string();
}

void WriteFile(const std::string& path, const std::string& contents) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  ASSERT_TRUE(out) << path;
  out << contents;
  ASSERT_TRUE(out.good()) << path;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

// Every entry of `zip`, in archive order, read back with libzip.
std::vector<std::pair<std::string, std::string>> Unzip(const std::string& zip) {
  std::vector<std::pair<std::string, std::string>> entries;
  zip_error_t error;
  zip_error_init(&error);
  zip_source_t* source =
      zip_source_buffer_create(zip.data(), zip.size(), 0, &error);
  EXPECT_NE(source, nullptr);
  if (source == nullptr) return entries;
  zip_t* archive =
      zip_open_from_source(source, ZIP_RDONLY | ZIP_CHECKCONS, &error);
  EXPECT_NE(archive, nullptr) << zip_error_strerror(&error);
  zip_error_fini(&error);
  if (archive == nullptr) {
    zip_source_free(source);
    return entries;
  }
  const zip_int64_t count = zip_get_num_entries(archive, 0);
  for (zip_int64_t i = 0; i < count; ++i) {
    zip_stat_t stat;
    EXPECT_EQ(zip_stat_index(archive, i, 0, &stat), 0);
    EXPECT_EQ(stat.comp_method, ZIP_CM_DEFLATE) << stat.name;
    zip_file_t* file = zip_fopen_index(archive, i, 0);
    EXPECT_NE(file, nullptr) << stat.name;
    if (file == nullptr) continue;
    std::string contents(stat.size, '\0');
    EXPECT_EQ(zip_fread(file, contents.data(), contents.size()),
              static_cast<zip_int64_t>(stat.size))
        << stat.name;
    char extra;
    EXPECT_EQ(zip_fread(file, &extra, 1), 0) << stat.name;  // at EOF
    EXPECT_EQ(zip_fclose(file), 0) << stat.name;            // CRC checked here
    entries.emplace_back(stat.name, std::move(contents));
  }
  zip_discard(archive);
  return entries;
}

// What Python's zipfile and hashlib make of the archive: the SHA-256, then
// the names, one a line. The script itself fails (non-zero exit) when
// an entry's CRC, method, timestamp or mode is off, or its bytes differ from
// the file of that name in `model_dir`.
constexpr char kPythonCheck[] = R"(import hashlib, os, sys, zipfile
path, model_dir = sys.argv[1], sys.argv[2]
print(hashlib.sha256(open(path, "rb").read()).hexdigest())
with zipfile.ZipFile(path) as z:
    assert z.testzip() is None
    for info in z.infolist():
        assert info.compress_type == zipfile.ZIP_DEFLATED, info
        assert info.date_time == (1980, 1, 1, 0, 0, 0), info
        assert info.external_attr >> 16 == 0o100644, oct(info.external_attr)
        with open(os.path.join(model_dir, info.filename), "rb") as f:
            assert z.read(info) == f.read(), info.filename
        print(info.filename)
)";

struct PythonView {
  int exit_code = -1;
  std::vector<std::string> lines;
};

PythonView ReadWithPython(const std::string& zip, const std::string& model_dir,
                          const std::string& tag) {
  const std::string tmp = MakeModelDir("python_" + tag);
  const std::string zip_path = tmp + "/bundle.zip";
  const std::string script_path = tmp + "/check.py";
  WriteFile(zip_path, zip);
  WriteFile(script_path, kPythonCheck);
  const std::string command = "/usr/bin/python3 '" + script_path + "' '" +
                              zip_path + "' '" + model_dir + "'";
  PythonView view;
  FILE* pipe = popen(command.c_str(), "r");
  EXPECT_NE(pipe, nullptr);
  if (pipe == nullptr) return view;
  std::string output;
  char buffer[4096];
  size_t n;
  while ((n = fread(buffer, 1, sizeof(buffer), pipe)) > 0) {
    output.append(buffer, n);
  }
  const int status = pclose(pipe);
  view.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  std::istringstream lines(output);
  for (std::string line; std::getline(lines, line);) {
    view.lines.push_back(line);
  }
  return view;
}

// A model directory as a Hugging Face download leaves it, with files that
// must stay out of the bundle.
struct RealisticModel {
  std::string dir;
  std::vector<std::string> expected_names;
};

RealisticModel MakeRealisticModel(const std::string& name) {
  RealisticModel model;
  model.dir = MakeModelDir(name);
  const std::string& d = model.dir;
  WriteFile(d + "/tokenizer.json",
            R"({"version":"1.0","model":{"type":"BPE","vocab":{"a":0,"b":1,)"
            R"("ab":2},"merges":["a b"]},"added_tokens":[{"id":3,)"
            R"("content":"<|eot|>","special":true}]})");
  WriteFile(d + "/tokenizer_config.json",
            R"({"bos_token":null,"eos_token":"<|eot|>",)"
            R"("model_max_length":131072})");
  WriteFile(d + "/special_tokens_map.json", R"({"eos_token":"<|eot|>"})");
  WriteFile(d + "/config.json",
            R"({"architectures":["LlamaForCausalLM"],"vocab_size":4})");
  WriteFile(d + "/chat_template.jinja",
            "{% for m in messages %}{{ m.role }}: {{ m.content }}\n"
            "{% endfor %}");
  WriteFile(d + "/foo.tiktoken", "YQ== 0\nYg== 1\nYWI= 2\n");
  // A Hugging Face cache snapshot is made of symlinks into blobs/.
  const std::string blob = MakeModelDir(name + "_blobs") + "/0123abcd";
  WriteFile(blob, std::string("\x0a\x05\x08\x01\x10\x02", 6));
  fs::create_symlink(blob, d + "/spiece.model");
  // Left out: weights, docs, anything nested, directories and dotfiles.
  WriteFile(d + "/model.safetensors", std::string(4096, '\x7f'));
  WriteFile(d + "/README.md", "# a model\n");
  fs::create_directories(d + "/nested");
  WriteFile(d + "/nested/tokenizer.json", R"({"nested":true})");
  fs::create_directories(d + "/checkpoints.model");
  WriteFile(d + "/.backup.jinja", "{{ old }}");
  model.expected_names = {"tokenizer.json",      "tokenizer_config.json",
                          "config.json",         "special_tokens_map.json",
                          "chat_template.jinja", "foo.tiktoken",
                          "spiece.model"};
  return model;
}

TEST(TokenizerBundleTest, ZipsExactlyTheTokenizerFiles) {
  const RealisticModel model = MakeRealisticModel("realistic");
  const absl::StatusOr<TokenizerBundle> bundle =
      BuildTokenizerBundle(model.dir);
  ASSERT_TRUE(bundle.ok()) << bundle.status();
  EXPECT_THAT(bundle->files, ElementsAreArray(model.expected_names));
  EXPECT_THAT(bundle->sha256_hex, MatchesRegex("[0-9a-f]{64}"));

  const auto entries = Unzip(bundle->zip);
  ASSERT_EQ(entries.size(), model.expected_names.size());
  for (size_t i = 0; i < entries.size(); ++i) {
    EXPECT_EQ(entries[i].first, model.expected_names[i]);
    EXPECT_EQ(entries[i].second,
              ReadFile(model.dir + "/" + model.expected_names[i]))
        << entries[i].first;
  }

  const PythonView python = ReadWithPython(bundle->zip, model.dir, "realistic");
  ASSERT_EQ(python.exit_code, 0);
  ASSERT_FALSE(python.lines.empty());
  EXPECT_EQ(python.lines[0], bundle->sha256_hex);
  EXPECT_THAT(
      std::vector<std::string>(python.lines.begin() + 1, python.lines.end()),
      ElementsAreArray(model.expected_names));
}

TEST(TokenizerBundleTest, SameFilesGiveTheSameBytesWhateverTheirMtimes) {
  const RealisticModel model = MakeRealisticModel("deterministic");
  const absl::StatusOr<TokenizerBundle> first = BuildTokenizerBundle(model.dir);
  ASSERT_TRUE(first.ok()) << first.status();
  const absl::StatusOr<TokenizerBundle> second =
      BuildTokenizerBundle(model.dir);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(second->sha256_hex, first->sha256_hex);

  // Touched files (a re-download) and another mode: still the same archive.
  const timeval times[2] = {{1700000000, 0}, {1700000000, 0}};
  for (const std::string& name : model.expected_names) {
    const std::string path = model.dir + "/" + name;
    ASSERT_EQ(utimes(path.c_str(), times), 0) << path;
    ASSERT_EQ(chmod(path.c_str(), 0600), 0) << path;
  }
  const absl::StatusOr<TokenizerBundle> touched =
      BuildTokenizerBundle(model.dir);
  ASSERT_TRUE(touched.ok()) << touched.status();
  EXPECT_EQ(touched->sha256_hex, first->sha256_hex);
  EXPECT_EQ(touched->zip, first->zip);

  // Other contents, another digest.
  WriteFile(model.dir + "/tokenizer_config.json", R"({"eos_token":"</s>"})");
  const absl::StatusOr<TokenizerBundle> edited =
      BuildTokenizerBundle(model.dir);
  ASSERT_TRUE(edited.ok()) << edited.status();
  EXPECT_NE(edited->sha256_hex, first->sha256_hex);
}

TEST(TokenizerBundleTest, ExactNamesInTheirOrderThenSortedPatterns) {
  const std::string dir = MakeModelDir("all_names");
  // Written in an order unlike the archive's.
  const std::vector<std::string> written = {
      "z.jinja",
      "video_preprocessor_config.json",
      "tiktoken.model",
      "a.tiktoken",
      "processor_config.json",
      "tokenizer.model",
      "preprocessor_config.json",
      "chat_template.json",
      "merges.txt",
      "vocab.json",
      "special_tokens_map.json",
      "generation_config.json",
      "config.json",
      "tokenizer_config.json",
      "tokenizer.json",
      "b.model",
      "tool_use.jinja",
      "vocab.txt",
      "added_tokens.json",
  };
  for (const std::string& name : written) {
    WriteFile((fs::path(dir) / name).string(), "contents of " + name);
  }
  const absl::StatusOr<TokenizerBundle> bundle = BuildTokenizerBundle(dir);
  ASSERT_TRUE(bundle.ok()) << bundle.status();
  const std::vector<std::string> expected = {
      "tokenizer.json",
      "tokenizer_config.json",
      "config.json",
      "generation_config.json",
      "special_tokens_map.json",
      "vocab.json",
      "merges.txt",
      "tokenizer.model",
      "tiktoken.model",
      "chat_template.json",
      "preprocessor_config.json",
      "processor_config.json",
      "video_preprocessor_config.json",
      "a.tiktoken",
      "b.model",
      "tool_use.jinja",
      "z.jinja",
  };
  EXPECT_THAT(bundle->files, ElementsAreArray(expected));
  const auto entries = Unzip(bundle->zip);
  ASSERT_EQ(entries.size(), expected.size());
  for (size_t i = 0; i < entries.size(); ++i) {
    EXPECT_EQ(entries[i].first, expected[i]);
    EXPECT_EQ(entries[i].second, "contents of " + expected[i]);
  }
}

TEST(TokenizerBundleTest, AChatTemplateAloneIsEnough) {
  const std::string dir = MakeModelDir("template_only");
  WriteFile(dir + "/config.json", "{}");
  WriteFile(dir + "/chat_template.jinja", "{{ messages }}");
  const absl::StatusOr<TokenizerBundle> bundle = BuildTokenizerBundle(dir);
  ASSERT_TRUE(bundle.ok()) << bundle.status();
  EXPECT_THAT(bundle->files, ElementsAre("config.json", "chat_template.jinja"));
}

TEST(TokenizerBundleTest, ModelConfigsAloneAreNotFound) {
  const std::string dir = MakeModelDir("config_only");
  WriteFile(dir + "/config.json", R"({"vocab_size":4})");
  absl::StatusOr<TokenizerBundle> bundle = BuildTokenizerBundle(dir);
  EXPECT_EQ(bundle.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(bundle.status().message(), HasSubstr(dir));
  // Tells the operator what would do.
  EXPECT_THAT(bundle.status().message(), HasSubstr("tokenizer.json"));
  EXPECT_THAT(bundle.status().message(), HasSubstr("tokenizer.model"));
  EXPECT_THAT(bundle.status().message(), HasSubstr("*.tiktoken"));
  EXPECT_THAT(bundle.status().message(), HasSubstr("config.json"));

  WriteFile(dir + "/generation_config.json", "{}");
  fs::create_directories(dir + "/tokenizer.json");  // not a file
  bundle = BuildTokenizerBundle(dir);
  EXPECT_EQ(bundle.status().code(), absl::StatusCode::kNotFound);

  const std::string empty = MakeModelDir("empty");
  EXPECT_EQ(BuildTokenizerBundle(empty).status().code(),
            absl::StatusCode::kNotFound);
}

TEST(TokenizerBundleTest, MissingDirectoryIsNotFound) {
  const std::string dir = MakeModelDir("gone") + "/no_such_model";
  const absl::StatusOr<TokenizerBundle> bundle = BuildTokenizerBundle(dir);
  EXPECT_EQ(bundle.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(bundle.status().message(), HasSubstr(dir));
}

TEST(TokenizerBundleTest, UnreadableFileIsAnErrorNamingIt) {
  const std::string dir = MakeModelDir("unreadable");
  WriteFile(dir + "/tokenizer_config.json", "{}");
  const std::string path = dir + "/tokenizer.json";
  WriteFile(path, "{}");
  ASSERT_EQ(chmod(path.c_str(), 0), 0);
  const int probe = open(path.c_str(), O_RDONLY);
  if (probe >= 0) {
    close(probe);
    GTEST_SKIP() << "running as root: mode 000 does not stop reading";
  }
  const absl::StatusOr<TokenizerBundle> bundle = BuildTokenizerBundle(dir);
  EXPECT_EQ(bundle.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(bundle.status().message(), HasSubstr(path));
}

TEST(TokenizerBundleTest, DanglingSymlinkIsAnErrorNamingIt) {
  // A snapshot whose blob is gone (an interrupted download): refused rather
  // than shipped without its tokenizer.json. Fails even for root.
  const std::string dir = MakeModelDir("dangling");
  WriteFile(dir + "/tokenizer_config.json", "{}");
  const std::string path = dir + "/tokenizer.json";
  fs::create_symlink(dir + "/../blobs/missing", path);
  const absl::StatusOr<TokenizerBundle> bundle = BuildTokenizerBundle(dir);
  EXPECT_EQ(bundle.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(bundle.status().message(), HasSubstr(path));
}

TEST(TokenizerBundleTest, LargeTokenizerJsonRoundTrips) {
  const std::string dir = MakeModelDir("large");
  // About 3 MiB of vocab-like JSON from a fixed seed: compressible, but not
  // trivially.
  std::mt19937 random(42);
  std::uniform_int_distribution<int> letter('a', 'z');
  std::uniform_int_distribution<int> length(1, 12);
  std::string json = R"({"model":{"type":"BPE","vocab":{)";
  for (int id = 0; json.size() < size_t{3} * 1024 * 1024; ++id) {
    if (id > 0) json += ',';
    json += '"';
    for (int n = length(random); n > 0; --n)
      json += static_cast<char>(letter(random));
    json += "\":" + std::to_string(id);
  }
  json += "}}}";
  WriteFile(dir + "/tokenizer.json", json);
  WriteFile(dir + "/tokenizer_config.json", "{}");

  const absl::StatusOr<TokenizerBundle> bundle = BuildTokenizerBundle(dir);
  ASSERT_TRUE(bundle.ok()) << bundle.status();
  EXPECT_LT(bundle->zip.size(), json.size());  // deflated
  const auto entries = Unzip(bundle->zip);
  ASSERT_EQ(entries.size(), 2u);
  EXPECT_EQ(entries[0].first, "tokenizer.json");
  EXPECT_TRUE(entries[0].second == json) << "tokenizer.json differs";
  const PythonView python = ReadWithPython(bundle->zip, dir, "large");
  ASSERT_EQ(python.exit_code, 0);
  EXPECT_THAT(python.lines, ElementsAre(bundle->sha256_hex, "tokenizer.json",
                                        "tokenizer_config.json"));
}

}  // namespace
}  // namespace pdworker
