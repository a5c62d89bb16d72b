#include "worker/server/tls_material.h"

#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>

#include <memory>
#include <string>

#include "absl/strings/str_cat.h"

namespace pdworker {
namespace {

struct BioFree {
  void operator()(BIO* b) const { BIO_free(b); }
};
struct X509Free {
  void operator()(X509* x) const { X509_free(x); }
};
struct KeyFree {
  void operator()(EVP_PKEY* k) const { EVP_PKEY_free(k); }
};
using BioPtr = std::unique_ptr<BIO, BioFree>;
using X509Ptr = std::unique_ptr<X509, X509Free>;
using KeyPtr = std::unique_ptr<EVP_PKEY, KeyFree>;

// OpenSSL's queued errors as one line (and the queue emptied, so the next
// check starts clean).
std::string OpenSslReason() {
  std::string reason;
  while (const unsigned long e = ERR_get_error()) {
    char buf[256];
    ERR_error_string_n(e, buf, sizeof(buf));
    if (!reason.empty()) reason += "; ";
    reason += buf;
  }
  return reason.empty() ? "no PEM data" : reason;
}

absl::Status Invalid(const PemFile& file, const std::string& why) {
  return absl::InvalidArgumentError(
      absl::StrCat("--", file.flag, " '", file.path, "': ", why));
}

BioPtr ReadOnlyBio(const std::string& pem) {
  return BioPtr(BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())));
}

}  // namespace

absl::Status CheckCertificates(const PemFile& chain) {
  ERR_clear_error();
  BioPtr bio = ReadOnlyBio(chain.pem);
  int count = 0;
  while (true) {
    X509Ptr cert(PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr));
    if (cert != nullptr) {
      ++count;
      continue;
    }
    // The end of the data after at least one certificate is the good end;
    // anything else (no PEM at all, a damaged block) is the reason.
    const unsigned long e = ERR_peek_last_error();
    if (count > 0 && ERR_GET_LIB(e) == ERR_LIB_PEM &&
        ERR_GET_REASON(e) == PEM_R_NO_START_LINE) {
      ERR_clear_error();
      return absl::OkStatus();
    }
    const std::string reason = OpenSslReason();
    if (count == 0) {
      return Invalid(chain,
                     absl::StrCat("is not a PEM certificate (", reason, ")"));
    }
    return Invalid(chain, absl::StrCat("certificate ", count + 1,
                                       " does not parse (", reason, ")"));
  }
}

absl::Status CheckKeyMatchesCertificate(const PemFile& key,
                                        const PemFile& cert) {
  ERR_clear_error();
  BioPtr key_bio = ReadOnlyBio(key.pem);
  KeyPtr private_key(
      PEM_read_bio_PrivateKey(key_bio.get(), nullptr, nullptr, nullptr));
  if (private_key == nullptr) {
    return Invalid(key, absl::StrCat("is not a PEM private key (or is "
                                     "encrypted) (",
                                     OpenSslReason(), ")"));
  }
  BioPtr cert_bio = ReadOnlyBio(cert.pem);
  X509Ptr leaf(PEM_read_bio_X509(cert_bio.get(), nullptr, nullptr, nullptr));
  if (leaf == nullptr) {
    return Invalid(
        cert, absl::StrCat("is not a PEM certificate (", OpenSslReason(), ")"));
  }
  if (X509_check_private_key(leaf.get(), private_key.get()) != 1) {
    ERR_clear_error();
    return Invalid(key, absl::StrCat("is not the private key of the first "
                                     "certificate in --",
                                     cert.flag, " '", cert.path, "'"));
  }
  return absl::OkStatus();
}

}  // namespace pdworker
