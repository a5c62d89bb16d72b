// The archive GetTokenizer streams to a router (SMG), which tokenizes on its
// side: the model directory's tokenizer files in one ZIP, with the SHA-256
// the router checks after concatenating the chunks.
#ifndef PDWORKER_WORKER_SERVER_TOKENIZER_BUNDLE_H_
#define PDWORKER_WORKER_SERVER_TOKENIZER_BUNDLE_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace pdworker {

struct TokenizerBundle {
  std::string zip;                 // the archive bytes
  std::string sha256_hex;          // of `zip`, lowercase hex, 64 chars
  std::vector<std::string> files;  // the names in the archive, in archive order
};

// The tokenizer files of a Hugging Face model directory, zipped (deflate).
// Exact names: tokenizer.json, tokenizer_config.json, config.json,
// generation_config.json, special_tokens_map.json, vocab.json, merges.txt,
// tokenizer.model, tiktoken.model, chat_template.json,
// preprocessor_config.json, processor_config.json,
// video_preprocessor_config.json; then any other *.tiktoken, *.jinja, *.model
// file, each once, in sorted order; regular files only, flat (no
// directories); what SMG's servicers ship. Symlinks are followed (a Hugging
// Face cache snapshot is made of them); a dangling one is an error, not a
// file silently left out.
//
// Deterministic: every entry has the same DOS timestamp (1980-01-01 00:00)
// and mode 0644, so the same files give the same bytes and SHA-256.
//
// NOT_FOUND naming the directory when it holds no tokenizer file at all
// (config.json and generation_config.json alone do not count: a router
// cannot tokenize with them), with a message telling the operator what is
// looked for; other errors (unreadable file, zip failure) as INTERNAL /
// the errno's code, naming the file.
absl::StatusOr<TokenizerBundle> BuildTokenizerBundle(
    const std::string& model_dir);

}  // namespace pdworker

#endif  // PDWORKER_WORKER_SERVER_TOKENIZER_BUNDLE_H_
