// ClassifyPullEnd: how a PullKv stream's end maps to the import's status
// and to the `reason` of pdworker_kv_transfer_failures_total, so an SRE can
// tell an expired lease from an unknown one, and a prefill worker that
// never answered from a transfer that broke half-way.
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <string>

#include "gtest/gtest.h"
#include "metrics/worker_metrics.h"
#include "proto/worker.pb.h"
#include "worker/transfer/grpc_kv_puller.h"

namespace pdworker {
namespace {

class PullOutcomeTest : public ::testing::Test {
 protected:
  PullOutcomeTest() {
    handle_.set_source_address("10.0.0.7:50051");
    handle_.set_lease_id("0123456789abcdef0123456789abcdef");
    params_.handle = &handle_;
    params_.call_deadline =
        std::chrono::system_clock::now() + std::chrono::hours(1);
    params_.pull_deadline = params_.call_deadline;
  }

  KvTransferOutcome Classify(const grpc::Status& finished, int64_t bytes,
                             absl::StatusCode* code = nullptr) {
    KvTransferOutcome outcome = KvTransferOutcome::kOk;
    const absl::Status status =
        ClassifyPullEnd(params_, finished, /*complete=*/false, bytes, &outcome);
    if (code != nullptr) *code = status.code();
    return outcome;
  }

  v1::KvHandle handle_;
  KvPullParams params_;
};

TEST_F(PullOutcomeTest, AnExpiredLeaseIsToldFromAnUnknownOne) {
  absl::StatusCode code;
  EXPECT_EQ(Classify(grpc::Status(grpc::StatusCode::NOT_FOUND,
                                  "KV lease 0123 expired"),
                     0, &code),
            KvTransferOutcome::kLeaseExpired);
  EXPECT_EQ(code, absl::StatusCode::kNotFound);
  EXPECT_EQ(Classify(grpc::Status(grpc::StatusCode::NOT_FOUND,
                                  "unknown KV lease '0123' (expired long "
                                  "ago, or never issued by this worker)"),
                     0),
            KvTransferOutcome::kLeaseNotFound);
  EXPECT_EQ(Classify(grpc::Status(grpc::StatusCode::NOT_FOUND,
                                  "KV lease 0123 was released (ReleaseKv) "
                                  "before it was pulled; its KV is gone"),
                     0),
            KvTransferOutcome::kLeaseNotFound);
}

TEST_F(PullOutcomeTest, NothingReceivedIsUnreachableSomethingIsATransport) {
  absl::StatusCode code;
  const grpc::Status refused(grpc::StatusCode::UNAVAILABLE,
                             "failed to connect to all addresses");
  EXPECT_EQ(Classify(refused, 0, &code), KvTransferOutcome::kSourceUnreachable);
  EXPECT_EQ(code, absl::StatusCode::kUnavailable);
  const grpc::Status reset(grpc::StatusCode::UNAVAILABLE, "Socket closed");
  EXPECT_EQ(Classify(reset, 65536, &code), KvTransferOutcome::kTransportError);
  EXPECT_EQ(code, absl::StatusCode::kUnavailable);
  // The pull timeout (not the caller's deadline) passed.
  const grpc::Status silent(grpc::StatusCode::DEADLINE_EXCEEDED,
                            "Deadline Exceeded");
  EXPECT_EQ(Classify(silent, 0), KvTransferOutcome::kSourceUnreachable);
  EXPECT_EQ(Classify(silent, 4096), KvTransferOutcome::kTransportError);
  // A source that failed on its side mid-stream.
  EXPECT_EQ(Classify(grpc::Status(grpc::StatusCode::ABORTED, "x"), 0),
            KvTransferOutcome::kTransportError);
}

TEST_F(PullOutcomeTest, TheCallersDeadlineIsItsOwnReason) {
  params_.call_deadline =
      std::chrono::system_clock::now() - std::chrono::seconds(1);
  absl::StatusCode code;
  EXPECT_EQ(Classify(grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, "x"), 0,
                     &code),
            KvTransferOutcome::kDeadline);
  EXPECT_EQ(code, absl::StatusCode::kDeadlineExceeded);
}

}  // namespace
}  // namespace pdworker
