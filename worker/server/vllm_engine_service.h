// VllmEngineService: `vllm.grpc.engine.VllmEngine` (proto/vllm_engine.proto)
// on the worker's gRPC port, over the engine's request-level API, so routers
// built for vLLM workers (SMG, llm-d) drive pdworker unchanged: Generate
// streams the tokens of an engine-owned request (the worker owns the decode
// loop), Abort ends requests, and the management RPCs answer from the
// checkpoint and the engine's published snapshot. Handlers never block;
// Generate's stream is written from the engine thread's updates.
#ifndef PDWORKER_WORKER_SERVER_VLLM_ENGINE_SERVICE_H_
#define PDWORKER_WORKER_SERVER_VLLM_ENGINE_SERVICE_H_

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <string>

#include "proto/vllm_engine.grpc.pb.h"
#include "worker/engine/engine.h"
#include "worker/runner/model_runner.h"
#include "worker/server/generate_request.h"
#include "worker/server/kv_event_stream.h"
#include "worker/server/worker_service.h"
#include "worker/transfer/kv_importer.h"

namespace pdworker {

struct VllmEngineServiceOptions {
  std::string model_dir;          // GetModelInfo.model_path, GetTokenizer
  std::string served_model_name;  // empty: the model directory
  // How recently a busy engine must have finished a step to be healthy.
  std::chrono::milliseconds health_step_window{30000};
  // SubscribeKvEvents' source (the prefix cache's events); null:
  // UNIMPLEMENTED (prefix caching off). Must outlive the service.
  KvEventStream* kv_events = nullptr;
};

// Every method raw: requests are parsed by us (parsed_call.h says why).
namespace vllm_engine_raw {
using vllm::grpc::engine::VllmEngine;
using Service = VllmEngine::WithRawCallbackMethod_Generate<
    VllmEngine::WithRawCallbackMethod_Embed<
        VllmEngine::WithRawCallbackMethod_HealthCheck<
            VllmEngine::WithRawCallbackMethod_Abort<
                VllmEngine::WithRawCallbackMethod_GetModelInfo<
                    VllmEngine::WithRawCallbackMethod_GetServerInfo<
                        VllmEngine::WithRawCallbackMethod_GetLoads<
                            VllmEngine::WithRawCallbackMethod_GetTokenizer<
                                VllmEngine::
                                    WithRawCallbackMethod_SubscribeKvEvents<
                                        VllmEngine::Service>>>>>>>>>;
}  // namespace vllm_engine_raw

class VllmEngineService final : public vllm_engine_raw::Service {
 public:
  // Reads the runner's static configuration now (before serving); from then
  // on only `engine` touches the runner. `importer` (decode side; may be
  // null) pulls the KV a request's kv_transfer_params_json names;
  // `handle_template` (read once serving) is what a prefill leg's handle
  // carries besides its lease.
  VllmEngineService(const ModelRunner& runner, Engine& engine,
                    const VllmEngineServiceOptions& options,
                    KvImporter* importer, const v1::KvHandle* handle_template);

  void SetState(ServingState state) {
    state_.store(state, std::memory_order_release);
  }

  // Requests and responses are proto/vllm_engine.proto's messages,
  // serialized.
  grpc::ServerWriteReactor<grpc::ByteBuffer>* Generate(
      grpc::CallbackServerContext* context,
      const grpc::ByteBuffer* request) override;
  grpc::ServerUnaryReactor* Embed(grpc::CallbackServerContext* context,
                                  const grpc::ByteBuffer* request,
                                  grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* HealthCheck(grpc::CallbackServerContext* context,
                                        const grpc::ByteBuffer* request,
                                        grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* Abort(grpc::CallbackServerContext* context,
                                  const grpc::ByteBuffer* request,
                                  grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* GetModelInfo(grpc::CallbackServerContext* context,
                                         const grpc::ByteBuffer* request,
                                         grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* GetServerInfo(grpc::CallbackServerContext* context,
                                          const grpc::ByteBuffer* request,
                                          grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* GetLoads(grpc::CallbackServerContext* context,
                                     const grpc::ByteBuffer* request,
                                     grpc::ByteBuffer* response) override;
  grpc::ServerWriteReactor<grpc::ByteBuffer>* GetTokenizer(
      grpc::CallbackServerContext* context,
      const grpc::ByteBuffer* request) override;
  grpc::ServerWriteReactor<grpc::ByteBuffer>* SubscribeKvEvents(
      grpc::CallbackServerContext* context,
      const grpc::ByteBuffer* request) override;

 private:
  // Empty when healthy, else why not (HealthCheck's message).
  std::string HealthProblem() const;

  Engine& engine_;
  KvImporter* const importer_;
  const v1::KvHandle* const handle_template_;
  const VllmEngineServiceOptions options_;
  const GenerateLimits limits_;
  const Role role_;
  const int max_num_seqs_;
  const int64_t kv_total_tokens_;
  const int32_t kv_block_size_;
  vllm::grpc::engine::GetModelInfoResponse model_info_;
  const std::chrono::steady_clock::time_point started_;
  std::atomic<ServingState> state_{ServingState::kStarting};
  // Unix seconds of the latest Generate, as a double's bits.
  std::atomic<double> last_receive_unix_{0.0};
  // Makes the KV sequence ids of imported prompts unique.
  std::atomic<int64_t> next_import_{0};
};

}  // namespace pdworker

#endif  // PDWORKER_WORKER_SERVER_VLLM_ENGINE_SERVICE_H_
