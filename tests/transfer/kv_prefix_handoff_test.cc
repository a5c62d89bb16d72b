// Prefix-aware P/D handoff between in-process workers over real gRPC on
// loopback: a decode worker whose prefix cache holds the leading blocks of
// an imported prompt reuses them and pulls only the rest (PullKvRequest.
// first_token), the bytes moved and the cached tokens are reported, and the
// tokens equal one aggregated worker's. The prefill and decode workers use
// different block sizes (16 and 8), so the pull starts inside a source
// block. A handle of other weights is refused before anything is reused, a
// handle whose token ids are not its lease's is refused by the source, and
// a failed import leaves every block free (shared ones included).
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/server/server_test_util.h"
#include "tests/transfer/handoff_test_util.h"
#include "tools/make_tiny_model/tiny_model.h"

namespace pdworker {
namespace {

using handoff_testing::Import;
using server_testing::Forward;
using server_testing::Input;
using server_testing::Request;
using server_testing::StartWorker;
using server_testing::TestWorker;
using server_testing::WaitFor;
using ::testing::HasSubstr;

constexpr int kPrefillBlock = 16;
constexpr int kDecodeBlock = 8;
constexpr int kMaxModelLen = 2048;
constexpr int kSystemLen = 1001;  // ends one token into a decode block

// The tiny GQA model with max_position_embeddings raised to kMaxModelLen
// (no weight depends on it), written once per seed.
std::string LongModelDir(int seed) {
  static std::map<int, std::string>* dirs = new std::map<int, std::string>;
  auto it = dirs->find(seed);
  if (it != dirs->end()) return it->second;
  const std::string dir = std::string(std::getenv("TEST_TMPDIR")) +
                          "/tiny_gqa_long_" + std::to_string(seed);
  TinyModelOptions options;
  options.shape = TinyShape::kGqa;
  options.seed = seed;
  const absl::Status written = WriteTinyModel(options, dir);
  EXPECT_TRUE(written.ok()) << written;
  std::stringstream config;
  config << std::ifstream(dir + "/config.json").rdbuf();
  std::string text = config.str();
  const std::string from = "\"max_position_embeddings\": 512";
  const size_t at = text.find(from);
  EXPECT_NE(at, std::string::npos) << text;
  if (at != std::string::npos) {
    text.replace(
        at, from.size(),
        "\"max_position_embeddings\": " + std::to_string(kMaxModelLen));
  }
  std::ofstream(dir + "/config.json", std::ios::trunc) << text;
  (*dirs)[seed] = dir;
  return dir;
}

ModelRunnerOptions Options(Role role, int block_size, PrefixCaching caching) {
  ModelRunnerOptions o = server_testing::SmallRunnerOptions();
  o.role = role;
  o.compilation = CompilationConfig{};  // the role's default graph mode
  o.compilation.cudagraph_capture_sizes = std::vector<int>{1, 2, 4, 8, 16};
  o.block_size = block_size;
  o.max_model_len = kMaxModelLen;
  o.max_num_batched_tokens = 256;
  o.kv_cache_bytes = int64_t{4} << 20;  // 16,384 tokens
  o.prefix_caching = caching;
  return o;
}

WorkerServerOptions ServerOptions() {
  WorkerServerOptions o;
  o.importer.pull_timeout = std::chrono::milliseconds(5000);
  // One source block per chunk: a pull from inside a block shows how the
  // first chunk ends at the block's end.
  o.transfer.max_chunk_bytes = 1;
  return o;
}

std::unique_ptr<TestWorker> Start(Role role, int block_size,
                                  PrefixCaching caching, int seed = 7) {
  return StartWorker(Options(role, block_size, caching), ServerOptions(),
                     /*capture_and_serve=*/true, LongModelDir(seed));
}

// Pseudo-random tokens (no short period, so blocks differ by content).
std::vector<int32_t> Tokens(int n, uint32_t seed) {
  std::vector<int32_t> tokens(n);
  uint32_t x = seed * 2654435761u + 12345u;
  for (int i = 0; i < n; ++i) {
    x = x * 1664525u + 1013904223u;
    tokens[i] = static_cast<int32_t>((x >> 16) % 256);
  }
  return tokens;
}

std::vector<int32_t> Concat(std::vector<int32_t> a,
                            const std::vector<int32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// One token's K (or V) row of one layer, bytes.
int64_t TokenBytes(const v1::KvLayout& layout) {
  EXPECT_EQ(layout.dtype(), "float32");
  return int64_t{layout.num_kv_heads()} * layout.head_dim() * 4;
}

// What pulling `tokens` tokens moves: K and V of every layer.
int64_t PullBytes(const v1::KvHandle& handle, int tokens) {
  return int64_t{tokens} * 2 * handle.layout().num_layers() *
         TokenBytes(handle.layout());
}

// The decode worker's hit for a prompt of `n` tokens sharing its first
// `common` tokens with what it has cached: whole blocks, never the last
// token's.
int ExpectedCached(int common, int n, int block_size) {
  return std::min(common / block_size, (n - 1) / block_size) * block_size;
}

v1::ForwardResponse Step(TestWorker& w, v1::SequenceInput in) {
  v1::ForwardResponse response;
  const grpc::Status s = Forward(*w.stub, Request({std::move(in)}), &response);
  EXPECT_TRUE(s.ok()) << s.error_message();
  return response;
}

// `steps` decode steps of `id` from `token`, releasing with the last.
std::vector<int32_t> Decode(TestWorker& w, const std::string& id, int32_t token,
                            int steps, const v1::SamplingParams& sampling) {
  std::vector<int32_t> out;
  for (int i = 0; i < steps; ++i) {
    v1::SequenceInput in = Input(id, {token}, false);
    *in.mutable_sampling() = sampling;
    in.set_release_after_step(i == steps - 1);
    v1::ForwardResponse r = Step(w, in);
    if (r.sequences_size() != 1) return out;
    token = r.sequences(0).token_id();
    out.push_back(token);
  }
  return out;
}

// The aggregated reference: the first token and `steps` more.
std::vector<int32_t> Aggregated(TestWorker& w, const std::string& id,
                                const std::vector<int32_t>& prompt, int steps,
                                const v1::SamplingParams& sampling) {
  v1::SequenceInput in = Input(id, prompt, true);
  *in.mutable_sampling() = sampling;
  const int32_t first = Step(w, in).sequences(0).token_id();
  std::vector<int32_t> out = {first};
  for (const int32_t t : Decode(w, id, first, steps, sampling)) {
    out.push_back(t);
  }
  return out;
}

void ExpectNothingHeld(TestWorker& w, const std::string& who) {
  ASSERT_TRUE(WaitFor([&] {
    return handoff_testing::HoldsNothing(w.Status());
  })) << who
      << ": " << w.Status().DebugString();
}

class KvPrefixHandoffTest : public ::testing::Test {
 protected:
  void SetUp() override {
    prefill_ = Start(Role::kPrefill, kPrefillBlock, PrefixCaching::kOn);
    ASSERT_FALSE(HasFatalFailure());
    decode_ = Start(Role::kDecode, kDecodeBlock, PrefixCaching::kOn);
    ASSERT_FALSE(HasFatalFailure());
  }
  void TearDown() override {
    if (prefill_ != nullptr) ExpectNothingHeld(*prefill_, "prefill");
    if (decode_ != nullptr) ExpectNothingHeld(*decode_, "decode");
  }

  // Holds `prompt` on the prefill worker; the response (first token, handle,
  // the prefill worker's own cached tokens).
  v1::SequenceOutput Hold(const std::string& id,
                          const std::vector<int32_t>& prompt,
                          const v1::SamplingParams& sampling) {
    const v1::ForwardResponse r =
        handoff_testing::Hold(*prefill_->stub, id, prompt, sampling);
    EXPECT_EQ(r.sequences_size(), 1);
    return r.sequences_size() == 1 ? r.sequences(0) : v1::SequenceOutput();
  }

  std::unique_ptr<TestWorker> prefill_;
  std::unique_ptr<TestWorker> decode_;
};

// The same ~1,000-token system prompt twice with other questions: the second
// import pulls only the tokens after the decode worker's cached blocks, and
// an identical prompt only its last partial block; a handle without the
// prompt's ids pulls everything. Every P/D run's tokens equal an
// aggregated worker's (prefix caching off there).
TEST_F(KvPrefixHandoffTest, SecondRequestPullsOnlyTheNewBlocks) {
  std::unique_ptr<TestWorker> both =
      Start(Role::kBoth, kPrefillBlock, PrefixCaching::kOff);
  ASSERT_FALSE(HasFatalFailure());
  const std::vector<int32_t> system = Tokens(kSystemLen, 1);
  std::vector<int32_t> question_a = Tokens(37, 2);
  std::vector<int32_t> question_b = Tokens(45, 3);
  std::vector<int32_t> question_c = Tokens(20, 4);
  // The questions differ from their first token on.
  question_b[0] = (question_a[0] + 1) % 256;
  question_c[0] = (question_a[0] + 2) % 256;
  const std::vector<int32_t> a = Concat(system, question_a);  // 1,038
  const std::vector<int32_t> b = Concat(system, question_b);  // 1,046
  const std::vector<int32_t> c = Concat(system, question_c);  // 1,021

  v1::SamplingParams greedy;
  v1::SamplingParams seeded;
  seeded.set_temperature(0.8f);
  seeded.set_top_k(20);
  seeded.set_seed(4242);

  struct Case {
    std::string id;
    const std::vector<int32_t>* prompt;
    v1::SamplingParams sampling;
    bool drop_ids;       // a handle without prompt_token_ids
    int cached;          // expected on the decode worker
    int prefill_cached;  // on the prefill worker (its own cache), at most
  };
  const int n_a = static_cast<int>(a.size());
  const int n_b = static_cast<int>(b.size());
  const int n_c = static_cast<int>(c.size());
  const std::vector<Case> cases = {
      // Nothing cached anywhere yet.
      {"a", &a, greedy, false, 0, 0},
      // The system prompt's whole decode blocks (1,000 tokens); the prefill
      // worker hit its own 62 blocks of 16 (992 tokens).
      {"b", &b, greedy, false, ExpectedCached(kSystemLen, n_b, kDecodeBlock),
       ExpectedCached(kSystemLen, n_b, kPrefillBlock)},
      // a again: every full block of it (129 × 8 = 1,032 of 1,038).
      {"a2", &a, seeded, false, ExpectedCached(n_a, n_a, kDecodeBlock),
       ExpectedCached(n_a, n_a, kPrefillBlock)},
      // Without the ids the decode worker cannot look its cache up.
      {"c", &c, seeded, true, 0,
       ExpectedCached(kSystemLen, n_c, kPrefillBlock)},
  };
  ASSERT_EQ(cases[1].cached, 1000);
  ASSERT_EQ(cases[1].prefill_cached, 992);
  ASSERT_EQ(cases[2].cached, 1032);

  for (const Case& k : cases) {
    SCOPED_TRACE(k.id);
    const int n = static_cast<int>(k.prompt->size());
    const std::vector<int32_t> expected =
        Aggregated(*both, k.id, *k.prompt, 5, k.sampling);

    const v1::SequenceOutput held = Hold(k.id, *k.prompt, k.sampling);
    // The prefill worker's lease then holds blocks shared with its cache
    // (read by the pull, never written). A chunked step-level prompt finds
    // its hit within its first chunk only (240 of 256 tokens here), so
    // this is at most the block rule's figure.
    EXPECT_LE(held.cached_tokens(), k.prefill_cached);
    EXPECT_EQ(held.cached_tokens() > 0, k.prefill_cached > 0);
    v1::KvHandle handle = held.kv_handle();
    ASSERT_EQ(handle.prompt_token_ids_size(), n);
    if (k.drop_ids) handle.clear_prompt_token_ids();

    v1::ImportKvResponse imported;
    const grpc::Status s = Import(*decode_->stub, k.id, handle, &imported);
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_EQ(imported.num_tokens(), n);
    EXPECT_EQ(imported.transport(), "grpc");
    EXPECT_EQ(imported.cached_tokens(), k.cached);
    EXPECT_EQ(imported.transfer_bytes(), PullBytes(handle, n - k.cached));

    std::vector<int32_t> got = {held.token_id()};
    for (const int32_t t :
         Decode(*decode_, k.id, held.token_id(), 5, k.sampling)) {
      got.push_back(t);
    }
    EXPECT_EQ(got, expected);
  }
  ExpectNothingHeld(*both, "aggregated");
}

// PullKv from first_token on, at the source: chunks start there (the first
// one inside a source block ends at that block's end), the bytes are the
// remaining tokens', and a first_token outside [0, num_tokens) is refused
// with INVALID_ARGUMENT naming it, nothing sent, the lease still pullable.
TEST_F(KvPrefixHandoffTest, PullStartsAtFirstToken) {
  const std::vector<int32_t> prompt = Tokens(50, 9);
  const v1::KvHandle handle =
      Hold("p", prompt, v1::SamplingParams()).kv_handle();
  v1::KvTransfer::Stub transfer(prefill_->channel);
  v1::PullKvRequest request;
  request.set_lease_id(handle.lease_id());
  request.set_model_fingerprint(handle.model_fingerprint());
  *request.mutable_layout() = handle.layout();
  request.set_num_tokens(handle.num_tokens());

  for (const int bad : {50, 51, -1}) {
    v1::PullKvRequest r = request;
    r.set_first_token(bad);
    grpc::ClientContext context;
    auto reader = transfer.PullKv(&context, r);
    v1::KvChunk chunk;
    EXPECT_FALSE(reader->Read(&chunk)) << bad;
    const grpc::Status s = reader->Finish();
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << bad;
    EXPECT_THAT(s.error_message(), HasSubstr("first_token")) << bad;
  }

  request.set_first_token(21);
  grpc::ClientContext context;
  auto reader = transfer.PullKv(&context, request);
  v1::KvChunk chunk;
  std::vector<std::pair<int, int>> runs;  // of layer 0's K
  int64_t bytes = 0;
  while (reader->Read(&chunk)) {
    bytes += static_cast<int64_t>(chunk.data().size());
    if (chunk.layer() == 0 && chunk.part() == v1::KvChunk::PART_KEY) {
      runs.emplace_back(chunk.first_token(), chunk.num_tokens());
    }
  }
  ASSERT_TRUE(reader->Finish().ok());
  EXPECT_EQ(bytes, PullBytes(handle, 50 - 21));
  EXPECT_THAT(runs, ::testing::ElementsAre(std::make_pair(21, 11),
                                           std::make_pair(32, 16),
                                           std::make_pair(48, 2)));
  grpc::ClientContext release_context;
  v1::ReleaseKvRequest release;
  release.set_lease_id(handle.lease_id());
  v1::ReleaseKvResponse released;
  ASSERT_TRUE(transfer.ReleaseKv(&release_context, release, &released).ok());
}

// An import that fails after reusing cached blocks (the source cannot be
// reached) only drops its references: every block is free again, the
// cache still holds the prefix (the next import reuses it), and once the
// worker is drained no block has a reference left.
TEST_F(KvPrefixHandoffTest, FailedImportLeavesEveryBlockFree) {
  const std::vector<int32_t> system = Tokens(kSystemLen, 11);
  const std::vector<int32_t> first = Concat(system, Tokens(30, 12));
  std::vector<int32_t> tail = Tokens(30, 13);
  tail[0] = (first[kSystemLen] + 1) % 256;
  const std::vector<int32_t> second = Concat(system, tail);

  const v1::SequenceOutput a = Hold("a", first, v1::SamplingParams());
  ASSERT_TRUE(Import(*decode_->stub, "a", a.kv_handle()).ok());
  Decode(*decode_, "a", a.token_id(), 2, v1::SamplingParams());
  ExpectNothingHeld(*decode_, "decode after the first import");
  const int32_t cached_blocks = decode_->Status().kv_blocks_cached();
  EXPECT_GE(cached_blocks, 1031 / kDecodeBlock);

  const v1::SequenceOutput b = Hold("b", second, v1::SamplingParams());
  v1::KvHandle unreachable = b.kv_handle();
  unreachable.set_source_address("127.0.0.1:1");
  const grpc::Status s = Import(*decode_->stub, "b", unreachable);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();
  ExpectNothingHeld(*decode_, "decode after the failed import");
  EXPECT_EQ(decode_->Status().kv_blocks_cached(), cached_blocks);

  // The lease is intact and the cache still serves the prefix.
  v1::ImportKvResponse imported;
  ASSERT_TRUE(Import(*decode_->stub, "b", b.kv_handle(), &imported).ok());
  EXPECT_EQ(imported.cached_tokens(),
            ExpectedCached(kSystemLen, 1031, kDecodeBlock));
  EXPECT_EQ(imported.transfer_bytes(),
            PullBytes(b.kv_handle(), 1031 - imported.cached_tokens()));
  Decode(*decode_, "b", b.token_id(), 2, v1::SamplingParams());
  ExpectNothingHeld(*decode_, "decode");
  ExpectNothingHeld(*prefill_, "prefill");

  decode_->server->Drain();
  const KvCacheManager& kv = decode_->runner.runner->kv_cache();
  const KvCacheStats stats = kv.Stats();
  EXPECT_EQ(stats.free_blocks, stats.total_blocks);
  EXPECT_EQ(stats.detached_blocks, 0);
  for (int32_t block = 0; block < stats.total_blocks; ++block) {
    ASSERT_EQ(kv.ref_count(block), 0) << "block " << block;
  }
  decode_.reset();
}

// A handle whose prompt_token_ids are not its lease's tokens (altered, or
// spliced from another handle) would make the decode worker cache the
// lease's K/V under other tokens' hashes: the source refuses the pull
// before sending anything, the decode worker's cache and blocks are as
// before, and the lease stays pullable by the true handle.
TEST_F(KvPrefixHandoffTest, HandleWithOtherTokenIdsIsRefused) {
  const std::vector<int32_t> system = Tokens(kSystemLen, 31);
  const std::vector<int32_t> first = Concat(system, Tokens(12, 32));
  std::vector<int32_t> tail = Tokens(12, 33);
  tail[0] = (first[kSystemLen] + 1) % 256;
  const std::vector<int32_t> second = Concat(system, tail);

  const v1::SequenceOutput a = Hold("a", first, v1::SamplingParams());
  ASSERT_TRUE(Import(*decode_->stub, "a", a.kv_handle()).ok());
  Decode(*decode_, "a", a.token_id(), 1, v1::SamplingParams());
  ExpectNothingHeld(*decode_, "decode after the first import");
  const int32_t cached_blocks = decode_->Status().kv_blocks_cached();

  const v1::SequenceOutput b = Hold("b", second, v1::SamplingParams());
  for (const int position : {3, kSystemLen + 5}) {
    SCOPED_TRACE(position);
    v1::KvHandle altered = b.kv_handle();
    altered.set_prompt_token_ids(
        position, (altered.prompt_token_ids(position) + 1) % 256);
    const grpc::Status s = Import(*decode_->stub, "b", altered);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION)
        << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr("prompt_token_ids"));
    EXPECT_THAT(s.error_message(), HasSubstr("first difference at token " +
                                             std::to_string(position)));
    ExpectNothingHeld(*decode_, "decode after the refused import");
    EXPECT_EQ(decode_->Status().kv_blocks_cached(), cached_blocks);
  }

  v1::ImportKvResponse imported;
  ASSERT_TRUE(Import(*decode_->stub, "b", b.kv_handle(), &imported).ok());
  EXPECT_EQ(imported.cached_tokens(),
            ExpectedCached(kSystemLen, kSystemLen + 12, kDecodeBlock));
  Decode(*decode_, "b", b.token_id(), 1, v1::SamplingParams());
}

// A decode worker running other weights (same config.json, so the same KV
// layout) with the same prompt's blocks in its cache: the handle is refused
// on the fingerprint before any lookup or reuse, nothing is allocated, its
// cache is untouched, and the lease survives for the right worker.
TEST_F(KvPrefixHandoffTest, OtherWeightsAreRefusedBeforeReuse) {
  const std::vector<int32_t> prompt = Tokens(kSystemLen + 20, 21);
  std::unique_ptr<TestWorker> tuned =
      Start(Role::kDecode, kDecodeBlock, PrefixCaching::kOn, /*seed=*/8);
  ASSERT_FALSE(HasFatalFailure());
  // The same tokens, computed by its own weights, are in its cache.
  v1::SequenceInput in = Input("own", prompt, true);
  in.set_release_after_step(true);
  Step(*tuned, in);
  ExpectNothingHeld(*tuned, "tuned after its own prompt");
  const int32_t cached_blocks = tuned->Status().kv_blocks_cached();
  ASSERT_EQ(cached_blocks, static_cast<int>(prompt.size()) / kDecodeBlock);

  const v1::SequenceOutput held = Hold("w", prompt, v1::SamplingParams());
  ASSERT_NE(tuned->Status().model_fingerprint(),
            held.kv_handle().model_fingerprint());
  const grpc::Status s = Import(*tuned->stub, "w", held.kv_handle());
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION)
      << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("model fingerprint"));
  ExpectNothingHeld(*tuned, "tuned after the refused import");
  EXPECT_EQ(tuned->Status().kv_blocks_cached(), cached_blocks);

  // A tampered fingerprint (our worker's own, on another worker's KV) is
  // refused by the source before anything is sent.
  v1::KvTransfer::Stub transfer(prefill_->channel);
  {
    v1::PullKvRequest pull;
    pull.set_lease_id(held.kv_handle().lease_id());
    pull.set_model_fingerprint(tuned->Status().model_fingerprint());
    *pull.mutable_layout() = held.kv_handle().layout();
    pull.set_first_token(kSystemLen - 1);
    grpc::ClientContext context;
    auto reader = transfer.PullKv(&context, pull);
    v1::KvChunk chunk;
    EXPECT_FALSE(reader->Read(&chunk));
    EXPECT_EQ(reader->Finish().error_code(),
              grpc::StatusCode::FAILED_PRECONDITION);
  }

  // The worker with the right weights (nothing cached) pulls it all.
  v1::ImportKvResponse imported;
  ASSERT_TRUE(Import(*decode_->stub, "w", held.kv_handle(), &imported).ok());
  EXPECT_EQ(imported.cached_tokens(), 0);
  EXPECT_EQ(imported.transfer_bytes(),
            PullBytes(held.kv_handle(), static_cast<int>(prompt.size())));
  Decode(*decode_, "w", held.token_id(), 1, v1::SamplingParams());
  ExpectNothingHeld(*tuned, "tuned");
}

}  // namespace
}  // namespace pdworker
