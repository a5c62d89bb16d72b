#include "worker/kv_cache/block_hash.h"

#include <openssl/sha.h>

#include <cstring>

#include "glog/logging.h"

namespace pdworker {
namespace {

constexpr char kRootPrefix[] = "pdworker-prefix-cache-v1";

}  // namespace

BlockHasher::BlockHasher(absl::string_view salt, int32_t block_size)
    : block_size_(block_size) {
  CHECK_GT(block_size, 0);
  CHECK_LE(block_size, kMaxHashedBlockSize);
  // The prefix's terminating NUL separates it from the salt.
  std::string text(kRootPrefix, sizeof(kRootPrefix));
  text.append(salt.data(), salt.size());
  SHA256(reinterpret_cast<const unsigned char*>(text.data()), text.size(),
         root_.data());
}

BlockHash BlockHasher::Hash(const BlockHash& parent,
                            absl::Span<const int32_t> token_ids) const {
  CHECK_EQ(static_cast<int32_t>(token_ids.size()), block_size_);
  // parent || token ids, little-endian int32 on every host we build for
  // (x86-64, aarch64). The one-shot SHA256(): OpenSSL 3 deprecates the
  // SHA256_Init/Update/Final steps.
  uint8_t buffer[sizeof(BlockHash) + kMaxHashedBlockSize * sizeof(int32_t)];
  std::memcpy(buffer, parent.data(), parent.size());
  std::memcpy(buffer + parent.size(), token_ids.data(),
              token_ids.size() * sizeof(int32_t));
  BlockHash out;
  SHA256(buffer, parent.size() + token_ids.size() * sizeof(int32_t),
         out.data());
  return out;
}

void BlockHasher::HashFullBlocks(absl::Span<const int32_t> token_ids,
                                 std::vector<BlockHash>* hashes) const {
  const size_t full = token_ids.size() / block_size_;
  for (size_t b = hashes->size(); b < full; ++b) {
    const BlockHash& parent = b == 0 ? root_ : (*hashes)[b - 1];
    hashes->push_back(
        Hash(parent, token_ids.subspan(b * block_size_, block_size_)));
  }
}

ExternalBlockHash BlockHasher::External(const BlockHash& hash) {
  ExternalBlockHash v = 0;
  for (int i = 0; i < 8; ++i) v = (v << 8) | hash[i];
  return v;
}

}  // namespace pdworker
