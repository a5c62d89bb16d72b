// Writes float32 arrays as NumPy .npy files (format version 1.0), so Python
// comparison scripts read them with numpy.load and no parser of ours.
#ifndef PDWORKER_TOOLS_LOGITS_PROBE_NPY_WRITER_H_
#define PDWORKER_TOOLS_LOGITS_PROBE_NPY_WRITER_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"

namespace pdworker {

// `values` is the C-order (row-major) contents of an array of `shape`; their
// counts must agree. Little-endian float32 ('<f4'), as on x86-64.
absl::Status WriteNpyFloat32(const std::string& path,
                             const std::vector<int64_t>& shape,
                             absl::Span<const float> values);

}  // namespace pdworker

#endif  // PDWORKER_TOOLS_LOGITS_PROBE_NPY_WRITER_H_
