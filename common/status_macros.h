// Early-return helpers for absl::Status / absl::StatusOr (abseil 20220623
// ships none).
#ifndef PDWORKER_COMMON_STATUS_MACROS_H_
#define PDWORKER_COMMON_STATUS_MACROS_H_

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define PDW_STATUS_CONCAT_INNER(a, b) a##b
#define PDW_STATUS_CONCAT(a, b) PDW_STATUS_CONCAT_INNER(a, b)

// Returns the status from the enclosing function when `expr` is not OK.
#define PDW_RETURN_IF_ERROR(expr)              \
  do {                                         \
    ::absl::Status pdw_status_ = (expr);       \
    if (!pdw_status_.ok()) return pdw_status_; \
  } while (0)

// `PDW_ASSIGN_OR_RETURN(auto x, MakeX());` or `(x, MakeX())` for an existing
// variable: evaluates the StatusOr, returns its status on error, otherwise
// moves the value into `lhs`.
#define PDW_ASSIGN_OR_RETURN(lhs, expr)                                      \
  PDW_ASSIGN_OR_RETURN_IMPL(PDW_STATUS_CONCAT(pdw_statusor_, __LINE__), lhs, \
                            expr)
#define PDW_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                              \
  if (!tmp.ok()) return tmp.status();             \
  lhs = std::move(*tmp)

#endif  // PDWORKER_COMMON_STATUS_MACROS_H_
