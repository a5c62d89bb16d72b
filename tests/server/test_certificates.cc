#include "tests/server/test_certificates.h"

#include <cstdlib>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"

namespace pdworker::server_testing {
namespace {

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  std::ostringstream contents;
  contents << in.rdbuf();
  return contents.str();
}

}  // namespace

absl::StatusOr<TestCertificates> MakeTestCertificates(const std::string& dir) {
  // EC keys: fast to generate. Short validity: these never leave the test.
  const std::string key =
      "-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes";
  const std::string script = absl::StrCat(
      "set -e; mkdir -p '", dir, "'; cd '", dir, "';", "openssl req -x509 ",
      key, " -keyout ca.key -out ca.crt -days 2 -subj /CN=pdworker-test-ca;",
      "openssl req ", key,
      " -keyout server.key -out server.csr -subj /CN=localhost;",
      "printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\\n' > server.ext;",
      "openssl x509 -req -in server.csr -CA ca.crt -CAkey ca.key ",
      "-CAcreateserial -out server.crt -days 2 -extfile server.ext;",
      "openssl req ", key,
      " -keyout client.key -out client.csr -subj /CN=pdworker-test-client;",
      "printf 'extendedKeyUsage=clientAuth\\n' > client.ext;",
      "openssl x509 -req -in client.csr -CA ca.crt -CAkey ca.key ",
      "-CAcreateserial -out client.crt -days 2 -extfile client.ext");
  const std::string command =
      absl::StrCat("sh -c \"", script, "\" > '", dir, ".log' 2>&1");
  if (std::system(command.c_str()) != 0) {
    return absl::InternalError(
        absl::StrCat("openssl failed (is it installed?); see ", dir, ".log"));
  }
  TestCertificates c;
  c.dir = dir;
  struct File {
    std::string* out;
    const char* name;
  };
  for (const File& f :
       {File{&c.ca_pem, "ca.crt"}, File{&c.server_cert_pem, "server.crt"},
        File{&c.server_key_pem, "server.key"},
        File{&c.client_cert_pem, "client.crt"},
        File{&c.client_key_pem, "client.key"}}) {
    absl::StatusOr<std::string> pem = ReadFile(absl::StrCat(dir, "/", f.name));
    if (!pem.ok()) return pem.status();
    *f.out = *std::move(pem);
  }
  return c;
}

}  // namespace pdworker::server_testing
