// Early-return macros for absl::Status and absl::StatusOr, the one error type of the program:
//   RETURN_IF_ERROR(Reserve(bytes));                    // returns the Status when not OK
//   ASSIGN_OR_RETURN(auto plan, Plan(params));          // declares plan = *Plan(params), or
//   ASSIGN_OR_RETURN(std::unique_ptr<T> p, Make());     //   returns Plan's error Status
//   ASSIGN_OR_RETURN(existing, Make());                 // assigns to a declared variable
// Both work in functions returning absl::Status or any absl::StatusOr<T>. ASSIGN_OR_RETURN is a
// statement sequence, not one statement: do not use it as the body of an unbraced if or loop. Its
// lhs must not contain an unparenthesised comma.
#pragma once

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define RETURN_IF_ERROR(expr)                                                       \
  do {                                                                              \
    if (absl::Status status_macros_status_ = (expr); !status_macros_status_.ok()) { \
      return status_macros_status_;                                                 \
    }                                                                               \
  } while (0)

// A name unique to the line, for ASSIGN_OR_RETURN's temporary.
#define STATUS_MACROS_CONCAT_INNER_(a, b) a##b
#define STATUS_MACROS_CONCAT_(a, b) STATUS_MACROS_CONCAT_INNER_(a, b)

#define ASSIGN_OR_RETURN(lhs, expr) \
  ASSIGN_OR_RETURN_IMPL_(STATUS_MACROS_CONCAT_(status_macros_statusor_, __LINE__), lhs, expr)

#define ASSIGN_OR_RETURN_IMPL_(statusor, lhs, expr)        \
  auto statusor = (expr);                                  \
  if (!statusor.ok()) return std::move(statusor).status(); \
  lhs = *std::move(statusor)
