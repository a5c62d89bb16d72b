// pdworker: the gRPC worker process.
//
//   pdworker --role=both --model=/models/llama --port=50051
//
// Startup: parse and check flags (worker_flags.h: errors name the flag),
// load the model and allocate everything, listen (health NOT_SERVING),
// capture CUDA graphs (progress logged), then serve (health SERVING) and
// print "listening on PORT" on stdout — the line scripts wait for. SIGTERM
// or SIGINT drains (new calls UNAVAILABLE, in-flight calls complete) and
// exits 0. Exit codes: 0 drained, 1 startup failed, 2 bad flags (or a
// --model directory whose config.json or checkpoint cannot be used).
#include <signal.h>

#include <cstdlib>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "dispatcher/role_defaults.h"
#include "glog/logging.h"
#include "metrics/metrics_server.h"
#include "metrics/table_logger.h"
#include "metrics/worker_metrics.h"
#include "worker/runner/model_runner.h"
#include "worker/runtime/device_factory.h"
#include "worker/server/worker_server.h"
#include "worker/transfer/nccl_transfer.h"
#include "worker/worker_flags.h"

namespace pdworker {
namespace {

// With the NCCL transport offered, the communicators it keeps (created on
// demand while serving) must find their device memory free: the KV pool is
// sized by --kv_cache_bytes or --gpu_memory_utilization, not from what NCCL
// will need, so this checks, once the weights and the pool are allocated,
// that --nccl_max_peers of them fit.
absl::Status CheckNcclBudget(Device& device, int max_peers) {
  if (max_peers == 0 || !NcclTransportAvailable(device)) {
    return absl::OkStatus();
  }
  const size_t needed = static_cast<size_t>(max_peers) * kNcclCommDeviceBytes;
  absl::StatusOr<MemoryStats> memory = device.GetMemoryStats();
  if (!memory.ok()) return memory.status();
  if (memory->free_bytes < needed) {
    return FlagError(
        "nccl_max_peers",
        absl::StrCat(max_peers, " NCCL communicators need up to ", needed >> 20,
                     " MiB of device memory (", kNcclCommDeviceBytes >> 20,
                     " MiB each) but ", memory->free_bytes >> 20,
                     " MiB are free on ", device.name(),
                     " after the model and its KV cache: lower "
                     "--gpu_memory_utilization or --kv_cache_bytes, or "
                     "--nccl_max_peers (0 = no NCCL transport)"));
  }
  LOG(INFO) << "NCCL KV transport: up to " << max_peers << " communicators, "
            << (needed >> 20) << " MiB of the " << (memory->free_bytes >> 20)
            << " MiB free kept for them";
  return absl::OkStatus();
}

// The model directory is the operator's input as much as a flag is: a
// config.json or checkpoint the worker cannot use (a missing tensor, a wrong
// shape or dtype, a truncated file) is reported as --model's error, exit 2.
// The device's own failures (out of memory, CUDA errors) stay startup
// failures, exit 1.
absl::Status ModelLoadError(const std::string& model_dir,
                            const absl::Status& status) {
  switch (status.code()) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kNotFound:
    case absl::StatusCode::kDataLoss:
    case absl::StatusCode::kOutOfRange:
      return FlagError("model",
                       absl::StrCat("'", model_dir, "': ", status.message()));
    default:
      return status;
  }
}

// Loads, captures, serves until SIGTERM/SIGINT (already blocked in every
// thread by main), then drains and exits 0. Returns only when startup
// fails.
absl::Status RunWorker(const WorkerConfig& c, const sigset_t& stop_signals) {
  DeviceOptions device_options;
  device_options.cpu.stream_execution = c.cpu_stream;
  absl::StatusOr<std::unique_ptr<Device>> device =
      CreateDevice(c.device.value_or(DeviceKind::kCuda), device_options);
  if (!c.device.has_value()) {  // --device=auto
    if (device.ok()) {
      LOG(INFO) << "--device=auto: using " << (*device)->name();
    } else {
      LOG(INFO) << "--device=auto: using the CPU backend (CUDA: "
                << device.status().message() << ")";
      device = CreateDevice(DeviceKind::kCpu, device_options);
    }
  }
  if (!device.ok()) return device.status();

  LOG(INFO) << "loading " << c.model_dir << " (role " << RoleName(c.runner.role)
            << ")";
  absl::StatusOr<std::unique_ptr<ModelRunner>> runner =
      ModelRunner::Create(**device, c.model_dir, c.runner);
  if (!runner.ok()) return ModelLoadError(c.model_dir, runner.status());
  ModelRunner& r = **runner;
  if (absl::Status s = CheckNcclBudget(**device, c.server.nccl_max_peers);
      !s.ok()) {
    return s;
  }

  const GraphStatsHeader header{r.resolved_mode(),
                                r.dispatcher().capture_sizes()};
  WorkerInfo info;
  info.role = std::string{RoleName(c.runner.role)};
  info.configured_mode = r.graph_plan().mode.ToString();
  info.resolved_mode = r.resolved_mode().ToString();
  info.model = c.model_dir;
  info.model_fingerprint = r.model_fingerprint();
  info.device = (*device)->name();
  WorkerMetricsOptions metrics_options;
  metrics_options.vllm_aliases = c.metrics_vllm_aliases;
  metrics_options.served_model_name = c.server.served_model_name.empty()
                                          ? c.model_dir
                                          : c.server.served_model_name;
  metrics_options.cache.block_size = r.kv_cache().block_size();
  metrics_options.cache.num_blocks = r.kv_cache().Stats().total_blocks;
  metrics_options.cache.kv_cache_bytes = r.kv_cache_bytes();
  metrics_options.cache.prefix_caching =
      c.runner.prefix_caching == PrefixCaching::kOn;
  WorkerMetrics metrics(info, &r.graph_stats(), header, metrics_options);
  std::unique_ptr<MetricsServer> metrics_server;
  if (!c.metrics_address.empty()) {
    absl::StatusOr<std::unique_ptr<MetricsServer>> started =
        MetricsServer::Start(c.metrics_address, metrics.registry());
    if (!started.ok()) {
      return absl::Status(
          started.status().code(),
          absl::StrCat("--metrics_port: ", started.status().message()));
    }
    metrics_server = *std::move(started);
    LOG(INFO) << "metrics on port " << metrics_server->port();
  }

  WorkerServerOptions server_options = c.server;
  server_options.device_name = (*device)->name();
  absl::StatusOr<std::unique_ptr<WorkerServer>> server =
      WorkerServer::Start(r, server_options, &metrics);
  if (!server.ok()) {
    return absl::Status(
        server.status().code(),
        absl::StrCat("--host/--port: ", server.status().message()));
  }
  LOG(INFO) << "KV handles advertise " << (*server)->advertise_address()
            << "; leases last " << c.server.kv_lease_ttl.count() << " ms";
  LOG(INFO) << "gRPC bound to port " << (*server)->port()
            << " (NOT_SERVING until graphs are captured); capturing "
            << r.resolved_mode() << " graphs for "
            << r.dispatcher().capture_sizes().size() << " capture sizes";
  absl::StatusOr<CaptureSummary> captured = (*server)->CaptureGraphsAndServe();
  if (!captured.ok()) return captured.status();

  TableLogger table_logger(&r.graph_stats(), header, c.stats_log_interval);
  std::cout << "listening on " << (*server)->port() << std::endl;

  int signal_number = 0;
  if (sigwait(&stop_signals, &signal_number) != 0) {
    return absl::InternalError("sigwait failed");
  }
  LOG(INFO) << "signal " << signal_number << ": draining";
  // gRPC's server shutdown would end calls still arriving with CANCELLED
  // (WorkerServer::DrainEnd): the process ends with the server up instead,
  // and the exit closes its connections (their clients see UNAVAILABLE).
  // Nothing is left to tear down in order: the engine has stopped, and the
  // device, sockets and threads go with the process.
  (*server)->Drain(WorkerServer::DrainEnd::kLeaveServerToProcessExit);
  std::cout.flush();
  google::FlushLogFiles(google::GLOG_INFO);
  std::_Exit(0);
}

}  // namespace
}  // namespace pdworker

int main(int argc, char** argv) {
  // Block the stop signals before any thread exists, so every thread
  // inherits the mask and only RunWorker's sigwait ever sees them: no
  // signal handler, no work in signal context.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGTERM);
  sigaddset(&stop_signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);

  absl::SetProgramUsageMessage(
      "pdworker: gRPC worker for disaggregated prefill/decode LLM serving.\n"
      "  pdworker --role=both --model=DIR [--port=50051] ...");
  std::vector<std::string> args = pdworker::UnderscoreFlagNames(argc, argv);
  if (pdworker::WantsHelp(args)) {
    std::cout << pdworker::HelpText();
    return 0;
  }
  std::vector<char*> arg_pointers;
  arg_pointers.reserve(args.size());
  for (std::string& a : args) arg_pointers.push_back(a.data());
  absl::ParseCommandLine(static_cast<int>(arg_pointers.size()),
                         arg_pointers.data());
  FLAGS_logtostderr = true;
  google::InitGoogleLogging(argv[0]);

  absl::StatusOr<pdworker::WorkerConfig> config = pdworker::ConfigFromFlags();
  if (!config.ok()) {
    std::cerr << "pdworker: " << config.status().message() << std::endl;
    return 2;
  }
  const absl::Status status = pdworker::RunWorker(*config, stop_signals);
  if (!status.ok()) {
    // FlagError's code: a flag, or the model it names, is unusable.
    if (absl::IsInvalidArgument(status)) {
      std::cerr << "pdworker: " << status.message() << std::endl;
      return 2;
    }
    std::cerr << "pdworker: startup failed: " << status << std::endl;
    return 1;
  }
  return 0;
}
