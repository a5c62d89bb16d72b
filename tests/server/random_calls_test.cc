// A randomized, model-based test of the worker over real gRPC on loopback.
//
// kThreads client threads each own a namespace of sequence ids ("t2-s17")
// and keep an exact shadow of their sequences: the tokens in the worker's KV
// cache. Each thread sends a few hundred random calls (new prompts, some long
// enough to be chunked; decode steps; several tokens at once; several
// sequences at once; release_after_step; Release with and without unknown
// ids; calls that break one rule of proto/worker.proto; calls with a 0-4 ms
// deadline or cancelled mid-flight) and checks every answer against the
// shadow:
//  - the status code is what the contract says for the call in the shadow's
//    state (RESOURCE_EXHAUSTED, from a KV cache the threads share, is
//    allowed where the call could run out of blocks);
//  - OK: each num_tokens is the shadow's length plus the tokens sent, and
//    each sampled token and its logprob are, bit for bit, what an in-process
//    ModelRunner computes for the sequence's whole history in one step, so
//    batching, chunking and rollbacks must not change results;
//  - an error changes nothing: the shadow stays, and every later call checks
//    it (ids of sequences a failed call would have created must not exist);
//  - a call that ended DEADLINE_EXCEEDED or CANCELLED ran whole or not at
//    all: a probe per sequence (a one-token step, or a Release) finds every
//    sequence of the call in the same one of those two states.
// At the end every sequence is released, the worker has all its KV blocks
// free and no sequence, and it still serves.
//
// A failure prints the seed and the thread's last calls. The seed fixes
// each thread's calls; how the threads interleave (and so which calls merge
// or hit a deadline) varies from run to run. Another seed:
//   bazel test //tests/server:random_calls_test --test_env=RANDOM_CALLS_SEED=N
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <deque>
#include <future>
#include <iostream>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "gtest/gtest.h"
#include "tests/server/server_test_util.h"

namespace pdworker {
namespace {

using server_testing::InProcessRunner;
using server_testing::Input;
using server_testing::MakeRunner;
using server_testing::Request;
using server_testing::SmallRunnerOptions;
using server_testing::StartForward;
using server_testing::StartWorker;
using server_testing::WaitFor;

constexpr uint32_t kDefaultSeed = 20240611;
constexpr int kThreads = 4;
// Under TSan the model runs ~15 times slower: fewer calls keep the test
// well inside its timeout (--config=tsan).
#if defined(__SANITIZE_THREAD__)
constexpr int kCallsPerThread = 120;
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
constexpr int kCallsPerThread = 120;
#else
constexpr int kCallsPerThread = 400;
#endif
#else
constexpr int kCallsPerThread = 400;
#endif
// SmallRunnerOptions' limits, which the shadow's expectations mirror.
constexpr int kVocab = 256;
constexpr int kMaxModelLen = 128;
constexpr int kMaxNumSeqs = 8;
constexpr int kStepTokens = 64;  // max_num_batched_tokens
constexpr int kBlockSize = 4;
// Small enough that the threads together sometimes fill it.
constexpr int kKvBlocks = 256;
constexpr int kMaxLivePerThread = 5;

int BlocksFor(int tokens) { return (tokens + kBlockSize - 1) / kBlockSize; }

uint32_t BaseSeed() {
  const char* env = std::getenv("RANDOM_CALLS_SEED");
  return env != nullptr ? static_cast<uint32_t>(std::strtoul(env, nullptr, 10))
                        : kDefaultSeed;
}

// How a sequence samples. Greedy unless temperature > 0 (then seeded, so the
// draw is a function of the history too).
struct Sampling {
  float temperature = 0.0f;
  int32_t top_k = 0;
  uint64_t seed = 0;

  static Sampling Of(const v1::SequenceInput& in) {
    Sampling s;
    if (in.sampling().temperature() > 0.0f) {
      s.temperature = in.sampling().temperature();
      s.top_k = in.sampling().top_k();
      s.seed = in.sampling().seed();
    }
    return s;
  }
  void SetOn(v1::SequenceInput* in) const {
    if (temperature == 0.0f) return;
    in->mutable_sampling()->set_temperature(temperature);
    in->mutable_sampling()->set_top_k(top_k);
    in->mutable_sampling()->set_seed(seed);
  }
  auto Key() const { return std::make_tuple(temperature, top_k, seed); }
};

// The next token of a history, as an in-process ModelRunner computes it in
// one unchunked step of a batch of one. Cached: a history is computed once.
class Oracle {
 public:
  Oracle() {
    ModelRunnerOptions options = SmallRunnerOptions();
    options.max_num_batched_tokens = kMaxModelLen;  // any history in one step
    reference_ = MakeRunner(options);
  }

  SequenceResult Next(const std::vector<int32_t>& history, const Sampling& s) {
    std::lock_guard<std::mutex> lock(mu_);
    auto key = std::make_pair(history, s.Key());
    auto it = cache_.find(key);
    if (it != cache_.end()) return it->second;
    std::vector<SequenceStep> batch = {
        MakeSequenceStep("reference", history, SequenceCreation::kMustBeNew)};
    batch[0].sampling.temperature = s.temperature;
    batch[0].sampling.top_k = s.top_k;
    batch[0].sampling.seed = s.seed;
    absl::StatusOr<StepResult> result = reference_.runner->Execute(batch);
    CHECK(result.ok()) << result.status();
    const absl::Status released = reference_.runner->Release("reference");
    CHECK(released.ok()) << released;
    ++computed_;
    return cache_.emplace(key, result->sequences[0]).first->second;
  }

  int64_t computed() {
    std::lock_guard<std::mutex> lock(mu_);
    return computed_;
  }

 private:
  std::mutex mu_;
  InProcessRunner reference_;
  std::map<
      std::pair<std::vector<int32_t>, std::tuple<float, int32_t, uint64_t>>,
      SequenceResult>
      cache_;
  int64_t computed_ = 0;
};

// Outcome counts over all threads, printed at the end (and a few asserted:
// the random mix must really reach every kind of answer).
struct Counters {
  std::atomic<int64_t> ok{0}, chunked_ok{0}, released{0};
  std::atomic<int64_t> invalid_argument{0}, not_found{0}, already_exists{0},
      resource_exhausted{0};
  std::atomic<int64_t> ambiguous_not_run{0}, ambiguous_ran{0},
      ambiguous_unknown{0};
};

// What the contract says a Forward call does in the shadow's state.
struct Expectation {
  grpc::StatusCode code = grpc::StatusCode::OK;
  bool chunked = false;
  // RESOURCE_EXHAUSTED is acceptable as well: a call that would succeed, or
  // a chunked call whose earlier chunk can run out of blocks before the
  // chunk with its error runs.
  bool may_exhaust = false;
};

struct Seq {
  std::vector<int32_t> history;  // tokens in the worker's KV cache
  int32_t next_token = 0;        // last sampled token: the next to feed
  Sampling sampling;
};

// A sequence's possible state after a call whose outcome is unknown.
struct Candidate {
  bool present = false;
  std::vector<int32_t> history;
  Sampling sampling;
};

enum class Timing { kNormal, kDeadline, kCancel };

const char* TimingName(Timing t) {
  switch (t) {
    case Timing::kNormal:
      return "";
    case Timing::kDeadline:
      return " [short deadline]";
    case Timing::kCancel:
      return " [cancelled]";
  }
  return "";
}

class ClientThread {
 public:
  ClientThread(int index, uint32_t seed, v1::Worker::Stub& stub, Oracle& oracle,
               Counters& counters)
      : index_(index),
        seed_(seed),
        rng_(seed),
        stub_(stub),
        oracle_(oracle),
        counters_(counters) {}

  void Run() {
    for (call_ = 0; call_ < kCallsPerThread && !failed_; ++call_) {
      const int r = Uniform(0, 99);
      if (r < 22) {
        ForwardOp(StartCall());
      } else if (r < 58) {
        ForwardOp(live_.empty() ? StartCall() : ContinueCall());
      } else if (r < 68) {
        ReleaseOp();
      } else {
        ForwardOp(BadCall());
      }
    }
    if (!failed_) Finish();
  }

 private:
  // --- randomness ---------------------------------------------------------

  int Uniform(int lo, int hi) {  // inclusive
    return std::uniform_int_distribution<int>(lo, hi)(rng_);
  }
  bool Chance(int percent) { return Uniform(0, 99) < percent; }
  int32_t Token() { return Uniform(0, kVocab - 1); }
  std::vector<int32_t> Tokens(int n) {
    std::vector<int32_t> t(n);
    for (int32_t& x : t) x = Token();
    return t;
  }
  int PromptLength() {
    const int r = Uniform(0, 99);
    if (r < 60) return Uniform(1, 24);
    if (r < 85) return Uniform(25, 64);
    return Uniform(65, 100);  // chunked even alone
  }
  Sampling RandomSampling() {
    Sampling s;
    if (Chance(20)) {
      s.temperature = Chance(50) ? 1.0f : 0.7f;
      s.top_k = Chance(50) ? 0 : 20;
      s.seed = static_cast<uint64_t>(Uniform(1, 3));
    }
    return s;
  }
  std::string FreshId() {
    return "t" + std::to_string(index_) + "-s" + std::to_string(next_id_++);
  }
  // An id the worker must not know: one a failed call would have created or
  // that was released, or a new one.
  std::string AbsentId() {
    if (!gone_.empty() && Chance(70)) {
      return *std::next(gone_.begin(), Uniform(0, gone_.size() - 1));
    }
    return FreshId();
  }
  std::vector<std::string> LiveIds(int n) {
    std::vector<std::string> ids;
    for (const auto& [id, seq] : live_) ids.push_back(id);
    std::shuffle(ids.begin(), ids.end(), rng_);
    ids.resize(std::min<size_t>(ids.size(), n));
    return ids;
  }

  // --- calls --------------------------------------------------------------

  v1::SequenceInput StartInput(const std::string& id, int length) {
    v1::SequenceInput in = Input(id, Tokens(length), true);
    RandomSampling().SetOn(&in);
    if (Chance(10)) in.set_release_after_step(true);
    return in;
  }

  v1::SequenceInput ContinueInput(const std::string& id) {
    const Seq& seq = live_.at(id);
    v1::SequenceInput in =
        Chance(65) ? Input(id, {seq.next_token}, false)
                   : Input(id, Tokens(Uniform(1, Chance(80) ? 12 : 40)), false);
    seq.sampling.SetOn(&in);
    const bool crowded = static_cast<int>(live_.size()) > kMaxLivePerThread;
    if (Chance(crowded ? 40 : 8)) in.set_release_after_step(true);
    return in;
  }

  std::vector<v1::SequenceInput> StartCall() {
    std::vector<v1::SequenceInput> inputs;
    const int n = Chance(70) ? 1 : Uniform(2, 3);
    for (int i = 0; i < n; ++i) {
      const std::string id =
          gone_.empty() || Chance(70) ? FreshId() : AbsentId();
      if (std::any_of(inputs.begin(), inputs.end(),
                      [&](const auto& in) { return in.sequence_id() == id; })) {
        continue;
      }
      inputs.push_back(StartInput(id, PromptLength()));
    }
    for (const std::string& id : LiveIds(Chance(30) ? Uniform(1, 2) : 0)) {
      inputs.push_back(ContinueInput(id));
    }
    std::shuffle(inputs.begin(), inputs.end(), rng_);
    return inputs;
  }

  std::vector<v1::SequenceInput> ContinueCall() {
    std::vector<v1::SequenceInput> inputs;
    for (const std::string& id : LiveIds(Chance(50) ? 1 : Uniform(2, 4))) {
      inputs.push_back(ContinueInput(id));
    }
    if (Chance(20)) inputs.push_back(StartInput(FreshId(), PromptLength()));
    std::shuffle(inputs.begin(), inputs.end(), rng_);
    return inputs;
  }

  // A call that breaks one rule (the expectation is computed from the
  // shadow, so the fault need not be the only reason it fails).
  std::vector<v1::SequenceInput> BadCall() {
    std::vector<v1::SequenceInput> inputs =
        live_.empty() || Chance(30) ? StartCall() : ContinueCall();
    auto insert = [&](v1::SequenceInput in) {
      inputs.insert(inputs.begin() + Uniform(0, inputs.size()), std::move(in));
    };
    auto& victim = inputs[Uniform(0, inputs.size() - 1)];
    switch (Uniform(0, 7)) {
      case 0:  // continue an unknown (released, never created) sequence
        insert(Input(AbsentId(), {Token()}, false));
        break;
      case 1:  // start an id that is live
        if (!live_.empty()) {
          insert(Input(LiveIds(1)[0], Tokens(Uniform(1, 20)), true));
        } else {
          insert(Input(AbsentId(), {Token()}, false));
        }
        break;
      case 2: {  // the same id twice
        v1::SequenceInput copy = victim;
        if (Chance(50)) copy.set_start(!copy.start());
        insert(std::move(copy));
        break;
      }
      case 3:  // a token outside the vocabulary
        victim.set_token_ids(
            Uniform(0, victim.token_ids_size() - 1),
            Chance(50) ? kVocab + Uniform(0, 1000) : -1 - Uniform(0, 1000));
        break;
      case 4:  // no tokens
        victim.clear_token_ids();
        break;
      case 5:  // a prompt longer than max_model_len
        insert(Input(FreshId(), Tokens(kMaxModelLen + Uniform(1, 30)), true));
        break;
      case 6:  // more sequences than max_num_seqs
        while (static_cast<int>(inputs.size()) <= kMaxNumSeqs) {
          insert(StartInput(FreshId(), Uniform(1, 8)));
        }
        break;
      case 7:  // a live sequence past max_model_len
        if (!live_.empty()) {
          const std::string id = LiveIds(1)[0];
          const int len = static_cast<int>(live_.at(id).history.size());
          inputs.erase(std::remove_if(inputs.begin(), inputs.end(),
                                      [&](const auto& in) {
                                        return in.sequence_id() == id;
                                      }),
                       inputs.end());
          const int n =
              std::min(kMaxModelLen, kMaxModelLen - len + 1 + Uniform(0, 20));
          v1::SequenceInput in = Input(id, Tokens(n), false);
          live_.at(id).sampling.SetOn(&in);
          insert(std::move(in));
        } else {
          insert(Input(FreshId(), Tokens(kMaxModelLen + 1), true));
        }
        break;
    }
    return inputs;
  }

  Expectation Expect(const v1::ForwardRequest& request) const {
    Expectation e;
    const int n = request.sequences_size();
    if (n == 0 || n > kMaxNumSeqs) {
      e.code = grpc::StatusCode::INVALID_ARGUMENT;
      return e;
    }
    std::set<std::string> ids;
    int total = 0;
    for (const v1::SequenceInput& in : request.sequences()) {
      bool bad = !ids.insert(in.sequence_id()).second ||
                 in.token_ids_size() == 0 || in.token_ids_size() > kMaxModelLen;
      for (const int32_t t : in.token_ids()) bad = bad || t < 0 || t >= kVocab;
      if (bad) {
        e.code = grpc::StatusCode::INVALID_ARGUMENT;
        return e;
      }
      total += in.token_ids_size();
    }
    e.chunked = total > kStepTokens;
    // The first sequence in request order that the worker's state refuses;
    // a chunked call may run out of KV in an earlier chunk first.
    e.may_exhaust = true;
    for (const v1::SequenceInput& in : request.sequences()) {
      auto it = live_.find(in.sequence_id());
      const int before =
          it == live_.end() ? 0 : static_cast<int>(it->second.history.size());
      if (in.start() && it != live_.end()) {
        e.code = grpc::StatusCode::ALREADY_EXISTS;
      } else if (!in.start() && it == live_.end()) {
        e.code = grpc::StatusCode::NOT_FOUND;
      } else if (before + in.token_ids_size() > kMaxModelLen) {
        e.code = grpc::StatusCode::INVALID_ARGUMENT;
      } else {
        continue;
      }
      e.may_exhaust = e.chunked;
      return e;
    }
    return e;
  }

  grpc::Status Send(const v1::ForwardRequest& request, Timing timing,
                    v1::ForwardResponse* response) {
    switch (timing) {
      case Timing::kNormal:
        return server_testing::Forward(stub_, request, response);
      case Timing::kDeadline: {
        grpc::ClientContext context;
        abandon_timeout_ = std::chrono::microseconds(Uniform(0, 4000));
        context.set_deadline(std::chrono::system_clock::now() +
                             abandon_timeout_);
        return stub_.Forward(&context, request, response);
      }
      case Timing::kCancel: {
        // A deadline too, so that WaitOutAbandonedCall has a bound.
        abandon_timeout_ = std::chrono::milliseconds(20);
        auto call =
            StartForward(stub_, request, [&](grpc::ClientContext* context) {
              context->set_deadline(std::chrono::system_clock::now() +
                                    abandon_timeout_);
            });
        std::this_thread::sleep_for(
            std::chrono::microseconds(Uniform(0, 4000)));
        call->context.TryCancel();
        const grpc::Status status = call->result.get();
        *response = call->response;
        return status;
      }
    }
    return grpc::Status::CANCELLED;
  }

  void ForwardOp(std::vector<v1::SequenceInput> inputs) {
    const v1::ForwardRequest request = Request(std::move(inputs));
    const Expectation want = Expect(request);
    Timing timing = Timing::kNormal;
    const int r = Uniform(0, 99);
    // Chunked calls are the interesting ones to cut short: between chunks.
    if (r < (want.chunked ? 25 : 8)) {
      timing = Timing::kDeadline;
    } else if (r < (want.chunked ? 45 : 15)) {
      timing = Timing::kCancel;
    }
    Log(Describe(request) + TimingName(timing) + " expect " +
        CodeName(want.code));
    v1::ForwardResponse response;
    const grpc::Status status = Send(request, timing, &response);
    const grpc::StatusCode code = status.error_code();
    Log("  -> " + CodeName(code) + " " + status.error_message());
    if (code == grpc::StatusCode::OK) {
      if (want.code != grpc::StatusCode::OK) {
        return Fail("the worker accepted a call that must fail with " +
                    CodeName(want.code));
      }
      ApplyOk(request, response, want);
      return;
    }
    if ((code == want.code) ||
        (code == grpc::StatusCode::RESOURCE_EXHAUSTED && want.may_exhaust)) {
      Count(code);
      ForgetFailedStarts(request);
      return;
    }
    if (timing != Timing::kNormal &&
        (code == grpc::StatusCode::DEADLINE_EXCEEDED ||
         code == grpc::StatusCode::CANCELLED)) {
      WaitOutAbandonedCall();
      ResolveForward(request, want.code == grpc::StatusCode::OK);
      return;
    }
    Fail("unexpected " + CodeName(code) + " (" + status.error_message() +
         "); expected " + CodeName(want.code) +
         (want.may_exhaust ? " or RESOURCE_EXHAUSTED" : ""));
  }

  void ApplyOk(const v1::ForwardRequest& request,
               const v1::ForwardResponse& response, const Expectation& want) {
    ++counters_.ok;
    if (want.chunked) ++counters_.chunked_ok;
    if (response.sequences_size() != request.sequences_size()) {
      return Fail("answered " + std::to_string(response.sequences_size()) +
                  " sequences for " + std::to_string(request.sequences_size()));
    }
    int total = 0;
    for (const v1::SequenceInput& in : request.sequences()) {
      total += in.token_ids_size();
    }
    const int min_steps = (total + kStepTokens - 1) / kStepTokens;
    if (want.chunked ? response.num_steps() < min_steps
                     : response.num_steps() != 1) {
      return Fail("num_steps " + std::to_string(response.num_steps()) +
                  " for " + std::to_string(total) + " tokens");
    }
    const v1::StepInfo& step = response.step();
    if (step.num_sequences() < 1 || step.num_sequences() > kMaxNumSeqs ||
        step.unpadded_tokens() < 1 || step.unpadded_tokens() > kStepTokens ||
        step.padded_tokens() < step.unpadded_tokens()) {
      return Fail("implausible step: " + step.ShortDebugString());
    }
    for (int i = 0; i < request.sequences_size(); ++i) {
      const v1::SequenceInput& in = request.sequences(i);
      const v1::SequenceOutput& out = response.sequences(i);
      const std::string& id = in.sequence_id();
      if (out.sequence_id() != id) {
        return Fail("sequences[" + std::to_string(i) + "] answered as '" +
                    out.sequence_id() + "'");
      }
      Seq& seq = live_[id];  // a start creates it
      if (in.start()) {
        seq = Seq();
        seq.sampling = Sampling::Of(in);
        gone_.erase(id);
      }
      const int want_tokens =
          static_cast<int>(seq.history.size()) + in.token_ids_size();
      if (out.num_tokens() != want_tokens) {
        return Fail("'" + id + "' has num_tokens " +
                    std::to_string(out.num_tokens()) + ", the shadow says " +
                    std::to_string(want_tokens));
      }
      seq.history.insert(seq.history.end(), in.token_ids().begin(),
                         in.token_ids().end());
      if (!CheckSample(id, seq.history, seq.sampling, out.token_id(),
                       out.logprob())) {
        return;
      }
      seq.next_token = out.token_id();
      if (in.release_after_step()) {
        live_.erase(id);
        gone_.insert(id);
      }
    }
  }

  bool CheckSample(const std::string& id, const std::vector<int32_t>& history,
                   const Sampling& sampling, int32_t token, float logprob) {
    const SequenceResult want = oracle_.Next(history, sampling);
    // Bit for bit: the CPU backend's results do not depend on batching,
    // chunking or graphs (DESIGN.md), and a wrong KV cache shows here.
    if (token != want.token_id || logprob != want.logprob) {
      Fail("'" + id + "' (" + std::to_string(history.size()) +
           " tokens, temperature " + std::to_string(sampling.temperature) +
           ") sampled " + std::to_string(token) + " logprob " +
           std::to_string(logprob) + "; the in-process runner samples " +
           std::to_string(want.token_id) + " logprob " +
           std::to_string(want.logprob));
      return false;
    }
    return true;
  }

  // A failed call created nothing: the ids it would have started are free.
  void ForgetFailedStarts(const v1::ForwardRequest& request) {
    for (const v1::SequenceInput& in : request.sequences()) {
      if (!in.sequence_id().empty() && !live_.count(in.sequence_id())) {
        gone_.insert(in.sequence_id());
      }
    }
  }

  // A call the client gave up on (DEADLINE_EXCEEDED or CANCELLED seen
  // here) may still be on its way to the executor: gRPC does not keep the
  // order of calls on one channel, so a probe sent now may overtake it, and
  // the worker may then run it after the probe (a cancellation it has not
  // seen yet does not stop it). Its deadline does: the server reads the
  // call's headers before those of any later call on the connection, so
  // once a later call (GetStatus) is answered, the call's server-side
  // deadline is at most abandon_timeout_ away, and past it the executor
  // never starts it.
  void WaitOutAbandonedCall() {
    grpc::ClientContext context;
    server_testing::SetGenerousDeadline(&context);
    v1::WorkerStatus status;
    const grpc::Status answered =
        stub_.GetStatus(&context, v1::GetStatusRequest(), &status);
    if (!answered.ok()) Fail("GetStatus: " + answered.error_message());
    std::this_thread::sleep_for(abandon_timeout_ +
                                std::chrono::milliseconds(1));
  }

  // The call may have run whole or not at all (never in part): probe each
  // of its sequences and check they agree on which.
  void ResolveForward(const v1::ForwardRequest& request, bool could_run) {
    std::map<std::string, std::pair<Candidate, Candidate>> candidates;
    for (const v1::SequenceInput& in : request.sequences()) {
      const std::string& id = in.sequence_id();
      Candidate not_run;
      auto it = live_.find(id);
      if (it != live_.end()) {
        not_run = {true, it->second.history, it->second.sampling};
      }
      Candidate ran = not_run;
      if (could_run && !in.release_after_step()) {
        ran.present = true;
        if (in.start()) ran.history.clear();
        ran.history.insert(ran.history.end(), in.token_ids().begin(),
                           in.token_ids().end());
        ran.sampling = Sampling::Of(in);
      } else if (could_run) {
        ran.present = false;
      }
      candidates[id] = {not_run, ran};
    }
    Resolve(candidates, could_run);
  }

  void Resolve(
      const std::map<std::string, std::pair<Candidate, Candidate>>& candidates,
      bool could_run) {
    bool not_run_possible = true, ran_possible = could_run;
    for (const auto& [id, pair] : candidates) {
      int mask = 0;
      if (!Probe(id, pair.first, could_run ? pair.second : pair.first, &mask)) {
        return;
      }
      not_run_possible = not_run_possible && (mask & 1);
      ran_possible = ran_possible && (mask & 2);
    }
    if (!not_run_possible && !ran_possible) {
      return Fail(
          "the call ran in part: its sequences disagree on whether it ran");
    }
    if (not_run_possible && ran_possible) {
      ++counters_.ambiguous_unknown;
    } else if (ran_possible) {
      ++counters_.ambiguous_ran;
    } else {
      ++counters_.ambiguous_not_run;
    }
  }

  // Finds which of two candidate states `id` is in (bit 0: a, bit 1: b; both
  // when the probe cannot tell), and leaves the shadow exact.
  bool Probe(const std::string& id, const Candidate& a, const Candidate& b,
             int* mask) {
    const Candidate* cands[2] = {&a, &b};
    const Sampling sampling = a.present ? a.sampling : b.sampling;
    v1::SequenceInput in = Input(id, {Token()}, false);
    sampling.SetOn(&in);
    const v1::ForwardRequest probe = Request({in});
    v1::ForwardResponse response;
    const grpc::Status status =
        server_testing::Forward(stub_, probe, &response);
    Log("  probe " + Describe(probe) + " -> " + CodeName(status.error_code()) +
        " " +
        (status.ok() ? std::to_string(response.sequences(0).num_tokens())
                     : status.error_message()));
    *mask = 0;
    if (status.ok()) {
      const int len = response.sequences(0).num_tokens() - 1;
      const Candidate* match = nullptr;
      for (int k = 0; k < 2; ++k) {
        if (cands[k]->present &&
            static_cast<int>(cands[k]->history.size()) == len) {
          *mask |= 1 << k;
          match = cands[k];
        }
      }
      if (match == nullptr) {
        Fail("probe: '" + id + "' has " + std::to_string(len) +
             " tokens; it should be " + Describe(a, b));
        return false;
      }
      Seq& seq = live_[id];
      seq.history = match->history;
      seq.history.push_back(in.token_ids(0));
      seq.sampling = sampling;
      seq.next_token = response.sequences(0).token_id();
      gone_.erase(id);
      return CheckSample(id, seq.history, sampling, seq.next_token,
                         response.sequences(0).logprob());
    }
    if (status.error_code() == grpc::StatusCode::NOT_FOUND) {
      for (int k = 0; k < 2; ++k) *mask |= cands[k]->present ? 0 : 1 << k;
      if (*mask == 0) {
        Fail("probe: '" + id + "' is unknown; it should be " + Describe(a, b));
        return false;
      }
      live_.erase(id);
      gone_.insert(id);
      return true;
    }
    // No room for one more token (KV full or max_model_len): a Release
    // tells by the blocks it frees.
    if (status.error_code() != grpc::StatusCode::RESOURCE_EXHAUSTED &&
        status.error_code() != grpc::StatusCode::INVALID_ARGUMENT) {
      Fail("probe: " + CodeName(status.error_code()) + " " +
           status.error_message());
      return false;
    }
    v1::ReleaseResponse released;
    const grpc::Status release = ReleaseRpc({id}, Timing::kNormal, &released);
    Log("  probe Release " + id + " -> " + CodeName(release.error_code()) +
        " freed " + std::to_string(released.freed_blocks()));
    if (!release.ok()) {
      Fail("probe: Release of '" + id + "' that a step found: " +
           CodeName(release.error_code()) + " " + release.error_message());
      return false;
    }
    for (int k = 0; k < 2; ++k) {
      if (cands[k]->present &&
          BlocksFor(cands[k]->history.size()) == released.freed_blocks()) {
        *mask |= 1 << k;
      }
    }
    if (*mask == 0) {
      Fail("probe: Release of '" + id + "' freed " +
           std::to_string(released.freed_blocks()) + " blocks; it should be " +
           Describe(a, b));
      return false;
    }
    live_.erase(id);
    gone_.insert(id);
    return true;
  }

  grpc::Status ReleaseRpc(const std::vector<std::string>& ids, Timing timing,
                          v1::ReleaseResponse* response) {
    grpc::ClientContext context;
    if (timing == Timing::kDeadline) {
      abandon_timeout_ = std::chrono::microseconds(Uniform(0, 2000));
      context.set_deadline(std::chrono::system_clock::now() + abandon_timeout_);
    } else {
      server_testing::SetGenerousDeadline(&context);
    }
    v1::ReleaseRequest request;
    for (const std::string& id : ids) request.add_sequence_ids(id);
    return stub_.Release(&context, request, response);
  }

  void ReleaseOp() {
    std::vector<std::string> ids = LiveIds(Uniform(1, 3));
    bool unknown = false, repeated = false;
    if (ids.empty() || Chance(25)) {
      ids.insert(ids.begin() + Uniform(0, ids.size()), AbsentId());
      unknown = true;
    } else if (Chance(5)) {
      ids.push_back(ids[0]);
      repeated = true;
    }
    int freed = 0;
    for (const std::string& id : ids) {
      auto it = live_.find(id);
      if (it != live_.end()) freed += BlocksFor(it->second.history.size());
    }
    const grpc::StatusCode want = repeated  ? grpc::StatusCode::INVALID_ARGUMENT
                                  : unknown ? grpc::StatusCode::NOT_FOUND
                                            : grpc::StatusCode::OK;
    const Timing timing = Chance(15) ? Timing::kDeadline : Timing::kNormal;
    std::string names;
    for (const std::string& id : ids) names += " " + id;
    Log("Release" + names + TimingName(timing) + " expect " + CodeName(want));
    v1::ReleaseResponse response;
    const grpc::Status status = ReleaseRpc(ids, timing, &response);
    const grpc::StatusCode code = status.error_code();
    Log("  -> " + CodeName(code) + " freed " +
        std::to_string(response.freed_blocks()) + " " + status.error_message());
    if (code == want && code == grpc::StatusCode::OK) {
      ++counters_.released;
      if (response.freed_blocks() != freed) {
        return Fail("Release freed " + std::to_string(response.freed_blocks()) +
                    " blocks; the shadow holds " + std::to_string(freed));
      }
      for (const std::string& id : ids) {
        live_.erase(id);
        gone_.insert(id);
      }
      return;
    }
    if (code == want) {
      Count(code);
      return;
    }
    if (timing != Timing::kNormal &&
        (code == grpc::StatusCode::DEADLINE_EXCEEDED ||
         code == grpc::StatusCode::CANCELLED)) {
      std::map<std::string, std::pair<Candidate, Candidate>> candidates;
      for (const std::string& id : ids) {
        Candidate before;
        auto it = live_.find(id);
        if (it != live_.end()) {
          before = {true, it->second.history, it->second.sampling};
        }
        candidates[id] = {before, Candidate()};  // ran: released
      }
      WaitOutAbandonedCall();
      Resolve(candidates, want == grpc::StatusCode::OK);
      return;
    }
    Fail("Release: unexpected " + CodeName(code) + " (" +
         status.error_message() + "); expected " + CodeName(want));
  }

  // Releases everything this thread holds and checks that every id it
  // believes gone is unknown to the worker.
  void Finish() {
    if (!live_.empty()) {
      std::vector<std::string> ids;
      int freed = 0;
      for (const auto& [id, seq] : live_) {
        ids.push_back(id);
        freed += BlocksFor(seq.history.size());
      }
      v1::ReleaseResponse response;
      const grpc::Status status = ReleaseRpc(ids, Timing::kNormal, &response);
      if (!status.ok() || response.freed_blocks() != freed) {
        return Fail("final Release: " + CodeName(status.error_code()) + " " +
                    status.error_message() + ", freed " +
                    std::to_string(response.freed_blocks()) + " of " +
                    std::to_string(freed) + " blocks");
      }
      for (const std::string& id : ids) gone_.insert(id);
      live_.clear();
    }
    for (const std::string& id : gone_) {
      v1::ReleaseResponse response;
      const grpc::Status status = ReleaseRpc({id}, Timing::kNormal, &response);
      if (status.error_code() != grpc::StatusCode::NOT_FOUND) {
        return Fail("'" + id + "' should be unknown, but Release answered " +
                    CodeName(status.error_code()) + " freeing " +
                    std::to_string(response.freed_blocks()) + " blocks");
      }
    }
  }

  // --- reporting ----------------------------------------------------------

  void Count(grpc::StatusCode code) {
    switch (code) {
      case grpc::StatusCode::INVALID_ARGUMENT:
        ++counters_.invalid_argument;
        break;
      case grpc::StatusCode::NOT_FOUND:
        ++counters_.not_found;
        break;
      case grpc::StatusCode::ALREADY_EXISTS:
        ++counters_.already_exists;
        break;
      case grpc::StatusCode::RESOURCE_EXHAUSTED:
        ++counters_.resource_exhausted;
        break;
      default:
        break;
    }
  }

  static std::string CodeName(grpc::StatusCode code) {
    switch (code) {
      case grpc::StatusCode::OK:
        return "OK";
      case grpc::StatusCode::CANCELLED:
        return "CANCELLED";
      case grpc::StatusCode::INVALID_ARGUMENT:
        return "INVALID_ARGUMENT";
      case grpc::StatusCode::DEADLINE_EXCEEDED:
        return "DEADLINE_EXCEEDED";
      case grpc::StatusCode::NOT_FOUND:
        return "NOT_FOUND";
      case grpc::StatusCode::ALREADY_EXISTS:
        return "ALREADY_EXISTS";
      case grpc::StatusCode::RESOURCE_EXHAUSTED:
        return "RESOURCE_EXHAUSTED";
      default:
        return "code " + std::to_string(static_cast<int>(code));
    }
  }

  std::string Describe(const v1::ForwardRequest& request) const {
    std::ostringstream out;
    out << "Forward[";
    for (int i = 0; i < request.sequences_size(); ++i) {
      const v1::SequenceInput& in = request.sequences(i);
      auto it = live_.find(in.sequence_id());
      out << (i > 0 ? ", " : "") << in.sequence_id()
          << (in.start() ? " start " : " continue ") << in.token_ids_size()
          << " tokens";
      if (it != live_.end())
        out << " (has " << it->second.history.size() << ")";
      if (in.release_after_step()) out << " release_after_step";
      if (in.sampling().temperature() > 0) out << " sampled";
    }
    out << "]";
    return out.str();
  }

  static std::string Describe(const Candidate& c) {
    return c.present ? std::to_string(c.history.size()) + " tokens" : "unknown";
  }
  // "N tokens (not run) or unknown (ran)".
  static std::string Describe(const Candidate& not_run, const Candidate& ran) {
    if (not_run.present == ran.present && not_run.history == ran.history) {
      return Describe(not_run) + " (the call could not run)";
    }
    return Describe(not_run) + " (not run) or " + Describe(ran) + " (ran)";
  }

  void Log(const std::string& line) {
    recent_.push_back("#" + std::to_string(call_) + " " + line);
    while (recent_.size() > 30) recent_.pop_front();
  }

  void Fail(const std::string& message) {
    failed_ = true;
    std::string recent;
    for (const std::string& line : recent_) recent += "\n  " + line;
    ADD_FAILURE() << "thread " << index_ << " (seed " << seed_
                  << " = RANDOM_CALLS_SEED + " << index_ << "), call #" << call_
                  << ": " << message << "\nlast calls:" << recent;
  }

  const int index_;
  const uint32_t seed_;
  std::mt19937 rng_;
  v1::Worker::Stub& stub_;
  Oracle& oracle_;
  Counters& counters_;
  int call_ = 0;
  int next_id_ = 0;
  // The timeout of the last call sent with a short deadline or cancelled.
  std::chrono::microseconds abandon_timeout_{0};
  bool failed_ = false;
  std::map<std::string, Seq> live_;
  std::set<std::string> gone_;  // ids the worker must not know
  std::deque<std::string> recent_;
};

TEST(RandomCallsTest, ShadowModelAgreesWithWorker) {
  const uint32_t seed = BaseSeed();
  std::cout << "RANDOM_CALLS_SEED=" << seed << "\n";
  ModelRunnerOptions options = SmallRunnerOptions();
  options.kv_cache_bytes = int64_t{kKvBlocks} * 1024;  // 1 KiB per block
  auto w = StartWorker(options);
  ASSERT_NE(w, nullptr);
  {
    const v1::WorkerStatus status = w->Status();
    ASSERT_EQ(status.kv_blocks_total(), kKvBlocks);
    ASSERT_EQ(status.kv_block_size(), kBlockSize);
    ASSERT_EQ(status.max_num_seqs(), kMaxNumSeqs);
    ASSERT_EQ(status.max_num_batched_tokens(), kStepTokens);
    ASSERT_EQ(status.max_model_len(), kMaxModelLen);
    ASSERT_EQ(status.vocab_size(), kVocab);
  }
  Oracle oracle;
  Counters counters;
  std::vector<std::unique_ptr<ClientThread>> clients;
  for (int t = 0; t < kThreads; ++t) {
    clients.push_back(std::make_unique<ClientThread>(t, seed + t, *w->stub,
                                                     oracle, counters));
  }
  std::vector<std::thread> threads;
  for (auto& client : clients) {
    threads.emplace_back([&client] { client->Run(); });
  }
  for (std::thread& t : threads) t.join();

  const ExecutorSnapshot snapshot = w->server->executor().snapshot();
  std::cout << "ok " << counters.ok << " (chunked " << counters.chunked_ok
            << "), released " << counters.released << ", INVALID_ARGUMENT "
            << counters.invalid_argument << ", NOT_FOUND " << counters.not_found
            << ", ALREADY_EXISTS " << counters.already_exists
            << ", RESOURCE_EXHAUSTED " << counters.resource_exhausted
            << "; cut short by deadline/cancel: not run "
            << counters.ambiguous_not_run << ", ran " << counters.ambiguous_ran
            << ", undecidable " << counters.ambiguous_unknown
            << "; worker dropped " << snapshot.dropped_deadline
            << " (deadline) + " << snapshot.dropped_cancelled
            << " (cancelled); " << snapshot.steps << " steps; "
            << oracle.computed() << " reference samples\n";
  if (HasFailure()) return;

  // The random mix reached every kind of answer (typical counts are 4 to 10
  // times these).
  constexpr int64_t kCalls = kThreads * kCallsPerThread;
  EXPECT_GT(counters.ok.load(), kCalls / 10);
  EXPECT_GT(counters.chunked_ok.load(), kCalls / 100);
  EXPECT_GT(counters.released.load(), kCalls / 100);
  EXPECT_GT(counters.invalid_argument.load(), kCalls / 100);
  EXPECT_GT(counters.not_found.load(), kCalls / 100);
  EXPECT_GT(counters.already_exists.load(), 0);

  // Calls the clients gave up on are finished on the worker too (the probes
  // that followed them already ran, so this is only a formality).
  ASSERT_TRUE(WaitFor(
      [&] { return w->server->executor().snapshot().queued_calls == 0; }));
  v1::WorkerStatus status = w->Status();
  EXPECT_EQ(status.num_sequences(), 0);
  EXPECT_EQ(status.kv_blocks_free(), status.kv_blocks_total());

  // And the worker still serves, with the same results.
  const std::vector<int32_t> prompt = {5, 6, 7, 8, 9, 10, 11};
  v1::SequenceInput in = Input("after", prompt, true);
  in.set_release_after_step(true);
  v1::ForwardResponse response;
  const grpc::Status last =
      server_testing::Forward(*w->stub, Request({in}), &response);
  ASSERT_TRUE(last.ok()) << last.error_message();
  EXPECT_EQ(response.sequences(0).num_tokens(), 7);
  EXPECT_EQ(response.sequences(0).token_id(),
            oracle.Next(prompt, Sampling()).token_id);
  status = w->Status();
  EXPECT_EQ(status.num_sequences(), 0);
  EXPECT_EQ(status.kv_blocks_free(), status.kv_blocks_total());
}

// Found by the test above: a chunked call whose deadline passes between its
// chunks is dropped and its chunks are undone, and a later call on the same
// sequence (queued behind it: per-sequence arrival order) must see it
// undone, never the half-run state. Made deterministic with tasks posted to
// the executor: it runs the first chunk, pauses, and is held until the
// deadline has passed while the later call waits in its queue; then it
// resumes, and the same loop iteration drops the chunked call and plans the
// later one.
TEST(RandomCallsTest, LaterCallsSeeADroppedChunkedCallUndone) {
  enum class Later { kContinue, kRelease };
  struct Case {
    const char* name;
    bool
        live_before;  // the chunked call continues "x" (10 tokens) or starts it
    Later later;
  };
  const Case cases[] = {
      {"new sequence, then a step", false, Later::kContinue},
      {"new sequence, then Release", false, Later::kRelease},
      {"live sequence, then a step", true, Later::kContinue},
  };
  std::vector<int32_t> prompt(100);
  for (int i = 0; i < 100; ++i) prompt[i] = (7 * i + 1) % kVocab;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    auto w = StartWorker(SmallRunnerOptions());
    ASSERT_NE(w, nullptr);
    // Opened on every way out, before the worker (declared earlier) stops.
    struct Gate {
      std::promise<void> promise;
      std::shared_future<void> future = promise.get_future().share();
      bool open = false;
      void Open() {
        if (!open) promise.set_value();
        open = true;
      }
      ~Gate() { Open(); }
    } gate;
    Executor& executor = w->server->executor();
    v1::ForwardResponse response;
    if (c.live_before) {
      ASSERT_TRUE(server_testing::Forward(
                      *w->stub,
                      Request({Input("x", {prompt.begin(), prompt.begin() + 10},
                                     true)}),
                      &response)
                      .ok());
    }
    const v1::WorkerStatus before = w->Status();
    const int64_t steps_before = executor.snapshot().steps;

    // 100 tokens: two steps, 64 + 36.
    executor.Pause();
    const auto sent = std::chrono::system_clock::now();
    const auto timeout = std::chrono::seconds(1);
    auto chunked =
        StartForward(*w->stub, Request({Input("x", prompt, !c.live_before)}),
                     [&](grpc::ClientContext* context) {
                       context->set_deadline(sent + timeout);
                     });
    ASSERT_TRUE(WaitFor([&] { return executor.snapshot().queued_calls == 1; }));
    // The server's deadline for the call is the timeout from when it read
    // the call (gRPC sends a timeout, not a time): no later than now.
    const auto server_deadline = std::chrono::system_clock::now() + timeout;
    // This loop iteration resumes and runs the first chunk; the next one
    // pauses before the second.
    ASSERT_TRUE(executor
                    .Post([&executor](ModelRunner&) {
                      executor.Resume();
                      executor
                          .Post([&executor](ModelRunner&) { executor.Pause(); })
                          .IgnoreError();
                    })
                    .ok());
    ASSERT_TRUE(
        WaitFor([&] { return executor.snapshot().steps > steps_before; }));

    // The later call on "x" waits behind the chunked one.
    std::unique_ptr<server_testing::PendingForward> step;
    grpc::ClientContext release_context;
    server_testing::SetGenerousDeadline(&release_context);
    v1::ReleaseRequest release;
    release.add_sequence_ids("x");
    v1::ReleaseResponse released;
    auto release_done = std::make_shared<std::promise<grpc::Status>>();
    if (c.later == Later::kContinue) {
      step = StartForward(*w->stub, Request({Input("x", {3}, false)}));
    } else {
      w->stub->async()->Release(&release_context, &release, &released,
                                [release_done](const grpc::Status& s) {
                                  release_done->set_value(s);
                                });
    }
    ASSERT_TRUE(WaitFor([&] { return executor.snapshot().queued_calls == 2; }));
    // Hold the executor (both calls now in its queue) past the deadline,
    // then resume in the same iteration.
    std::shared_future<void> held = gate.future;
    ASSERT_TRUE(executor
                    .Post([&executor, held](ModelRunner&) {
                      held.wait();
                      executor.Resume();
                    })
                    .ok());
    std::this_thread::sleep_until(server_deadline +
                                  std::chrono::milliseconds(10));
    gate.Open();

    EXPECT_EQ(chunked->result.get().error_code(),
              grpc::StatusCode::DEADLINE_EXCEEDED);
    const grpc::Status later = c.later == Later::kContinue
                                   ? step->result.get()
                                   : release_done->get_future().get();
    if (c.live_before) {
      ASSERT_TRUE(later.ok()) << later.error_message();
      EXPECT_EQ(step->response.sequences(0).num_tokens(), 11);
    } else {
      EXPECT_EQ(later.error_code(), grpc::StatusCode::NOT_FOUND)
          << (c.later == Later::kContinue && later.ok()
                  ? "num_tokens " +
                        std::to_string(step->response.sequences(0).num_tokens())
                  : later.error_message());
    }
    const v1::WorkerStatus after = w->Status();
    EXPECT_EQ(after.num_sequences(), before.num_sequences());
    EXPECT_EQ(after.kv_blocks_free(), before.kv_blocks_free());  // 10, 11: 3
  }
}

}  // namespace
}  // namespace pdworker
