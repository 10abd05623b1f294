// Building attention.v1 Tensors from float values and reading them back, in any of the API's
// dtypes. The 16- and 8-bit conversions are kernels/dtype_convert.h's (round to nearest even;
// float8 e4m3 turns what rounds past 448 into NaN).
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "attention/v1/attention.pb.h"

namespace attention::client {

// Bytes per element of `dtype`; 0 for DTYPE_UNSPECIFIED.
int64_t DTypeBytes(v1::DType dtype);

// Lower-case name as the CLI and logs spell it: "float32", "float16", "bfloat16", "float8_e4m3".
const char* DTypeName(v1::DType dtype);

// Parses "float32" | "float16" | "bfloat16" | "float8_e4m3" (also "fp32", "fp16", "bf16",
// "fp8_e4m3").
absl::StatusOr<v1::DType> ParseDType(absl::string_view name);

// Product of `shape`.
int64_t NumElements(absl::Span<const int64_t> shape);

// A Tensor of `dtype` and `shape` holding `values` (row-major, prod(shape) of them) rounded to
// `dtype`. The caller guarantees values.size() == prod(shape).
v1::Tensor MakeTensor(v1::DType dtype, absl::Span<const int64_t> shape,
                      absl::Span<const float> values);

// The elements of `tensor` as floats; an error when its dtype is unspecified or its byte size
// does not match its shape.
absl::StatusOr<std::vector<float>> TensorToFloat(const v1::Tensor& tensor);

}  // namespace attention::client
