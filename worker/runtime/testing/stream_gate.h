// Holding a stream at a point a test chooses: an op that waits on a Gate
// keeps the threaded CPU stream (or anything queued behind it) from running
// until the test opens it, so a test can check what the host may and may not
// do while the device is behind.
#ifndef PDWORKER_WORKER_RUNTIME_TESTING_STREAM_GATE_H_
#define PDWORKER_WORKER_RUNTIME_TESTING_STREAM_GATE_H_

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>

namespace pdworker {
namespace testing {

// How long Wait blocks before giving up, so that a stream that wrongly runs
// ops on the caller's thread fails its test instead of hanging.
inline constexpr std::chrono::seconds kGateTimeout{5};

class Gate {
 public:
  void Open() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      open_ = true;
    }
    cv_.notify_all();
  }
  // False when the gate stayed closed for kGateTimeout.
  bool Wait() {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, kGateTimeout, [this] { return open_; });
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool open_ = false;
};

// Opens `gate` `delay` after construction, from its own thread (while the
// test thread blocks on something the gate holds up); joins on destruction.
class DelayedOpener {
 public:
  DelayedOpener(Gate& gate, std::chrono::milliseconds delay)
      : thread_([&gate, delay] {
          std::this_thread::sleep_for(delay);
          gate.Open();
        }) {}
  ~DelayedOpener() { thread_.join(); }
  DelayedOpener(const DelayedOpener&) = delete;
  DelayedOpener& operator=(const DelayedOpener&) = delete;

 private:
  std::thread thread_;
};

}  // namespace testing
}  // namespace pdworker

#endif  // PDWORKER_WORKER_RUNTIME_TESTING_STREAM_GATE_H_
