// The worker's model fingerprint: which model a KV cache was computed by.
// Two workers exchange KV (P/D handoff) only when their fingerprints are
// equal, so the fingerprint must identify the weights as well as the shape:
// a base checkpoint and its instruct fine-tune share config.json
// (ModelConfig::Fingerprint() alone calls them equal) yet compute different
// K/V for the same tokens.
//
// What is hashed (SHA-256, OpenSSL EVP):
//   WeightsDigest: for every tensor of the checkpoint, in name order, the
//     record "<len(name)>:<name>;<dtype>;<dim>,<dim>,...;<byte length>;"
//     followed by ALL of the tensor's bytes. Not hashed: file names, sharding,
//     data offsets, header padding and "__metadata__", so the same weights
//     saved in another directory, resharded or with tensors in another order
//     keep their digest; any changed value, name, dtype or shape changes it.
//   ModelFingerprint: "shape=<ModelConfig::CanonicalString()>;weights=<digest>"
//     (the canonical string covers exactly what ModelConfig::Fingerprint()
//     does: architecture, sizes, heads, eps, RoPE, vocab, tying, biases).
//
// Every byte, not a sample: a fine-tune may change only a few rows (new
// special tokens' embeddings), which evenly spaced windows would miss, and a
// full hash costs well under the budget of one second per GB. Measured with
// //bench:weights_digest_bench (--config=opt, one core of a shared 2-core AMD
// EPYC with SHA-NI, OpenSSL 3.0.19, page cache warm, checkpoint mapped once as
// at load), llama_1b shape in bf16, 2.47 GB in 146 tensors, best of 3, three
// runs: SHA-256 of every tensor 1.55-1.61 s = 0.63-0.65 s/GB (1.55-1.60 GB/s;
// `openssl speed -evp sha256` says 1.69 GB/s); converting the same tensors to
// float32, as the CPU backend's load does, 0.78-1.35 s/GB. BLAKE2b-512 is
// slower here (0.89 GB/s), and so is common/fnv1a.h's byte-at-a-time loop
// (0.65-0.83 GB/s over 1 GiB in memory, g++ -O2). So a 16 GB (8B bf16)
// checkpoint adds ~10 s to a start that reads all of it anyway.
#ifndef PDWORKER_WORKER_MODEL_MODEL_FINGERPRINT_H_
#define PDWORKER_WORKER_MODEL_MODEL_FINGERPRINT_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "worker/model/checkpoint.h"
#include "worker/model/model_config.h"

namespace pdworker {

// SHA-256 of the checkpoint's tensors as described above: 64 lowercase hex
// digits. Internal only if OpenSSL fails.
absl::StatusOr<std::string> WeightsDigest(const Checkpoint& checkpoint);

// The worker's fingerprint (WorkerStatus, KV handles, PullKv, the info
// metric): SHA-256 of the shape and the weights digest, 64 lowercase hex
// digits. Internal only if OpenSSL fails.
absl::StatusOr<std::string> ModelFingerprint(const ModelConfig& config,
                                             absl::string_view weights_digest);

}  // namespace pdworker

#endif  // PDWORKER_WORKER_MODEL_MODEL_FINGERPRINT_H_
