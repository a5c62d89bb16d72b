#include "tests/metrics/metrics_test_util.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <sstream>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "gtest/gtest.h"
#include "prometheus/text_serializer.h"

namespace pdworker::testing {

std::string Serialize(const prometheus::Collectable& collectable) {
  return prometheus::TextSerializer().Serialize(collectable.Collect());
}

std::vector<std::string> Samples(const std::string& text,
                                 const std::string& name) {
  std::vector<std::string> out;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (line.empty() || line[0] == '#') continue;
    const size_t end = line.find_first_of("{ ");
    if (end == absl::string_view::npos) continue;
    if (line.substr(0, end) == name) out.emplace_back(line);
  }
  return out;
}

namespace {

// Closes the socket on every path.
class Socket {
 public:
  Socket() : fd_(socket(AF_INET, SOCK_STREAM, 0)) {}
  ~Socket() {
    if (fd_ >= 0) close(fd_);
  }
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;
  int fd() const { return fd_; }

 private:
  int fd_;
};

sockaddr_in Loopback(int port) {
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  return addr;
}

absl::Status Errno(absl::string_view what) {
  return absl::UnavailableError(absl::StrCat(what, ": ", strerror(errno)));
}

}  // namespace

int ConnectLoopback(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  sockaddr_in addr = Loopback(port);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

absl::StatusOr<HttpResponse> HttpGet(int port, const std::string& target) {
  return HttpExchange(
      port,
      absl::StrCat("GET ", target, " HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n"));
}

absl::StatusOr<HttpResponse> HttpExchange(int port,
                                          const std::string& request) {
  Socket sock;
  if (sock.fd() < 0) return Errno("socket");
  // Bounded: a wedged server fails the test instead of hanging it.
  timeval timeout{10, 0};
  setsockopt(sock.fd(), SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  setsockopt(sock.fd(), SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof(timeout));
  sockaddr_in addr = Loopback(port);
  if (connect(sock.fd(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) !=
      0) {
    return Errno(absl::StrCat("connect to port ", port));
  }
  if (send(sock.fd(), request.data(), request.size(), MSG_NOSIGNAL) !=
      static_cast<ssize_t>(request.size())) {
    return Errno("send");
  }
  std::string raw;
  char buf[4096];
  ssize_t n;
  while ((n = read(sock.fd(), buf, sizeof(buf))) > 0) raw.append(buf, n);
  if (n < 0) return Errno("read");

  const size_t header_end = raw.find("\r\n\r\n");
  if (header_end == std::string::npos) {
    return absl::DataLossError(absl::StrCat("no HTTP header in: ", raw));
  }
  // "HTTP/1.x NNN reason"
  std::vector<absl::string_view> status_line =
      absl::StrSplit(absl::string_view(raw).substr(0, raw.find("\r\n")), ' ');
  HttpResponse response;
  if (status_line.size() < 2 ||
      !absl::SimpleAtoi(status_line[1], &response.status)) {
    return absl::DataLossError(absl::StrCat("bad status line in: ", raw));
  }
  response.body = raw.substr(header_end + 4);
  return response;
}

absl::StatusOr<int> PickFreePort() {
  Socket sock;
  if (sock.fd() < 0) return Errno("socket");
  sockaddr_in addr = Loopback(0);
  if (bind(sock.fd(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    return Errno("bind");
  }
  socklen_t len = sizeof(addr);
  if (getsockname(sock.fd(), reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    return Errno("getsockname");
  }
  return ntohs(addr.sin_port);
}

std::string TestTmpDir() {
  const char* dir = std::getenv("TEST_TMPDIR");
  return dir != nullptr && *dir != '\0' ? std::string(dir)
                                        : ::testing::TempDir();
}

}  // namespace pdworker::testing
