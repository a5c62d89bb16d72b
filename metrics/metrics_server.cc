#include "metrics/metrics_server.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <exception>
#include <list>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "prometheus/text_serializer.h"

namespace pdworker {
namespace {

using Clock = std::chrono::steady_clock;

// Longest request head we read (request line + headers); Prometheus sends
// ~300 bytes.
constexpr size_t kMaxRequestBytes = 8192;
// How long accepting pauses when the process is out of fds and no connection
// can be evicted: the listening socket stays readable, so retrying at once
// would spin.
constexpr std::chrono::milliseconds kAcceptPause(100);

constexpr char kExpositionContentType[] =
    "text/plain; version=0.0.4; charset=utf-8";

// Closes a file descriptor on every early return in Start() and when a
// connection leaves the event loop.
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

// One client connection, owned by the event loop. It first reads a request
// head, then (response non-empty) writes the response; either way it is
// closed at `deadline`.
struct Connection {
  Connection(int fd, Clock::time_point deadline) : fd(fd), deadline(deadline) {}

  bool answering() const { return !response.empty(); }

  ScopedFd fd;
  Clock::time_point deadline;
  std::string request;   // the head so far, at most kMaxRequestBytes
  std::string response;  // status line, headers and body
  size_t sent = 0;       // bytes of `response` already written
};

enum class ReadResult { kPartial, kComplete, kFailed };

// Takes what has arrived on `c` (the socket is non-blocking). kFailed: the
// peer hung up, errored, or sent a head longer than kMaxRequestBytes.
ReadResult ReadRequest(Connection& c) {
  char buf[kMaxRequestBytes];
  const ssize_t n =
      recv(c.fd.get(), buf, kMaxRequestBytes - c.request.size(), 0);
  if (n < 0) {
    return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR
               ? ReadResult::kPartial
               : ReadResult::kFailed;
  }
  if (n == 0) return ReadResult::kFailed;
  // Only the new bytes (and 3 before them) can complete the blank line, so a
  // client trickling one byte at a time costs O(bytes), not O(bytes^2).
  const size_t scan_from = c.request.size() < 3 ? 0 : c.request.size() - 3;
  c.request.append(buf, static_cast<size_t>(n));
  if (c.request.find("\r\n\r\n", scan_from) != std::string::npos ||
      c.request.find("\n\n", scan_from) != std::string::npos) {
    return ReadResult::kComplete;
  }
  return c.request.size() < kMaxRequestBytes ? ReadResult::kPartial
                                             : ReadResult::kFailed;
}

// Writes as much of the response as the socket takes; true once `c` is
// finished (everything sent, or the peer is gone).
bool WriteResponse(Connection& c) {
  while (c.sent < c.response.size()) {
    // MSG_NOSIGNAL: a client that hung up must not SIGPIPE the worker.
    const ssize_t n = send(c.fd.get(), c.response.data() + c.sent,
                           c.response.size() - c.sent, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return false;
    if (n <= 0) return true;
    c.sent += static_cast<size_t>(n);
  }
  // Closing with unread input makes the kernel send RST instead of FIN,
  // which can destroy the response in the client's receive buffer; drop
  // what extra the client already sent (a body, a pipelined request) first,
  // a bounded amount so a client that keeps sending cannot hold the loop.
  char sink[kMaxRequestBytes];
  (void)!recv(c.fd.get(), sink, sizeof(sink), 0);
  return true;
}

// Closes one connection to make room: the oldest that has not sent a full
// request (idle or slow clients; a real scrape sends its request within
// milliseconds of connecting), else the oldest of all (stuck writing to a
// client that does not read). False when there is none.
bool EvictOne(std::list<Connection>& connections) {
  if (connections.empty()) return false;
  auto victim =
      std::find_if(connections.begin(), connections.end(),
                   [](const Connection& c) { return !c.answering(); });
  connections.erase(victim != connections.end() ? victim : connections.begin());
  return true;
}

// poll()'s timeout: milliseconds until `t`, rounded up (so the loop does not
// wake just before a deadline and spin), within [0, INT_MAX].
int PollTimeoutMs(Clock::time_point t, Clock::time_point now) {
  const auto ms = std::chrono::ceil<std::chrono::milliseconds>(t - now);
  return static_cast<int>(std::clamp<int64_t>(ms.count(), 0, INT_MAX));
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
    std::shared_ptr<prometheus::Registry> registry,
    MetricsServerOptions options) {
  if (registry == nullptr) {
    return absl::InvalidArgumentError("MetricsServer: registry is null");
  }
  if (options.max_connections < 1 ||
      options.connection_timeout <= std::chrono::milliseconds::zero()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "MetricsServer: max_connections (", options.max_connections,
        ") and connection_timeout (", options.connection_timeout.count(),
        " ms) must be positive"));
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
    // Non-blocking so the event loop can drain the accept queue until
    // EAGAIN.
    ScopedFd fd(socket(a->ai_family,
                       a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC,
                       a->ai_protocol));
    if (fd.get() < 0) {
      last_error = ErrnoText();
      continue;
    }
    // Restarts may rebind while old connections sit in TIME_WAIT; a live
    // listener on the port still makes bind() fail.
    const int one = 1;
    setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(fd.get(), a->ai_addr, a->ai_addrlen) != 0 ||
        listen(fd.get(), SOMAXCONN) != 0) {
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
  return std::unique_ptr<MetricsServer>(
      new MetricsServer(std::move(registry), options, listen_fd.release(),
                        wake[0], wake[1], port));
}

MetricsServer::MetricsServer(std::shared_ptr<prometheus::Registry> registry,
                             MetricsServerOptions options, int listen_fd,
                             int wake_read_fd, int wake_write_fd, int port)
    : registry_(std::move(registry)),
      options_(options),
      listen_fd_(listen_fd),
      wake_read_fd_(wake_read_fd),
      wake_write_fd_(wake_write_fd),
      port_(port),
      loop_(&MetricsServer::EventLoop, this) {}

MetricsServer::~MetricsServer() {
  const char byte = 0;
  // The pipe is empty and never written otherwise: this cannot block.
  (void)!write(wake_write_fd_, &byte, 1);
  // The loop closes every connection on its way out.
  loop_.join();
  close(listen_fd_);
  close(wake_read_fd_);
  close(wake_write_fd_);
}

void MetricsServer::EventLoop() {
  // In accept order, which is also deadline order (every connection gets the
  // same timeout), so expiry and eviction look at the front.
  std::list<Connection> connections;
  std::vector<pollfd> fds;
  Clock::time_point accept_paused_until;
  while (true) {
    Clock::time_point now = Clock::now();
    while (!connections.empty() && connections.front().deadline <= now) {
      connections.pop_front();
    }
    const bool accepting = now >= accept_paused_until;

    // [0] wake pipe, [1] listener (-1: ignored by poll), [2..] connections
    // in list order.
    fds.clear();
    fds.push_back({wake_read_fd_, POLLIN, 0});
    fds.push_back({accepting ? listen_fd_ : -1, POLLIN, 0});
    for (const Connection& c : connections) {
      fds.push_back({c.fd.get(),
                     static_cast<short>(c.answering() ? POLLOUT : POLLIN), 0});
    }
    int timeout_ms = -1;
    if (!connections.empty()) {
      timeout_ms = PollTimeoutMs(connections.front().deadline, now);
    }
    if (!accepting) {
      const int pause_ms = PollTimeoutMs(accept_paused_until, now);
      timeout_ms = timeout_ms < 0 ? pause_ms : std::min(timeout_ms, pause_ms);
    }
    if (poll(fds.data(), fds.size(), timeout_ms) < 0) {
      if (errno == EINTR) continue;
      return;  // cannot happen with valid fds; the destructor still joins
    }
    if (fds[0].revents != 0) return;  // shutting down

    // Connections before accepting, so fds[i] still matches the list.
    auto it = connections.begin();
    for (size_t i = 2; i < fds.size(); ++i) {
      Connection& c = *it;
      bool finished = false;
      if (fds[i].revents != 0 && !c.answering()) {
        switch (ReadRequest(c)) {
          case ReadResult::kPartial:
            break;
          case ReadResult::kFailed:
            finished = true;
            break;
          case ReadResult::kComplete:
            c.response = Respond(c.request);
            std::string().swap(c.request);
            break;
        }
      }
      // A fresh response is written at once: the socket almost always has
      // room, which saves a poll() round trip.
      if (!finished && c.answering() && fds[i].revents != 0) {
        finished = WriteResponse(c);
      }
      it = finished ? connections.erase(it) : std::next(it);
    }

    if ((fds[1].revents & POLLIN) == 0) continue;
    now = Clock::now();
    // Drain the accept queue (a scrape may wait there behind a burst of
    // idle connects), but take at most max_connections per wake: more would
    // only evict each other, and the open connections must get their turn.
    for (size_t accepted = 0; accepted < options_.max_connections;) {
      const int fd =
          accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) {
        if (errno == EINTR || errno == ECONNABORTED) continue;
        if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS ||
            errno == ENOMEM) {
          // Out of fds (or kernel memory): free one for the newcomer, or
          // back off if there is nothing of ours to free.
          if (EvictOne(connections)) continue;
          accept_paused_until = now + kAcceptPause;
        }
        break;  // EAGAIN: the queue is empty
      }
      if (connections.size() >= options_.max_connections) {
        EvictOne(connections);
      }
      connections.emplace_back(fd, now + options_.connection_timeout);
      ++accepted;
    }
  }
}

std::string MetricsServer::Respond(const std::string& request_head) const {
  // "METHOD TARGET HTTP/x.y"
  const absl::string_view request_line =
      absl::string_view(request_head)
          .substr(0, request_head.find_first_of("\r\n"));
  const std::vector<absl::string_view> parts =
      absl::StrSplit(request_line, ' ', absl::SkipEmpty());
  if (parts.size() != 3 || !absl::StartsWith(parts[2], "HTTP/")) {
    return TextResponse("400 Bad Request", "malformed request\n");
  }
  if (parts[0] != "GET" && parts[0] != "HEAD") {
    return TextResponse("405 Method Not Allowed", "GET only\n");
  }
  const absl::string_view path = parts[1].substr(0, parts[1].find('?'));
  if (path == "/") {
    return TextResponse("200 OK", "pdworker metrics: see /metrics\n");
  }
  if (path != "/metrics")
    return TextResponse("404 Not Found", "see /metrics\n");
  std::string body;
  try {
    body = prometheus::TextSerializer().Serialize(registry_->Collect());
  } catch (const std::exception& e) {
    return TextResponse("500 Internal Server Error",
                        absl::StrCat(e.what(), "\n"));
  }
  return Response("200 OK", kExpositionContentType, body,
                  /*include_body=*/parts[0] == "GET");
}

}  // namespace pdworker
