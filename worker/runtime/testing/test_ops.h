// Backend-neutral elementwise float32 ops for runtime tests and benchmarks:
// one closure per launch on the CPU backend, one tiny kernel on CUDA.
#ifndef PDWORKER_WORKER_RUNTIME_TESTING_TEST_OPS_H_
#define PDWORKER_WORKER_RUNTIME_TESTING_TEST_OPS_H_

#include "absl/status/status.h"
#include "worker/runtime/device_buffer.h"
#include "worker/runtime/stream.h"

namespace pdworker {
namespace test_ops {

// Every float of `data` = value. `value` is frozen into a captured graph.
absl::Status Fill(Stream& stream, DeviceBuffer data, float value);
// y = a * x + y over the floats of y; x must be at least as large.
absl::Status Axpy(Stream& stream, float a, DeviceBuffer x, DeviceBuffer y);
// out = a * b + c over the floats of out; a and b at least as large.
absl::Status MulAdd(Stream& stream, DeviceBuffer a, DeviceBuffer b, float c,
                    DeviceBuffer out);

}  // namespace test_ops
}  // namespace pdworker

#endif  // PDWORKER_WORKER_RUNTIME_TESTING_TEST_OPS_H_
