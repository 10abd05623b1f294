// Reading and writing NumPy .npy files (format versions 1.0-3.0) for the CLI's tensor inputs and
// outputs. Supported element types: little-endian float32 ('<f4') and float16 ('<f2'), C order.
// NumPy has no bfloat16; bfloat16 tensors travel as float32 files (exact: every bfloat16 is a
// float32) and are rounded to bfloat16 when a request is built.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace attention::client {

enum class NpyType { kFloat32, kFloat16 };

struct NpyArray {
  NpyType type = NpyType::kFloat32;  // the file's element type
  std::vector<int64_t> shape;
  std::vector<float> values;  // row-major, prod(shape) of them
};

// Reads a '<f4' or '<f2' array in C order; float16 values are widened to float.
absl::StatusOr<NpyArray> ReadNpy(const std::string& path);

// Writes `values` (prod(shape) of them, row-major) as `type` (float16 rounds to nearest even).
absl::Status WriteNpy(const std::string& path, absl::Span<const int64_t> shape,
                      absl::Span<const float> values, NpyType type = NpyType::kFloat32);

}  // namespace attention::client
