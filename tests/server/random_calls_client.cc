#include "tests/server/random_calls_client.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "tests/server/random_calls_shadow.h"

namespace pdworker::random_calls {
namespace {

using server_testing::Input;
using server_testing::Request;
using server_testing::StartForward;

constexpr int kMaxLivePerThread = 5;

}  // namespace

class ClientThread::Impl {
 public:
  Impl(int index, uint32_t seed, v1::Worker::Stub& stub, Oracle& oracle,
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
    const Expectation want = Expect(request, live_);
    Timing timing = Timing::kNormal;
    const int r = Uniform(0, 99);
    // Chunked calls are the interesting ones to cut short: between chunks.
    if (r < (want.chunked ? 25 : 8)) {
      timing = Timing::kDeadline;
    } else if (r < (want.chunked ? 45 : 15)) {
      timing = Timing::kCancel;
    }
    Log(Describe(request, live_) + TimingName(timing) + " expect " +
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
  // here) may still be on its way to the engine: gRPC does not keep the
  // order of calls on one channel, so a probe sent now may overtake it, and
  // the worker may then run it after the probe (a cancellation it has not
  // seen yet does not stop it). Its deadline does: the server reads the
  // call's headers before those of any later call on the connection, so
  // once a later call (GetStatus) is answered, the call's server-side
  // deadline is at most abandon_timeout_ away, and past it the engine
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
    Log("  probe " + Describe(probe, live_) + " -> " +
        CodeName(status.error_code()) + " " +
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

ClientThread::ClientThread(int index, uint32_t seed, v1::Worker::Stub& stub,
                           Oracle& oracle, Counters& counters)
    : impl_(std::make_unique<Impl>(index, seed, stub, oracle, counters)) {}

ClientThread::~ClientThread() = default;

void ClientThread::Run() { impl_->Run(); }

}  // namespace pdworker::random_calls
