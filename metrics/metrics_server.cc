#include "metrics/metrics_server.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <exception>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "prometheus/text_serializer.h"

namespace pdworker {
namespace {

// Budget for one connection: request in, response out.
constexpr std::chrono::seconds kRequestTimeout(5);
// Longest request head we read (request line + headers).
constexpr size_t kMaxRequestBytes = 8192;

constexpr char kExpositionContentType[] =
    "text/plain; version=0.0.4; charset=utf-8";

// Closes a file descriptor on every early return in Start().
class ScopedFd {
 public:
  explicit ScopedFd(int fd = -1) : fd_(fd) {}
  ~ScopedFd() {
    if (fd_ >= 0) close(fd_);
  }
  ScopedFd(const ScopedFd&) = delete;
  ScopedFd& operator=(const ScopedFd&) = delete;
  int get() const { return fd_; }
  int release() { return std::exchange(fd_, -1); }
  void reset(int fd) {
    if (fd_ >= 0) close(fd_);
    fd_ = fd;
  }

 private:
  int fd_;
};

std::string ErrnoText() { return strerror(errno); }

// Milliseconds left until `deadline`, at least 0.
int RemainingMs(std::chrono::steady_clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
      deadline - std::chrono::steady_clock::now());
  return left.count() > 0 ? static_cast<int>(left.count()) : 0;
}

// Waits for `events` on `fd` until `deadline`; false on timeout, error or
// hang-up without the event.
bool WaitFor(int fd, short events,
             std::chrono::steady_clock::time_point deadline) {
  while (true) {
    pollfd p{fd, events, 0};
    const int n = poll(&p, 1, RemainingMs(deadline));
    if (n < 0 && errno == EINTR) continue;
    return n > 0 && (p.revents & events) != 0;
  }
}

std::string Response(absl::string_view status, absl::string_view content_type,
                     absl::string_view body, bool include_body) {
  return absl::StrCat("HTTP/1.1 ", status, "\r\nContent-Type: ", content_type,
                      "\r\nContent-Length: ", body.size(),
                      "\r\nConnection: close\r\n\r\n",
                      include_body ? body : "");
}

std::string TextResponse(absl::string_view status, absl::string_view body) {
  return Response(status, "text/plain; charset=utf-8", body, true);
}

}  // namespace

absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Start(
    const std::string& bind_address,
    std::shared_ptr<prometheus::Registry> registry) {
  if (registry == nullptr) {
    return absl::InvalidArgumentError("MetricsServer: registry is null");
  }
  const auto invalid = [&bind_address](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat(
        "metrics bind address '", bind_address, "' ", why,
        " (want host:port, e.g. 0.0.0.0:9090, 127.0.0.1:0 or [::]:9090)"));
  };
  // host:port, or [host]:port for IPv6. A bare port would silently bind
  // every interface: the scope must be explicit.
  const size_t colon = bind_address.rfind(':');
  if (colon == std::string::npos || colon == 0) {
    return invalid("has no host");
  }
  std::string host = bind_address.substr(0, colon);
  const std::string port_text = bind_address.substr(colon + 1);
  int requested_port = -1;
  if (!absl::SimpleAtoi(port_text, &requested_port) || requested_port < 0 ||
      requested_port > 65535) {
    return invalid("has no valid port");
  }
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }

  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* resolved = nullptr;
  const int gai =
      getaddrinfo(host.c_str(), port_text.c_str(), &hints, &resolved);
  if (gai != 0) return invalid(gai_strerror(gai));
  std::unique_ptr<addrinfo, decltype(&freeaddrinfo)> addresses(resolved,
                                                               freeaddrinfo);

  ScopedFd listen_fd;
  std::string last_error = "no address";
  for (addrinfo* a = addresses.get(); a != nullptr; a = a->ai_next) {
    ScopedFd fd(
        socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol));
    if (fd.get() < 0) {
      last_error = ErrnoText();
      continue;
    }
    // Restarts may rebind while old connections sit in TIME_WAIT; a live
    // listener on the port still makes bind() fail.
    const int one = 1;
    setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(fd.get(), a->ai_addr, a->ai_addrlen) != 0 ||
        listen(fd.get(), 64) != 0) {
      last_error = ErrnoText();
      continue;
    }
    listen_fd.reset(fd.release());
    break;
  }
  if (listen_fd.get() < 0) {
    return absl::UnavailableError(absl::StrCat("cannot serve metrics on ",
                                               bind_address, ": ", last_error));
  }

  sockaddr_storage bound{};
  socklen_t bound_len = sizeof(bound);
  if (getsockname(listen_fd.get(), reinterpret_cast<sockaddr*>(&bound),
                  &bound_len) != 0) {
    return absl::UnavailableError(
        absl::StrCat("getsockname on ", bind_address, ": ", ErrnoText()));
  }
  const int port =
      ntohs(bound.ss_family == AF_INET6
                ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);

  int wake[2];
  if (pipe2(wake, O_CLOEXEC) != 0) {
    return absl::UnavailableError(absl::StrCat("pipe: ", ErrnoText()));
  }
  return std::unique_ptr<MetricsServer>(new MetricsServer(
      std::move(registry), listen_fd.release(), wake[0], wake[1], port));
}

MetricsServer::MetricsServer(std::shared_ptr<prometheus::Registry> registry,
                             int listen_fd, int wake_read_fd, int wake_write_fd,
                             int port)
    : registry_(std::move(registry)),
      listen_fd_(listen_fd),
      wake_read_fd_(wake_read_fd),
      wake_write_fd_(wake_write_fd),
      port_(port) {
  for (int i = 0; i < kNumWorkers; ++i) {
    workers_.emplace_back(&MetricsServer::WorkerLoop, this);
  }
  acceptor_ = std::thread(&MetricsServer::AcceptLoop, this);
}

MetricsServer::~MetricsServer() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    for (int fd : active_) shutdown(fd, SHUT_RDWR);
  }
  work_.notify_all();
  const char byte = 0;
  // The pipe is empty and never written otherwise: this cannot block.
  (void)!write(wake_write_fd_, &byte, 1);
  acceptor_.join();
  for (std::thread& worker : workers_) worker.join();
  for (int fd : pending_) close(fd);
  close(listen_fd_);
  close(wake_read_fd_);
  close(wake_write_fd_);
}

void MetricsServer::AcceptLoop() {
  while (true) {
    pollfd fds[2] = {{listen_fd_, POLLIN, 0}, {wake_read_fd_, POLLIN, 0}};
    if (poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      return;  // cannot happen with valid fds; the destructor still joins
    }
    if (fds[1].revents != 0) return;  // shutting down
    if ((fds[0].revents & POLLIN) == 0) continue;
    const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;  // e.g. the peer gave up already, or EMFILE
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!stopping_ && pending_.size() < kMaxPendingConnections) {
        pending_.push_back(fd);
        work_.notify_one();
        continue;
      }
    }
    close(fd);  // overloaded (or stopping): shed the connection
  }
}

void MetricsServer::WorkerLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    work_.wait(lock, [this] { return stopping_ || !pending_.empty(); });
    if (stopping_) return;
    const int fd = pending_.front();
    pending_.pop_front();
    active_.insert(fd);
    lock.unlock();
    Serve(fd);
    lock.lock();
    // Unregister before closing so the destructor never shuts down a reused
    // descriptor number.
    active_.erase(fd);
    close(fd);
  }
}

void MetricsServer::Serve(int fd) {
  const auto deadline = std::chrono::steady_clock::now() + kRequestTimeout;
  std::string request;
  char buf[2048];
  while (request.find("\r\n\r\n") == std::string::npos &&
         request.find("\n\n") == std::string::npos) {
    if (request.size() > kMaxRequestBytes || !WaitFor(fd, POLLIN, deadline)) {
      return;  // too long, too slow, or shut down: drop it
    }
    const ssize_t n = recv(fd, buf, sizeof(buf), 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    request.append(buf, static_cast<size_t>(n));
  }

  // "METHOD TARGET HTTP/x.y"
  const absl::string_view request_line =
      absl::string_view(request).substr(0, request.find_first_of("\r\n"));
  const std::vector<absl::string_view> parts =
      absl::StrSplit(request_line, ' ', absl::SkipEmpty());
  std::string response;
  if (parts.size() != 3 || !absl::StartsWith(parts[2], "HTTP/")) {
    response = TextResponse("400 Bad Request", "malformed request\n");
  } else if (parts[0] != "GET" && parts[0] != "HEAD") {
    response = TextResponse("405 Method Not Allowed", "GET only\n");
  } else {
    const absl::string_view path = parts[1].substr(0, parts[1].find('?'));
    if (path == "/metrics") {
      std::string body;
      try {
        body = prometheus::TextSerializer().Serialize(registry_->Collect());
      } catch (const std::exception& e) {
        body.clear();
        response = TextResponse("500 Internal Server Error",
                                absl::StrCat(e.what(), "\n"));
      }
      if (response.empty()) {
        response = Response("200 OK", kExpositionContentType, body,
                            /*include_body=*/parts[0] == "GET");
      }
    } else if (path == "/") {
      response = TextResponse("200 OK", "pdworker metrics: see /metrics\n");
    } else {
      response = TextResponse("404 Not Found", "see /metrics\n");
    }
  }

  size_t sent = 0;
  while (sent < response.size()) {
    if (!WaitFor(fd, POLLOUT, deadline)) return;
    // MSG_NOSIGNAL: a client that hung up must not SIGPIPE the worker.
    const ssize_t n =
        send(fd, response.data() + sent, response.size() - sent, MSG_NOSIGNAL);
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (n <= 0) return;
    sent += static_cast<size_t>(n);
  }
}

}  // namespace pdworker
