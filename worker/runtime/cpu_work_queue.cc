#include "worker/runtime/cpu_work_queue.h"

#include <utility>

#include "glog/logging.h"

namespace pdworker {

absl::string_view CpuStreamExecutionName(CpuStreamExecution execution) {
  switch (execution) {
    case CpuStreamExecution::kInline:
      return "inline";
    case CpuStreamExecution::kThreaded:
      return "threaded";
  }
  return "unknown";
}

std::ostream& operator<<(std::ostream& os, CpuStreamExecution execution) {
  return os << CpuStreamExecutionName(execution);
}

CpuWorkQueue::CpuWorkQueue(CpuStreamExecution execution)
    : execution_(execution) {
  if (execution_ == CpuStreamExecution::kThreaded) {
    worker_ = std::thread([this] { WorkerLoop(); });
  }
}

CpuWorkQueue::~CpuWorkQueue() {
  if (!worker_.joinable()) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  queued_cv_.notify_one();
  worker_.join();
}

void CpuWorkQueue::EnqueueWork(std::function<void()> work) {
  Enqueue(Entry{[work = std::move(work)](const absl::Status& stream_status) {
                  if (stream_status.ok()) work();
                },
                absl::OkStatus()});
}

void CpuWorkQueue::EnqueueTask(Task task) {
  Enqueue(Entry{std::move(task), absl::OkStatus()});
}

void CpuWorkQueue::EnqueueFault(absl::Status fault) {
  CHECK(!fault.ok()) << "a fault must not be OK";
  Enqueue(Entry{nullptr, std::move(fault)});
}

void CpuWorkQueue::Enqueue(Entry entry) {
  if (execution_ == CpuStreamExecution::kInline) {
    Execute(std::move(entry));
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(std::move(entry));
    ++enqueued_;
  }
  queued_cv_.notify_one();
}

void CpuWorkQueue::Execute(Entry entry) {
  absl::Status stream_status;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stream_status = status_;
  }
  if (entry.task) entry.task(stream_status);
  if (!entry.fault.ok() && stream_status.ok()) {
    std::lock_guard<std::mutex> lock(mu_);
    status_ = std::move(entry.fault);
  }
}

void CpuWorkQueue::WorkerLoop() {
  for (;;) {
    Entry entry;
    {
      std::unique_lock<std::mutex> lock(mu_);
      queued_cv_.wait(lock, [this]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
        return !queue_.empty() || stopping_;
      });
      // Stopping only once the queue is empty: destruction finishes work.
      if (queue_.empty()) return;
      entry = std::move(queue_.front());
      queue_.pop_front();
    }
    Execute(std::move(entry));
    {
      std::lock_guard<std::mutex> lock(mu_);
      ++completed_;
    }
    completed_cv_.notify_all();
  }
}

absl::Status CpuWorkQueue::Drain() {
  std::unique_lock<std::mutex> lock(mu_);
  const uint64_t target = enqueued_;
  completed_cv_.wait(lock, [this, target]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
    return completed_ >= target;
  });
  return status_;
}

}  // namespace pdworker
