// The device scan for Inf and NaN (kernels/cuda/prep/non_finite_scan.h) against the host scan
// (kernels/non_finite.h), which it must answer alike (the CUDA runner picks the exact path by it):
// every float16 and bfloat16 pattern, float32 specials, at every position of tensors that start
// off a 16-byte boundary (the element-wise ends and the 16-byte middle). Skips without a GPU.
#include <cuda_runtime_api.h>

#include <bit>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/cuda/prep/non_finite_scan.h"
#include "kernels/non_finite.h"

namespace attention::cuda {
namespace {

bool HaveGpu() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

#define SKIP_WITHOUT_GPU() \
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device visible: GPU test skipped"

// Device copies of host bytes, and one flag per scan.
struct DeviceScans {
  void* data = nullptr;
  unsigned int* flags = nullptr;
  int64_t count = 0;

  DeviceScans(const void* host, size_t bytes, int64_t scans) : count(scans) {
    EXPECT_EQ(cudaMalloc(&data, bytes), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(data, host, bytes, cudaMemcpyHostToDevice), cudaSuccess);
    EXPECT_EQ(cudaMalloc(reinterpret_cast<void**>(&flags), scans * sizeof(unsigned int)),
              cudaSuccess);
    EXPECT_EQ(cudaMemset(flags, 0, scans * sizeof(unsigned int)), cudaSuccess);
  }
  ~DeviceScans() {
    cudaFree(data);
    cudaFree(flags);
  }
  // Scan i over `elements` values starting `offset` bytes into the copy.
  void Scan(int64_t i, int64_t offset, int64_t elements, DType dtype) {
    ASSERT_EQ(LaunchNonFiniteScan(static_cast<const char*>(data) + offset, elements,
                                  static_cast<int>(DTypeSize(dtype)), NonFiniteBitsOf(dtype),
                                  flags + i, nullptr),
              cudaSuccess);
  }
  std::vector<unsigned int> Flags() const {
    std::vector<unsigned int> host(count);
    EXPECT_EQ(cudaMemcpy(host.data(), flags, count * sizeof(unsigned int), cudaMemcpyDeviceToHost),
              cudaSuccess);
    return host;
  }
};

TEST(CudaNonFiniteScanTest, EverySixteenBitPatternAsTheHostScan) {
  SKIP_WITHOUT_GPU();
  for (DType dtype : {DType::kFloat16, DType::kBFloat16}) {
    SCOPED_TRACE(DTypeName(dtype));
    std::vector<uint16_t> patterns(0x10000);
    for (uint32_t h = 0; h < 0x10000; ++h) patterns[h] = static_cast<uint16_t>(h);
    DeviceScans scans(patterns.data(), patterns.size() * 2, 0x10000);
    for (int64_t h = 0; h < 0x10000; ++h) scans.Scan(h, h * 2, 1, dtype);
    const std::vector<unsigned int> flags = scans.Flags();
    for (uint32_t h = 0; h < 0x10000; ++h) {
      ASSERT_EQ(flags[h] != 0, HoldsNonFinite(dtype, &patterns[h], 1)) << std::hex << h;
    }
  }
}

TEST(CudaNonFiniteScanTest, EveryPositionOfUnalignedTensorsAsTheHostScan) {
  SKIP_WITHOUT_GPU();
  constexpr float kInf = std::numeric_limits<float>::infinity();
  for (DType dtype : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    const int64_t elem = static_cast<int64_t>(DTypeSize(dtype));
    // Bit patterns of 1.0 and of the non-finite values under test in this dtype.
    const uint32_t one = dtype == DType::kFloat32   ? 0x3f800000u
                         : dtype == DType::kFloat16 ? 0x3c00u
                                                    : 0x3f80u;
    const std::vector<uint32_t> bad =
        dtype == DType::kFloat32
            ? std::vector<uint32_t>{std::bit_cast<uint32_t>(kInf), std::bit_cast<uint32_t>(-kInf),
                                    std::bit_cast<uint32_t>(
                                        std::numeric_limits<float>::quiet_NaN()),
                                    0xff800001u}
        : dtype == DType::kFloat16 ? std::vector<uint32_t>{0x7c00u, 0xfc00u, 0x7e00u, 0x7c01u}
                                   : std::vector<uint32_t>{0x7f80u, 0xff80u, 0x7fc0u, 0x7f81u};
    for (int64_t start : {0, 1, 3, 4, 7}) {  // elements past a 16-byte boundary
      for (int64_t n : {1, 3, 4, 5, 8, 17, 64, 1000}) {
        SCOPED_TRACE(absl::StrCat(DTypeName(dtype), " start ", start, " n ", n));
        for (uint32_t value : bad) {
          // Scan p over [start, start + n) with `value` at element start + p (p = n: none).
          const int64_t total = start + n + 8;
          std::vector<std::vector<char>> tensors;
          for (int64_t p = 0; p <= n; ++p) {
            std::vector<char> t(total * elem);
            for (int64_t i = 0; i < total; ++i) std::memcpy(&t[i * elem], &one, elem);
            if (p < n) std::memcpy(&t[(start + p) * elem], &value, elem);
            // A value outside the scanned range must not count.
            std::memcpy(&t[(start + n) * elem], &bad[0], elem);
            tensors.push_back(std::move(t));
          }
          // Each tensor at a 16-byte aligned offset of the copy (its bytes padded to 16).
          const int64_t stride = (total * elem + 15) / 16 * 16;
          std::vector<char> laid(stride * (n + 1), 0);
          for (int64_t p = 0; p <= n; ++p) {
            std::memcpy(&laid[p * stride], tensors[p].data(), total * elem);
          }
          DeviceScans scans(laid.data(), laid.size(), n + 1);
          for (int64_t p = 0; p <= n; ++p) scans.Scan(p, p * stride + start * elem, n, dtype);
          const std::vector<unsigned int> flags = scans.Flags();
          for (int64_t p = 0; p <= n; ++p) {
            const bool host_says = HoldsNonFinite(dtype, tensors[p].data() + start * elem, n);
            ASSERT_EQ(host_says, p < n) << "position " << p;
            ASSERT_EQ(flags[p] != 0, host_says)
                << "position " << p << " value " << std::hex << value;
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace attention::cuda
