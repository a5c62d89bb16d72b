#include "tests/server/random_calls_shadow.h"

#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "glog/logging.h"

namespace pdworker::random_calls {

using server_testing::MakeRunner;
using server_testing::SmallRunnerOptions;

Sampling Sampling::Of(const v1::SequenceInput& in) {
  Sampling s;
  if (in.sampling().temperature() > 0.0f) {
    s.temperature = in.sampling().temperature();
    s.top_k = in.sampling().top_k();
    s.seed = in.sampling().seed();
  }
  return s;
}

void Sampling::SetOn(v1::SequenceInput* in) const {
  if (temperature == 0.0f) return;
  in->mutable_sampling()->set_temperature(temperature);
  in->mutable_sampling()->set_top_k(top_k);
  in->mutable_sampling()->set_seed(seed);
}

std::tuple<float, int32_t, uint64_t> Sampling::Key() const {
  return std::make_tuple(temperature, top_k, seed);
}

Oracle::Oracle() {
  ModelRunnerOptions options = SmallRunnerOptions();
  options.max_num_batched_tokens = kMaxModelLen;  // any history in one step
  reference_ = MakeRunner(options);
}

SequenceResult Oracle::Next(const std::vector<int32_t>& history,
                            const Sampling& s) {
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

int64_t Oracle::computed() {
  std::lock_guard<std::mutex> lock(mu_);
  return computed_;
}

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

Expectation Expect(const v1::ForwardRequest& request,
                   const std::map<std::string, Seq>& live) {
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
    auto it = live.find(in.sequence_id());
    const int before =
        it == live.end() ? 0 : static_cast<int>(it->second.history.size());
    if (in.start() && it != live.end()) {
      e.code = grpc::StatusCode::ALREADY_EXISTS;
    } else if (!in.start() && it == live.end()) {
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

std::string CodeName(grpc::StatusCode code) {
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

std::string Describe(const v1::ForwardRequest& request,
                     const std::map<std::string, Seq>& live) {
  std::ostringstream out;
  out << "Forward[";
  for (int i = 0; i < request.sequences_size(); ++i) {
    const v1::SequenceInput& in = request.sequences(i);
    auto it = live.find(in.sequence_id());
    out << (i > 0 ? ", " : "") << in.sequence_id()
        << (in.start() ? " start " : " continue ") << in.token_ids_size()
        << " tokens";
    if (it != live.end()) out << " (has " << it->second.history.size() << ")";
    if (in.release_after_step()) out << " release_after_step";
    if (in.sampling().temperature() > 0) out << " sampled";
  }
  out << "]";
  return out.str();
}

std::string Describe(const Candidate& c) {
  return c.present ? std::to_string(c.history.size()) + " tokens" : "unknown";
}

std::string Describe(const Candidate& not_run, const Candidate& ran) {
  if (not_run.present == ran.present && not_run.history == ran.history) {
    return Describe(not_run) + " (the call could not run)";
  }
  return Describe(not_run) + " (not run) or " + Describe(ran) + " (ran)";
}

}  // namespace pdworker::random_calls
