// Token sampling on CUDA: the CPU kernel's decisions (worker/kernels/
// sampling.cc) computed on the GPU: rows with top-k / top-p by one
// 1024-thread block each after a sort, the others over 64 blocks each.
//
// Same math, in the same precision: weights exp((logit - max) / T) in
// double, the counter-based uniform u = SamplingUniform(seed, position)
// bit for bit, candidates ordered most likely first with ties to the lower
// id (a stable descending radix sort of ids in ascending order), top-k, then
// the shortest top-p prefix, then the inverse CDF. The one difference is the
// summation order of the double sums (per-thread chunks and slices combined
// in fixed orders instead of one sequential loop) and CUDA's double exp vs
// glibc's (both within 1 ulp): the two backends pick different tokens only
// when u·total falls within ~1e-15 (relative) of a CDF boundary.
#include <algorithm>
#include <climits>
#include <cmath>
#include <cub/cub.cuh>

#include "worker/kernels/cuda_common.cuh"
#include "worker/kernels/sampling_cuda.h"
#include "worker/kernels/sampling_logit.cuh"

namespace pdworker {
namespace kernels {
namespace {

constexpr int kThreads = 1024;
constexpr int kPrepareThreads = 256;
constexpr size_t kAlign = 256;
constexpr uint64_t kGolden = 0x9e3779b97f4a7c15ULL;
constexpr float kNegInf = -INFINITY;

size_t Aligned(size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

// Rows without top-k / top-p are sampled in kRowSlices slices of their
// vocabulary (one block each), see SliceMaxKernel.
constexpr int kRowSlices = 64;
// Written without a GPU (2026-11-27): false puts those rows back on
// SampleKernel's one block per row, should the GPU suite disagree.
constexpr bool kSliceUntruncatedRows = true;
constexpr int kSliceThreads = 256;
// A slice's sums of exp((logit - row max) / T) and of exp(logit - row max)
// (the raw logprob's denominator), in double.
struct SliceSums {
  double weights;
  double raw;
};
constexpr size_t kSliceMaxBytes = 8;  // sizeof(ArgMax), asserted below

// The workspace, carved in this order (each part 256-byte aligned).
struct Workspace {
  float* keys_in;      // [kCudaSamplingSortRows, vocab]
  float* keys_out;     // [kCudaSamplingSortRows, vocab], sorted descending
  int32_t* ids_in;     // [kCudaSamplingSortRows, vocab]
  int32_t* ids_out;    // [kCudaSamplingSortRows, vocab], ids of keys_out
  int32_t* seg_begin;  // [kCudaSamplingSortRows]
  int32_t* seg_end;    // [kCudaSamplingSortRows]
  // [1 + num_reqs]: how many rows use top-k / top-p, then those rows in
  // ascending order.
  int32_t* truncated;
  void* sort_temp;  // cub scratch
  size_t sort_temp_bytes;
  // [num_reqs, kRowSlices] ArgMax, then [num_reqs, kRowSlices] SliceSums:
  // the sliced rows' partial results.
  void* row_slices;
};

size_t RowSliceBytes(int num_reqs) {
  return static_cast<size_t>(num_reqs) * kRowSlices *
         (kSliceMaxBytes + sizeof(SliceSums));
}

size_t SortBytes(int vocab_size) {
  const size_t items = static_cast<size_t>(kCudaSamplingSortRows) * vocab_size;
  return 2 * Aligned(items * sizeof(float)) +
         2 * Aligned(items * sizeof(int32_t)) +
         2 * Aligned(kCudaSamplingSortRows * sizeof(int32_t));
}

size_t ListBytes(int max_num_reqs) {
  return Aligned((1 + static_cast<size_t>(max_num_reqs)) * sizeof(int32_t));
}

Workspace Carve(void* base, int vocab_size, int num_reqs,
                size_t sort_temp_bytes) {
  const size_t items = static_cast<size_t>(kCudaSamplingSortRows) * vocab_size;
  char* at = static_cast<char*>(base);
  Workspace w;
  w.keys_in = reinterpret_cast<float*>(at);
  at += Aligned(items * sizeof(float));
  w.keys_out = reinterpret_cast<float*>(at);
  at += Aligned(items * sizeof(float));
  w.ids_in = reinterpret_cast<int32_t*>(at);
  at += Aligned(items * sizeof(int32_t));
  w.ids_out = reinterpret_cast<int32_t*>(at);
  at += Aligned(items * sizeof(int32_t));
  w.seg_begin = reinterpret_cast<int32_t*>(at);
  at += Aligned(kCudaSamplingSortRows * sizeof(int32_t));
  w.seg_end = reinterpret_cast<int32_t*>(at);
  at += Aligned(kCudaSamplingSortRows * sizeof(int32_t));
  w.truncated = reinterpret_cast<int32_t*>(at);
  at += ListBytes(num_reqs);
  w.sort_temp = at;
  w.sort_temp_bytes = sort_temp_bytes;
  at += Aligned(sort_temp_bytes);
  w.row_slices = at;
  return w;
}

// One segmented sort call over all kCudaSamplingSortRows segments (unused
// ones empty), so its scratch size is the one queried up front.
cudaError_t SortRows(const Workspace& w, int vocab_size, size_t* temp_bytes,
                     cudaStream_t stream) {
  return cub::DeviceSegmentedRadixSort::SortPairsDescending(
      w.sort_temp, *temp_bytes, w.keys_in, w.keys_out, w.ids_in, w.ids_out,
      kCudaSamplingSortRows * vocab_size, kCudaSamplingSortRows, w.seg_begin,
      w.seg_end, 0, static_cast<int>(sizeof(float) * 8), stream);
}

cudaError_t SortTempBytes(int vocab_size, size_t* bytes) {
  const Workspace w{};  // null scratch: cub only reports the size it needs
  *bytes = 0;
  return SortRows(w, vocab_size, bytes, nullptr);
}

// --- Shared with the CPU kernel, bit for bit. ------------------------------

__device__ __forceinline__ uint64_t Mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// SamplingUniform(seed, position) of sampling.cc.
__device__ __forceinline__ double Uniform(uint64_t seed, int32_t position) {
  const uint64_t stream = Mix64(seed + kGolden);
  const uint64_t counter =
      static_cast<uint64_t>(static_cast<uint32_t>(position));
  const uint64_t bits = Mix64(stream + (counter + 1) * kGolden);
  return static_cast<double>(bits >> 11) * 0x1.0p-53;
}

using cuda::Logit;

__device__ __forceinline__ bool UsesTopK(int32_t top_k, int vocab) {
  return top_k > 0 && top_k < vocab;
}
__device__ __forceinline__ bool UsesTopP(float top_p) {
  return !isnan(top_p) && top_p < 1.0f;
}

__device__ __forceinline__ bool Truncates(const SamplingCudaParams& p, int r) {
  return UsesTopK(p.top_k[r], p.vocab_size) || UsesTopP(p.top_p[r]);
}

// --- Which rows truncate (top-k / top-p). ------------------------------------

using BlockScanInt = cub::BlockScan<int, 1024>;

// grid: [1], block: 1024. Writes the number of rows that use top-k or top-p
// into truncated[0] and those rows, ascending, into truncated[1..].
__global__ void ListTruncatedRowsKernel(SamplingCudaParams p,
                                        int32_t* truncated) {
  __shared__ typename BlockScanInt::TempStorage temp;
  __shared__ int found;
  if (threadIdx.x == 0) found = 0;
  __syncthreads();
  for (int r0 = 0; r0 < p.num_reqs; r0 += blockDim.x) {
    const int r = r0 + threadIdx.x;
    const int flag = r < p.num_reqs && Truncates(p, r) ? 1 : 0;
    int offset = 0, total = 0;
    BlockScanInt(temp).ExclusiveSum(flag, offset, total);
    if (flag) truncated[1 + found + offset] = r;
    __syncthreads();  // everyone has read `found` and is done with `temp`
    if (threadIdx.x == 0) found += total;
    __syncthreads();
  }
  if (threadIdx.x == 0) truncated[0] = found;
}

// --- Prepare: sort keys for one group of truncating rows. --------------------

// grid: [kCudaSamplingSortRows]. Slot b of the group (request
// rows[slot_base + b], for b < count) gets the segment [b·vocab,
// (b+1)·vocab); unused slots get empty segments. Keys are the logits with
// NaN -> -inf and -0 -> +0, so the radix order equals the CPU comparator's
// (which treats -0 == +0); ids ascend, and the sort is stable, so ties keep
// the lower id first.
__global__ void PrepareSortKernel(SamplingCudaParams p, Workspace w,
                                  const int32_t* rows, int slot_base,
                                  int count) {
  const int b = blockIdx.x;
  const int vocab = p.vocab_size;
  const int64_t begin = static_cast<int64_t>(b) * vocab;
  const bool used = b < count;
  if (threadIdx.x == 0) {
    w.seg_begin[b] = static_cast<int32_t>(begin);
    w.seg_end[b] = static_cast<int32_t>(used ? begin + vocab : begin);
  }
  if (!used) return;
  const int r = rows[slot_base + b];
  const float* row = p.logits + static_cast<int64_t>(r) * vocab;
  for (int v = threadIdx.x; v < vocab; v += blockDim.x) {
    const float l = Logit(row[v]);
    w.keys_in[begin + v] = l == 0.0f ? 0.0f : l;
    w.ids_in[begin + v] = v;
  }
}

// --- Block-level building blocks (kThreads threads). ------------------------

struct ArgMax {
  float value;
  int index;
};

struct ArgMaxOp {
  __device__ __forceinline__ ArgMax operator()(const ArgMax& a,
                                               const ArgMax& b) const {
    if (a.value > b.value) return a;
    if (b.value > a.value) return b;
    return a.index <= b.index ? a : b;  // ties: the lower id
  }
};

struct MinOp {
  __device__ __forceinline__ int operator()(int a, int b) const {
    return a < b ? a : b;
  }
};
struct MaxOp {
  __device__ __forceinline__ int operator()(int a, int b) const {
    return a > b ? a : b;
  }
};

using BlockArgMax = cub::BlockReduce<ArgMax, kThreads>;
using BlockScanDouble = cub::BlockScan<double, kThreads>;
using BlockReduceInt = cub::BlockReduce<int, kThreads>;

struct SharedState {
  union {
    typename BlockArgMax::TempStorage argmax;
    typename BlockScanDouble::TempStorage scan;
    typename BlockReduceInt::TempStorage reduce_int;
  } temp;
  ArgMax argmax_result;
  int int_result;
  double double_result;
};

// This thread's contiguous chunk of [0, count) and the sums around it.
struct Chunk {
  int begin;
  int end;
  double prefix;  // sum of all earlier chunks
  double total;   // sum of everything (every thread)
};

// Contiguous chunks (thread t: [t·c, (t+1)·c)), summed sequentially in
// double, combined by an exclusive block scan: a fixed order, so the
// result is deterministic.
template <typename WeightAt>
__device__ Chunk ScanChunks(SharedState& s, int count, WeightAt weight_at) {
  const int per_thread = (count + kThreads - 1) / kThreads;
  Chunk c;
  c.begin = min(count, static_cast<int>(threadIdx.x) * per_thread);
  c.end = min(count, c.begin + per_thread);
  double sum = 0.0;
  for (int m = c.begin; m < c.end; ++m) sum += weight_at(m);
  __syncthreads();  // temp storage may still be in use by a previous call
  BlockScanDouble(s.temp.scan).ExclusiveSum(sum, c.prefix, c.total);
  __syncthreads();
  return c;
}

// The first m (in chunk order, i.e. in [0, count) order) whose inclusive
// running sum satisfies `crosses`, a predicate monotone in the sum; -1 when
// none does. *sum_at gets the running sum at m.
template <typename WeightAt, typename Crosses>
__device__ int FindFirstCrossing(SharedState& s, const Chunk& c,
                                 WeightAt weight_at, Crosses crosses,
                                 double* sum_at) {
  int found = INT_MAX;
  double running = c.prefix;
  for (int m = c.begin; m < c.end; ++m) {
    running += weight_at(m);
    if (crosses(running)) {
      found = m;
      break;
    }
  }
  const int first = BlockReduceInt(s.temp.reduce_int).Reduce(found, MinOp());
  if (threadIdx.x == 0) s.int_result = first;
  __syncthreads();
  const int result = s.int_result;
  if (result != INT_MAX && found == result) s.double_result = running;
  __syncthreads();
  *sum_at = s.double_result;
  __syncthreads();
  return result == INT_MAX ? -1 : result;
}

// The last m with a positive weight, or 0 (the CPU InverseCdf's fallback
// when rounding leaves the target above the summed mass).
template <typename WeightAt>
__device__ int LastPositive(SharedState& s, const Chunk& c,
                            WeightAt weight_at) {
  int last = -1;
  for (int m = c.begin; m < c.end; ++m) {
    if (weight_at(m) > 0.0) last = m;
  }
  const int result = BlockReduceInt(s.temp.reduce_int).Reduce(last, MaxOp());
  if (threadIdx.x == 0) s.int_result = result;
  __syncthreads();
  const int out = s.int_result;
  __syncthreads();
  return out < 0 ? 0 : out;
}

// Inverse CDF over [0, count): the first m whose running weight exceeds
// `target` (zero weights never cross), else the last positive one.
template <typename WeightAt>
__device__ int InverseCdf(SharedState& s, const Chunk& c, WeightAt weight_at,
                          double target) {
  double unused;
  const int m = FindFirstCrossing(
      s, c, weight_at, [target](double sum) { return sum > target; }, &unused);
  return m >= 0 ? m : LastPositive(s, c, weight_at);
}

// --- Sampling: one block per request of the group. --------------------------

// Two passes: with rows == nullptr, block b samples request b unless it
// truncates (those return at once); otherwise block b samples request
// rows[slot_base + b] from the sorted slot b of the workspace.
__global__ void __launch_bounds__(kThreads)
    SampleKernel(SamplingCudaParams p, Workspace w, const int32_t* rows,
                 int slot_base) {
  __shared__ SharedState s;
  const int b = blockIdx.x;
  const bool sorted_pass = rows != nullptr;
  const int r = sorted_pass ? rows[slot_base + b] : b;
  if (!sorted_pass && Truncates(p, r)) return;
  const int vocab = p.vocab_size;
  const float* row = p.logits + static_cast<int64_t>(r) * vocab;

  const float temperature = p.temperature[r];
  const bool greedy = !(temperature >= p.greedy_temperature);  // NaN: greedy
  const double inv_temperature = greedy ? 1.0 : 1.0 / temperature;
  const int32_t top_k = p.top_k[r];
  const bool use_top_k = UsesTopK(top_k, vocab);
  const bool use_top_p = UsesTopP(p.top_p[r]);
  const double u = Uniform(p.seeds[r], p.positions[r]);

  // Max and argmax (ties to the lowest id).
  ArgMax local{kNegInf, INT_MAX};
  for (int v = threadIdx.x; v < vocab; v += kThreads) {
    const float l = Logit(row[v]);
    if (l > local.value) local = {l, v};  // strided ascending: lowest id
  }
  const ArgMax best = BlockArgMax(s.temp.argmax).Reduce(local, ArgMaxOp());
  if (threadIdx.x == 0) s.argmax_result = best;
  __syncthreads();
  const float max_logit = s.argmax_result.value;
  const int argmax = s.argmax_result.index;

  int32_t token = 0;
  float logprob = kNegInf;
  if (max_logit != kNegInf) {  // else: nothing has mass, token 0, logprob -inf
    auto weight_by_id = [row, max_logit, inv_temperature](int v) {
      return exp((static_cast<double>(Logit(row[v])) - max_logit) *
                 inv_temperature);
    };
    if (!use_top_k && !use_top_p) {
      // Whole vocabulary in id order.
      const Chunk c = ScanChunks(s, vocab, weight_by_id);
      const int chosen =
          greedy ? argmax : InverseCdf(s, c, weight_by_id, u * c.total);
      token = chosen;
      logprob = static_cast<float>(log(weight_by_id(chosen) / c.total));
    } else {
      // Candidates most likely first (sorted by PrepareSortKernel + cub).
      const float* keys = w.keys_out + static_cast<int64_t>(b) * vocab;
      const int32_t* ids = w.ids_out + static_cast<int64_t>(b) * vocab;
      auto weight_sorted = [keys, max_logit, inv_temperature](int m) {
        return exp((static_cast<double>(keys[m]) - max_logit) *
                   inv_temperature);
      };
      const int count = use_top_k ? top_k : vocab;
      // Top-p's base: the mass of all candidates (top-k's, or the whole
      // vocabulary summed in id order as the CPU kernel does).
      const Chunk candidates = ScanChunks(s, count, weight_sorted);
      const double candidate_total =
          use_top_k ? candidates.total
                    : ScanChunks(s, vocab, weight_by_id).total;
      int kept = count;
      double kept_total = use_top_k ? candidate_total : candidates.total;
      if (use_top_p) {
        // The shortest prefix whose mass reaches top_p of the candidates'
        // (at least one token).
        const double threshold =
            static_cast<double>(p.top_p[r]) * candidate_total;
        double mass = 0.0;
        const int last = FindFirstCrossing(
            s, candidates, weight_sorted,
            [threshold](double sum) { return sum >= threshold; }, &mass);
        if (last >= 0) {
          kept = last + 1;
          kept_total = mass;
        } else {
          kept_total = candidates.total;
        }
      }
      int chosen = 0;
      if (!greedy) {
        const Chunk kept_chunk = ScanChunks(s, kept, weight_sorted);
        chosen = InverseCdf(s, kept_chunk, weight_sorted, u * kept_total);
      }
      token = ids[chosen];
      logprob = static_cast<float>(log(weight_sorted(chosen) / kept_total));
    }
    if (p.raw_logprobs) {
      // log_softmax(logits)[token] over the whole vocabulary.
      auto raw_weight = [row, max_logit](int v) {
        return exp(static_cast<double>(Logit(row[v])) - max_logit);
      };
      const Chunk c = ScanChunks(s, vocab, raw_weight);
      logprob = static_cast<float>(static_cast<double>(Logit(row[token])) -
                                   max_logit - log(c.total));
    }
  }
  if (threadIdx.x == 0) {
    p.sampled_token_ids[r] = token;
    p.sampled_logprobs[r] = logprob;
  }
}

// --- Rows without top-k / top-p: kRowSlices blocks per row. ---------------
//
// SampleKernel gives such a row one 1024-thread block: its max pass and two
// passes of double-precision exps over the whole vocabulary run on one SM
// while the rest of the GPU idles. Here three kernels spread a row over
// kRowSlices blocks; the decisions are SampleKernel's:
//   1. SliceMaxKernel: each slice's max and argmax (ties to the lowest id);
//   2. SliceSumKernel: the row's max (the slices folded in order), then each
//      slice's sums of exp((logit - max) / T) and exp(logit - max), double;
//   3. SliceSampleKernel (one block per row): the total (slice sums added in
//      slice order), the slice where the running mass first exceeds u·total,
//      and the inverse CDF inside that slice (ScanChunks / InverseCdf over
//      its ids, from the slice's prefix). Greedy rows take the argmax.
// The totals are summed in a different order than the CPU's loop, so the
// two backends may differ only where u·total lies within ~1e-15 (relative)
// of a CDF boundary, as with SampleKernel. Kernels 2 and 3 are launched
// with programmatic serialization and wait for their predecessor first.

// Slice `slice` of a row: ids [begin, end).
__device__ __forceinline__ void RowSlice(int vocab, int slice, int* begin,
                                         int* end) {
  const int span = (vocab + kRowSlices - 1) / kRowSlices;
  *begin = min(vocab, slice * span);
  *end = min(vocab, *begin + span);
}

static_assert(sizeof(ArgMax) == kSliceMaxBytes, "ArgMax is (float, int)");

__device__ __forceinline__ ArgMax* SliceMaxes(const Workspace& w, int r) {
  return static_cast<ArgMax*>(w.row_slices) + r * kRowSlices;
}
__device__ __forceinline__ SliceSums* SliceSumsOf(const Workspace& w,
                                                  int num_reqs, int r) {
  return reinterpret_cast<SliceSums*>(static_cast<char*>(w.row_slices) +
                                      static_cast<size_t>(num_reqs) *
                                          kRowSlices * kSliceMaxBytes) +
         r * kRowSlices;
}

// The row's max and argmax: its slices folded in slice order.
__device__ __forceinline__ ArgMax RowMax(const ArgMax* slices) {
  ArgMax best = slices[0];
  for (int i = 1; i < kRowSlices; ++i) best = ArgMaxOp()(best, slices[i]);
  return best;
}

using SliceArgMax = cub::BlockReduce<ArgMax, kSliceThreads>;
using SliceSum = cub::BlockReduce<double, kSliceThreads>;

// grid: [kRowSlices, num_reqs], block: kSliceThreads.
__global__ void __launch_bounds__(kSliceThreads)
    SliceMaxKernel(SamplingCudaParams p, Workspace w) {
  cuda::AllowDependentLaunch();
  __shared__ typename SliceArgMax::TempStorage temp;
  const int r = blockIdx.y;
  if (Truncates(p, r)) return;  // the sorted path samples it
  const float* row = p.logits + static_cast<int64_t>(r) * p.vocab_size;
  int begin, end;
  RowSlice(p.vocab_size, blockIdx.x, &begin, &end);
  ArgMax local{kNegInf, INT_MAX};
  for (int v = begin + threadIdx.x; v < end; v += kSliceThreads) {
    const float l = Logit(row[v]);
    if (l > local.value) local = {l, v};  // strided ascending: lowest id
  }
  const ArgMax best = SliceArgMax(temp).Reduce(local, ArgMaxOp());
  if (threadIdx.x == 0) SliceMaxes(w, r)[blockIdx.x] = best;
}

// grid: [kRowSlices, num_reqs], block: kSliceThreads.
__global__ void __launch_bounds__(kSliceThreads)
    SliceSumKernel(SamplingCudaParams p, Workspace w) {
  cuda::WaitForPreviousKernel();
  cuda::AllowDependentLaunch();
  __shared__ typename SliceSum::TempStorage temp;
  __shared__ float max_shared;
  const int r = blockIdx.y;
  if (Truncates(p, r)) return;
  if (threadIdx.x == 0) max_shared = RowMax(SliceMaxes(w, r)).value;
  __syncthreads();
  const float max_logit = max_shared;
  SliceSums sums{0.0, 0.0};
  if (max_logit != kNegInf) {
    const float temperature = p.temperature[r];
    const bool greedy = !(temperature >= p.greedy_temperature);
    const double inv_temperature = greedy ? 1.0 : 1.0 / temperature;
    const float* row = p.logits + static_cast<int64_t>(r) * p.vocab_size;
    int begin, end;
    RowSlice(p.vocab_size, blockIdx.x, &begin, &end);
    double weights = 0.0, raw = 0.0;
    for (int v = begin + threadIdx.x; v < end; v += kSliceThreads) {
      const double d = static_cast<double>(Logit(row[v])) - max_logit;
      const double weight = exp(d * inv_temperature);
      weights += weight;
      if (p.raw_logprobs) raw += inv_temperature == 1.0 ? weight : exp(d);
    }
    sums.weights = SliceSum(temp).Sum(weights);
    __syncthreads();  // temp is reused
    if (p.raw_logprobs) sums.raw = SliceSum(temp).Sum(raw);
  }
  if (threadIdx.x == 0) SliceSumsOf(w, p.num_reqs, r)[blockIdx.x] = sums;
}

// grid: [num_reqs], block: kThreads.
__global__ void __launch_bounds__(kThreads, 1)
    SliceSampleKernel(SamplingCudaParams p, Workspace w) {
  cuda::WaitForPreviousKernel();
  __shared__ SharedState s;
  __shared__ double totals[2];  // weights, raw
  __shared__ double prefix_shared;
  __shared__ int slice_shared;
  const int r = blockIdx.x;
  if (Truncates(p, r)) return;
  const int vocab = p.vocab_size;
  const float* row = p.logits + static_cast<int64_t>(r) * vocab;
  const float temperature = p.temperature[r];
  const bool greedy = !(temperature >= p.greedy_temperature);  // NaN: greedy
  const double inv_temperature = greedy ? 1.0 : 1.0 / temperature;
  const double u = Uniform(p.seeds[r], p.positions[r]);
  const SliceSums* sums = SliceSumsOf(w, p.num_reqs, r);
  if (threadIdx.x == 0) {
    s.argmax_result = RowMax(SliceMaxes(w, r));
    double total = 0.0, raw_total = 0.0;
    for (int i = 0; i < kRowSlices; ++i) {
      total += sums[i].weights;
      raw_total += sums[i].raw;
    }
    totals[0] = total;
    totals[1] = raw_total;
    // The first slice whose running mass exceeds the target; if rounding
    // leaves none, the last slice with mass (its last positive weight is
    // InverseCdf's fallback too).
    const double target = u * total;
    double prefix = 0.0;
    int slice = -1, last = 0;
    double last_prefix = 0.0;
    for (int i = 0; i < kRowSlices; ++i) {
      if (sums[i].weights > 0.0) {
        last = i;
        last_prefix = prefix;
      }
      if (prefix + sums[i].weights > target) {
        slice = i;
        break;
      }
      prefix += sums[i].weights;
    }
    slice_shared = slice >= 0 ? slice : last;
    prefix_shared = slice >= 0 ? prefix : last_prefix;
  }
  __syncthreads();
  const float max_logit = s.argmax_result.value;
  int32_t token = 0;
  float logprob = kNegInf;
  if (max_logit != kNegInf) {  // else: nothing has mass, token 0, logprob -inf
    auto weight_by_id = [row, max_logit, inv_temperature](int v) {
      return exp((static_cast<double>(Logit(row[v])) - max_logit) *
                 inv_temperature);
    };
    const double total = totals[0];
    int chosen = s.argmax_result.index;
    if (!greedy) {
      int begin, end;
      RowSlice(vocab, slice_shared, &begin, &end);
      auto weight_in_slice = [weight_by_id, begin](int m) {
        return weight_by_id(begin + m);
      };
      const Chunk c = ScanChunks(s, end - begin, weight_in_slice);
      chosen =
          begin + InverseCdf(s, c, weight_in_slice, u * total - prefix_shared);
    }
    token = chosen;
    logprob = p.raw_logprobs
                  ? static_cast<float>(static_cast<double>(Logit(row[token])) -
                                       max_logit - log(totals[1]))
                  : static_cast<float>(log(weight_by_id(chosen) / total));
  }
  if (threadIdx.x == 0) {
    p.sampled_token_ids[r] = token;
    p.sampled_logprobs[r] = logprob;
  }
}

// The three kernels above for every row that does not truncate.
cudaError_t LaunchSlicedRows(const SamplingCudaParams& p, const Workspace& w,
                             cudaStream_t stream) {
  SliceMaxKernel<<<dim3(kRowSlices, p.num_reqs), kSliceThreads, 0, stream>>>(p,
                                                                             w);
  cudaError_t error = cudaGetLastError();
  if (error != cudaSuccess) return error;
  constexpr auto kPdl = cuda::DependentLaunch::kProgrammatic;
  error = cuda::LaunchKernel(SliceSumKernel, dim3(kRowSlices, p.num_reqs),
                             dim3(kSliceThreads), 0, stream, kPdl, p, w);
  if (error != cudaSuccess) return error;
  return cuda::LaunchKernel(SliceSampleKernel, dim3(p.num_reqs), dim3(kThreads),
                            0, stream, kPdl, p, w);
}

}  // namespace

cudaError_t SamplingCudaWorkspaceBytes(int vocab_size, int max_num_reqs,
                                       size_t* bytes) {
  size_t temp_bytes = 0;
  const cudaError_t error = SortTempBytes(vocab_size, &temp_bytes);
  if (error != cudaSuccess) return error;
  // The greedy path's slices reuse the start of the same scratch.
  *bytes = std::max(SortBytes(vocab_size) + ListBytes(max_num_reqs) +
                        Aligned(temp_bytes) + RowSliceBytes(max_num_reqs),
                    GreedySamplingCudaWorkspaceBytes(max_num_reqs));
  return cudaSuccess;
}

cudaError_t LaunchSamplingCuda(const SamplingCudaParams& p,
                               cudaStream_t stream) {
  size_t temp_bytes = 0;
  cudaError_t error = SortTempBytes(p.vocab_size, &temp_bytes);
  if (error != cudaSuccess) return error;
  const Workspace w = Carve(p.workspace, p.vocab_size, p.num_reqs, temp_bytes);

  // Which rows need the sorted path. The host needs their count to size the
  // sort passes: the caller's (the runner counts them from the options it
  // holds), or read back, which synchronizes the stream: the host then waits
  // for the whole forward before it can enqueue the next step.
  ListTruncatedRowsKernel<<<1, 1024, 0, stream>>>(p, w.truncated);
  error = cudaGetLastError();
  if (error != cudaSuccess) return error;
  int32_t num_truncated = p.num_truncated_rows;
  if (num_truncated < 0) {
    error = cudaMemcpyAsync(&num_truncated, w.truncated, sizeof(int32_t),
                            cudaMemcpyDeviceToHost, stream);
    if (error != cudaSuccess) return error;
    error = cudaStreamSynchronize(stream);
    if (error != cudaSuccess) return error;
  }

  // Rows without top-k / top-p, all at once, each over kRowSlices blocks
  // (kSliceUntruncatedRows; SampleKernel's one block per row otherwise).
  if (kSliceUntruncatedRows) {
    error = LaunchSlicedRows(p, w, stream);
  } else {
    SampleKernel<<<p.num_reqs, kThreads, 0, stream>>>(p, w, nullptr, 0);
    error = cudaGetLastError();
  }
  if (error != cudaSuccess) return error;
  // Rows with top-k / top-p, kCudaSamplingSortRows per sort.
  const int32_t* rows = w.truncated + 1;
  for (int slot0 = 0; slot0 < num_truncated; slot0 += kCudaSamplingSortRows) {
    const int count = min(kCudaSamplingSortRows, num_truncated - slot0);
    PrepareSortKernel<<<kCudaSamplingSortRows, kPrepareThreads, 0, stream>>>(
        p, w, rows, slot0, count);
    error = cudaGetLastError();
    if (error != cudaSuccess) return error;
    error = SortRows(w, p.vocab_size, &temp_bytes, stream);
    if (error != cudaSuccess) return error;
    SampleKernel<<<count, kThreads, 0, stream>>>(p, w, rows, slot0);
    error = cudaGetLastError();
    if (error != cudaSuccess) return error;
  }
  return cudaSuccess;
}

}  // namespace kernels
}  // namespace pdworker
