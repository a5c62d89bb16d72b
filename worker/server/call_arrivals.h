// CallArrivals: when the latest call reached the gRPC server (any service,
// health included), and whether the calls that reached it before a point
// (Cut) have all ended. A draining worker waits until calls stop arriving
// before it shuts the server down: gRPC's shutdown drops a call that
// arrives during it, and its client sees CANCELLED ("the client cancelled"),
// on which routers do not fail over; until then the worker answers such a
// call itself with UNAVAILABLE, on which they do. A worker that ends its
// process instead of shutting the server down waits for the calls that
// arrived before it stopped its engine, so that none that did real work
// (e.g. the step that released the last sequence) loses its answer.
#ifndef PDWORKER_WORKER_SERVER_CALL_ARRIVALS_H_
#define PDWORKER_WORKER_SERVER_CALL_ARRIVALS_H_

#include <grpcpp/support/server_interceptor.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>

namespace pdworker {

// Registered with ServerBuilder::experimental().SetInterceptorCreators; the
// server owns it. gRPC calls the factory once per arriving call; the
// interceptor it returns only notes when that call ends (gRPC deletes it
// with the call's context, after the call's status was sent).
class CallArrivals final
    : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    last_ns_.store(std::chrono::steady_clock::now().time_since_epoch().count(),
                   std::memory_order_relaxed);
    // A health Watch stays open for as long as its client watches; it has
    // no answer to lose.
    if (std::string(info->method()) == "/grpc.health.v1.Health/Watch") {
      return nullptr;
    }
    std::lock_guard<std::mutex> lock(mu_);
    if (cut_) return nullptr;
    ++open_before_cut_;
    return new EndNotice(this);
  }

  // The latest arrival (the clock's epoch when none yet).
  std::chrono::steady_clock::time_point last() const {
    return std::chrono::steady_clock::time_point(
        std::chrono::steady_clock::duration(
            last_ns_.load(std::memory_order_relaxed)));
  }

  // Stops counting calls: later arrivals are not waited for.
  void Cut() {
    std::lock_guard<std::mutex> lock(mu_);
    cut_ = true;
  }

  // Waits until every call counted before Cut() has ended, for at most
  // `timeout`; false when some are still open then.
  bool WaitForCallsBeforeCut(std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> lock(mu_);
    return ended_.wait_for(lock, timeout,
                           [this] { return open_before_cut_ == 0; });
  }

 private:
  class EndNotice final : public grpc::experimental::Interceptor {
   public:
    explicit EndNotice(CallArrivals* arrivals) : arrivals_(arrivals) {}
    ~EndNotice() override { arrivals_->Ended(); }
    void Intercept(
        grpc::experimental::InterceptorBatchMethods* methods) override {
      methods->Proceed();
    }

   private:
    CallArrivals* const arrivals_;
  };

  void Ended() {
    std::lock_guard<std::mutex> lock(mu_);
    if (--open_before_cut_ == 0) ended_.notify_all();
  }

  std::atomic<int64_t> last_ns_{0};
  std::mutex mu_;
  std::condition_variable ended_;
  bool cut_ = false;             // guarded by mu_
  int64_t open_before_cut_ = 0;  // guarded by mu_
};

}  // namespace pdworker

#endif  // PDWORKER_WORKER_SERVER_CALL_ARRIVALS_H_
