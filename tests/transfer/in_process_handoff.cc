#include "tests/transfer/in_process_handoff.h"

#include "gtest/gtest.h"
#include "tests/transfer/handoff_test_util.h"

namespace pdworker::handoff_testing {

ModelRunnerOptions Options(Role role) {
  ModelRunnerOptions o = server_testing::SmallRunnerOptions();
  o.role = role;
  o.compilation = CompilationConfig{};  // the role's default graph mode
  o.compilation.cudagraph_capture_sizes = std::vector<int>{1, 2, 4, 8, 16};
  return o;
}

std::vector<int32_t> Prompt(int n, int salt) {
  std::vector<int32_t> tokens(n);
  for (int i = 0; i < n; ++i) tokens[i] = (salt * 31 + 7 * i + 3) % 256;
  return tokens;
}

WorkerServerOptions ServerOptions(std::chrono::milliseconds lease_ttl) {
  WorkerServerOptions o;
  o.kv_lease_ttl = lease_ttl;
  o.importer.pull_timeout = std::chrono::milliseconds(5000);
  return o;
}

// Forward one sequence; returns the response (ASSERTs OK).
v1::ForwardResponse Step(server_testing::TestWorker& w, v1::SequenceInput in) {
  v1::ForwardResponse response;
  const grpc::Status s = server_testing::Forward(
      *w.stub, server_testing::Request({std::move(in)}), &response);
  EXPECT_TRUE(s.ok()) << s.error_message();
  return response;
}

// The prefill half: start + hold. Returns the first token and the handle.
std::pair<int32_t, v1::KvHandle> Prefill(server_testing::TestWorker& prefill,
                                         const std::string& id,
                                         const std::vector<int32_t>& prompt,
                                         const v1::SamplingParams& sampling) {
  const v1::ForwardResponse r = Hold(*prefill.stub, id, prompt, sampling);
  if (r.sequences_size() != 1) return {-1, {}};
  return {r.sequences(0).token_id(), r.sequences(0).kv_handle()};
}

// `steps` decode steps of `id` on `w` starting from `token`; returns the
// sampled tokens (releasing the sequence with the last step).
std::vector<int32_t> Decode(server_testing::TestWorker& w,
                            const std::string& id, int32_t token, int steps,
                            const v1::SamplingParams& sampling) {
  std::vector<int32_t> out;
  for (int i = 0; i < steps; ++i) {
    v1::SequenceInput in = server_testing::Input(id, {token}, false);
    *in.mutable_sampling() = sampling;
    in.set_release_after_step(i == steps - 1);
    v1::ForwardResponse r = Step(w, in);
    if (r.sequences_size() != 1) return out;
    token = r.sequences(0).token_id();
    out.push_back(token);
  }
  return out;
}

void ExpectNothingHeld(server_testing::TestWorker& w, const std::string& who) {
  ASSERT_TRUE(server_testing::WaitFor([&] { return HoldsNothing(w.Status()); }))
      << who << ": " << w.Status().DebugString();
}

}  // namespace pdworker::handoff_testing
