#include "worker/model/model_fingerprint.h"

#include <openssl/evp.h>
#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/types/span.h"
#include "common/dtype.h"
#include "worker/model/safetensors.h"

namespace pdworker {
namespace {

struct MdCtxDeleter {
  void operator()(EVP_MD_CTX* ctx) const { EVP_MD_CTX_free(ctx); }
};

// A streaming SHA-256; every OpenSSL failure becomes one Internal error at
// Finish, so callers feed it without checking each step.
class Sha256 {
 public:
  Sha256() : ctx_(EVP_MD_CTX_new()) {
    ok_ = ctx_ != nullptr &&
          EVP_DigestInit_ex(ctx_.get(), EVP_sha256(), nullptr) == 1;
  }

  void Update(absl::string_view bytes) {
    Update(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
  }
  void Update(const uint8_t* data, size_t size) {
    if (ok_ && size > 0) {
      ok_ = EVP_DigestUpdate(ctx_.get(), data, size) == 1;
    }
  }

  // 64 lowercase hex digits.
  absl::StatusOr<std::string> FinishHex(absl::string_view what) {
    unsigned char digest[EVP_MAX_MD_SIZE];
    unsigned int digest_size = 0;
    if (!ok_ || EVP_DigestFinal_ex(ctx_.get(), digest, &digest_size) != 1) {
      return absl::InternalError(absl::StrCat("SHA-256 of ", what, " failed"));
    }
    return absl::BytesToHexString(
        absl::string_view(reinterpret_cast<const char*>(digest), digest_size));
  }

 private:
  std::unique_ptr<EVP_MD_CTX, MdCtxDeleter> ctx_;
  bool ok_ = false;
};

}  // namespace

absl::StatusOr<std::string> WeightsDigest(const Checkpoint& checkpoint,
                                          int threads) {
  // The leaves in root order: every tensor's chunks, tensors by name.
  const std::vector<std::string> names = checkpoint.TensorNames();
  std::vector<absl::Span<const uint8_t>> chunks;
  for (const std::string& name : names) {
    const absl::Span<const uint8_t> bytes = checkpoint.Find(name)->bytes;
    for (size_t at = 0; at < bytes.size(); at += kWeightsDigestChunkBytes) {
      chunks.push_back(bytes.subspan(at, kWeightsDigestChunkBytes));
    }
  }

  // Workers take the next chunk until none is left, so a slow thread (a
  // core shared with the loader) costs no more than its own chunks.
  std::vector<XXH128_canonical_t> leaves(chunks.size());
  std::atomic<size_t> next{0};
  const auto hash_chunks = [&] {
    for (size_t i = next.fetch_add(1); i < chunks.size();
         i = next.fetch_add(1)) {
      XXH128_canonicalFromHash(
          &leaves[i], XXH3_128bits(chunks[i].data(), chunks[i].size()));
    }
  };
  if (threads <= 0) {
    threads = static_cast<int>(std::thread::hardware_concurrency());
  }
  threads = static_cast<int>(
      std::clamp<size_t>(static_cast<size_t>(std::max(threads, 1)), 1,
                         std::max<size_t>(chunks.size(), 1)));
  {
    std::vector<std::thread> helpers;
    helpers.reserve(threads - 1);
    for (int t = 1; t < threads; ++t) helpers.emplace_back(hash_chunks);
    hash_chunks();
    for (std::thread& helper : helpers) helper.join();
  }
  const std::string what =
      absl::StrCat("the weights of ", checkpoint.model_dir());

  // The root. The name is length-prefixed and the byte count (which fixes
  // the number of leaves that follow) precedes the leaves, so no two
  // different checkpoints feed the same stream.
  Sha256 root;
  root.Update(absl::StrCat(kWeightsDigestScheme,
                           ";chunk=", kWeightsDigestChunkBytes, ";"));
  size_t leaf = 0;
  for (const std::string& name : names) {
    const TensorInfo& info = *checkpoint.Find(name);
    root.Update(absl::StrCat(
        name.size(), ":", name, ";", SafetensorsDTypeName(info.dtype), ";",
        absl::StrJoin(info.shape, ","), ";", info.bytes.size(), ";"));
    for (size_t at = 0; at < info.bytes.size();
         at += kWeightsDigestChunkBytes) {
      root.Update(leaves[leaf].digest, sizeof(leaves[leaf].digest));
      ++leaf;
    }
  }
  return root.FinishHex(what);
}

absl::StatusOr<std::string> ModelFingerprint(const ModelConfig& config,
                                             absl::string_view weights_digest) {
  Sha256 sha;
  sha.Update(absl::StrCat("shape=", config.CanonicalString(),
                          ";weights=", weights_digest));
  return sha.FinishHex("the model fingerprint");
}

}  // namespace pdworker
