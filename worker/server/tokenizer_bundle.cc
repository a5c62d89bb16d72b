#include "worker/server/tokenizer_bundle.h"

#include <dirent.h>
#include <fcntl.h>
#include <openssl/evp.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zip.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <memory>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "common/status_macros.h"

namespace pdworker {
namespace {

// The fixed names, in archive order.
constexpr absl::string_view kExactNames[] = {
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
};
// Any other file with one of these suffixes follows, sorted by name.
constexpr absl::string_view kSuffixes[] = {".tiktoken", ".jinja", ".model"};

// Shipped when present, but a router cannot tokenize with them alone.
bool IsModelConfig(absl::string_view name) {
  return name == "config.json" || name == "generation_config.json";
}

// Every entry gets the same timestamp and mode, so the archive depends only
// on the names and contents. DOS date bits: year-1980 << 9 | month << 5 | day.
constexpr zip_uint16_t kDosDate1980Jan1 = (0 << 9) | (1 << 5) | 1;
constexpr zip_uint16_t kDosTimeMidnight = 0;
constexpr zip_uint32_t kUnixRegular0644 = (S_IFREG | 0644);
// zlib's default: close to level 9 on JSON and much faster on a 10+ MB
// tokenizer.json.
constexpr zip_uint32_t kDeflateLevel = 6;

struct ZipSourceFree {
  void operator()(zip_source_t* source) const { zip_source_free(source); }
};
struct ZipDiscard {
  void operator()(zip_t* archive) const { zip_discard(archive); }
};
struct DirClose {
  void operator()(DIR* dir) const { closedir(dir); }
};

class FileDescriptor {
 public:
  explicit FileDescriptor(int fd) : fd_(fd) {}
  ~FileDescriptor() {
    if (fd_ >= 0) close(fd_);
  }
  FileDescriptor(const FileDescriptor&) = delete;
  FileDescriptor& operator=(const FileDescriptor&) = delete;
  int get() const { return fd_; }

 private:
  int fd_;
};

absl::Status ZipErrorStatus(absl::string_view what, zip_error_t* error) {
  return absl::InternalError(
      absl::StrCat(what, ": ", zip_error_strerror(error)));
}

// The names of the directory's entries (any type; "." and ".." left out).
absl::StatusOr<std::vector<std::string>> ListDirectory(const std::string& dir) {
  std::unique_ptr<DIR, DirClose> handle(opendir(dir.c_str()));
  if (handle == nullptr) {
    return absl::ErrnoToStatus(errno,
                               absl::StrCat("cannot open model directory ", dir,
                                            " for the tokenizer bundle"));
  }
  std::vector<std::string> names;
  while (true) {
    errno = 0;
    const dirent* entry = readdir(handle.get());
    if (entry == nullptr) {
      if (errno != 0) {
        return absl::ErrnoToStatus(
            errno, absl::StrCat("cannot list model directory ", dir));
      }
      break;
    }
    const absl::string_view name = entry->d_name;
    if (name != "." && name != "..") names.emplace_back(name);
  }
  return names;
}

// The exact names that exist, in kExactNames order, then the other
// suffix-matched names, sorted. Dotfiles never match a suffix (as a shell
// glob would not).
std::vector<std::string> SelectCandidates(
    const std::vector<std::string>& listed) {
  const absl::flat_hash_set<absl::string_view> present(listed.begin(),
                                                       listed.end());
  std::vector<std::string> selected;
  for (absl::string_view name : kExactNames) {
    if (present.contains(name)) selected.emplace_back(name);
  }
  const absl::flat_hash_set<absl::string_view> exact(std::begin(kExactNames),
                                                     std::end(kExactNames));
  std::vector<std::string> matched;
  for (const std::string& name : listed) {
    if (absl::StartsWith(name, ".") || exact.contains(name)) continue;
    for (absl::string_view suffix : kSuffixes) {
      if (absl::EndsWith(name, suffix)) {
        matched.push_back(name);
        break;
      }
    }
  }
  std::sort(matched.begin(), matched.end());
  selected.insert(selected.end(), matched.begin(), matched.end());
  return selected;
}

absl::StatusOr<std::string> ReadWholeFile(const std::string& path,
                                          off_t size_hint) {
  FileDescriptor fd(open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) {
    return absl::ErrnoToStatus(
        errno, absl::StrCat("cannot open tokenizer file ", path));
  }
  std::string contents;
  contents.reserve(static_cast<size_t>(std::max<off_t>(size_hint, 0)));
  char buffer[64 * 1024];
  while (true) {
    const ssize_t n = read(fd.get(), buffer, sizeof(buffer));
    if (n < 0) {
      if (errno == EINTR) continue;
      return absl::ErrnoToStatus(
          errno, absl::StrCat("cannot read tokenizer file ", path));
    }
    if (n == 0) break;
    contents.append(buffer, static_cast<size_t>(n));
  }
  return contents;
}

struct NamedFile {
  std::string name;
  std::string contents;
};

// Deflates `files` into a ZIP built in memory. `files` must outlive the
// zip_close below: libzip reads the buffers only then.
absl::StatusOr<std::string> ZipInMemory(const std::vector<NamedFile>& files) {
  zip_error_t error;
  zip_error_init(&error);
  std::unique_ptr<zip_source_t, ZipSourceFree> sink(
      zip_source_buffer_create(nullptr, 0, 0, &error));
  if (sink == nullptr) {
    absl::Status status = ZipErrorStatus("cannot create a zip buffer", &error);
    zip_error_fini(&error);
    return status;
  }
  std::unique_ptr<zip_t, ZipDiscard> archive(
      zip_open_from_source(sink.get(), ZIP_TRUNCATE, &error));
  if (archive == nullptr) {
    absl::Status status = ZipErrorStatus("cannot start a zip archive", &error);
    zip_error_fini(&error);
    return status;
  }
  zip_error_fini(&error);
  // The archive now holds a reference to `sink` and drops it when closed;
  // this one keeps the written bytes readable after that.
  zip_source_keep(sink.get());

  for (const NamedFile& file : files) {
    zip_source_t* data = zip_source_buffer(archive.get(), file.contents.data(),
                                           file.contents.size(), /*freep=*/0);
    if (data == nullptr) {
      return ZipErrorStatus(absl::StrCat("cannot add ", file.name, " to zip"),
                            zip_get_error(archive.get()));
    }
    const zip_int64_t index =
        zip_file_add(archive.get(), file.name.c_str(), data, ZIP_FL_ENC_GUESS);
    if (index < 0) {
      zip_source_free(data);  // Not taken over by a failed zip_file_add.
      return ZipErrorStatus(absl::StrCat("cannot add ", file.name, " to zip"),
                            zip_get_error(archive.get()));
    }
    const zip_uint64_t i = static_cast<zip_uint64_t>(index);
    if (zip_set_file_compression(archive.get(), i, ZIP_CM_DEFLATE,
                                 kDeflateLevel) != 0 ||
        zip_file_set_dostime(archive.get(), i, kDosTimeMidnight,
                             kDosDate1980Jan1, 0) != 0 ||
        zip_file_set_external_attributes(archive.get(), i, 0, ZIP_OPSYS_UNIX,
                                         kUnixRegular0644 << 16) != 0) {
      return ZipErrorStatus(
          absl::StrCat("cannot set zip attributes of ", file.name),
          zip_get_error(archive.get()));
    }
  }
  // Compresses everything into `sink` and frees the archive, unless it fails.
  zip_t* closing = archive.release();
  if (zip_close(closing) != 0) {
    absl::Status status = ZipErrorStatus("cannot write the tokenizer zip",
                                         zip_get_error(closing));
    zip_discard(closing);
    return status;
  }

  if (zip_source_open(sink.get()) != 0) {
    return ZipErrorStatus("cannot read back the tokenizer zip",
                          zip_source_error(sink.get()));
  }
  std::string bytes;
  zip_int64_t size = -1;
  if (zip_source_seek(sink.get(), 0, SEEK_END) == 0) {
    size = zip_source_tell(sink.get());
  }
  if (size >= 0 && zip_source_seek(sink.get(), 0, SEEK_SET) == 0) {
    bytes.resize(static_cast<size_t>(size));
    if (zip_source_read(sink.get(), bytes.data(), bytes.size()) != size) {
      size = -1;
    }
  }
  if (size < 0) {
    absl::Status status = ZipErrorStatus("cannot read back the tokenizer zip",
                                         zip_source_error(sink.get()));
    zip_source_close(sink.get());
    return status;
  }
  zip_source_close(sink.get());
  return bytes;
}

absl::StatusOr<std::string> Sha256Hex(const std::string& bytes) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int digest_size = 0;
  if (EVP_Digest(bytes.data(), bytes.size(), digest, &digest_size, EVP_sha256(),
                 nullptr) != 1) {
    return absl::InternalError("SHA-256 of the tokenizer zip failed");
  }
  return absl::BytesToHexString(
      absl::string_view(reinterpret_cast<const char*>(digest), digest_size));
}

std::string WhatIsLookedFor() {
  std::vector<absl::string_view> tokenizer_names;
  for (absl::string_view name : kExactNames) {
    if (!IsModelConfig(name)) tokenizer_names.push_back(name);
  }
  return absl::StrCat(absl::StrJoin(tokenizer_names, ", "),
                      " or any *.tiktoken, *.jinja or *.model file");
}

}  // namespace

absl::StatusOr<TokenizerBundle> BuildTokenizerBundle(
    const std::string& model_dir) {
  PDW_ASSIGN_OR_RETURN(const std::vector<std::string> listed,
                       ListDirectory(model_dir));
  const std::string dir_prefix =
      absl::EndsWith(model_dir, "/") ? model_dir : absl::StrCat(model_dir, "/");

  struct Selected {
    std::string name;
    std::string path;
    off_t size;
  };
  std::vector<Selected> selected;
  bool has_tokenizer_file = false;
  for (std::string& name : SelectCandidates(listed)) {
    std::string path = absl::StrCat(dir_prefix, name);
    struct stat info = {};
    // stat, not lstat: a Hugging Face cache snapshot links to its blobs.
    if (stat(path.c_str(), &info) != 0) {
      return absl::ErrnoToStatus(
          errno, absl::StrCat("cannot stat tokenizer file ", path));
    }
    if (!S_ISREG(info.st_mode)) continue;  // e.g. a directory named *.model
    has_tokenizer_file = has_tokenizer_file || !IsModelConfig(name);
    selected.push_back({std::move(name), std::move(path), info.st_size});
  }
  if (!has_tokenizer_file) {
    return absl::NotFoundError(absl::StrCat(
        "model directory ", model_dir,
        " holds no tokenizer file for GetTokenizer: looked for ",
        WhatIsLookedFor(),
        " (config.json and generation_config.json alone cannot tokenize)"));
  }

  std::vector<NamedFile> files;
  files.reserve(selected.size());
  for (Selected& file : selected) {
    PDW_ASSIGN_OR_RETURN(std::string contents,
                         ReadWholeFile(file.path, file.size));
    files.push_back({std::move(file.name), std::move(contents)});
  }

  TokenizerBundle bundle;
  PDW_ASSIGN_OR_RETURN(bundle.zip, ZipInMemory(files));
  PDW_ASSIGN_OR_RETURN(bundle.sha256_hex, Sha256Hex(bundle.zip));
  bundle.files.reserve(files.size());
  for (NamedFile& file : files) bundle.files.push_back(std::move(file.name));
  return bundle;
}

}  // namespace pdworker
