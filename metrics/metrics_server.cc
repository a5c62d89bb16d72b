#include "metrics/metrics_server.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
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
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
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

// One client connection, owned by the event loop. It reads a request head,
// then (response non-empty) writes the response, then either closes or waits
// for the next request; it is closed at `deadline` whatever it is doing.
struct Connection {
  Connection(int fd, Clock::time_point now, Clock::time_point deadline)
      : fd(fd), deadline(deadline), waiting_since(now) {}

  bool answering() const { return !response.empty(); }

  ScopedFd fd;
  // The current exchange's deadline (connection_timeout after accept or
  // after its request's first byte), or the idle deadline between requests.
  Clock::time_point deadline;
  // Since when it has been waiting for a complete request (accept, or its
  // previous response's last byte): who is evicted first at the cap.
  Clock::time_point waiting_since;
  // Bytes read and not yet answered: at most kMaxRequestBytes, the current
  // request head first, possibly followed by pipelined requests.
  std::string in;
  // How far `in` has been searched for the end of the head without a match
  // (so a client trickling one byte at a time costs O(bytes), not
  // O(bytes^2)).
  size_t scanned = 0;
  std::string response;  // status line, headers and body
  size_t sent = 0;       // bytes of `response` already written
  bool close_after_response = false;
  int requests = 0;  // requests answered or being answered
};

// The length of the complete request head at the front of `c.in` (through
// its blank line, "\r\n\r\n" or bare "\n\n"), or 0 while incomplete.
size_t CompleteHeadLength(Connection& c) {
  // The terminator may straddle what was searched before: back up 3 bytes.
  const size_t from = c.scanned < 3 ? 0 : c.scanned - 3;
  const size_t crlf = c.in.find("\r\n\r\n", from);
  const size_t lf = c.in.find("\n\n", from);
  if (crlf == std::string::npos && lf == std::string::npos) {
    c.scanned = c.in.size();
    return 0;
  }
  return std::min(crlf == std::string::npos ? std::string::npos : crlf + 4,
                  lf == std::string::npos ? std::string::npos : lf + 2);
}

enum class ReadResult { kOk, kFailed };

// Takes what has arrived on `c` (the socket is non-blocking). kFailed: the
// peer hung up, errored, or filled kMaxRequestBytes without finishing a head.
ReadResult ReadRequest(Connection& c) {
  char buf[kMaxRequestBytes];
  if (c.in.size() >= kMaxRequestBytes) return ReadResult::kFailed;
  const ssize_t n = recv(c.fd.get(), buf, kMaxRequestBytes - c.in.size(), 0);
  if (n < 0) {
    return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR
               ? ReadResult::kOk
               : ReadResult::kFailed;
  }
  if (n == 0) return ReadResult::kFailed;
  c.in.append(buf, static_cast<size_t>(n));
  if (CompleteHeadLength(c) == 0 && c.in.size() >= kMaxRequestBytes) {
    return ReadResult::kFailed;
  }
  return ReadResult::kOk;
}

// Writes as much of the response as the socket takes. True once the
// response is finished: everything sent, or the peer is gone (then
// `c.close_after_response` is set).
bool WriteResponse(Connection& c) {
  while (c.sent < c.response.size()) {
    // MSG_NOSIGNAL: a client that hung up must not SIGPIPE the worker.
    const ssize_t n = send(c.fd.get(), c.response.data() + c.sent,
                           c.response.size() - c.sent, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return false;
    if (n <= 0) {
      c.close_after_response = true;
      return true;
    }
    c.sent += static_cast<size_t>(n);
  }
  return true;
}

// Before closing a connection that answered: closing with unread input makes
// the kernel send RST instead of FIN, which can destroy the response in the
// client's receive buffer, so drop what extra the client already sent (a
// body, a pipelined request), a bounded amount so a client that keeps
// sending cannot hold the loop.
void DrainBeforeClose(const Connection& c) {
  char sink[kMaxRequestBytes];
  (void)!recv(c.fd.get(), sink, sizeof(sink), MSG_DONTWAIT);
}

// Closes one connection to make room: the one that has waited longest for a
// complete request (idle, slow or kept-alive and silent; a real scrape sends
// its request within milliseconds), else the oldest of all (stuck writing to
// a client that does not read). False when there is none.
bool EvictOne(std::list<Connection>& connections) {
  if (connections.empty()) return false;
  auto victim = connections.end();
  for (auto it = connections.begin(); it != connections.end(); ++it) {
    if (!it->answering() && (victim == connections.end() ||
                             it->waiting_since < victim->waiting_since)) {
      victim = it;
    }
  }
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
                     absl::string_view body, bool include_body, bool close) {
  return absl::StrCat("HTTP/1.1 ", status, "\r\nContent-Type: ", content_type,
                      "\r\nContent-Length: ", body.size(),
                      "\r\nConnection: ", close ? "close" : "keep-alive",
                      "\r\n\r\n", include_body ? body : "");
}

std::string TextResponse(absl::string_view status, absl::string_view body,
                         bool close) {
  return Response(status, "text/plain; charset=utf-8", body, true, close);
}

// What the request's head says about its connection.
struct HeadFields {
  bool connection_close = false;       // "Connection: close"
  bool connection_keep_alive = false;  // "Connection: keep-alive"
  // Content-Length other than 0, or any Transfer-Encoding: the body's bytes
  // would follow the head, and this server does not read bodies.
  bool has_body = false;
};

HeadFields ParseHeaderFields(absl::string_view head) {
  HeadFields fields;
  bool request_line = true;
  for (absl::string_view line : absl::StrSplit(head, '\n')) {
    if (request_line) {
      request_line = false;
      continue;
    }
    const size_t colon = line.find(':');
    if (colon == absl::string_view::npos) continue;
    const absl::string_view name =
        absl::StripAsciiWhitespace(line.substr(0, colon));
    const absl::string_view value =
        absl::StripAsciiWhitespace(line.substr(colon + 1));
    if (absl::EqualsIgnoreCase(name, "Connection")) {
      // A comma-separated list of options, e.g. "keep-alive, Upgrade".
      for (absl::string_view option : absl::StrSplit(value, ',')) {
        option = absl::StripAsciiWhitespace(option);
        fields.connection_close |= absl::EqualsIgnoreCase(option, "close");
        fields.connection_keep_alive |=
            absl::EqualsIgnoreCase(option, "keep-alive");
      }
    } else if (absl::EqualsIgnoreCase(name, "Transfer-Encoding") ||
               (absl::EqualsIgnoreCase(name, "Content-Length") &&
                value != "0")) {
      fields.has_body = true;
    }
  }
  return fields;
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
      options.connection_timeout <= std::chrono::milliseconds::zero() ||
      options.idle_timeout <= std::chrono::milliseconds::zero() ||
      options.max_requests_per_connection < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "MetricsServer: max_connections (", options.max_connections,
        "), connection_timeout (", options.connection_timeout.count(),
        " ms), idle_timeout (", options.idle_timeout.count(),
        " ms) and max_requests_per_connection (",
        options.max_requests_per_connection, ") must be positive"));
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
  // In accept order. Deadlines differ once connections are kept alive, so
  // expiry and eviction scan the list (poll() is O(connections) anyway).
  std::list<Connection> connections;
  std::vector<pollfd> fds;
  Clock::time_point accept_paused_until;

  // Answers the request head at the front of `c.in`, if complete; the
  // response is written by the caller.
  const auto start_response = [this](Connection& c) {
    const size_t head = CompleteHeadLength(c);
    if (head == 0) return;
    ++c.requests;
    Reply reply = Respond(
        absl::string_view(c.in).substr(0, head),
        /*may_keep_alive=*/c.requests < options_.max_requests_per_connection);
    c.response = std::move(reply.bytes);
    c.sent = 0;
    c.close_after_response = reply.close;
    c.in.erase(0, head);
    c.scanned = 0;
    requests_answered_.fetch_add(1, std::memory_order_relaxed);
  };
  // After a response's last byte on a kept-alive connection: wait for the
  // next request, or take one the client already pipelined.
  const auto finish_response = [&](Connection& c, Clock::time_point now) {
    std::string().swap(c.response);
    c.sent = 0;
    c.waiting_since = now;
    c.deadline = now + (c.in.empty() ? options_.idle_timeout
                                     : options_.connection_timeout);
    start_response(c);
  };

  while (true) {
    Clock::time_point now = Clock::now();
    Clock::time_point next_deadline = Clock::time_point::max();
    for (auto it = connections.begin(); it != connections.end();) {
      if (it->deadline <= now) {
        it = connections.erase(it);
        continue;
      }
      next_deadline = std::min(next_deadline, it->deadline);
      ++it;
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
    if (!connections.empty()) timeout_ms = PollTimeoutMs(next_deadline, now);
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
    now = Clock::now();
    auto it = connections.begin();
    for (size_t i = 2; i < fds.size(); ++i) {
      Connection& c = *it;
      bool finished = false;
      if (fds[i].revents != 0 && !c.answering()) {
        const bool was_idle = c.in.empty();
        if (ReadRequest(c) == ReadResult::kFailed) {
          finished = true;
        } else {
          // A kept-alive connection's next request starts its exchange.
          if (was_idle && !c.in.empty() && c.requests > 0) {
            c.deadline = now + options_.connection_timeout;
          }
          start_response(c);
        }
      }
      // A fresh response is written at once: the socket almost always has
      // room, which saves a poll() round trip. A pipelined request found
      // after it is answered on the next wake (its socket is then writable
      // at once), so one client's burst cannot hold the loop.
      if (!finished && c.answering() && fds[i].revents != 0 &&
          WriteResponse(c)) {
        if (c.close_after_response) {
          DrainBeforeClose(c);
          finished = true;
        } else {
          finish_response(c, now);
        }
      }
      it = finished ? connections.erase(it) : std::next(it);
    }

    if ((fds[1].revents & POLLIN) == 0) continue;
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
      // Each response goes out in one send(); without this, Nagle's
      // algorithm can hold its last partial segment until the client's
      // delayed ACK (up to 40 ms), which a kept-alive scraper would see on
      // every scrape.
      const int one = 1;
      setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
      if (connections.size() >= options_.max_connections) {
        EvictOne(connections);
      }
      connections.emplace_back(fd, now, now + options_.connection_timeout);
      connections_accepted_.fetch_add(1, std::memory_order_relaxed);
      ++accepted;
    }
  }
}

MetricsServer::Reply MetricsServer::Respond(absl::string_view request_head,
                                            bool may_keep_alive) const {
  // "METHOD TARGET HTTP/x.y"
  const absl::string_view request_line =
      request_head.substr(0, request_head.find_first_of("\r\n"));
  const std::vector<absl::string_view> parts =
      absl::StrSplit(request_line, ' ', absl::SkipEmpty());
  if (parts.size() != 3 || !absl::StartsWith(parts[2], "HTTP/")) {
    return {TextResponse("400 Bad Request", "malformed request\n", true), true};
  }
  if (parts[0] != "GET" && parts[0] != "HEAD") {
    // Its body (if any) is not read, so the connection cannot continue.
    return {TextResponse("405 Method Not Allowed", "GET only\n", true), true};
  }
  const HeadFields fields = ParseHeaderFields(request_head);
  // HTTP/1.1 (and any later 1.x) persists by default, HTTP/1.0 only when
  // asked; anything else (HTTP/0.9, 2.0 over plain text) is answered once.
  const bool persistent_by_default =
      absl::StartsWith(parts[2], "HTTP/1.") && parts[2] != "HTTP/1.0";
  const bool keep_alive =
      may_keep_alive && !fields.has_body && !fields.connection_close &&
      (persistent_by_default ||
       (parts[2] == "HTTP/1.0" && fields.connection_keep_alive));
  const bool close = !keep_alive;

  const absl::string_view path = parts[1].substr(0, parts[1].find('?'));
  if (path == "/") {
    return {TextResponse("200 OK", "pdworker metrics: see /metrics\n", close),
            close};
  }
  if (path != "/metrics") {
    return {TextResponse("404 Not Found", "see /metrics\n", close), close};
  }
  std::string body;
  try {
    body = prometheus::TextSerializer().Serialize(registry_->Collect());
  } catch (const std::exception& e) {
    return {TextResponse("500 Internal Server Error",
                         absl::StrCat(e.what(), "\n"), close),
            close};
  }
  return {Response("200 OK", kExpositionContentType, body,
                   /*include_body=*/parts[0] == "GET", close),
          close};
}

}  // namespace pdworker
