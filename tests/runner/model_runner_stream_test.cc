// The model runner's memory and the work queued on its stream (threaded CPU
// stream, held by a gate so the work is surely still queued): blocks handed
// to another stream, and the runner's own buffers at destruction, are
// released only after that work has run.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/runner/model_runner_test_util.h"
#include "worker/runtime/cpu_stream.h"
#include "worker/runtime/testing/stream_gate.h"

namespace pdworker {
namespace {

using runner_testing::SmallOptions;
using runner_testing::TinyModelDir;

std::unique_ptr<ModelRunner> ThreadedRunner(Device& device) {
  auto dir = TinyModelDir(TinyShape::kGqa);
  EXPECT_TRUE(dir.ok()) << dir.status();
  auto runner = ModelRunner::Create(
      device, *dir, SmallOptions(R"({"cudagraph_mode":"NONE"})"));
  EXPECT_TRUE(runner.ok()) << runner.status();
  return runner.ok() ? *std::move(runner) : nullptr;
}

CpuDeviceOptions ThreadedStreams() {
  CpuDeviceOptions options;
  options.stream_execution = CpuStreamExecution::kThreaded;
  return options;
}

// Blocks freed while the runner's stream still writes them (a failed
// step's Undo, an abort, a flushed prefix) are reused in order on that
// stream, but a KV pull fills detached blocks on a stream of its own: the
// allocation waits until the runner's queued work has run.
TEST(ModelRunnerStreamTest, DetachedBlocksWaitForQueuedWork) {
  CpuDevice device(ThreadedStreams());
  std::unique_ptr<ModelRunner> runner = ThreadedRunner(device);
  ASSERT_NE(runner, nullptr);
  testing::Gate gate;
  std::atomic<bool> held{true};
  ASSERT_TRUE(runner->stream()
                  .Launch("hold",
                          [&](const OpContext&) {
                            gate.Wait();
                            held.store(false);
                          })
                  .ok());
  testing::DelayedOpener opener(gate, std::chrono::milliseconds(200));
  absl::StatusOr<SequenceKv> kv = runner->AllocateDetached(8);
  ASSERT_TRUE(kv.ok()) << kv.status();
  EXPECT_FALSE(held.load());
  runner->FreeDetached(*kv);
}

// An abort while the sequence's step is still queued (the engine releases
// a cancelled request's KV at once): the freed blocks go to the next
// sequence, whose step is queued behind the aborted one on the same
// in-order stream, so the aborted step's K/V writes land first and are
// overwritten; the new sequence computes exactly what it computes alone.
TEST(ModelRunnerStreamTest, AbortWhileItsStepIsQueuedLeavesReusedBlocksIntact) {
  const std::vector<int32_t> aborted_prompt = {5, 9, 2, 7, 1, 3, 8, 6, 4, 2};
  const std::vector<int32_t> prompt = {11, 3, 17, 2, 9, 30, 4, 21, 8, 1};
  // Alone: the prefill's token and two decode steps after it.
  std::vector<int32_t> expected;
  {
    CpuDevice device(ThreadedStreams());
    std::unique_ptr<ModelRunner> runner = ThreadedRunner(device);
    ASSERT_NE(runner, nullptr);
    auto first = runner->Execute(
        {MakeSequenceStep("b", prompt, SequenceCreation::kMustBeNew)});
    ASSERT_TRUE(first.ok()) << first.status();
    expected.push_back(first->sequences[0].token_id);
    for (int i = 0; i < 2; ++i) {
      auto next = runner->Execute({MakeSequenceStep(
          "b", {expected.back()}, SequenceCreation::kMustExist)});
      ASSERT_TRUE(next.ok()) << next.status();
      expected.push_back(next->sequences[0].token_id);
    }
  }

  CpuDevice device(ThreadedStreams());
  std::unique_ptr<ModelRunner> runner = ThreadedRunner(device);
  ASSERT_NE(runner, nullptr);
  testing::Gate gate;
  ASSERT_TRUE(runner->stream()
                  .Launch("hold", [&](const OpContext&) { gate.Wait(); })
                  .ok());
  auto aborted = runner->Launch(
      {MakeSequenceStep("a", aborted_prompt, SequenceCreation::kMustBeNew)});
  ASSERT_TRUE(aborted.ok()) << aborted.status();
  const std::vector<int32_t> aborted_blocks =
      runner->kv_cache().Find("a")->blocks;
  ASSERT_TRUE(runner->Release("a").ok());
  auto reused = runner->Launch(
      {MakeSequenceStep("b", prompt, SequenceCreation::kMustBeNew)});
  ASSERT_TRUE(reused.ok()) << reused.status();
  // The cache hands the aborted sequence's blocks to the new one.
  EXPECT_EQ(runner->kv_cache().Find("b")->blocks, aborted_blocks);
  gate.Open();
  ASSERT_TRUE(runner->Retire(*aborted).ok());
  auto first = runner->Retire(*reused);
  ASSERT_TRUE(first.ok()) << first.status();
  std::vector<int32_t> got = {first->sequences[0].token_id};
  for (int i = 0; i < 2; ++i) {
    auto next = runner->Execute(
        {MakeSequenceStep("b", {got.back()}, SequenceCreation::kMustExist)});
    ASSERT_TRUE(next.ok()) << next.status();
    got.push_back(next->sequences[0].token_id);
  }
  EXPECT_EQ(got, expected);
}

// A runner destroyed with work queued (a step launched and never retired,
// a Create that failed half way) frees its weights, arenas and KV cache
// only after that work ran: the work still sees all of them allocated.
TEST(ModelRunnerStreamTest, DestructionWaitsForQueuedWork) {
  CpuDevice device(ThreadedStreams());
  std::unique_ptr<ModelRunner> runner = ThreadedRunner(device);
  ASSERT_NE(runner, nullptr);
  const size_t allocated = device.GetMemoryStats()->used_bytes;
  ASSERT_GT(allocated, 0u);
  testing::Gate gate;
  std::atomic<size_t> allocated_when_run{0};
  ASSERT_TRUE(runner->stream()
                  .Launch("hold",
                          [&](const OpContext&) {
                            gate.Wait();
                            allocated_when_run.store(
                                device.GetMemoryStats()->used_bytes);
                          })
                  .ok());
  {
    testing::DelayedOpener opener(gate, std::chrono::milliseconds(200));
    runner.reset();
  }
  EXPECT_EQ(allocated_when_run.load(), allocated);
  EXPECT_EQ(device.GetMemoryStats()->used_bytes, 0u);
}

// --- A step that fails after part of its work was queued ---

// What the step that fails holds: its batch needs the token a step in
// flight samples (the feed), and, in kMixed, a new sequence whose prompt
// the prefix cache partly holds from the last round.
enum class FailingStep { kDecode, kMixed };

struct StepFailureCase {
  std::string mode_json;
  FailingStep failing;
};

void PrintTo(const StepFailureCase& c, std::ostream* os) {
  *os << c.mode_json
      << (c.failing == FailingStep::kDecode ? " decode" : " mixed");
}

// Holds the runner's stream until Open() or, at the latest, `kHoldLimit`:
// a failed Launch may itself wait for the stream (an upload ring that
// cannot mark its copy waits for it), and must then not wait for long.
class StreamHold {
 public:
  static constexpr std::chrono::milliseconds kHoldLimit{250};
  absl::Status Hold(Stream& stream) {
    open_ = false;
    return stream.Launch("hold", [this](const OpContext&) {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait_for(lock, kHoldLimit, [this] { return open_; });
    });
  }
  void Open() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      open_ = true;
    }
    cv_.notify_all();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool open_ = false;
};

// The gqa tiny model with prefix caching, graphs captured.
std::unique_ptr<ModelRunner> PrefixCachingRunner(Device& device,
                                                 const std::string& mode_json) {
  auto dir = TinyModelDir(TinyShape::kGqa);
  EXPECT_TRUE(dir.ok()) << dir.status();
  ModelRunnerOptions options = SmallOptions(mode_json);
  options.prefix_caching = PrefixCaching::kOn;
  auto runner = ModelRunner::Create(device, *dir, options);
  EXPECT_TRUE(runner.ok()) << runner.status();
  if (!runner.ok()) return nullptr;
  EXPECT_TRUE((*runner)->CaptureGraphs().ok());
  return *std::move(runner);
}

class StepFailureTest : public ::testing::TestWithParam<StepFailureCase> {
 protected:
  std::unique_ptr<ModelRunner> MakeRunner(Device& device) {
    return PrefixCachingRunner(device, GetParam().mode_json);
  }
};

SamplingOptions Sampled(uint64_t seed) {
  SamplingOptions o;
  o.temperature = 0.8f;
  o.top_k = 40;
  o.top_p = 0.9f;
  o.min_p = 0.02f;
  o.seed = seed;
  return o;
}

// Round `round`'s steps: a's prefill (run at once), then a's decode (in
// flight), then the step under test, which feeds a's sampled token from
// the decode's slot and, in kMixed, starts b on a prompt whose first
// blocks last round's b left in the prefix cache.
std::vector<SequenceStep> FirstDecode(int round, int32_t token) {
  SequenceStep a = MakeSequenceStep(absl::StrCat("a", round), {token},
                                    SequenceCreation::kMustExist);
  a.sampling = Sampled(7);
  a.banned_token_ids = {3, 5};  // min_tokens' bans go up with the sampler
  a.num_top_logprobs = 2;
  return {a};
}

std::vector<SequenceStep> StepUnderTest(int round, int decode_slot,
                                        FailingStep failing) {
  SequenceStep a = MakeSequenceStep(absl::StrCat("a", round), {0},
                                    SequenceCreation::kMustExist);
  a.last_token_from = SampleRef{decode_slot, 0};  // {0}: a placeholder
  a.sampling = Sampled(11);
  a.banned_token_ids = {4};
  a.num_top_logprobs = 3;
  std::vector<SequenceStep> batch = {a};
  if (failing == FailingStep::kMixed) {
    SequenceStep b =
        MakeSequenceStep(absl::StrCat("b", round),
                         {21, 4, 9, 13, 2, 8, 30, 1, 17, 6, round % 7 + 40},
                         SequenceCreation::kMustBeNew);
    b.num_top_logprobs = 1;
    batch.push_back(b);
  }
  return batch;
}

void ExpectSameResults(const StepResult& got, const StepResult& want) {
  ASSERT_EQ(got.sequences.size(), want.sequences.size());
  for (size_t r = 0; r < got.sequences.size(); ++r) {
    const SequenceResult& g = got.sequences[r];
    const SequenceResult& w = want.sequences[r];
    EXPECT_EQ(g.token_id, w.token_id) << "row " << r;
    EXPECT_EQ(g.logprob, w.logprob) << "row " << r;
    EXPECT_EQ(g.num_tokens, w.num_tokens) << "row " << r;
    EXPECT_EQ(g.cached_tokens, w.cached_tokens) << "row " << r;
    EXPECT_EQ(g.raw_logprob, w.raw_logprob) << "row " << r;
    ASSERT_EQ(g.top_logprobs.size(), w.top_logprobs.size()) << "row " << r;
    for (size_t j = 0; j < g.top_logprobs.size(); ++j) {
      EXPECT_EQ(g.top_logprobs[j].token_id, w.top_logprobs[j].token_id);
      EXPECT_EQ(g.top_logprobs[j].logprob, w.top_logprobs[j].logprob);
    }
  }
}

void ExpectSameCache(const KvCacheStats& got, const KvCacheStats& want) {
  EXPECT_EQ(got.free_blocks, want.free_blocks);
  EXPECT_EQ(got.used_blocks, want.used_blocks);
  EXPECT_EQ(got.num_sequences, want.num_sequences);
  EXPECT_EQ(got.used_tokens, want.used_tokens);
  EXPECT_EQ(got.cached_blocks, want.cached_blocks);
  EXPECT_EQ(got.detached_blocks, want.detached_blocks);
}

// A step that fails after part of its work was queued (a launch or copy
// error in the step-input upload, the feed of a token a step in flight
// samples, the forward or a graph replay, the sampler's parameter upload,
// the logprob copies, the event that ends the step) changes nothing: the
// KV cache is as before (no sequence created, no length advanced, no block
// held or cached), the pinned blocks its queued copies read are not handed
// out before those copies ran, and the step launched again computes, bit
// for bit, what a runner that never failed computes. Swept over every
// enqueueing call of the step, each round on the same runner, while the
// stream is held so that the failed step's work is still queued when it
// fails and when the retry queues its own.
TEST_P(StepFailureTest, FailingAnyEnqueueOfAStepChangesNothing) {
  CpuDevice device(ThreadedStreams());
  CpuDevice reference_device(ThreadedStreams());
  std::unique_ptr<ModelRunner> runner = MakeRunner(device);
  std::unique_ptr<ModelRunner> reference = MakeRunner(reference_device);
  ASSERT_NE(runner, nullptr);
  ASSERT_NE(reference, nullptr);
  auto& stream = static_cast<CpuStream&>(runner->stream());
  const FailingStep failing = GetParam().failing;
  const std::vector<int32_t> prompt = {5, 9, 2, 7, 1, 3, 8, 6, 4, 2};
  StreamHold hold;
  int failures = 0;
  for (int round = 0;; ++round) {
    SCOPED_TRACE(absl::StrCat("failing enqueue call ", round));
    ASSERT_LT(round, 400) << "the step never ran out of enqueueing calls";
    // Both runners: a's prefill, a's decode in flight.
    std::vector<StepResult> want;
    {
      auto first = reference->Execute({MakeSequenceStep(
          absl::StrCat("a", round), prompt, SequenceCreation::kMustBeNew)});
      ASSERT_TRUE(first.ok()) << first.status();
      auto decode =
          reference->Launch(FirstDecode(round, first->sequences[0].token_id));
      ASSERT_TRUE(decode.ok()) << decode.status();
      auto step = reference->Launch(StepUnderTest(round, *decode, failing));
      ASSERT_TRUE(step.ok()) << step.status();
      for (const int slot : {*decode, *step}) {
        auto result = reference->Retire(slot);
        ASSERT_TRUE(result.ok()) << result.status();
        want.push_back(*std::move(result));
      }
    }
    auto first = runner->Execute({MakeSequenceStep(
        absl::StrCat("a", round), prompt, SequenceCreation::kMustBeNew)});
    ASSERT_TRUE(first.ok()) << first.status();
    ASSERT_TRUE(hold.Hold(stream).ok());
    auto decode =
        runner->Launch(FirstDecode(round, first->sequences[0].token_id));
    ASSERT_TRUE(decode.ok()) << decode.status();
    const KvCacheStats before = runner->kv_cache().Stats();
    const int32_t a_tokens =
        runner->kv_cache().Find(absl::StrCat("a", round))->num_tokens;
    ASSERT_TRUE(
        stream.FailEnqueue(round, absl::InternalError("injected launch error"))
            .ok());
    const std::vector<SequenceStep> batch =
        StepUnderTest(round, *decode, failing);
    auto step = runner->Launch(batch);
    const bool failed = !step.ok();
    if (failed) {
      ++failures;
      EXPECT_EQ(step.status().code(), absl::StatusCode::kInternal);
      EXPECT_THAT(std::string(step.status().message()),
                  ::testing::HasSubstr("injected launch error"));
      ExpectSameCache(runner->kv_cache().Stats(), before);
      EXPECT_EQ(runner->kv_cache().Find(absl::StrCat("a", round))->num_tokens,
                a_tokens);
      EXPECT_EQ(runner->kv_cache().Find(absl::StrCat("b", round)), nullptr);
      EXPECT_EQ(runner->steps_in_flight(), 1);
      step = runner->Launch(batch);  // the retry, still behind the hold
      ASSERT_TRUE(step.ok()) << step.status();
    } else {
      // More calls to pass than the step makes: the sweep is complete.
      EXPECT_TRUE(stream.EnqueueFailureArmed());
      stream.DisarmEnqueueFailure();
    }
    hold.Open();
    std::vector<StepResult> got;
    for (const int slot : {*decode, *step}) {
      auto result = runner->Retire(slot);
      ASSERT_TRUE(result.ok()) << result.status();
      got.push_back(*std::move(result));
    }
    for (size_t i = 0; i < got.size(); ++i) ExpectSameResults(got[i], want[i]);
    for (ModelRunner* r : {runner.get(), reference.get()}) {
      ASSERT_TRUE(r->Release(absl::StrCat("a", round)).ok());
      if (failing == FailingStep::kMixed) {
        ASSERT_TRUE(r->Release(absl::StrCat("b", round)).ok());
      }
    }
    ExpectSameCache(runner->kv_cache().Stats(), reference->kv_cache().Stats());
    if (::testing::Test::HasFailure() || !failed) break;
  }
  // A step makes a dozen enqueueing calls at the least.
  EXPECT_GT(failures, 10);
  RecordProperty("failures", failures);
}

// FlushCache (ClearPrefixCache) while a step that hit the prefix cache is
// still queued: the hit's blocks stay with the sequence that holds them
// (only their hashes go), the blocks the flush frees go to the next
// sequence in stream order, and both compute what a runner that was never
// held computes.
TEST(ModelRunnerStreamTest, FlushWhileAHitIsQueuedKeepsTheHitsBlocks) {
  const std::vector<int32_t> shared = {5, 9, 2, 7, 1, 3, 8, 6, 4, 2, 11, 3};
  std::vector<int32_t> hit = shared;
  hit.insert(hit.end(), {30, 31, 32});
  const std::vector<int32_t> other = {17, 2, 9, 30, 4, 21, 8, 1, 6, 6, 12};
  auto run = [&](ModelRunner& runner, StreamHold* hold,
                 std::vector<StepResult>* out) {
    auto a = runner.Execute(
        {MakeSequenceStep("a", shared, SequenceCreation::kMustBeNew)});
    ASSERT_TRUE(a.ok()) << a.status();
    ASSERT_TRUE(runner.Release("a").ok());  // its blocks stay cached
    if (hold != nullptr) ASSERT_TRUE(hold->Hold(runner.stream()).ok());
    auto b = runner.Launch(
        {MakeSequenceStep("b", hit, SequenceCreation::kMustBeNew)});
    ASSERT_TRUE(b.ok()) << b.status();
    const std::vector<int32_t> b_blocks = runner.kv_cache().Find("b")->blocks;
    runner.ClearPrefixCache();
    EXPECT_EQ(runner.kv_cache().Stats().cached_blocks, 0);
    EXPECT_EQ(runner.kv_cache().Find("b")->blocks, b_blocks);
    auto c = runner.Launch(
        {MakeSequenceStep("c", other, SequenceCreation::kMustBeNew)});
    ASSERT_TRUE(c.ok()) << c.status();
    for (const int32_t block : runner.kv_cache().Find("c")->blocks) {
      EXPECT_THAT(b_blocks, ::testing::Not(::testing::Contains(block)));
    }
    if (hold != nullptr) hold->Open();
    for (const int slot : {*b, *c}) {
      auto result = runner.Retire(slot);
      ASSERT_TRUE(result.ok()) << result.status();
      out->push_back(*std::move(result));
    }
    for (const char* id : {"b", "c"}) {
      auto next = runner.Execute(
          {MakeSequenceStep(id, {out->back().sequences[0].token_id},
                            SequenceCreation::kMustExist)});
      ASSERT_TRUE(next.ok()) << next.status();
      out->push_back(*std::move(next));
    }
  };
  constexpr char kEager[] = R"({"cudagraph_mode":"NONE"})";
  CpuDevice reference_device(ThreadedStreams());
  CpuDevice device(ThreadedStreams());
  std::unique_ptr<ModelRunner> reference =
      PrefixCachingRunner(reference_device, kEager);
  std::unique_ptr<ModelRunner> runner = PrefixCachingRunner(device, kEager);
  ASSERT_NE(reference, nullptr);
  ASSERT_NE(runner, nullptr);
  std::vector<StepResult> want, got;
  run(*reference, nullptr, &want);
  StreamHold hold;
  run(*runner, &hold, &got);
  ASSERT_EQ(got.size(), want.size());
  EXPECT_GT(got[0].sequences[0].cached_tokens, 0);  // b did hit
  for (size_t i = 0; i < got.size(); ++i) ExpectSameResults(got[i], want[i]);
}

INSTANTIATE_TEST_SUITE_P(
    Modes, StepFailureTest,
    ::testing::Values(
        StepFailureCase{R"({"cudagraph_mode":"NONE"})", FailingStep::kDecode},
        StepFailureCase{R"({"cudagraph_mode":"NONE"})", FailingStep::kMixed},
        StepFailureCase{R"({"cudagraph_mode":"FULL_AND_PIECEWISE"})",
                        FailingStep::kDecode},
        StepFailureCase{R"({"cudagraph_mode":"FULL_AND_PIECEWISE"})",
                        FailingStep::kMixed}),
    [](const ::testing::TestParamInfo<StepFailureCase>& info) {
      const bool graphs =
          info.param.mode_json.find("FULL") != std::string::npos;
      return absl::StrCat(
          graphs ? "Graphs" : "Eager",
          info.param.failing == FailingStep::kDecode ? "Decode" : "Mixed");
    });

}  // namespace
}  // namespace pdworker
