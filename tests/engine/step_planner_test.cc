// The coalescing rules of StepPlanner, on hand-made queues.
#include "worker/engine/step_planner.h"

#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace pdworker {
namespace {

using ::testing::ElementsAre;

// Owns the strings and token counts a PendingCall points into.
struct Call {
  std::vector<std::string> id_storage;
  std::vector<absl::string_view> ids;
  std::vector<int32_t> remaining;
  PendingCall view;
};

Call Forward(std::vector<std::string> ids, std::vector<int32_t> tokens,
             Chunking chunking = Chunking::kWhole) {
  Call c;
  c.id_storage = std::move(ids);
  c.remaining = std::move(tokens);
  c.view.kind = PendingKind::kForward;
  c.view.chunking = chunking;
  return c;
}

Call Release(std::vector<std::string> ids) {
  Call c;
  c.id_storage = std::move(ids);
  c.view.kind = PendingKind::kRelease;
  return c;
}

StepPlan Plan(std::vector<Call>& queue, StepBudget budget) {
  std::vector<const PendingCall*> views;
  for (Call& c : queue) {
    c.ids.assign(c.id_storage.begin(), c.id_storage.end());
    c.view.sequence_ids = c.ids;
    c.view.remaining_tokens = c.remaining;
    views.push_back(&c.view);
  }
  StepPlanner planner(budget);
  StepPlan plan;
  planner.Plan(views, &plan);
  return plan;
}

std::vector<std::vector<int>> Pieces(const StepPlan& plan) {
  std::vector<std::vector<int>> out;
  for (const StepPiece& p : plan.pieces) {
    out.push_back({p.index, p.sequence, p.num_tokens});
  }
  return out;
}

TEST(StepPlannerTest, MergesWhatFitsAndDefersTheRest) {
  std::vector<Call> q;
  q.push_back(Forward({"a"}, {1}));
  q.push_back(Forward({"b", "c"}, {5, 1}));
  q.push_back(Forward({"d"}, {10}));  // does not fit what is left (8 - 7)
  q.push_back(Forward({"e"}, {1}));   // a younger, smaller call still joins
  const StepPlan plan = Plan(q, {8, 8});
  EXPECT_THAT(plan.forwards, ElementsAre(0, 1, 3));
  EXPECT_THAT(Pieces(plan),
              ElementsAre(ElementsAre(0, 0, 1), ElementsAre(1, 0, 5),
                          ElementsAre(1, 1, 1), ElementsAre(3, 0, 1)));
  EXPECT_EQ(plan.num_tokens, 8);
}

TEST(StepPlannerTest, SequenceBudgetLimitsToo) {
  std::vector<Call> q;
  q.push_back(Forward({"a", "b"}, {1, 1}));
  q.push_back(Forward({"c", "d"}, {1, 1}));
  q.push_back(Forward({"e"}, {1}));
  const StepPlan plan = Plan(q, {3, 100});
  EXPECT_THAT(plan.forwards, ElementsAre(0, 2));
}

TEST(StepPlannerTest, ConflictingCallsWaitAndKeepTheirOrder) {
  std::vector<Call> q;
  q.push_back(Forward({"a"}, {1}));
  q.push_back(Forward({"a"}, {1}));    // same sequence: next step
  q.push_back(Release({"b"}));         // independent: runs now
  q.push_back(Release({"a"}));         // after both forwards on a
  q.push_back(Forward({"x"}, {100}));  // too big for what is left: deferred
  q.push_back(Forward({"x"}, {1}));    // fits, but must not overtake
  const StepPlan plan = Plan(q, {8, 64});
  EXPECT_THAT(plan.forwards, ElementsAre(0));
  EXPECT_THAT(plan.releases, ElementsAre(2));
}

TEST(StepPlannerTest, ChunksACallLargerThanTheBudget) {
  std::vector<Call> q;
  q.push_back(Forward({"p", "q"}, {50, 40}, Chunking::kChunked));
  q.push_back(Forward({"r"}, {1}));
  StepPlan plan = Plan(q, {8, 64});
  // p whole, q's first 14 tokens; nothing left for r.
  EXPECT_THAT(Pieces(plan),
              ElementsAre(ElementsAre(0, 0, 50), ElementsAre(0, 1, 14)));
  EXPECT_THAT(plan.forwards, ElementsAre(0));

  // Next step: p done, q's remaining 26 tokens, and r joins.
  q[0].remaining = {0, 26};
  plan = Plan(q, {8, 64});
  EXPECT_THAT(Pieces(plan),
              ElementsAre(ElementsAre(0, 1, 26), ElementsAre(1, 0, 1)));
}

TEST(StepPlannerTest, ChunkedCallBehindOthersTakesWhatIsLeft) {
  std::vector<Call> q;
  q.push_back(Forward({"a"}, {60}));
  q.push_back(Forward({"long"}, {300}, Chunking::kChunked));
  const StepPlan plan = Plan(q, {8, 64});
  EXPECT_THAT(Pieces(plan),
              ElementsAre(ElementsAre(0, 0, 60), ElementsAre(1, 0, 4)));
}

TEST(StepPlannerTest, TheOldestCallAlwaysProgresses) {
  // Whatever the queue, a plan over a non-empty queue is never empty: the
  // oldest call sees an empty budget.
  for (const int tokens : {1, 64, 65, 1000}) {
    std::vector<Call> q;
    q.push_back(Forward({"a"}, {tokens},
                        tokens > 64 ? Chunking::kChunked : Chunking::kWhole));
    q.push_back(Forward({"a"}, {1}));
    const StepPlan plan = Plan(q, {1, 64});
    ASSERT_EQ(plan.pieces.size(), 1u) << tokens;
    EXPECT_EQ(plan.pieces[0].index, 0);
    EXPECT_EQ(plan.pieces[0].num_tokens, std::min(tokens, 64));
  }
}

// --- Engine-owned requests ---

PendingRequest Decode(int32_t computed, int32_t blocks) {
  return {1, computed, blocks, true};
}
PendingRequest Drafting(int32_t computed, int32_t blocks, int32_t drafts) {
  return {1 + drafts, computed, blocks, true, drafts};
}
PendingRequest Prefill(int32_t wanted, int32_t computed, int32_t blocks) {
  return {wanted, computed, blocks, true};
}
PendingRequest Waiting(int32_t wanted, bool admissible = true) {
  return {wanted, 0, 0, admissible};
}

// A plan over calls (optional) and requests, with `free_blocks` KV blocks
// of 4 tokens.
StepPlan PlanAll(std::vector<Call>& calls, std::vector<PendingRequest>& running,
                 std::vector<PendingRequest>& waiting, StepBudget budget,
                 int32_t free_blocks, int32_t reserved_seats = 0) {
  std::vector<const PendingCall*> call_views;
  for (Call& c : calls) {
    c.ids.assign(c.id_storage.begin(), c.id_storage.end());
    c.view.sequence_ids = c.ids;
    c.view.remaining_tokens = c.remaining;
    call_views.push_back(&c.view);
  }
  std::vector<const PendingRequest*> r, w;
  for (const PendingRequest& p : running) r.push_back(&p);
  for (const PendingRequest& p : waiting) w.push_back(&p);
  budget.block_size = 4;
  PlanInput input;
  input.calls = call_views;
  input.running = r;
  input.waiting = w;
  input.free_kv_blocks = free_blocks;
  input.reserved_seats = reserved_seats;
  StepPlanner planner(budget);
  StepPlan plan;
  planner.Plan(input, &plan);
  return plan;
}

// (source, index, tokens) per piece.
std::vector<std::vector<int>> Rows(const StepPlan& plan) {
  std::vector<std::vector<int>> out;
  for (const StepPiece& p : plan.pieces) {
    out.push_back({static_cast<int>(p.source), p.index, p.num_tokens});
  }
  return out;
}
constexpr int kCallSrc = static_cast<int>(PieceSource::kCall);
constexpr int kRun = static_cast<int>(PieceSource::kRunningRequest);
constexpr int kAdm = static_cast<int>(PieceSource::kAdmittedRequest);

TEST(StepPlannerRequestsTest, DecodesFirstThenPrefillChunksFillTheRest) {
  std::vector<Call> calls;
  // A prefill admitted first must not hold the decodes admitted after it.
  std::vector<PendingRequest> running = {Prefill(100, 0, 0), Decode(8, 2),
                                         Decode(9, 3), Decode(4, 1)};
  std::vector<PendingRequest> waiting = {Waiting(5)};
  const StepPlan plan = PlanAll(calls, running, waiting, {8, 16}, 1000);
  EXPECT_THAT(Rows(plan),
              ElementsAre(ElementsAre(kRun, 1, 1), ElementsAre(kRun, 2, 1),
                          ElementsAre(kRun, 3, 1), ElementsAre(kRun, 0, 13)));
  EXPECT_TRUE(plan.admitted.empty());  // no tokens left
  EXPECT_EQ(plan.num_tokens, 16);
}

// A decode verifying k drafts (speculative decoding) is a decode: it goes
// first with its 1 + k tokens, as many drafts as the tokens left allow.
TEST(StepPlannerRequestsTest, DecodesWithDraftsGoFirstAndTakeWhatIsLeft) {
  std::vector<Call> calls;
  std::vector<PendingRequest> running = {Prefill(100, 0, 0), Drafting(8, 3, 3),
                                         Decode(9, 3), Drafting(4, 1, 3)};
  std::vector<PendingRequest> waiting;
  StepPlan plan = PlanAll(calls, running, waiting, {8, 16}, 1000);
  EXPECT_THAT(Rows(plan),
              ElementsAre(ElementsAre(kRun, 1, 4), ElementsAre(kRun, 2, 1),
                          ElementsAre(kRun, 3, 4), ElementsAre(kRun, 0, 7)));
  // 6 tokens: the first drafting decode takes 4, the decode 1, the last
  // one only its own token.
  plan = PlanAll(calls, running, waiting, {8, 6}, 1000);
  EXPECT_THAT(Rows(plan),
              ElementsAre(ElementsAre(kRun, 1, 4), ElementsAre(kRun, 2, 1),
                          ElementsAre(kRun, 3, 1)));
}

// Drafts never preempt: a drafting decode whose drafts need a block that is
// not free verifies fewer (here none), and nobody is preempted for them.
TEST(StepPlannerRequestsTest, DraftsNeverPreemptAnotherRequest) {
  std::vector<Call> calls;
  // 7 tokens in 2 blocks of 4: its own token fits, drafts 2 and 3 would
  // need a third block.
  std::vector<PendingRequest> running = {Drafting(7, 2, 3), Decode(6, 2)};
  std::vector<PendingRequest> waiting;
  StepPlan plan = PlanAll(calls, running, waiting, {8, 64}, 0);
  EXPECT_TRUE(plan.preempted.empty());
  EXPECT_THAT(Rows(plan),
              ElementsAre(ElementsAre(kRun, 0, 1), ElementsAre(kRun, 1, 1)));
  // With one block free, all three drafts.
  plan = PlanAll(calls, running, waiting, {8, 64}, 1);
  EXPECT_THAT(Rows(plan),
              ElementsAre(ElementsAre(kRun, 0, 4), ElementsAre(kRun, 1, 1)));
}

TEST(StepPlannerRequestsTest, ALongPromptIsAdmittedInChunksBesideDecodes) {
  std::vector<Call> calls;
  std::vector<PendingRequest> running;
  for (int i = 0; i < 16; ++i) running.push_back(Decode(20, 6));
  std::vector<PendingRequest> waiting = {Waiting(2000), Waiting(3)};
  StepPlan plan = PlanAll(calls, running, waiting, {64, 64}, 1000);
  ASSERT_EQ(plan.pieces.size(), 17u);
  for (int i = 0; i < 16; ++i)
    EXPECT_EQ(plan.pieces[i].source, PieceSource::kRunningRequest);
  EXPECT_THAT(Rows(plan).back(), ElementsAre(kAdm, 0, 48));
  EXPECT_THAT(plan.admitted, ElementsAre(0));  // FCFS: the 3-token one waits

  // Next step: the prompt is running, 1952 tokens to go; the decodes first
  // again, every step.
  running.push_back(Prefill(1952, 48, 12));
  waiting.erase(waiting.begin());
  plan = PlanAll(calls, running, waiting, {64, 64}, 1000);
  for (int i = 0; i < 16; ++i)
    EXPECT_THAT(Rows(plan)[i], ElementsAre(kRun, i, 1));
  EXPECT_THAT(Rows(plan)[16], ElementsAre(kRun, 16, 48));
  EXPECT_TRUE(plan.admitted.empty());
}

TEST(StepPlannerRequestsTest, CallsTakeWhatTheDecodesLeave) {
  std::vector<Call> calls;
  calls.push_back(Forward({"a"}, {1}));
  calls.push_back(Forward({"b"}, {7}));  // does not fit: deferred
  std::vector<PendingRequest> running = {Decode(8, 2), Decode(8, 2),
                                         Decode(8, 2)};
  std::vector<PendingRequest> waiting = {Waiting(1)};
  const StepPlan plan = PlanAll(calls, running, waiting, {8, 8}, 1000);
  EXPECT_THAT(plan.forwards, ElementsAre(0));
  EXPECT_TRUE(plan.call_deferred);
  // No request is admitted ahead of a call that waits for room.
  EXPECT_TRUE(plan.admitted.empty());
  EXPECT_THAT(Rows(plan),
              ElementsAre(ElementsAre(kCallSrc, 0, 1), ElementsAre(kRun, 0, 1),
                          ElementsAre(kRun, 1, 1), ElementsAre(kRun, 2, 1)));
}

TEST(StepPlannerRequestsTest, TheOldestCallIsChunkedWhenDecodesSqueezeIt) {
  std::vector<Call> calls;
  calls.push_back(Forward({"a"}, {6}));  // whole: fits an empty step only
  std::vector<PendingRequest> running = {Decode(8, 2), Decode(8, 2),
                                         Decode(8, 2), Decode(8, 2)};
  std::vector<PendingRequest> waiting;
  const StepPlan plan = PlanAll(calls, running, waiting, {8, 8}, 1000);
  EXPECT_THAT(plan.forwards, ElementsAre(0));
  EXPECT_THAT(Rows(plan)[0], ElementsAre(kCallSrc, 0, 4));
  EXPECT_EQ(plan.num_tokens, 8);
}

TEST(StepPlannerRequestsTest, AGrowingRequestPreemptsTheMostRecent) {
  std::vector<Call> calls;
  // Both fill their last block: each decode needs a new one; none is free.
  std::vector<PendingRequest> running = {Decode(8, 2), Decode(8, 2),
                                         Decode(8, 2)};
  std::vector<PendingRequest> waiting = {Waiting(1)};
  const StepPlan plan = PlanAll(calls, running, waiting, {8, 64}, 0);
  // 0 takes 2's blocks (2 free then), 1 takes one of them.
  EXPECT_THAT(plan.preempted, ElementsAre(2));
  EXPECT_THAT(Rows(plan),
              ElementsAre(ElementsAre(kRun, 0, 1), ElementsAre(kRun, 1, 1)));
  EXPECT_TRUE(plan.admitted.empty());  // nothing admitted in a preempting step
}

TEST(StepPlannerRequestsTest, TheMostRecentPreemptsItself) {
  std::vector<Call> calls;
  std::vector<PendingRequest> running = {Decode(8, 2)};
  std::vector<PendingRequest> waiting;
  const StepPlan plan = PlanAll(calls, running, waiting, {8, 64}, 0);
  EXPECT_THAT(plan.preempted, ElementsAre(0));
  EXPECT_TRUE(plan.pieces.empty());
}

TEST(StepPlannerRequestsTest, ADecodeWithRoomInItsBlockNeedsNoNewBlock) {
  std::vector<Call> calls;
  std::vector<PendingRequest> running = {Decode(6, 2), Decode(7, 2)};
  std::vector<PendingRequest> waiting;
  const StepPlan plan = PlanAll(calls, running, waiting, {8, 64}, 0);
  EXPECT_TRUE(plan.preempted.empty());
  EXPECT_EQ(plan.pieces.size(), 2u);
}

TEST(StepPlannerRequestsTest, CallsKvComesFirstAndCanPreemptRequests) {
  // The call creates a sequence of 12 tokens: 3 blocks; 3 are free, and the
  // running request needs one more: it preempts itself.
  std::vector<Call> calls;
  calls.push_back(Forward({"a"}, {12}));
  std::vector<SequenceKvState> kv = {{0, 0}};
  calls[0].view.kv = kv;
  std::vector<PendingRequest> running = {Decode(8, 2)};
  std::vector<PendingRequest> waiting;
  StepPlan plan = PlanAll(calls, running, waiting, {8, 64}, 3);
  EXPECT_THAT(plan.forwards, ElementsAre(0));
  EXPECT_THAT(plan.preempted, ElementsAre(0));

  // 5 blocks for the call, 3 free, the request holds 2: it is preempted
  // for the call.
  calls[0].remaining = {20};
  plan = PlanAll(calls, running, waiting, {8, 64}, 3);
  EXPECT_THAT(plan.forwards, ElementsAre(0));
  EXPECT_THAT(plan.preempted, ElementsAre(0));

  // 6 blocks: even preempting cannot make room, so nothing is preempted
  // (the call will fail with RESOURCE_EXHAUSTED).
  calls[0].remaining = {24};
  plan = PlanAll(calls, running, waiting, {8, 64}, 3);
  EXPECT_THAT(plan.forwards, ElementsAre(0));
  EXPECT_TRUE(plan.preempted.empty());
}

TEST(StepPlannerRequestsTest, AdmissionIsInOrderAndStopsAtTheFirstMisfit) {
  std::vector<Call> calls;
  std::vector<PendingRequest> running;
  // 40 tokens = 10 blocks > 5 free: it waits, and the small one behind it
  // does not overtake.
  std::vector<PendingRequest> waiting = {Waiting(40), Waiting(4)};
  StepPlan plan = PlanAll(calls, running, waiting, {8, 64}, 5);
  EXPECT_TRUE(plan.pieces.empty());
  // A request whose last sample is still in flight cannot be recomputed
  // yet; it holds the queue for that step.
  waiting = {Waiting(4, /*admissible=*/false), Waiting(4)};
  plan = PlanAll(calls, running, waiting, {8, 64}, 5);
  EXPECT_TRUE(plan.pieces.empty());
  waiting = {Waiting(4), Waiting(4), Waiting(4)};
  plan = PlanAll(calls, running, waiting, {2, 64}, 5);  // 2 seats
  EXPECT_THAT(plan.admitted, ElementsAre(0, 1));
}

TEST(StepPlannerRequestsTest, RunningRequestsAreCappedAtMaxNumSeqs) {
  std::vector<Call> calls;
  // Two running with nothing to run this step (their samples in flight)
  // still hold their seats among the running.
  std::vector<PendingRequest> running = {Prefill(0, 8, 2), Prefill(0, 8, 2)};
  std::vector<PendingRequest> waiting = {Waiting(4), Waiting(4)};
  const StepPlan plan = PlanAll(calls, running, waiting, {3, 64}, 100);
  EXPECT_THAT(plan.admitted, ElementsAre(0));
}

TEST(StepPlannerRequestsTest, SeatsHeldForImportsCountAsRunning) {
  std::vector<Call> calls;
  std::vector<PendingRequest> running = {Decode(8, 2)};
  std::vector<PendingRequest> waiting = {Waiting(4), Waiting(4)};
  // max_num_seqs 3: one running, one seat held by a decode leg's import.
  StepPlan plan = PlanAll(calls, running, waiting, {3, 64}, 100, 1);
  EXPECT_THAT(plan.admitted, ElementsAre(0));
  plan = PlanAll(calls, running, waiting, {3, 64}, 100, 2);
  EXPECT_TRUE(plan.admitted.empty());
}

TEST(StepPlannerRequestsTest, APrefillChunkNeverPreemptsAScheduledDecode) {
  std::vector<Call> calls;
  // 0 prefills (admitted first), 1 decodes with room in its block; the
  // chunk needs blocks, and the only more recent request already runs in
  // this step: the chunk waits.
  std::vector<PendingRequest> running = {Prefill(16, 4, 1), Decode(6, 2)};
  std::vector<PendingRequest> waiting;
  const StepPlan plan = PlanAll(calls, running, waiting, {8, 64}, 0);
  EXPECT_TRUE(plan.preempted.empty());
  EXPECT_THAT(Rows(plan), ElementsAre(ElementsAre(kRun, 1, 1)));
}

}  // namespace
}  // namespace pdworker
