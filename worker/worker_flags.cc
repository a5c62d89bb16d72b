// pdworker's flags (worker_flags.h).
//
// Flag spelling: absl flags only accept underscores. vLLM users write
// dashes (--compilation-config, --max-num-seqs), so before parsing, any
// "--some-name[=value]" whose underscore spelling is one of our flags is
// rewritten to it (UnderscoreFlagNames).
#include "worker/worker_flags.h"

#include <sys/stat.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/flags/commandlineflag.h"
#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "common/status_macros.h"
#include "dispatcher/compilation_config.h"
#include "dispatcher/role_defaults.h"
#include "glog/logging.h"
#include "metrics/worker_metrics.h"
#include "worker/engine/speculative_config.h"
#include "worker/kv_events/kv_event_publisher.h"
#include "worker/kv_events/kv_events_config.h"
#include "worker/kv_events/vllm_event_batch.h"
#include "worker/runner/model_runner.h"
#include "worker/runtime/device_factory.h"
#include "worker/server/tls_material.h"
#include "worker/server/worker_server.h"
#include "worker/transfer/nccl_transfer.h"

ABSL_FLAG(std::string, role, "both", "Worker role: prefill, decode or both.");
ABSL_FLAG(std::string, model, "",
          "Hugging Face model directory (config.json + *.safetensors).");
ABSL_FLAG(std::string, compilation_config, "",
          "vLLM-style JSON overriding the role's CUDA graph defaults, e.g. "
          "'{\"cudagraph_mode\":\"FULL_DECODE_ONLY\","
          "\"cudagraph_capture_sizes\":[1,2,4,8]}'. Also accepted as "
          "--compilation-config.");
ABSL_FLAG(int, max_num_seqs, 64, "Most sequences in one step (and one call).");
ABSL_FLAG(int, max_num_batched_tokens, 2048,
          "Most tokens in one step; longer prompts are chunked.");
ABSL_FLAG(int, max_model_len, 0,
          "Most tokens per sequence; 0 = the model's max_position_embeddings.");
ABSL_FLAG(int64_t, kv_cache_bytes, 0,
          "KV cache bytes; must hold one max_model_len sequence. 0 = what "
          "--gpu_memory_utilization leaves once the weights, step buffers, "
          "activations (and on CUDA a graph reserve) are counted.");
ABSL_FLAG(double, gpu_memory_utilization, 0.9,
          "Fraction of the device's memory the worker may use in all (vLLM's "
          "flag): the KV cache gets what the rest leaves. On CUDA the total "
          "is the GPU's memory and what other processes hold counts as used; "
          "on the CPU backend it is the host memory available at startup. "
          "Ignored when --kv_cache_bytes is set.");
ABSL_FLAG(int, block_size, 16, "KV cache tokens per block.");
ABSL_FLAG(bool, enable_prefix_caching, true,
          "Automatic prefix caching: full KV blocks are kept after their "
          "sequences end and shared by later prompts that start with the same "
          "tokens (only the rest is computed). Also accepted as "
          "--enable-prefix-caching / --no-enable-prefix-caching.");
ABSL_FLAG(std::string, host, "0.0.0.0",
          "Address the gRPC and metrics servers bind.");
ABSL_FLAG(int, port, 50051, "gRPC port; 0 = let the kernel pick one.");
ABSL_FLAG(int, metrics_port, 9090,
          "Prometheus /metrics port; 0 = pick one, -1 = no metrics server.");
ABSL_FLAG(bool, metrics_vllm_aliases, false,
          "Also export vllm:num_requests_running, vllm:num_requests_waiting, "
          "vllm:kv_cache_usage_perc, vllm:gpu_cache_usage_perc and "
          "vllm:cache_config_info (labels model_name, engine) computed from "
          "pdworker's own values, for endpoint pickers (llm-d, Gateway API "
          "Inference Extension), production-stack's router and KEDA "
          "examples that query vLLM's names.");
ABSL_FLAG(std::string, device, "auto",
          "auto | cpu | cuda. auto: CUDA device 0 when the binary has the "
          "CUDA backend and a GPU is usable, else the CPU backend.");
ABSL_FLAG(std::string, tls_cert, "",
          "PEM certificate chain; with --tls_key, serve TLS.");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert.");
ABSL_FLAG(std::string, tls_client_ca, "",
          "PEM CA bundle; when set, clients must present a certificate it "
          "signed (mutual TLS).");
ABSL_FLAG(int, max_queue, 1024,
          "Calls queued or running; beyond it Forward gets "
          "RESOURCE_EXHAUSTED.");
ABSL_FLAG(std::string, served_model_name, "",
          "The model name the request-level API reports to routers "
          "(GetModelInfo.served_model_name); empty: the --model directory.");
ABSL_FLAG(int, max_waiting_requests, 1024,
          "Engine-owned requests waiting for room (not yet running); beyond "
          "it a new request gets RESOURCE_EXHAUSTED.");
ABSL_FLAG(bool, async_scheduling, true,
          "Plan and enqueue step N+1 while step N runs on the device; the "
          "tokens step N samples reach step N+1 on the device (vLLM's "
          "--async-scheduling). Stop conditions are then checked one step "
          "late and the extra token is discarded.");
ABSL_FLAG(std::string, speculative_config, "",
          "Speculative decoding of the engine's requests, vLLM's JSON: "
          "{\"method\": \"ngram\", \"num_speculative_tokens\": k, "
          "\"prompt_lookup_min\": a, \"prompt_lookup_max\": b}. Each decode "
          "step verifies up to k drafts (steps of 1 + k tokens per request, "
          "FULL graphs of those). Draft models and EAGLE are refused for "
          "now. Empty: off.");
ABSL_FLAG(std::string, cpu_stream, "threaded",
          "CPU backend only: run the stream's work on its own thread, in "
          "order, as a GPU does (threaded), or inline on the engine thread "
          "(inline).");
ABSL_FLAG(std::string, unverified_cuda_kernels, "refuse",
          "CUDA backend: models that need CUDA kernels written but not yet "
          "run on a GPU (Qwen3's per-head q/k norm, partial rotary, Gemma's "
          "layer) are refused by name and windowed models kept within their "
          "window (refuse), or run with them (allow).");
ABSL_FLAG(int, max_message_bytes, 4 << 20,
          "Largest request accepted; larger ones get RESOURCE_EXHAUSTED.");
ABSL_FLAG(std::string, grpc_keepalive_time, "30s",
          "Ping a connection (a router's, a KV puller's) after this long "
          "without traffic; see --grpc_keepalive_timeout.");
ABSL_FLAG(std::string, grpc_keepalive_timeout, "10s",
          "Close a connection whose keepalive ping is unanswered this long: "
          "a peer whose node vanished does not hold it for hours.");
ABSL_FLAG(std::string, grpc_min_client_ping_interval, "5s",
          "Accept client keepalive pings this often, also on idle "
          "connections (gRPC's default, 5m and never when idle, answers a "
          "router's keepalive with GOAWAY too_many_pings).");
ABSL_FLAG(std::string, advertise_address, "",
          "host:port decode workers use to pull KV from this worker (sent "
          "in every KV handle). Default: --host with the bound port, or the "
          "host name when --host is a wildcard. In Kubernetes: the pod IP.");
ABSL_FLAG(std::string, drain_timeout, "30s",
          "On SIGTERM: how long live sequences may keep stepping (new ones "
          "are refused) before the worker stops anyway. Keep it below the "
          "kill deadline (Kubernetes terminationGracePeriodSeconds).");
ABSL_FLAG(std::string, drain_linger, "3s",
          "After the drain: keep answering UNAVAILABLE while calls still "
          "arrive (until none for 250ms), at most this long, before the gRPC "
          "server shuts down; a call arriving during the shutdown would end "
          "CANCELLED, on which routers do not fail over. 0 = no linger.");
ABSL_FLAG(std::string, kv_lease_ttl, "30s",
          "How long a prefill worker holds a prompt's KV for its decode "
          "worker (hold_for_handoff) before freeing it.");
ABSL_FLAG(std::string, kv_pull_timeout, "10s",
          "Decode side: bound on one KV pull; a prefill worker that dies or "
          "hangs mid-pull fails the import with UNAVAILABLE within it.");
ABSL_FLAG(std::string, kv_import_wait_timeout, "10s",
          "Decode side: how long a KV import (ImportKv, or a P/D Generate's "
          "decode leg) may wait for room in a full KV cache (and, for a "
          "decode leg, for one of the --max_num_seqs running seats) before "
          "it fails with RESOURCE_EXHAUSTED; also bounded by the caller's "
          "deadline and the lease's end (its expiry with "
          "--kv_lease_renew_margin=0). "
          "0 = fail at once when there is no room.");
ABSL_FLAG(int, kv_import_threads, 4, "Decode side: concurrent KV pulls.");
ABSL_FLAG(int, kv_chunk_bytes, 256 << 10,
          "Prefill side: payload of one KV chunk on the gRPC stream transport "
          "(as many tokens of every layer as fit, at least one; layer runs "
          "for older pullers: whole blocks). At most --max_message_bytes of "
          "the decode workers less 64 KiB.");
ABSL_FLAG(std::string, kv_pull_chunks, "token_span",
          "Decode side: the chunks a pull over the gRPC stream asks for: "
          "token_span (every layer of a run of tokens per chunk, one device "
          "copy each way) or layer_run (one layer's K or V per chunk, block "
          "by block: what older workers do).");
ABSL_FLAG(int, nccl_max_peers, 8,
          "CUDA with NCCL: NCCL communicators kept at once, one per peer "
          "worker this worker pulls KV from or serves it to (made on the "
          "pair's first NCCL pull, reused after). Each takes up to 80 MiB "
          "of device memory, which must be free at startup after the model "
          "and --kv_cache_bytes are allocated. 0 = no NCCL transport.");
ABSL_FLAG(std::string, kv_events_endpoint, "",
          "Publish KV cache events (prefix caching's BlockStored, "
          "BlockRemoved, AllBlocksCleared) in vLLM's format on a ZMQ PUB "
          "socket here, for cache-aware routers (llm-d, Dynamo). Bound when "
          "the address has a wildcard (tcp://*:5557), connected otherwise "
          "(vLLM's rule). Empty: off.");
ABSL_FLAG(std::string, kv_events_replay_endpoint, "",
          "ZMQ ROUTER socket answering replays of missed event batches by "
          "sequence number (vLLM's replay protocol). Empty: none.");
ABSL_FLAG(std::string, kv_events_topic, "",
          "First frame of every KV event message; llm-d expects "
          "kv@<pod-ip>@<model>.");
ABSL_FLAG(std::string, kv_events_layout, "map",
          "KV event msgpack layout: map (vLLM >= 0.26, tagged maps) or array "
          "(older positional structs).");
ABSL_FLAG(int, kv_events_buffer_steps, 10000, "Event batches kept for replay.");
ABSL_FLAG(std::string, kv_events_config, "",
          "vLLM's --kv-events-config JSON (enable_kv_cache_events, publisher, "
          "endpoint, replay_endpoint, topic, buffer_steps, hwm, "
          "max_queue_size), as llm-d's charts pass it to vLLM; instead of "
          "the --kv_events_* flags (--kv_events_layout still applies). Also "
          "accepted as --kv-events-config.");
ABSL_FLAG(std::string, kv_lease_renew_margin, "5s",
          "Decode side: while an import is queued or pulling, renew its "
          "source lease (RenewKv) when it would expire within this, so a "
          "slow import keeps its source. Keep it below the prefill workers' "
          "--kv_lease_ttl. 0 = never renew.");
ABSL_FLAG(std::string, sequence_idle_timeout, "10m",
          "Release a sequence (and its KV blocks) when no step or Release "
          "has named it for this long: its router crashed or forgot it. "
          "Later calls for it get NOT_FOUND saying so. 0 = never.");
ABSL_FLAG(std::string, kv_peer_ca, "",
          "With TLS: PEM CA that signed the prefill workers' certificates, "
          "for KV pulls. Default: --tls_client_ca, else the system's roots.");
ABSL_FLAG(std::string, kv_peer_tls_server_name, "",
          "With TLS: the name prefill workers' certificates are checked "
          "against on KV pulls (they are dialled by --advertise_address, "
          "usually a pod IP). Default: the address's host.");
// A string, not an absl::Duration flag: reading Duration flags compiles to an
// atomic_thread_fence that GCC refuses under -fsanitize=thread.
ABSL_FLAG(std::string, stats_log_interval, "60s",
          "Log the CUDA graph statistics table this often while it changes "
          "(e.g. 30s, 5m); 0 = never.");

namespace pdworker {

absl::Status FlagError(absl::string_view flag, absl::string_view message) {
  return absl::InvalidArgumentError(absl::StrCat("--", flag, ": ", message));
}

namespace {

absl::Status CheckPositive(absl::string_view flag, int64_t value) {
  if (value > 0) return absl::OkStatus();
  return FlagError(flag, absl::StrCat("must be positive, got ", value));
}

// Whether a duration flag may be 0 (meaning "never" / "at once").
enum class ZeroDuration { kRefused, kAllowed };

// A duration flag ("500ms", "30s", "10m") in milliseconds; a positive one
// below 1 ms becomes 1 ms, so it never turns into 0.
absl::Status ParseMillisFlag(absl::string_view flag, const std::string& text,
                             ZeroDuration zero,
                             std::chrono::milliseconds* out) {
  absl::Duration d;
  const absl::Duration least = absl::ZeroDuration();
  if (!absl::ParseDuration(text, &d) || d < least ||
      (d == least && zero == ZeroDuration::kRefused)) {
    return FlagError(flag, absl::StrCat("'", text,
                                        zero == ZeroDuration::kRefused
                                            ? "' is not a positive duration "
                                              "(e.g. 500ms, 30s)"
                                            : "' is not a duration >= 0 "
                                              "(e.g. 10m, 90s, 0)"));
  }
  *out = absl::ToChronoMilliseconds(d);
  if (d > least && out->count() == 0) *out = std::chrono::milliseconds(1);
  return absl::OkStatus();
}

absl::StatusOr<std::string> ReadPemFile(absl::string_view flag,
                                        const std::string& path) {
  if (path.empty()) return std::string();
  std::ifstream in(path, std::ios::binary);
  if (!in) return FlagError(flag, absl::StrCat("cannot read '", path, "'"));
  std::ostringstream contents;
  contents << in.rdbuf();
  if (contents.str().empty()) {
    return FlagError(flag, absl::StrCat("'", path, "' is empty"));
  }
  return contents.str();
}

// The flags `--help` lists, by subsystem. A flag of this file missing here
// is listed under "Other", so none is ever hidden.
struct FlagGroup {
  const char* title;
  std::vector<const char*> flags;
};

std::vector<FlagGroup> FlagGroups() {
  return {
      {"Model and device",
       {"role", "model", "served_model_name", "device", "cpu_stream",
        "compilation_config", "unverified_cuda_kernels"}},
      {"Scheduling and KV cache",
       {"max_num_seqs", "max_num_batched_tokens", "max_model_len",
        "kv_cache_bytes", "gpu_memory_utilization", "block_size",
        "enable_prefix_caching", "max_queue", "max_waiting_requests",
        "async_scheduling", "speculative_config", "sequence_idle_timeout"}},
      {"gRPC server and lifecycle",
       {"host", "port", "max_message_bytes", "grpc_keepalive_time",
        "grpc_keepalive_timeout", "grpc_min_client_ping_interval",
        "drain_timeout", "drain_linger"}},
      {"TLS", {"tls_cert", "tls_key", "tls_client_ca"}},
      {"KV handoff (prefill/decode)",
       {"advertise_address", "kv_lease_ttl", "kv_pull_timeout",
        "kv_import_wait_timeout", "kv_import_threads", "kv_chunk_bytes",
        "kv_pull_chunks", "kv_lease_renew_margin", "kv_peer_ca",
        "kv_peer_tls_server_name", "nccl_max_peers"}},
      {"KV cache events (prefix caching)",
       {"kv_events_endpoint", "kv_events_replay_endpoint", "kv_events_topic",
        "kv_events_layout", "kv_events_buffer_steps", "kv_events_config"}},
      {"Metrics and logs",
       {"metrics_port", "metrics_vllm_aliases", "stats_log_interval"}},
  };
}

// `text` wrapped to lines of at most `width` characters, each indented.
std::string Wrapped(absl::string_view text, size_t width,
                    absl::string_view indent) {
  std::string out;
  std::string line;
  for (absl::string_view word : absl::StrSplit(text, ' ', absl::SkipEmpty())) {
    if (!line.empty() && line.size() + 1 + word.size() > width) {
      absl::StrAppend(&out, indent, line, "\n");
      line.clear();
    }
    absl::StrAppend(&line, line.empty() ? "" : " ", word);
  }
  if (!line.empty()) absl::StrAppend(&out, indent, line, "\n");
  return out;
}

}  // namespace

absl::StatusOr<WorkerConfig> ConfigFromFlags() {
  WorkerConfig c;
  ModelRunnerOptions& r = c.runner;

  absl::StatusOr<Role> role = ParseRole(absl::GetFlag(FLAGS_role));
  if (!role.ok()) return FlagError("role", role.status().message());
  r.role = *role;

  c.compilation_config_json = absl::GetFlag(FLAGS_compilation_config);
  absl::StatusOr<CompilationConfig> compilation =
      ParseCompilationConfig(c.compilation_config_json);
  if (!compilation.ok()) {
    return FlagError("compilation_config", compilation.status().message());
  }
  r.compilation = *compilation;

  c.model_dir = absl::GetFlag(FLAGS_model);
  if (c.model_dir.empty()) return FlagError("model", "is required");
  struct stat st {};
  if (stat(c.model_dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    return FlagError("model",
                     absl::StrCat("'", c.model_dir, "' is not a directory"));
  }
  c.server.model_dir = c.model_dir;
  c.server.served_model_name = absl::GetFlag(FLAGS_served_model_name);

  r.max_num_seqs = absl::GetFlag(FLAGS_max_num_seqs);
  r.max_num_batched_tokens = absl::GetFlag(FLAGS_max_num_batched_tokens);
  r.max_model_len = absl::GetFlag(FLAGS_max_model_len);
  r.kv_cache_bytes = absl::GetFlag(FLAGS_kv_cache_bytes);
  r.gpu_memory_utilization = absl::GetFlag(FLAGS_gpu_memory_utilization);
  r.block_size = absl::GetFlag(FLAGS_block_size);
  r.prefix_caching = absl::GetFlag(FLAGS_enable_prefix_caching)
                         ? PrefixCaching::kOn
                         : PrefixCaching::kOff;
  for (const auto& [flag, value] : std::vector<std::pair<const char*, int64_t>>{
           {"max_num_seqs", r.max_num_seqs},
           {"max_num_batched_tokens", r.max_num_batched_tokens},
           {"block_size", r.block_size},
           {"max_queue", absl::GetFlag(FLAGS_max_queue)},
           {"max_message_bytes", absl::GetFlag(FLAGS_max_message_bytes)}}) {
    if (absl::Status s = CheckPositive(flag, value); !s.ok()) return s;
  }
  if (r.kv_cache_bytes < 0) {
    return FlagError("kv_cache_bytes",
                     absl::StrCat("must be >= 0 (0 = from "
                                  "--gpu_memory_utilization), got ",
                                  r.kv_cache_bytes));
  }
  if (!(r.gpu_memory_utilization > 0.0 && r.gpu_memory_utilization <= 1.0)) {
    return FlagError(
        "gpu_memory_utilization",
        absl::StrCat("must be in (0, 1], got ", r.gpu_memory_utilization));
  }
  if (r.max_model_len < 0) {
    return FlagError("max_model_len",
                     absl::StrCat("must be >= 0 (0 = the model's limit), got ",
                                  r.max_model_len));
  }

  const std::string device = absl::AsciiStrToLower(absl::GetFlag(FLAGS_device));
  if (device == "cpu") {
    c.device = DeviceKind::kCpu;
  } else if (device == "cuda") {
    c.device = DeviceKind::kCuda;
  } else if (device != "auto") {
    return FlagError("device", absl::StrCat("unknown device '", device,
                                            "'; expected auto, cpu or cuda"));
  }

  const std::string host = absl::GetFlag(FLAGS_host);
  const int port = absl::GetFlag(FLAGS_port);
  if (port < 0 || port > 65535) {
    return FlagError("port", absl::StrCat("must be in [0, 65535], got ", port));
  }
  const int metrics_port = absl::GetFlag(FLAGS_metrics_port);
  if (metrics_port < -1 || metrics_port > 65535) {
    return FlagError(
        "metrics_port",
        absl::StrCat("must be -1 (off) or in [0, 65535], got ", metrics_port));
  }
  // IPv6 literals need brackets in host:port.
  const std::string bind_host =
      host.find(':') != std::string::npos ? absl::StrCat("[", host, "]") : host;
  c.server.listen_address = absl::StrCat(bind_host, ":", port);
  if (metrics_port >= 0) {
    c.metrics_address = absl::StrCat(bind_host, ":", metrics_port);
  }
  c.metrics_vllm_aliases = absl::GetFlag(FLAGS_metrics_vllm_aliases)
                               ? VllmAliases::kOn
                               : VllmAliases::kOff;

  ServerTls& tls = c.server.tls;
  absl::StatusOr<std::string> pem =
      ReadPemFile("tls_cert", absl::GetFlag(FLAGS_tls_cert));
  if (!pem.ok()) return pem.status();
  tls.cert_chain_pem = *pem;
  pem = ReadPemFile("tls_key", absl::GetFlag(FLAGS_tls_key));
  if (!pem.ok()) return pem.status();
  tls.private_key_pem = *pem;
  pem = ReadPemFile("tls_client_ca", absl::GetFlag(FLAGS_tls_client_ca));
  if (!pem.ok()) return pem.status();
  tls.client_ca_pem = *pem;
  if (tls.cert_chain_pem.empty() != tls.private_key_pem.empty()) {
    return FlagError(tls.cert_chain_pem.empty() ? "tls_cert" : "tls_key",
                     "--tls_cert and --tls_key go together");
  }
  if (!tls.client_ca_pem.empty() && tls.cert_chain_pem.empty()) {
    return FlagError("tls_client_ca",
                     "mutual TLS needs --tls_cert and --tls_key as well");
  }
  // Before the model loads: gRPC would only say it cannot listen.
  const PemFile cert{"tls_cert", absl::GetFlag(FLAGS_tls_cert),
                     tls.cert_chain_pem};
  const PemFile key{"tls_key", absl::GetFlag(FLAGS_tls_key),
                    tls.private_key_pem};
  const PemFile client_ca{"tls_client_ca", absl::GetFlag(FLAGS_tls_client_ca),
                          tls.client_ca_pem};
  if (!cert.pem.empty()) {
    PDW_RETURN_IF_ERROR(CheckCertificates(cert));
    PDW_RETURN_IF_ERROR(CheckKeyMatchesCertificate(key, cert));
  }
  if (!client_ca.pem.empty()) PDW_RETURN_IF_ERROR(CheckCertificates(client_ca));

  c.server.max_receive_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  c.server.engine.max_queue = absl::GetFlag(FLAGS_max_queue);
  c.server.engine.max_waiting_requests =
      absl::GetFlag(FLAGS_max_waiting_requests);
  if (absl::Status s = CheckPositive("max_waiting_requests",
                                     c.server.engine.max_waiting_requests);
      !s.ok()) {
    return s;
  }
  c.server.engine.overlap = absl::GetFlag(FLAGS_async_scheduling)
                                ? StepOverlap::kOn
                                : StepOverlap::kOff;
  absl::StatusOr<SpeculativeConfig> speculative =
      ParseSpeculativeConfig(absl::GetFlag(FLAGS_speculative_config));
  if (!speculative.ok()) {
    return FlagError("speculative_config", speculative.status().message());
  }
  c.server.engine.speculative = *speculative;
  // Verify steps hold the last token and k drafts per request: the
  // dispatcher's uniform decode keys and FULL graphs are of that length.
  r.uniform_decode_query_len = 1 + speculative->num_speculative_tokens;
  const std::string cpu_stream = absl::GetFlag(FLAGS_cpu_stream);
  if (cpu_stream == "threaded") {
    c.cpu_stream = CpuStreamExecution::kThreaded;
  } else if (cpu_stream == "inline") {
    c.cpu_stream = CpuStreamExecution::kInline;
  } else {
    return FlagError("cpu_stream", absl::StrCat("'", cpu_stream,
                                                "' is not threaded or inline"));
  }
  const std::string unverified = absl::GetFlag(FLAGS_unverified_cuda_kernels);
  if (unverified == "refuse") {
    r.kernel_options.unverified_cuda_kernels = UnverifiedCudaKernels::kRefuse;
  } else if (unverified == "allow") {
    r.kernel_options.unverified_cuda_kernels = UnverifiedCudaKernels::kAllow;
  } else {
    return FlagError("unverified_cuda_kernels",
                     absl::StrCat("'", unverified, "' is not refuse or allow"));
  }
  c.server.advertise_address = absl::GetFlag(FLAGS_advertise_address);
  struct DurationFlag {
    const char* flag;
    std::string text;
    std::chrono::milliseconds* out;
    ZeroDuration zero;
  };
  for (const DurationFlag& f : std::vector<DurationFlag>{
           {"kv_lease_ttl", absl::GetFlag(FLAGS_kv_lease_ttl),
            &c.server.kv_lease_ttl, ZeroDuration::kRefused},
           {"kv_pull_timeout", absl::GetFlag(FLAGS_kv_pull_timeout),
            &c.server.importer.pull_timeout, ZeroDuration::kRefused},
           {"kv_import_wait_timeout",
            absl::GetFlag(FLAGS_kv_import_wait_timeout),
            &c.server.importer.wait_timeout, ZeroDuration::kAllowed},
           {"kv_lease_renew_margin", absl::GetFlag(FLAGS_kv_lease_renew_margin),
            &c.server.importer.renew_margin, ZeroDuration::kAllowed},
           {"grpc_keepalive_time", absl::GetFlag(FLAGS_grpc_keepalive_time),
            &c.server.keepalive.time, ZeroDuration::kRefused},
           {"grpc_keepalive_timeout",
            absl::GetFlag(FLAGS_grpc_keepalive_timeout),
            &c.server.keepalive.timeout, ZeroDuration::kRefused},
           {"grpc_min_client_ping_interval",
            absl::GetFlag(FLAGS_grpc_min_client_ping_interval),
            &c.server.keepalive.min_client_ping_interval,
            ZeroDuration::kRefused},
           {"sequence_idle_timeout", absl::GetFlag(FLAGS_sequence_idle_timeout),
            &c.server.engine.sequence_idle_timeout, ZeroDuration::kAllowed},
           {"drain_timeout", absl::GetFlag(FLAGS_drain_timeout),
            &c.server.drain_timeout, ZeroDuration::kAllowed},
           {"drain_linger", absl::GetFlag(FLAGS_drain_linger),
            &c.server.drain_linger, ZeroDuration::kAllowed}}) {
    if (absl::Status s = ParseMillisFlag(f.flag, f.text, f.zero, f.out);
        !s.ok()) {
      return s;
    }
  }
  c.server.importer.num_threads = absl::GetFlag(FLAGS_kv_import_threads);
  const int chunk_bytes = absl::GetFlag(FLAGS_kv_chunk_bytes);
  const int max_chunk_bytes =
      absl::GetFlag(FLAGS_max_message_bytes) - (64 << 10);
  if (chunk_bytes <= 0 || chunk_bytes > max_chunk_bytes) {
    return FlagError(
        "kv_chunk_bytes",
        absl::StrCat("must be in [1, ", max_chunk_bytes,
                     "] (--max_message_bytes less 64 KiB), got ", chunk_bytes));
  }
  c.server.transfer.max_chunk_bytes = static_cast<size_t>(chunk_bytes);
  if (const std::string chunks = absl::GetFlag(FLAGS_kv_pull_chunks);
      chunks == "token_span") {
    c.server.importer.stream_chunk_layout = v1::KV_CHUNK_LAYOUT_TOKEN_SPAN;
  } else if (chunks == "layer_run") {
    c.server.importer.stream_chunk_layout = v1::KV_CHUNK_LAYOUT_LAYER_RUN;
  } else {
    return FlagError("kv_pull_chunks", absl::StrCat("'", chunks,
                                                    "' is not token_span or "
                                                    "layer_run"));
  }
  c.server.nccl_max_peers = absl::GetFlag(FLAGS_nccl_max_peers);
  if (c.server.nccl_max_peers < 0) {
    return FlagError("nccl_max_peers",
                     absl::StrCat("must be >= 0 (0 = no NCCL transport), got ",
                                  c.server.nccl_max_peers));
  }
  if (const std::string json = absl::GetFlag(FLAGS_kv_events_config);
      !json.empty()) {
    if (!absl::GetFlag(FLAGS_kv_events_endpoint).empty() ||
        !absl::GetFlag(FLAGS_kv_events_replay_endpoint).empty()) {
      return FlagError("kv_events_config",
                       "give it or --kv_events_endpoint, not both");
    }
    absl::StatusOr<KvEventLayout> layout =
        ParseKvEventLayout(absl::GetFlag(FLAGS_kv_events_layout));
    if (!layout.ok()) {
      return FlagError("kv_events_layout", layout.status().message());
    }
    VllmEventBatchFormat format;
    format.layout = *layout;
    absl::StatusOr<std::optional<KvEventPublisherOptions>> events =
        ParseKvEventsConfig(json, format);
    if (!events.ok()) return events.status();
    if (events->has_value() && !absl::GetFlag(FLAGS_enable_prefix_caching)) {
      return FlagError("kv_events_config",
                       "needs --enable_prefix_caching (no prefix cache, no "
                       "KV cache events)");
    }
    c.server.kv_events_zmq = std::move(*events);
  } else if (const std::string endpoint =
                 absl::GetFlag(FLAGS_kv_events_endpoint);
             !endpoint.empty()) {
    KvEventPublisherOptions events;
    events.endpoint = endpoint;
    events.replay_endpoint = absl::GetFlag(FLAGS_kv_events_replay_endpoint);
    events.topic = absl::GetFlag(FLAGS_kv_events_topic);
    events.buffer_steps = absl::GetFlag(FLAGS_kv_events_buffer_steps);
    absl::StatusOr<KvEventLayout> layout =
        ParseKvEventLayout(absl::GetFlag(FLAGS_kv_events_layout));
    if (!layout.ok()) {
      return FlagError("kv_events_layout", layout.status().message());
    }
    events.format.layout = *layout;
    if (!absl::GetFlag(FLAGS_enable_prefix_caching)) {
      return FlagError("kv_events_endpoint",
                       "needs --enable_prefix_caching (no prefix cache, no "
                       "KV cache events)");
    }
    c.server.kv_events_zmq = std::move(events);
  } else if (!absl::GetFlag(FLAGS_kv_events_replay_endpoint).empty()) {
    return FlagError("kv_events_replay_endpoint", "needs --kv_events_endpoint");
  }
  pem = ReadPemFile("kv_peer_ca", absl::GetFlag(FLAGS_kv_peer_ca));
  if (!pem.ok()) return pem.status();
  if (!pem->empty() && tls.cert_chain_pem.empty()) {
    return FlagError("kv_peer_ca", "needs --tls_cert and --tls_key");
  }
  if (!pem->empty()) {
    const PemFile peer_ca{"kv_peer_ca", absl::GetFlag(FLAGS_kv_peer_ca), *pem};
    PDW_RETURN_IF_ERROR(CheckCertificates(peer_ca));
    c.server.peer_tls.enabled = true;
    c.server.peer_tls.root_certs_pem = *pem;
    c.server.peer_tls.cert_chain_pem = tls.cert_chain_pem;
    c.server.peer_tls.private_key_pem = tls.private_key_pem;
  }
  const std::string peer_name = absl::GetFlag(FLAGS_kv_peer_tls_server_name);
  if (!peer_name.empty() && tls.cert_chain_pem.empty()) {
    return FlagError("kv_peer_tls_server_name",
                     "needs --tls_cert and --tls_key");
  }
  c.server.peer_tls.server_name_override = peer_name;
  if (absl::Status s =
          CheckPositive("kv_import_threads", c.server.importer.num_threads);
      !s.ok()) {
    return s;
  }
  if (!absl::ParseDuration(absl::GetFlag(FLAGS_stats_log_interval),
                           &c.stats_log_interval)) {
    return FlagError("stats_log_interval",
                     absl::StrCat("'", absl::GetFlag(FLAGS_stats_log_interval),
                                  "' is not a duration (e.g. 30s, 5m, 0)"));
  }
  return c;
}

std::vector<std::string> UnderscoreFlagNames(int argc, char** argv) {
  std::vector<std::string> args(argv, argv + argc);
  for (size_t i = 1; i < args.size(); ++i) {
    std::string& arg = args[i];
    if (arg == "--") break;
    if (arg.size() < 3 || arg.compare(0, 2, "--") != 0) continue;
    const size_t eq = arg.find('=');
    const std::string name =
        arg.substr(2, eq == std::string::npos ? std::string::npos : eq - 2);
    if (name.find('-') == std::string::npos) continue;
    const std::string underscored = absl::StrReplaceAll(name, {{"-", "_"}});
    // vLLM's negated booleans (--no-enable-prefix-caching): absl spells
    // them --noenable_prefix_caching.
    if (absl::StartsWith(underscored, "no_") && eq == std::string::npos &&
        absl::FindCommandLineFlag(underscored.substr(3)) != nullptr) {
      arg = absl::StrCat("--no", underscored.substr(3));
      continue;
    }
    if (absl::FindCommandLineFlag(underscored) == nullptr) continue;
    arg = absl::StrCat("--", underscored,
                       eq == std::string::npos ? "" : arg.substr(eq));
  }
  return args;
}

bool WantsHelp(const std::vector<std::string>& args) {
  for (size_t i = 1; i < args.size(); ++i) {
    if (args[i] == "--") return false;
    if (args[i] == "--help" || args[i] == "-help" || args[i] == "-h" ||
        args[i] == "--helpfull" || args[i] == "--helpshort") {
      return true;
    }
  }
  return false;
}

// Every flag this file defines, grouped, with its default. (Abseil's own --help
// lists only flags defined in a file named after the program, none here, and
// exits 1.)
std::string HelpText() {
  absl::flat_hash_map<std::string, const absl::CommandLineFlag*> ours;
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    if (absl::EndsWith(flag->Filename(), "worker/worker_flags.cc")) {
      ours[std::string(name)] = flag;
    }
  }
  std::string out = absl::StrCat(
      absl::ProgramUsageMessage(),
      "\n\nFlags take --name=value; dashes work too (--max-num-seqs=8).\n");
  const auto append = [&](const absl::CommandLineFlag& flag) {
    absl::StrAppend(&out, "  --", flag.Name(), " (default: ",
                    flag.DefaultValue().empty() ? "\"\"" : flag.DefaultValue(),
                    ")\n", Wrapped(flag.Help(), 72, "      "));
  };
  for (const FlagGroup& group : FlagGroups()) {
    absl::StrAppend(&out, "\n", group.title, ":\n");
    for (const char* name : group.flags) {
      auto it = ours.find(name);
      if (it == ours.end()) continue;
      append(*it->second);
      ours.erase(it);
    }
  }
  if (!ours.empty()) {
    std::vector<std::string> rest;
    for (const auto& [name, flag] : ours) rest.push_back(name);
    std::sort(rest.begin(), rest.end());
    absl::StrAppend(&out, "\nOther:\n");
    for (const std::string& name : rest) append(*ours[name]);
  }
  return out;
}

}  // namespace pdworker
