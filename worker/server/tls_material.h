// Checks the worker's TLS files before anything else starts: a key that does
// not match its certificate, or a file that is not PEM, would otherwise
// surface only after the model loaded, as gRPC failing to listen ("address
// in use"), which sends an SRE after the wrong problem.
#ifndef PDWORKER_WORKER_SERVER_TLS_MATERIAL_H_
#define PDWORKER_WORKER_SERVER_TLS_MATERIAL_H_

#include <string>

#include "absl/status/status.h"

namespace pdworker {

// One PEM file as a flag named it: errors say "--<flag> '<path>': why".
struct PemFile {
  std::string flag;  // e.g. "tls_cert"
  std::string path;
  std::string pem;  // the file's contents
};

// OK when `chain` holds one or more PEM certificates, each parsing as X.509,
// and nothing else but whitespace (or PEM blocks' explanatory text);
// INVALID_ARGUMENT naming the flag, the path and OpenSSL's reason otherwise.
absl::Status CheckCertificates(const PemFile& chain);

// OK when `key` is a PEM private key and it is the key of the first
// certificate of `cert` (the leaf); INVALID_ARGUMENT naming both otherwise.
absl::Status CheckKeyMatchesCertificate(const PemFile& key,
                                        const PemFile& cert);

}  // namespace pdworker

#endif  // PDWORKER_WORKER_SERVER_TLS_MATERIAL_H_
