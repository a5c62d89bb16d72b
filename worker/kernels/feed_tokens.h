// Feeding sampled tokens into the next step's input on the device:
// token_ids[dst_indices[i]] = sampled_token_ids[src_rows[i]].
//
// With host/device overlap, step N+1 is enqueued before step N's sampled
// tokens reach the host, so a decoding request's next input token is copied
// from step N's sample buffer on the device (vLLM's async scheduling does the
// same); the host only knows where each sample goes. Runs between steps,
// outside graphs: num_feeds is a host value that changes every step.
#ifndef PDWORKER_WORKER_KERNELS_FEED_TOKENS_H_
#define PDWORKER_WORKER_KERNELS_FEED_TOKENS_H_

#include "absl/status/status.h"
#include "worker/runtime/device_buffer.h"
#include "worker/runtime/stream.h"

namespace pdworker {
namespace kernels {

// Feed i (i < num_feeds) copies sample src_rows[i] to token_ids[
// dst_indices[i]]. A feed whose src_rows[i] is outside [0, num_sampled) or
// whose dst_indices[i] is outside [0, num_tokens) is skipped: the indices are
// device data the host does not read, so such an entry means a bug upstream,
// and it must never become an out-of-bounds access. Nothing but the fed
// entries of token_ids is written. One sample may feed several entries; two
// feeds to the same dst index are undefined (the CPU kernel keeps the last
// one, CUDA threads race and either may win), so the caller must not list a
// destination twice.
struct FeedSampledTokensParams {
  // int32 [>= num_sampled]: the previous step's samples.
  DeviceBuffer sampled_token_ids;
  DeviceBuffer src_rows;  // int32 [>= num_feeds]: which sample feeds entry i
  // int32 [>= num_tokens]: the next step's input ids, modified in place.
  DeviceBuffer token_ids;
  DeviceBuffer dst_indices;  // int32 [>= num_feeds]: where entry i lands
  int num_feeds = 0;         // host value; 0 launches nothing
  int num_sampled = 0;       // bound for src_rows[i]
  int num_tokens = 0;        // bound for dst_indices[i]
};

// FAILED_PRECONDITION while the stream is capturing (num_feeds would be
// frozen into the graph), and the capture is invalidated. INVALID_ARGUMENT
// naming the field for a negative count, a buffer smaller than its shape, or
// token_ids overlapping a buffer the op reads. The shapes are checked even
// when num_feeds is 0.
absl::Status LaunchFeedSampledTokens(Stream& stream,
                                     const FeedSampledTokensParams& p);

}  // namespace kernels
}  // namespace pdworker

#endif  // PDWORKER_WORKER_KERNELS_FEED_TOKENS_H_
