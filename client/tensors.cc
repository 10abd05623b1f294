#include "client/tensors.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kernels/dtype_convert.h"

namespace attention::client {
namespace {

// The kernel-side dtype of a specified wire dtype.
attention::DType KernelDType(v1::DType dtype) {
  switch (dtype) {
    case v1::DTYPE_FLOAT16:
      return attention::DType::kFloat16;
    case v1::DTYPE_BFLOAT16:
      return attention::DType::kBFloat16;
    case v1::DTYPE_FLOAT8_E4M3:
      return attention::DType::kFloat8E4M3;
    default:
      return attention::DType::kFloat32;
  }
}

}  // namespace

int64_t DTypeBytes(v1::DType dtype) {
  switch (dtype) {
    case v1::DTYPE_FLOAT32:
      return 4;
    case v1::DTYPE_FLOAT16:
    case v1::DTYPE_BFLOAT16:
      return 2;
    case v1::DTYPE_FLOAT8_E4M3:
      return 1;
    default:
      return 0;
  }
}

const char* DTypeName(v1::DType dtype) {
  switch (dtype) {
    case v1::DTYPE_FLOAT32:
      return "float32";
    case v1::DTYPE_FLOAT16:
      return "float16";
    case v1::DTYPE_BFLOAT16:
      return "bfloat16";
    case v1::DTYPE_FLOAT8_E4M3:
      return "float8_e4m3";
    default:
      return "unspecified";
  }
}

absl::StatusOr<v1::DType> ParseDType(absl::string_view name) {
  if (name == "float32" || name == "fp32") return v1::DTYPE_FLOAT32;
  if (name == "float16" || name == "fp16") return v1::DTYPE_FLOAT16;
  if (name == "bfloat16" || name == "bf16") return v1::DTYPE_BFLOAT16;
  if (name == "float8_e4m3" || name == "fp8_e4m3") return v1::DTYPE_FLOAT8_E4M3;
  return absl::InvalidArgumentError(
      absl::StrCat("dtype must be float32, float16, bfloat16 or float8_e4m3, got '", name, "'"));
}

int64_t NumElements(absl::Span<const int64_t> shape) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

v1::Tensor MakeTensor(v1::DType dtype, absl::Span<const int64_t> shape,
                      absl::Span<const float> values) {
  v1::Tensor tensor;
  tensor.set_dtype(dtype);
  for (int64_t s : shape) tensor.add_shape(s);
  std::string* data = tensor.mutable_data();
  data->resize(values.size() * DTypeBytes(dtype));
  if (dtype == v1::DTYPE_FLOAT32) {
    std::memcpy(data->data(), values.data(), data->size());
  } else {
    const attention::DType kernel_dtype = KernelDType(dtype);
    for (size_t i = 0; i < values.size(); ++i) {
      StoreFromFloat(data->data(), static_cast<int64_t>(i), kernel_dtype, values[i]);
    }
  }
  return tensor;
}

absl::StatusOr<std::vector<float>> TensorToFloat(const v1::Tensor& tensor) {
  const int64_t element_bytes = DTypeBytes(tensor.dtype());
  if (element_bytes == 0) return absl::InvalidArgumentError("tensor dtype is unspecified");
  const int64_t n = NumElements(tensor.shape());
  if (static_cast<int64_t>(tensor.data().size()) != n * element_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor of shape [", absl::StrJoin(tensor.shape(), ", "), "] and dtype ",
                     DTypeName(tensor.dtype()), " needs ", n * element_bytes, " bytes, has ",
                     tensor.data().size()));
  }
  std::vector<float> values(n);
  const attention::DType kernel_dtype = KernelDType(tensor.dtype());
  for (int64_t i = 0; i < n; ++i) values[i] = LoadAsFloat(tensor.data().data(), i, kernel_dtype);
  return values;
}

}  // namespace attention::client
