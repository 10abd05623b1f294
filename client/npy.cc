#include "client/npy.h"

#include <cstring>
#include <fstream>
#include <iterator>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "client/tensors.h"
#include "kernels/dtype_convert.h"

namespace attention::client {
namespace {

constexpr char kMagic[] = "\x93NUMPY";
constexpr size_t kMagicSize = 6;

// The value after `'key':` in a header dict such as
//   {'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }
absl::StatusOr<std::string> HeaderField(absl::string_view header, absl::string_view key) {
  const std::string quoted = absl::StrCat("'", key, "':");
  const size_t at = header.find(quoted);
  if (at == absl::string_view::npos) {
    return absl::InvalidArgumentError(absl::StrCat("npy header has no '", key, "'"));
  }
  absl::string_view rest = absl::StripLeadingAsciiWhitespace(header.substr(at + quoted.size()));
  size_t end;
  if (absl::StartsWith(rest, "(")) {
    end = rest.find(')') + 1;
  } else if (absl::StartsWith(rest, "'")) {
    end = rest.find('\'', 1) + 1;
  } else {
    end = rest.find_first_of(",}");
  }
  if (end == 0 || end == absl::string_view::npos) {
    return absl::InvalidArgumentError(absl::StrCat("npy header field '", key, "' is malformed"));
  }
  return std::string(rest.substr(0, end));
}

absl::StatusOr<std::vector<int64_t>> ParseShape(absl::string_view text) {
  // "(2, 3)", "(5,)" or "()".
  absl::ConsumePrefix(&text, "(");
  absl::ConsumeSuffix(&text, ")");
  std::vector<int64_t> shape;
  for (absl::string_view part : absl::StrSplit(text, ',', absl::SkipWhitespace())) {
    int64_t dim;
    if (!absl::SimpleAtoi(part, &dim) || dim < 0) {
      return absl::InvalidArgumentError(absl::StrCat("npy shape has a bad dimension '", part, "'"));
    }
    shape.push_back(dim);
  }
  return shape;
}

}  // namespace

absl::StatusOr<NpyArray> ReadNpy(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  // Magic, version (major, minor), header length (2 bytes in 1.0, 4 bytes in 2.0 and 3.0).
  if (bytes.size() < kMagicSize + 4 || bytes.compare(0, kMagicSize, kMagic) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(path, " is not a .npy file"));
  }
  const int major = static_cast<uint8_t>(bytes[kMagicSize]);
  size_t header_len, header_start;
  if (major == 1) {
    header_len = static_cast<uint8_t>(bytes[8]) | static_cast<uint8_t>(bytes[9]) << 8;
    header_start = 10;
  } else {
    if (bytes.size() < 12) return absl::InvalidArgumentError(absl::StrCat(path, " is truncated"));
    header_len = 0;
    for (int i = 3; i >= 0; --i) header_len = header_len << 8 | static_cast<uint8_t>(bytes[8 + i]);
    header_start = 12;
  }
  if (bytes.size() < header_start + header_len) {
    return absl::InvalidArgumentError(absl::StrCat(path, " has a truncated header"));
  }
  const absl::string_view header(bytes.data() + header_start, header_len);

  absl::StatusOr<std::string> descr = HeaderField(header, "descr");
  absl::StatusOr<std::string> fortran = HeaderField(header, "fortran_order");
  absl::StatusOr<std::string> shape_text = HeaderField(header, "shape");
  for (const absl::Status& s : {descr.status(), fortran.status(), shape_text.status()}) {
    if (!s.ok()) return absl::InvalidArgumentError(absl::StrCat(path, ": ", s.message()));
  }
  if (*fortran != "False") {
    return absl::InvalidArgumentError(absl::StrCat(path, " is in Fortran order; need C order"));
  }
  size_t element_bytes;
  if (*descr == "'<f4'") {
    element_bytes = 4;
  } else if (*descr == "'<f2'") {
    element_bytes = 2;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat(path, " has dtype ", *descr, "; need '<f4' or '<f2'"));
  }
  NpyArray array;
  absl::StatusOr<std::vector<int64_t>> shape = ParseShape(*shape_text);
  if (!shape.ok()) return shape.status();
  array.shape = *std::move(shape);
  array.type = element_bytes == 2 ? NpyType::kFloat16 : NpyType::kFloat32;

  const size_t n = static_cast<size_t>(NumElements(array.shape));
  const size_t data_start = header_start + header_len;
  if (bytes.size() - data_start != n * element_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(path, " holds ", bytes.size() - data_start,
                                                   " data bytes, its shape needs ",
                                                   n * element_bytes));
  }
  array.values.resize(n);
  const char* data = bytes.data() + data_start;
  if (element_bytes == 4) {
    std::memcpy(array.values.data(), data, n * 4);
  } else {
    for (size_t i = 0; i < n; ++i) array.values[i] = LoadAsFloat(data, i, DType::kFloat16);
  }
  return array;
}

absl::Status WriteNpy(const std::string& path, absl::Span<const int64_t> shape,
                      absl::Span<const float> values, NpyType type) {
  if (static_cast<int64_t>(values.size()) != NumElements(shape)) {
    return absl::InvalidArgumentError(
        absl::StrCat("WriteNpy: ", values.size(), " values do not fill the shape"));
  }
  std::string shape_text = "(";
  for (int64_t dim : shape) absl::StrAppend(&shape_text, dim, ", ");
  if (shape.size() > 1) shape_text.resize(shape_text.size() - 2);
  if (shape.size() == 1) shape_text.resize(shape_text.size() - 1);  // "(5,)"
  absl::StrAppend(&shape_text, ")");
  std::string header = absl::StrCat("{'descr': '", type == NpyType::kFloat32 ? "<f4" : "<f2",
                                    "', 'fortran_order': False, 'shape': ", shape_text, ", }");
  // Version 1.0: magic, 1, 0, uint16 header length; the header is padded with spaces and ends in
  // a newline so the data starts on a 64-byte boundary.
  const size_t unpadded = kMagicSize + 4 + header.size() + 1;
  header.append((64 - unpadded % 64) % 64, ' ');
  header.push_back('\n');

  std::string data;
  if (type == NpyType::kFloat32) {
    data.assign(reinterpret_cast<const char*>(values.data()), values.size() * 4);
  } else {
    data.resize(values.size() * 2);
    for (size_t i = 0; i < values.size(); ++i) {
      StoreFromFloat(data.data(), i, DType::kFloat16, values[i]);
    }
  }
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) return absl::PermissionDeniedError(absl::StrCat("cannot write ", path));
  out.write(kMagic, kMagicSize);
  const char version_and_length[4] = {1, 0, static_cast<char>(header.size() & 0xff),
                                      static_cast<char>(header.size() >> 8)};
  out.write(version_and_length, 4);
  out << header << data;
  out.close();
  if (!out) return absl::DataLossError(absl::StrCat("writing ", path, " failed"));
  return absl::OkStatus();
}

}  // namespace attention::client
