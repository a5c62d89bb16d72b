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
    out.push_back({p.call, p.sequence, p.num_tokens});
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
    EXPECT_EQ(plan.pieces[0].call, 0);
    EXPECT_EQ(plan.pieces[0].num_tokens, std::min(tokens, 64));
  }
}

}  // namespace
}  // namespace pdworker
