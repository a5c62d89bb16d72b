// Launch-time argument checks shared by the op families in worker/kernels/.
//
// Every launcher validates its params on the host before it launches (or,
// while capturing, records) its op: a too-small or missing buffer is an
// INVALID_ARGUMENT naming the op and the buffer, never a crash inside a
// replayed graph where nobody could report it.
#ifndef PDWORKER_WORKER_KERNELS_KERNEL_CHECKS_H_
#define PDWORKER_WORKER_KERNELS_KERNEL_CHECKS_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <initializer_list>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "common/dtype.h"
#include "worker/runtime/device_buffer.h"
#include "worker/runtime/stream.h"

namespace pdworker {
namespace kernels {

// Largest head_dim the CPU kernels accept: rope and attention keep per-head
// scratch (cos/sin, the softmax accumulator) in fixed stack arrays so that
// nothing is allocated on the step path. Llama-family models use 64..256.
inline constexpr int kMaxHeadDim = 512;

// The first non-OK status of `statuses`, or OK. Lets a launcher list its
// checks in order: `return FirstError({CheckPositive(...), CheckBuffer(...)})`.
absl::Status FirstError(std::initializer_list<absl::Status> statuses);

// OK when `value` > 0; otherwise INVALID_ARGUMENT "<op>: <field> must be
// positive, got <value>".
absl::Status CheckPositive(absl::string_view op, absl::string_view field,
                           int64_t value);

// OK when `value` >= 0; otherwise INVALID_ARGUMENT "<op>: <field> must not be
// negative, got <value>". For host counts where 0 means "launch nothing".
absl::Status CheckNonNegative(absl::string_view op, absl::string_view field,
                              int64_t value);

// OK when `buffer` holds at least `num_elements` elements of `element_bytes`
// bytes each and is not null. `layout` describes the expected shape in the
// message, e.g. "[num_tokens=8, hidden_size=64] fp32".
absl::Status CheckBuffer(absl::string_view op, absl::string_view buffer_name,
                         const DeviceBuffer& buffer, int64_t num_elements,
                         size_t element_bytes, absl::string_view layout);

// Number of elements a row-strided 2-D view spans: `rows` rows of `width`
// elements whose starts are `row_stride` elements apart (the last row needs
// only `width`). 0 when rows == 0.
int64_t StridedElements(int64_t rows, int64_t width, int64_t row_stride);

// OK when the byte ranges [a, a + a_bytes) and [b, b + b_bytes) are disjoint;
// otherwise INVALID_ARGUMENT naming both buffers. For ops whose math would be
// wrong in place (e.g. sgemm).
absl::Status CheckDisjoint(absl::string_view op, absl::string_view a_name,
                           const DeviceBuffer& a, size_t a_bytes,
                           absl::string_view b_name, const DeviceBuffer& b,
                           size_t b_bytes);

// Like CheckDisjoint, but also OK when both views start at the same address
// (a row-wise op that reads each row before writing it runs exactly in
// place; a shifted overlap would read rows it already overwrote).
absl::Status CheckSameOrDisjoint(absl::string_view op, absl::string_view a_name,
                                 const DeviceBuffer& a, size_t a_bytes,
                                 absl::string_view b_name,
                                 const DeviceBuffer& b, size_t b_bytes);

// "fp32", "bf16" or "fp16": the element type in shape messages.
absl::string_view ShortDTypeName(DType dtype);

// The element type of weights, activations and the KV cache on each backend:
// fp32 on the CPU backend, bf16 on CUDA (with fp32 accumulation inside the
// kernels). Logits, RoPE frequencies and sampling stay fp32 on both.
DType ModelDTypeFor(DeviceKind kind);

// OK when `dtype` is what the stream's backend computes in
// (ModelDTypeFor(stream.kind())); otherwise INVALID_ARGUMENT naming the op,
// the field and both types.
absl::Status CheckModelDType(const Stream& stream, absl::string_view op,
                             absl::string_view field, DType dtype);

// OK on the CPU backend, and on CUDA when this binary has the CUDA kernels
// (PDW_HAVE_CUDA); UNIMPLEMENTED otherwise.
absl::Status CheckBackendImplemented(const Stream& stream,
                                     absl::string_view op);

// The body of one CUDA op: enqueues kernels / cuBLAS calls on the context's
// stream and reports what the CUDA runtime or cuBLAS said about the launch.
using CudaOpBody = std::function<absl::Status(const OpContext&)>;

// Launches `body` as op `name` on a CUDA stream and returns the first error
// of the launch and of the body. CudaStream runs an op synchronously inside
// Stream::Launch (CUDA, not the closure list, records the kernels during
// capture), so the body's status can be handed back here; on the CPU backend
// this would be wrong (ops are recorded and run later), hence INTERNAL there.
absl::Status LaunchCudaOp(Stream& stream, absl::string_view name,
                          const CudaOpBody& body);

}  // namespace kernels
}  // namespace pdworker

#endif  // PDWORKER_WORKER_KERNELS_KERNEL_CHECKS_H_
