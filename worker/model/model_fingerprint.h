// The worker's model fingerprint: which model a KV cache was computed by.
// Two workers exchange KV (P/D handoff) only when their fingerprints are
// equal, so the fingerprint must identify the weights as well as the shape:
// a base checkpoint and its instruct fine-tune share config.json
// (ModelConfig::Fingerprint() alone calls them equal) yet compute different
// K/V for the same tokens.
//
// What is hashed: a two-level tree, so the leaves can be hashed on several
// threads and the digest does not depend on how many.
//   Leaves: every tensor's bytes cut into chunks of kWeightsDigestChunkBytes
//     (16 MiB; the last chunk of a tensor shorter, an empty tensor none);
//     leaf = XXH3-128(chunk bytes) (libxxhash, seed 0), its 16-byte
//     canonical (big-endian) form.
//   WeightsDigest = SHA-256 of the stream
//       "pdworker-weights-v3;chunk=16777216;"
//     then, for every tensor of the checkpoint in name order, the record
//       "<len(name)>:<name>;<dtype>;<dim>,<dim>,...;<byte length>;"
//     followed by its leaves in byte order (ceil(byte length / 16 MiB) of
//     them). The byte length fixes how many leaves follow, so the stream
//     parses one way only: any changed byte changes its leaf (XXH3-128:
//     a 2^-128 chance per chunk that it does not) and so the root
//     (SHA-256, OpenSSL EVP). Not hashed: file names,
//     sharding, data offsets, header padding and "__metadata__", so the
//     same weights saved in another directory, resharded or with tensors in
//     another order keep their digest; any changed value, name, dtype or
//     shape changes it.
//   ModelFingerprint: "shape=<ModelConfig::CanonicalString()>;weights=<digest>"
//     (the canonical string covers exactly what ModelConfig::Fingerprint()
//     does: architecture, sizes, heads, eps, RoPE, vocab, tying, biases).
// Both sides of a P/D handoff compare ModelFingerprint(), so every worker
// and tool computing it must use this exact scheme; changing the chunk size
// or the record is a new scheme name.
//
// Every byte, not a sample: a fine-tune may change only a few rows (new
// special tokens' embeddings), which evenly spaced windows would miss.
// XXH3 for the leaves rather than SHA-256 (scheme v2): the digest tells a
// worker that its peer loaded the same bytes (a wrong or half-copied
// checkpoint, another revision), which needs every changed byte to change
// it, not resistance to a crafted collision: whoever can write the
// checkpoint can change the weights anyway, and the model store's own
// SHA-256 (Hugging Face's LFS pointers) is what guards against tampering.
// SHA-256 with SHA-NI runs ~1.6 GB/s per core, which on a 2-core host made
// the digest alone 3-5x `cat` of the files; XXH3 runs at memory speed.
// The root stays SHA-256 (a few KiB of records and leaves). Costs are in
// bench/RESULTS.md ("Model load time"): //bench:load_time_bench times `cat`
// of the files against the load and this digest in one run.
#ifndef PDWORKER_WORKER_MODEL_MODEL_FINGERPRINT_H_
#define PDWORKER_WORKER_MODEL_MODEL_FINGERPRINT_H_

#include <cstddef>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "worker/model/checkpoint.h"
#include "worker/model/model_config.h"

namespace pdworker {

inline constexpr char kWeightsDigestScheme[] = "pdworker-weights-v3";
inline constexpr size_t kWeightsDigestChunkBytes = size_t{16} << 20;

// The tree digest of the checkpoint's tensors described above: 64 lowercase
// hex digits, the same for any `threads`. Hashes the leaves on `threads`
// threads (the caller's among them; <= 0: one per hardware thread).
// Internal only if OpenSSL fails (the root).
absl::StatusOr<std::string> WeightsDigest(const Checkpoint& checkpoint,
                                          int threads = 0);

// The worker's fingerprint (WorkerStatus, KV handles, PullKv, the info
// metric): SHA-256 of the shape and the weights digest, 64 lowercase hex
// digits. Internal only if OpenSSL fails.
absl::StatusOr<std::string> ModelFingerprint(const ModelConfig& config,
                                             absl::string_view weights_digest);

}  // namespace pdworker

#endif  // PDWORKER_WORKER_MODEL_MODEL_FINGERPRINT_H_
