// Throwaway TLS material for tests, made by the openssl command-line tool at
// test time: a CA, a server certificate for localhost / 127.0.0.1 and a
// client certificate, all signed by the CA.
#ifndef PDWORKER_TESTS_SERVER_TEST_CERTIFICATES_H_
#define PDWORKER_TESTS_SERVER_TEST_CERTIFICATES_H_

#include <string>

#include "absl/status/statusor.h"

namespace pdworker::server_testing {

struct TestCertificates {
  std::string dir;  // holds ca.crt, server.crt/.key, client.crt/.key
  std::string ca_pem;
  std::string server_cert_pem, server_key_pem;
  std::string client_cert_pem, client_key_pem;
};

// Writes the files under `dir` (created) and reads them back.
absl::StatusOr<TestCertificates> MakeTestCertificates(const std::string& dir);

}  // namespace pdworker::server_testing

#endif  // PDWORKER_TESTS_SERVER_TEST_CERTIFICATES_H_
