// CallArrivals: when the latest call reached the gRPC server (any service,
// health included). A draining worker waits until calls stop arriving
// before it shuts the server down: gRPC's shutdown drops a call that
// arrives during it, and its client sees CANCELLED ("the client cancelled"),
// on which routers do not fail over; until then the worker answers such a
// call itself with UNAVAILABLE, on which they do.
#ifndef PDWORKER_WORKER_SERVER_CALL_ARRIVALS_H_
#define PDWORKER_WORKER_SERVER_CALL_ARRIVALS_H_

#include <grpcpp/support/server_interceptor.h>

#include <atomic>
#include <chrono>
#include <cstdint>

namespace pdworker {

// Registered with ServerBuilder::experimental().SetInterceptorCreators; the
// server owns it. It installs no interceptor (returns null): gRPC calls the
// factory once per arriving call, which is all it needs to know.
class CallArrivals final
    : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* /*info*/) override {
    last_ns_.store(std::chrono::steady_clock::now().time_since_epoch().count(),
                   std::memory_order_relaxed);
    return nullptr;
  }

  // The latest arrival (the clock's epoch when none yet).
  std::chrono::steady_clock::time_point last() const {
    return std::chrono::steady_clock::time_point(
        std::chrono::steady_clock::duration(
            last_ns_.load(std::memory_order_relaxed)));
  }

 private:
  std::atomic<int64_t> last_ns_{0};
};

}  // namespace pdworker

#endif  // PDWORKER_WORKER_SERVER_CALL_ARRIVALS_H_
