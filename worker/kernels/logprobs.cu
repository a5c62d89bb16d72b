// Raw logprobs on CUDA (see logprobs.h): the CPU kernels' results.
//
// The top-k ids are exactly the CPU's (max and comparisons are exact). The
// logsumexp is summed in double like the CPU's, in another order (per-thread
// strided partials combined by cub's fixed reduction tree; CUDA's double exp
// vs glibc's, both within 1 ulp), so the doubles differ by ~1e-16 relative
// and the fp32 results by at most one rounding step; the logprobs are then
// the same fp32 subtraction as on the CPU.
#include <algorithm>
#include <climits>
#include <cmath>
#include <cub/cub.cuh>

#include "worker/kernels/cuda_common.cuh"
#include "worker/kernels/logprobs_cuda.h"

namespace pdworker {
namespace kernels {
namespace {

constexpr int kTopThreads = 1024;
constexpr int kGatherThreads = 256;
// Entries per step are at most one per request; the cap only bounds the grid
// for absurd counts (the loop strides over the rest).
constexpr unsigned int kMaxGatherBlocks = 1024;
constexpr float kNegInf = -INFINITY;

// NaN logits count as -inf (never chosen before a real logit, no mass).
__device__ __forceinline__ float Logit(float v) {
  return isnan(v) ? kNegInf : v;
}

// logprobs.cc's Logprob: the same fp32 subtraction.
__device__ __forceinline__ float Logprob(float logit, float logsumexp) {
  return logsumexp == kNegInf ? kNegInf : logit - logsumexp;
}

// A candidate in the (logit descending, id ascending) order: a strict total
// order over distinct ids.
struct Candidate {
  float value;
  int id;
};

__device__ __forceinline__ bool Before(const Candidate& a, const Candidate& b) {
  return a.value > b.value || (a.value == b.value && a.id < b.id);
}

struct FirstOp {
  __device__ __forceinline__ Candidate operator()(const Candidate& a,
                                                  const Candidate& b) const {
    return Before(b, a) ? b : a;
  }
};

using BlockFirst = cub::BlockReduce<Candidate, kTopThreads>;
using BlockSumDouble = cub::BlockReduce<double, kTopThreads>;

struct TopShared {
  union {
    typename BlockFirst::TempStorage first;
    typename BlockSumDouble::TempStorage sum;
  } temp;
  Candidate pick;
  float logsumexp;
};

// grid: [num_rows], block: kTopThreads; block i handles entry i. Pass 0 is a
// block-wide argmax over the row (the max, and the top-1); then the
// logsumexp; then pass j = 1..k-1 takes the first id after pass j-1's pick
// in the candidate order, which skips exactly the ids already chosen (only
// the last pick needs to be kept, in shared memory).
__global__ void __launch_bounds__(kTopThreads)
    TopLogprobsKernel(TopLogprobsCudaParams p) {
  __shared__ TopShared s;
  const int i = blockIdx.x;
  const int k = p.k;
  const int vocab = p.vocab_size;
  const int32_t r = p.rows[i];
  float* logsumexp_out = p.logsumexp + i;
  int32_t* ids_out = p.top_token_ids + static_cast<int64_t>(i) * k;
  float* logprobs_out = p.top_logprobs + static_cast<int64_t>(i) * k;
  if (r < 0 || r >= p.num_logit_rows) {  // a corrupt entry: read nothing
    // The same r in every thread: the whole block returns here.
    if (threadIdx.x == 0) *logsumexp_out = kNegInf;
    for (int j = threadIdx.x; j < k; j += blockDim.x) {
      ids_out[j] = -1;
      logprobs_out[j] = kNegInf;
    }
    return;
  }
  const float* row = p.logits + static_cast<int64_t>(r) * vocab;

  // Pass 0: the first candidate of the whole row.
  Candidate local{kNegInf, INT_MAX};
  for (int v = threadIdx.x; v < vocab; v += kTopThreads) {
    const Candidate c{Logit(row[v]), v};
    if (Before(c, local)) local = c;
  }
  Candidate best = BlockFirst(s.temp.first).Reduce(local, FirstOp());
  if (threadIdx.x == 0) s.pick = best;
  __syncthreads();
  Candidate pick = s.pick;
  const float max = pick.value;

  // logsumexp = max + log(sum_v exp(logit - max)), in double, rounded once.
  if (isinf(max)) {  // all -inf: -inf; a +inf logit: +inf
    if (threadIdx.x == 0) s.logsumexp = max;
  } else {
    double sum = 0.0;
    for (int v = threadIdx.x; v < vocab; v += kTopThreads) {
      sum += exp(static_cast<double>(Logit(row[v])) - max);
    }
    sum = BlockSumDouble(s.temp.sum).Sum(sum);
    if (threadIdx.x == 0) {
      s.logsumexp = static_cast<float>(static_cast<double>(max) + log(sum));
    }
  }
  __syncthreads();
  const float logsumexp = s.logsumexp;
  if (threadIdx.x == 0) {
    *logsumexp_out = logsumexp;
    if (k > 0) {
      ids_out[0] = pick.id;
      logprobs_out[0] = Logprob(pick.value, logsumexp);
    }
  }

  // Passes 1..k-1: the first candidate after the previous pick.
  for (int j = 1; j < k; ++j) {
    local = {kNegInf, INT_MAX};
    for (int v = threadIdx.x; v < vocab; v += kTopThreads) {
      const Candidate c{Logit(row[v]), v};
      if (Before(pick, c) && Before(c, local)) local = c;
    }
    __syncthreads();  // everyone has read s.pick; temp storage is free
    best = BlockFirst(s.temp.first).Reduce(local, FirstOp());
    if (threadIdx.x == 0) {
      s.pick = best;
      ids_out[j] = best.id;
      logprobs_out[j] = Logprob(best.value, logsumexp);
    }
    __syncthreads();
    pick = s.pick;
  }
}

// grid: [min(ceil(num_rows / kGatherThreads), kMaxGatherBlocks)], block:
// kGatherThreads; one thread per entry, grid-stride.
__global__ void GatherLogprobsKernel(GatherLogprobsCudaParams p) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < p.num_rows; i += stride) {
    const int32_t r = p.rows[i];
    float logprob = kNegInf;  // a corrupt row or token id: read nothing
    if (r >= 0 && r < p.num_logit_rows) {
      const int32_t token = p.token_ids[r];
      if (token >= 0 && token < p.vocab_size) {
        logprob = Logprob(
            Logit(p.logits[static_cast<int64_t>(r) * p.vocab_size + token]),
            p.logsumexp[i]);
      }
    }
    p.logprobs[i] = logprob;
  }
}

}  // namespace

cudaError_t LaunchTopLogprobsCuda(const TopLogprobsCudaParams& p,
                                  cudaStream_t stream) {
  if (p.num_rows <= 0) return cudaSuccess;
  TopLogprobsKernel<<<p.num_rows, kTopThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t LaunchGatherLogprobsCuda(const GatherLogprobsCudaParams& p,
                                     cudaStream_t stream) {
  if (p.num_rows <= 0) return cudaSuccess;
  const unsigned int grid =
      std::min(cuda::NumBlocks(p.num_rows, kGatherThreads), kMaxGatherBlocks);
  GatherLogprobsKernel<<<grid, kGatherThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace kernels
}  // namespace pdworker
