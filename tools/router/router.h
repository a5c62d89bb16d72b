// Router: the reference router. Runs one generation request end to end over
// pdworker's gRPC API, in one of two topologies:
//
// Disaggregated (prefill + decode pools), DESIGN.md "P/D KV handoff":
//   1. prefill worker (least loaded): Forward {prompt, start,
//      hold_for_handoff} -> the first token and a KvHandle (the prefill
//      worker frees the sequence id at once and holds the KV under a lease);
//   2. done already (max_tokens == 1 or EOS): KvTransfer.ReleaseKv(lease);
//   3. decode worker (least loaded): ImportKv {sequence id, handle} -> the
//      sequence is live there (the decode worker pulls the KV and releases
//      the lease itself);
//   4. decode steps, batched with every other request on that worker (see
//      DecodeBatcher), until max_tokens or EOS; the final step carries
//      release_after_step, an early EOS is followed by Worker.Release.
// Aggregated (one pool of role-both workers): the prompt's Forward (no hold)
// and the decode steps go to the same worker.
//
// The request id is the sequence id on every worker. A request never leaves
// anything behind: on any error the router releases what it holds (the decode
// sequence if it exists, else the prefill lease) and returns the error with
// the worker's gRPC code. A failed ReleaseKv is only logged: the lease
// expires on its own; a failed decode Release is the request's error, since
// nothing else would ever free that sequence.
#ifndef PDWORKER_TOOLS_ROUTER_ROUTER_H_
#define PDWORKER_TOOLS_ROUTER_ROUTER_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "proto/worker.grpc.pb.h"
#include "tools/router/decode_batcher.h"
#include "tools/router/prefix_index.h"
#include "tools/router/worker_pool.h"

namespace pdworker::router {

// Which of pdworker's APIs the router drives.
enum class RouterApi {
  // pdworker.v1.Worker: the router schedules every step (Forward with
  // hold_for_handoff, ImportKv, batched decode Forward calls).
  kStepLevel,
  // vllm.grpc.engine.VllmEngine only, the way SMG drives vLLM workers: one
  // streamed Generate per request (aggregated), or a prefill Generate with
  // max_tokens 1 whose kv_transfer_params_json the decode Generate carries
  // (P/D); the workers own the decode loop.
  kRequestLevel,
};

struct RouterOptions {
  RouterApi api = RouterApi::kStepLevel;
  // Either prefill AND decode addresses (disaggregated), or aggregated ones
  // (role both, no handoff); host:port each.
  std::vector<std::string> prefill_addresses;
  std::vector<std::string> decode_addresses;
  std::vector<std::string> aggregated_addresses;

  // Deadlines per RPC. The prefill Forward runs a whole prompt (maybe in
  // several chunks); ImportKv moves its KV; a decode step is one token.
  std::chrono::milliseconds prefill_timeout{60000};
  std::chrono::milliseconds import_timeout{60000};
  std::chrono::milliseconds decode_step_timeout{60000};
  // Release, ReleaseKv.
  std::chrono::milliseconds control_timeout{10000};

  WorkerPoolOptions pool;

  // Prefix-aware routing: the prompt goes to the worker of its pool
  // (aggregated, or prefill) whose KV cache holds the longest prefix of it,
  // as the workers' KV events say (PrefixIndex); ties (a prompt nobody
  // holds) go to the least loaded. Decode workers are still picked by load.
  // `kv_events` maps worker addresses of that pool to their event
  // endpoints; a worker without an entry always scores 0.
  bool route_by_prefix = false;
  std::map<std::string, KvEventEndpoints> kv_events;
  PrefixIndexOptions prefix_index;
};

// Mirrors v1::SamplingParams. All-default: greedy.
struct Sampling {
  float temperature = 0.0f;
  int32_t top_k = 0;
  float top_p = 0.0f;
  // Unset: each worker derives the seed from the sequence (= request) id,
  // identically on prefill and decode workers.
  std::optional<uint64_t> seed;
};

struct GenerationRequest {
  // The sequence id on the workers: 1..128 bytes, unique among the requests
  // in flight.
  std::string request_id;
  std::vector<int32_t> prompt;
  // Tokens to generate, counting the one the prompt's step samples; >= 1.
  int max_tokens = 16;
  // Stop after sampling this token (it is included in the output).
  std::optional<int32_t> eos_token_id;
  Sampling sampling;
};

enum class FinishReason { kLength, kEos };

// Microseconds of router wall clock unless noted.
struct GenerationTimings {
  // Generate() called -> first token received (includes picking a worker).
  int64_t ttft_us = 0;
  // The prompt's Forward RPC.
  int64_t prefill_us = 0;
  // The ImportKv RPC (0 when aggregated), and the pull inside it as the
  // decode worker measured it (ImportKvResponse.transfer_micros).
  int64_t transfer_us = 0;
  int64_t worker_transfer_us = 0;
  int64_t transfer_bytes = 0;
  // Joining the decode batch -> the first decode token received (0 when the
  // prompt's token was the last).
  int64_t first_decode_step_us = 0;
  // Between consecutive tokens as received, starting with first -> second
  // (so in P/D mode the first gap includes the transfer, as in vLLM's ITL).
  std::vector<int64_t> inter_token_us;
};

struct GenerationResult {
  std::vector<int32_t> tokens;
  FinishReason finish_reason = FinishReason::kLength;
  std::string prefill_address;  // the worker that ran the prompt
  std::string decode_address;   // the worker that ran the decode steps
  // Prompt tokens the prompt's worker found in its prefix cache (as it
  // reported them; step-level API only), and what the router's prefix index
  // predicted for it (0 when not routing by prefix).
  int32_t cached_tokens = 0;
  int32_t predicted_cached_tokens = 0;
  GenerationTimings timings;
};

// Called on Generate's thread, once per token as it arrives, first token
// included.
using TokenCallback = std::function<void(int32_t token_id)>;

class Router {
 public:
  // INVALID_ARGUMENT for a topology that is neither (prefill + decode) nor
  // aggregated, or a bad address list. Connects lazily.
  static absl::StatusOr<std::unique_ptr<Router>> Create(
      const RouterOptions& options);
  // Stops the batchers. Every Generate call must have returned.
  ~Router();

  Router(const Router&) = delete;
  Router& operator=(const Router&) = delete;

  bool disaggregated() const { return aggregated_ == nullptr; }

  // Runs one request to completion (thread-safe; run many concurrently so
  // their decode steps batch). INVALID_ARGUMENT for a bad request; otherwise
  // the failing RPC's status (code kept, message naming call and worker).
  absl::StatusOr<GenerationResult> Generate(
      const GenerationRequest& request,
      const TokenCallback& on_token = nullptr);

  // Decode batching so far, summed over every worker's batcher.
  DecodeBatcherStats decode_stats() const;

  // Every worker, prefill pool first, then decode, then aggregated.
  std::vector<PoolWorker*> workers();

  // The index behind route_by_prefix (null when off).
  PrefixIndex* prefix_index() { return prefix_index_.get(); }

 private:
  explicit Router(const RouterOptions& options) : options_(options) {}

  // The prompt's Forward on `worker`; fills tokens and prefill timings and
  // sets `received` to when the first token arrived.
  absl::StatusOr<v1::SequenceOutput> RunPrompt(
      PoolWorker& worker, const GenerationRequest& request, bool hold,
      std::chrono::steady_clock::time_point started,
      std::chrono::steady_clock::time_point* received, GenerationResult* result,
      const TokenCallback& on_token);
  // Picks the worker of `pool` for a new request's prompt: by prefix when
  // `pool` is the prompt pool and route_by_prefix is on (setting
  // `*predicted` to the chosen worker's score), else least loaded.
  absl::StatusOr<PoolWorker*> PickForPrompt(WorkerPool& pool,
                                            const GenerationRequest& request,
                                            int expected_tokens,
                                            int32_t* predicted);
  // RunPrompt on the least-loaded worker of `pool`, then on the next one
  // while a worker refuses for not serving (see TryAnotherWorker). Sets
  // `*worker` to the one that answered last.
  absl::StatusOr<v1::SequenceOutput> PlacePrompt(
      WorkerPool& pool, const GenerationRequest& request, bool hold,
      std::chrono::steady_clock::time_point started,
      std::chrono::steady_clock::time_point* received, GenerationResult* result,
      const TokenCallback& on_token, PoolWorker** worker);
  // Whether a call that failed with `error` on attempt `attempt` (0-based)
  // should go to another worker of `pool`: only UNAVAILABLE from a worker
  // that, asked again, is not serving (draining for a rolling update,
  // stopped, gone). Such a refusal changed nothing there; another
  // UNAVAILABLE (e.g. the KV source died mid-pull) another worker would
  // not fix.
  bool TryAnotherWorker(WorkerPool& pool, const PoolWorker& worker,
                        const absl::Status& error, int attempt);
  absl::StatusOr<GenerationResult> GenerateDisaggregated(
      const GenerationRequest& request, const TokenCallback& on_token);
  absl::StatusOr<GenerationResult> GenerateAggregated(
      const GenerationRequest& request, const TokenCallback& on_token);
  // RouterApi::kRequestLevel (request_level.cc).
  absl::StatusOr<GenerationResult> GenerateRequestLevel(
      const GenerationRequest& request, const TokenCallback& on_token);
  // Steps the live sequence on `worker` through its batcher until done and
  // frees it there (on success and on error).
  absl::Status Decode(PoolWorker& worker, WorkerPool& pool,
                      const GenerationRequest& request,
                      std::chrono::steady_clock::time_point last_token_at,
                      GenerationResult* result, const TokenCallback& on_token);

  // Worker.Release of the request's sequence; NOT_FOUND counts as done.
  absl::Status ReleaseSequence(PoolWorker& worker,
                               const std::string& sequence_id);
  // KvTransfer.ReleaseKv; failures are logged (the lease expires anyway).
  void ReleaseLease(PoolWorker& worker, const std::string& lease_id);

  // The worker's batcher, created on first use with the worker's
  // max_num_seqs from `pool`'s status.
  DecodeBatcher& BatcherFor(PoolWorker& worker, WorkerPool& pool);

  const RouterOptions options_;
  std::unique_ptr<WorkerPool> prefill_;
  std::unique_ptr<WorkerPool> decode_;
  std::unique_ptr<WorkerPool> aggregated_;
  std::unique_ptr<PrefixIndex> prefix_index_;

  mutable std::mutex batchers_mu_;
  std::map<const PoolWorker*, std::unique_ptr<DecodeBatcher>> batchers_;
};

}  // namespace pdworker::router

#endif  // PDWORKER_TOOLS_ROUTER_ROUTER_H_
