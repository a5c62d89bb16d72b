// CpuWorkQueue: runs a CPU stream's work in order, inline or on its own
// thread, and keeps the stream's sticky fault.
#ifndef PDWORKER_WORKER_RUNTIME_CPU_WORK_QUEUE_H_
#define PDWORKER_WORKER_RUNTIME_CPU_WORK_QUEUE_H_

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <ostream>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace pdworker {

// Where the CPU backend runs a stream's work.
enum class CpuStreamExecution {
  // Inside the call that enqueues it, on the calling thread: every stream is
  // always synchronized. Simplest to debug, but it hides every race between
  // host work and device work.
  kInline,
  // On one worker thread per stream, in FIFO order, as a GPU runs a CUDA
  // stream: enqueueing returns at once and the host must wait (Synchronize,
  // CopyToHost, an event) before it reads results. Use it to test code that
  // overlaps host work with device work.
  kThreaded,
};

// "inline" or "threaded".
absl::string_view CpuStreamExecutionName(CpuStreamExecution execution);
std::ostream& operator<<(std::ostream& os, CpuStreamExecution execution);

// The in-order executor behind one CpuStream. With kThreaded it owns the
// worker thread and a FIFO of tasks; with kInline it runs each task inside
// the Enqueue call. Either way it keeps the stream's status: OK until the
// stream reaches an injected fault, that fault forever after (like a CUDA
// context after an illegal address), and work reached after it is skipped.
//
// Enqueue*/Drain are called by the stream's user thread (one at a time);
// the tasks run on the worker thread. std::mutex/condition_variable give the
// happens-before edges: a task's writes are visible to the host once Drain,
// or a CpuEvent whose marker ran after the task, has returned.
class CpuWorkQueue {
 public:
  // Runs with the stream's status at the point the task is reached.
  using Task = std::function<void(const absl::Status& stream_status)>;

  explicit CpuWorkQueue(CpuStreamExecution execution);
  // Finishes every queued task, then joins the worker thread.
  ~CpuWorkQueue();
  CpuWorkQueue(const CpuWorkQueue&) = delete;
  CpuWorkQueue& operator=(const CpuWorkQueue&) = delete;

  CpuStreamExecution execution() const { return execution_; }

  // Runs `work` after everything enqueued before it; skipped when the stream
  // has faulted by then.
  void EnqueueWork(std::function<void()> work);
  // Runs `task` after everything enqueued before it, faulted or not (event
  // markers: a waiter must wake up and learn about the fault).
  void EnqueueTask(Task task);
  // The stream faults with `fault` (not OK) when it reaches this point,
  // unless it has already faulted (the first fault is kept).
  void EnqueueFault(absl::Status fault);

  // Waits until every task enqueued so far has run (or been skipped).
  // Returns the stream's status at that point: OK, or the fault.
  absl::Status Drain();

 private:
  struct Entry {
    Task task;           // May be empty (a fault marker).
    absl::Status fault;  // Not OK: the stream faults after `task`.
  };

  void Enqueue(Entry entry);
  // Runs one entry on the executing thread, with mu_ not held.
  void Execute(Entry entry);
  // The worker thread's loop: until stopping_ and the queue is empty.
  void WorkerLoop();

  const CpuStreamExecution execution_;

  std::mutex mu_;
  // Signals the worker: a task was queued, or stopping_ was set.
  std::condition_variable queued_cv_;
  // Signals Drain: completed_ advanced.
  std::condition_variable completed_cv_;
  std::deque<Entry> queue_ ABSL_GUARDED_BY(mu_);
  // Tasks enqueued / finished (run or skipped) since construction; Drain
  // waits for completed_ to reach the enqueued_ it saw.
  uint64_t enqueued_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t completed_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;

  // Last member: started once everything above is initialized. Not joinable
  // with kInline.
  std::thread worker_;
};

}  // namespace pdworker

#endif  // PDWORKER_WORKER_RUNTIME_CPU_WORK_QUEUE_H_
