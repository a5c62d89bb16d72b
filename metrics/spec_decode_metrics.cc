// Speculative decoding's counters (issue 42), with vLLM's names and
// meanings (vllm/v1/spec_decode/metrics.py): drafts (verify steps of a
// request with drafts), draft tokens, accepted tokens, and accepted tokens
// by draft position. Acceptance rate = accepted / draft tokens; mean
// acceptance length = 1 + accepted / drafts (the dashboard's two panels).
#include <string>

#include "absl/strings/str_cat.h"
#include "metrics/worker_metrics.h"
#include "prometheus/counter.h"

namespace pdworker {

void WorkerMetrics::RegisterSpecDecodeFamilies(
    const WorkerMetricsOptions& options) {
  prometheus::Registry& r = *registry_;
  const bool aliases = options.vllm_aliases == VllmAliases::kOn;
  const prometheus::Labels vllm_labels = {
      {"model_name", options.served_model_name}, {"engine", "0"}};
  struct Name {
    const char* suffix;
    const char* help;
    SpecCounters SpecDecode::*counters;
  };
  for (const Name& n : {
           Name{"num_drafts", "Verify steps of a request with draft tokens.",
                &SpecDecode::drafts},
           Name{"num_draft_tokens", "Draft tokens verified.",
                &SpecDecode::draft_tokens},
           Name{"num_accepted_tokens", "Draft tokens accepted.",
                &SpecDecode::accepted_tokens},
       }) {
    SpecCounters& c = spec_decode_.*n.counters;
    c.ours =
        &prometheus::BuildCounter()
             .Name(absl::StrCat("pdworker_spec_decode_", n.suffix, "_total"))
             .Help(n.help)
             .Register(r)
             .Add({});
    if (aliases) {
      c.vllm = &prometheus::BuildCounter()
                    .Name(absl::StrCat("vllm:spec_decode_", n.suffix, "_total"))
                    .Help(absl::StrCat(n.help, " (--metrics_vllm_aliases)"))
                    .Register(r)
                    .Add(vllm_labels);
    }
  }
  spec_decode_.per_position = &prometheus::BuildCounter()
                                   .Name(
                                       "pdworker_spec_decode_num_accepted_"
                                       "tokens_per_pos_total")
                                   .Help(
                                       "Draft tokens accepted, by their "
                                       "position in the draft (0: first).")
                                   .Register(r);
  if (aliases) {
    spec_decode_.vllm_per_position =
        &prometheus::BuildCounter()
             .Name("vllm:spec_decode_num_accepted_tokens_per_pos_total")
             .Help(
                 "Draft tokens accepted, by position (--metrics_vllm_aliases)")
             .Register(r);
    spec_decode_.vllm_labels = vllm_labels;
  }
}

void WorkerMetrics::ObserveSpeculation(int32_t num_draft_tokens,
                                       int32_t num_accepted_tokens) {
  SpecDecode& s = spec_decode_;
  auto add = [](SpecCounters& c, double v) {
    c.ours->Increment(v);
    if (c.vllm != nullptr) c.vllm->Increment(v);
  };
  add(s.drafts, 1);
  add(s.draft_tokens, num_draft_tokens);
  add(s.accepted_tokens, num_accepted_tokens);
  // A counter per position drafted so far (at most num_speculative_tokens
  // of them), made when a draft first reaches it, so every position a
  // draft had shows, with 0 where none was accepted.
  while (static_cast<int32_t>(s.position.size()) < num_draft_tokens) {
    const std::string pos = absl::StrCat(s.position.size());
    s.position.push_back(&s.per_position->Add({{"position", pos}}));
    if (s.vllm_per_position != nullptr) {
      prometheus::Labels labels = s.vllm_labels;
      labels["position"] = pos;
      s.vllm_position.push_back(&s.vllm_per_position->Add(labels));
    }
  }
  for (int32_t i = 0; i < num_accepted_tokens; ++i) {
    s.position[i]->Increment();
    if (!s.vllm_position.empty()) s.vllm_position[i]->Increment();
  }
}

}  // namespace pdworker
