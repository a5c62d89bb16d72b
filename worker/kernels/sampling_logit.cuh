// How the CUDA sampling kernels (sampling.cu, sampling_greedy.cu) read a
// logit: as the CPU kernel does (sampling.cc). (nvcc only; a textual
// header.)
#ifndef PDWORKER_WORKER_KERNELS_SAMPLING_LOGIT_CUH_
#define PDWORKER_WORKER_KERNELS_SAMPLING_LOGIT_CUH_

#include <cmath>

namespace pdworker {
namespace kernels {
namespace cuda {

// NaN logits count as -inf (never win, no mass).
__device__ __forceinline__ float Logit(float v) {
  return isnan(v) ? -INFINITY : v;
}

}  // namespace cuda
}  // namespace kernels
}  // namespace pdworker

#endif  // PDWORKER_WORKER_KERNELS_SAMPLING_LOGIT_CUH_
