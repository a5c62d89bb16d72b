#include "worker/model/model_fingerprint.h"

#include <openssl/evp.h>

#include <memory>

#include "absl/status/status.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
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

absl::StatusOr<std::string> WeightsDigest(const Checkpoint& checkpoint) {
  Sha256 sha;
  // TensorNames() is sorted, so the digest does not depend on file order,
  // sharding or offsets. The name is length-prefixed and the byte count
  // precedes the bytes, so no two different checkpoints feed the same stream.
  for (const std::string& name : checkpoint.TensorNames()) {
    const TensorInfo& info = *checkpoint.Find(name);
    sha.Update(absl::StrCat(
        name.size(), ":", name, ";", SafetensorsDTypeName(info.dtype), ";",
        absl::StrJoin(info.shape, ","), ";", info.bytes.size(), ";"));
    sha.Update(info.bytes.data(), info.bytes.size());
  }
  return sha.FinishHex(absl::StrCat("the weights of ", checkpoint.model_dir()));
}

absl::StatusOr<std::string> ModelFingerprint(const ModelConfig& config,
                                             absl::string_view weights_digest) {
  Sha256 sha;
  sha.Update(absl::StrCat("shape=", config.CanonicalString(),
                          ";weights=", weights_digest));
  return sha.FinishHex("the model fingerprint");
}

}  // namespace pdworker
