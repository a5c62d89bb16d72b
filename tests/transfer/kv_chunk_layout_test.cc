// The gRPC stream's chunk layouts between in-process workers over real
// loopback gRPC: token spans (every layer of a run of tokens per chunk, cut
// by bytes) and the layer runs older workers use, on the wire and end to
// end.
#include <algorithm>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/server/server_test_util.h"
#include "tests/transfer/handoff_test_util.h"
#include "tests/transfer/in_process_handoff.h"

namespace pdworker {
namespace {

using handoff_testing::Decode;
using handoff_testing::ExpectNothingHeld;
using handoff_testing::Import;
using handoff_testing::Options;
using handoff_testing::Prefill;
using handoff_testing::Prompt;
using handoff_testing::ServerOptions;
using handoff_testing::Step;
using server_testing::Input;
using server_testing::StartWorker;
using server_testing::TestWorker;
using ::testing::HasSubstr;

// Token spans cut by bytes (one token per chunk, a few, the whole prompt)
// and the layer runs older pullers ask for all hand the KV over exactly:
// the decode worker's tokens equal an aggregated worker's in every pairing.
TEST(KvChunkLayoutTest, EveryChunkLayoutAndSizeGivesTheAggregatedTokens) {
  std::unique_ptr<TestWorker> both =
      StartWorker(Options(Role::kBoth), ServerOptions());
  ASSERT_FALSE(testing::Test::HasFatalFailure());
  // The small model's token: 2 layers x (K + V) x 2 KV heads x 8 x 4 bytes.
  constexpr size_t kSpanTokenBytes = 2 * 2 * 2 * 8 * 4;
  std::vector<std::unique_ptr<TestWorker>> prefills;
  for (const size_t chunk_bytes :
       {size_t{1}, 3 * kSpanTokenBytes + 100, size_t{256} << 10}) {
    WorkerServerOptions o = ServerOptions();
    o.transfer.max_chunk_bytes = chunk_bytes;
    prefills.push_back(StartWorker(Options(Role::kPrefill), o));
    ASSERT_FALSE(testing::Test::HasFatalFailure());
  }
  std::vector<std::unique_ptr<TestWorker>> decodes;
  for (const v1::KvChunkLayout layout :
       {v1::KV_CHUNK_LAYOUT_TOKEN_SPAN, v1::KV_CHUNK_LAYOUT_LAYER_RUN}) {
    WorkerServerOptions o = ServerOptions();
    o.importer.stream_chunk_layout = layout;
    decodes.push_back(StartWorker(Options(Role::kDecode), o));
    ASSERT_FALSE(testing::Test::HasFatalFailure());
  }
  int salt = 100;
  for (const int len : {1, 6, 37}) {
    ++salt;
    const std::vector<int32_t> prompt = Prompt(len, salt);
    const v1::SamplingParams greedy;
    const std::string id = "a" + std::to_string(salt);
    const int32_t first =
        Step(*both, Input(id, prompt, true)).sequences(0).token_id();
    std::vector<int32_t> expected = {first};
    for (int32_t t : Decode(*both, id, first, 4, greedy)) expected.push_back(t);
    for (size_t p = 0; p < prefills.size(); ++p) {
      for (size_t d = 0; d < decodes.size(); ++d) {
        SCOPED_TRACE(::testing::Message() << "length " << len << " prefill "
                                          << p << " decode " << d);
        const std::string pd = id + "-" + std::to_string(p * 2 + d);
        const auto [p_first, handle] =
            Prefill(*prefills[p], pd, prompt, greedy);
        v1::ImportKvResponse imported;
        const grpc::Status s = Import(*decodes[d]->stub, pd, handle, &imported);
        ASSERT_TRUE(s.ok()) << s.error_message();
        EXPECT_EQ(imported.transfer_bytes(), int64_t{len} * kSpanTokenBytes);
        std::vector<int32_t> got = {p_first};
        for (int32_t t : Decode(*decodes[d], pd, p_first, 4, greedy)) {
          got.push_back(t);
        }
        EXPECT_EQ(got, expected);
      }
    }
  }
  ExpectNothingHeld(*both, "aggregated");
  for (auto& w : prefills) ExpectNothingHeld(*w, "prefill");
  for (auto& w : decodes) ExpectNothingHeld(*w, "decode");
}

// Reads a whole PullKv stream; the status and the chunks.
grpc::Status PullAll(v1::KvTransfer::Stub& transfer,
                     const v1::PullKvRequest& request,
                     std::vector<v1::KvChunk>* chunks) {
  grpc::ClientContext context;
  auto reader = transfer.PullKv(&context, request);
  v1::KvChunk chunk;
  while (reader->Read(&chunk)) chunks->push_back(chunk);
  return reader->Finish();
}

// The stream on the wire: token spans of whole tokens, at most
// max_chunk_bytes each (3 tokens here), one after another from first_token
// to the lease's end, carrying the very bytes of the layer runs of the same
// prompt, rearranged [layer][K, V][token]. A chunk_layout the source does
// not know, or spans over another transport, is INVALID_ARGUMENT naming
// chunk_layout, and the lease stays pullable.
TEST(KvChunkLayoutTest, SpansCarryTheLayerRunsBytesCutByBytes) {
  constexpr size_t kSpanTokenBytes = 2 * 2 * 2 * 8 * 4;
  constexpr size_t kRowBytes = 2 * 8 * 4;  // one layer part of one token
  WorkerServerOptions o = ServerOptions();
  o.transfer.max_chunk_bytes = 3 * kSpanTokenBytes + 100;
  std::unique_ptr<TestWorker> prefill = StartWorker(Options(Role::kPrefill), o);
  ASSERT_FALSE(testing::Test::HasFatalFailure());
  v1::KvTransfer::Stub transfer(prefill->channel);
  const std::vector<int32_t> prompt = Prompt(11, 9);
  auto request_for = [](const v1::KvHandle& handle, v1::KvChunkLayout layout) {
    v1::PullKvRequest r;
    r.set_lease_id(handle.lease_id());
    r.set_model_fingerprint(handle.model_fingerprint());
    *r.mutable_layout() = handle.layout();
    r.set_num_tokens(handle.num_tokens());
    r.set_first_token(2);
    r.set_chunk_layout(layout);
    return r;
  };

  // [part][token] rows from either layout.
  using Rows = std::map<std::pair<int, int>, std::string>;
  const v1::KvHandle spans_handle =
      Prefill(*prefill, "s", prompt, v1::SamplingParams()).second;
  std::vector<v1::KvChunk> spans;
  ASSERT_TRUE(PullAll(transfer,
                      request_for(spans_handle, v1::KV_CHUNK_LAYOUT_TOKEN_SPAN),
                      &spans)
                  .ok());
  Rows from_spans;
  int32_t next = 2;
  for (const v1::KvChunk& c : spans) {
    EXPECT_EQ(c.chunk_layout(), v1::KV_CHUNK_LAYOUT_TOKEN_SPAN);
    EXPECT_EQ(c.layer(), 0);
    EXPECT_EQ(c.part(), v1::KvChunk::PART_UNSPECIFIED);
    EXPECT_EQ(c.first_token(), next);
    EXPECT_EQ(c.num_tokens(), std::min(3, 11 - next));
    ASSERT_EQ(c.data().size(), c.num_tokens() * kSpanTokenBytes);
    for (int part = 0; part < 4; ++part) {
      for (int t = 0; t < c.num_tokens(); ++t) {
        from_spans[{part, c.first_token() + t}] =
            c.data().substr((part * c.num_tokens() + t) * kRowBytes, kRowBytes);
      }
    }
    next += c.num_tokens();
  }
  EXPECT_EQ(next, 11);
  EXPECT_EQ(spans.size(), 3u);  // [2, 5) [5, 8) [8, 11)

  const v1::KvHandle runs_handle =
      Prefill(*prefill, "r", prompt, v1::SamplingParams()).second;
  std::vector<v1::KvChunk> runs;
  ASSERT_TRUE(PullAll(transfer,
                      request_for(runs_handle, v1::KV_CHUNK_LAYOUT_LAYER_RUN),
                      &runs)
                  .ok());
  Rows from_runs;
  for (const v1::KvChunk& c : runs) {
    EXPECT_EQ(c.chunk_layout(), v1::KV_CHUNK_LAYOUT_LAYER_RUN);
    const int part =
        2 * c.layer() + (c.part() == v1::KvChunk::PART_KEY ? 0 : 1);
    for (int t = 0; t < c.num_tokens(); ++t) {
      from_runs[{part, c.first_token() + t}] =
          c.data().substr(t * kRowBytes, kRowBytes);
    }
  }
  EXPECT_EQ(from_spans.size(), 4u * 9);
  EXPECT_TRUE(from_spans == from_runs);

  const v1::KvHandle handle =
      Prefill(*prefill, "x", prompt, v1::SamplingParams()).second;
  {
    std::vector<v1::KvChunk> none;
    const grpc::Status s =
        PullAll(transfer,
                request_for(handle, static_cast<v1::KvChunkLayout>(7)), &none);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(s.error_message(), HasSubstr("chunk_layout=7"));
    EXPECT_TRUE(none.empty());
  }
  {
    v1::PullKvRequest ipc = request_for(handle, v1::KV_CHUNK_LAYOUT_TOKEN_SPAN);
    ipc.set_transport("cuda_ipc");
    std::vector<v1::KvChunk> none;
    const grpc::Status s = PullAll(transfer, ipc, &none);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(s.error_message(), HasSubstr("chunk_layout"));
    EXPECT_TRUE(none.empty());
  }
  std::vector<v1::KvChunk> after;
  ASSERT_TRUE(PullAll(transfer,
                      request_for(handle, v1::KV_CHUNK_LAYOUT_TOKEN_SPAN),
                      &after)
                  .ok());
  EXPECT_EQ(after.size(), 3u);
  // A pulled lease is freed by ReleaseKv (the decode worker's, after its
  // import).
  for (const v1::KvHandle* h : {&spans_handle, &runs_handle, &handle}) {
    grpc::ClientContext context;
    v1::ReleaseKvRequest release;
    release.set_lease_id(h->lease_id());
    v1::ReleaseKvResponse released;
    EXPECT_TRUE(transfer.ReleaseKv(&context, release, &released).ok());
    EXPECT_EQ(released.freed_blocks(), 3);  // 11 tokens in blocks of 4
  }
  ExpectNothingHeld(*prefill, "prefill");
}

}  // namespace
}  // namespace pdworker
