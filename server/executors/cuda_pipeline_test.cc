// The CUDA request pipeline (kernels/cuda/runtime/host_runner.h, the CUDA executor): requests
// batched into one launch (concatenated along B, or packed as varlen beside requests of other
// lengths) against the float64 reference, the device memory budget, a CUDA error failing only the
// request that met it, and requests whose tensors are in device memory (CUDA regions). GPU tests
// skip, with a message, where no GPU is visible.
#include <cuda_runtime_api.h>

#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cuda/runtime/host_runner.h"
#include "kernels/dtype_convert.h"
#include "server/executors/executor.h"
#include "server/testing/small_request_for_tests.h"
#include "tests/kernels/attention_test_grid.h"

namespace attention::server {
namespace {

using ::attention::kernel_test::AttentionCase;
using ::testing::HasSubstr;

bool HaveGpu() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

#define SKIP_WITHOUT_GPU() \
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device visible: GPU test skipped"

// The service's unforced plan may serve float8 natively on Hopper (P rounded to e4m3) or through
// bfloat16 copies: its bound is the native path's.
double Tolerance(DType dtype) {
  return dtype == DType::kFloat8E4M3 ? kernel_test::Float8RoundedPTolerance()
                                     : kernel_test::DefaultTolerance(dtype);
}

// Host buffers for one request shaped like `p` (or with other lengths), filled with a constant:
// the companions that share a launch with the request under test.
struct Companion {
  std::vector<char> q, k, v, o;
  std::vector<float> lse;
  AttentionParams params;

  // `p` with its own buffers; dense BSHD with `seqlen_q` x `seqlen_k` rows when those are > 0.
  Companion(const AttentionParams& p, int64_t seqlen_q, int64_t seqlen_k) : params(p) {
    if (seqlen_q > 0) {
      params.cu_seqlens_q = params.cu_seqlens_k = nullptr;
      params.batch = 2;
      params.seqlen_q = seqlen_q;
      params.seqlen_k = seqlen_k;
      params.SetContiguousStrides(Layout::kBSHD);
    }
    const kernel_test::HostBufferBytes bytes = kernel_test::BufferBytes(params);
    // 0x3c3c.. is a small positive value in every dtype.
    q.assign(bytes.q, 0x3c);
    k.assign(bytes.k, 0x3c);
    v.assign(bytes.v, 0x3c);
    o.assign(bytes.o, 0);
    lse.assign(bytes.lse / sizeof(float), 0);
    params.q = q.data();
    params.k = k.data();
    params.v = v.data();
    params.o = o.data();
    params.lse = p.lse ? lse.data() : nullptr;
  }
};

cuda::HostRunner& Runner() {
  static cuda::HostRunner* runner = [] {
    auto r = cuda::HostRunner::Create({.device = 0, .streams = 2, .poison_outputs = true});
    return r.ok() ? r->release() : nullptr;
  }();
  return *runner;
}

using Param = std::tuple<AttentionCase, DType>;

class BatchedLaunchTest : public testing::TestWithParam<Param> {};

// The request under test between two companions of its own shape: one launch, concatenated
// along B (or packed, when varlen).
TEST_P(BatchedLaunchTest, SameShapeBatchMatchesReference) {
  SKIP_WITHOUT_GPU();
  const auto& [c, dtype] = GetParam();
  kernel_test::CheckCase(
      c, dtype,
      [](const AttentionParams& p) {
        Companion before(p, 0, 0), after(p, 0, 0);
        const AttentionParams items[] = {before.params, p, after.params};
        return Runner().RunBatch(items).status();
      },
      Tolerance(dtype));
}

// The request under test beside a request of other lengths: packed as varlen. Only BSHD and
// varlen requests can be packed so.
TEST_P(BatchedLaunchTest, PackedWithOtherLengthsMatchesReference) {
  SKIP_WITHOUT_GPU();
  const auto& [c, dtype] = GetParam();
  if (!c.is_varlen() && c.layout != Layout::kBSHD && c.heads_q > 1) {
    GTEST_SKIP() << "BHSD requests of different lengths do not share a launch";
  }
  kernel_test::CheckCase(
      c, dtype,
      [](const AttentionParams& p) {
        Companion other(p, p.seqlen_q + 7, p.seqlen_k + 29);
        if (!cuda::CanShareLaunch(p, other.params)) {
          return absl::InternalError("the companion cannot share the launch");
        }
        const AttentionParams items[] = {other.params, p};
        return Runner().RunBatch(items).status();
      },
      Tolerance(dtype));
}

std::vector<AttentionCase> BatchCases() {
  std::vector<AttentionCase> cases;
  for (const AttentionCase& c : kernel_test::StandardGrid()) {
    // A few of each kind keep the GPU run short: varlen, BSHD, windows, lse, odd head dims.
    if (c.is_varlen() || c.layout == Layout::kBSHD || c.return_lse || c.head_dim % 8 != 0 ||
        c.window_left != kUnboundedWindow) {
      cases.push_back(c);
    }
  }
  return cases;
}

// Host-side only (no GPU needed): requests whose masks sit on different diagonals never share
// a launch, whatever else they share.
TEST(CanShareLaunchTest, MaskAlignmentsDoNotMix) {
  AttentionParams a;
  a.batch = 1;
  a.heads_q = a.heads_kv = 2;
  a.seqlen_q = 5;
  a.seqlen_k = 9;
  a.head_dim = 16;
  a.window_right = 0;
  a.SetContiguousStrides(Layout::kBHSD);
  AttentionParams b = a;
  EXPECT_TRUE(cuda::CanShareLaunch(a, b));
  b.mask_alignment = MaskAlignment::kTopLeft;
  EXPECT_FALSE(cuda::CanShareLaunch(a, b));
  a.mask_alignment = MaskAlignment::kTopLeft;
  EXPECT_TRUE(cuda::CanShareLaunch(a, b));
}

// Host-side only: the descales fold into the launch's scale, so float8 requests with other
// descales never share a launch.
TEST(CanShareLaunchTest, DescalesDoNotMix) {
  AttentionParams a;
  a.dtype = DType::kFloat8E4M3;
  a.batch = 1;
  a.heads_q = a.heads_kv = 2;
  a.seqlen_q = a.seqlen_k = 9;
  a.head_dim = 16;
  a.SetContiguousStrides(Layout::kBHSD);
  AttentionParams b = a;
  EXPECT_TRUE(cuda::CanShareLaunch(a, b));
  for (float AttentionParams::*descale :
       {&AttentionParams::q_descale, &AttentionParams::k_descale, &AttentionParams::v_descale}) {
    b = a;
    b.*descale = 0.5f;
    EXPECT_FALSE(cuda::CanShareLaunch(a, b));
  }
}

INSTANTIATE_TEST_SUITE_P(Grid, BatchedLaunchTest,
                         testing::Combine(testing::ValuesIn(BatchCases()),
                                          testing::Values(DType::kFloat32, DType::kFloat16,
                                                          DType::kBFloat16, DType::kFloat8E4M3)),
                         [](const testing::TestParamInfo<Param>& info) {
                           return kernel_test::CaseName(std::get<0>(info.param),
                                                        std::get<1>(info.param));
                         });

// A dense bfloat16 BHSD request of [1, heads, rows, 128]; its tensors are `data` (at least 16
// bytes), which must never be read: the calls below fail before any copy.
AttentionParams Oversized(int64_t heads, int64_t rows, std::vector<char>* data) {
  data->assign(64, 0);
  AttentionParams p;
  p.dtype = DType::kBFloat16;
  p.batch = 1;
  p.heads_q = p.heads_kv = heads;
  p.seqlen_q = p.seqlen_k = rows;
  p.head_dim = 128;
  p.q = p.k = p.v = data->data();
  p.o = data->data();
  p.SetContiguousStrides(Layout::kBHSD);
  return p;
}

TEST(CudaPipelineTest, OverBudgetRequestIsRefusedBeforeAnyAllocation) {
  SKIP_WITHOUT_GPU();
  absl::StatusOr<std::unique_ptr<Executor>> executor =
      MakeCudaExecutor(0, {.streams = 2, .memory_budget_bytes = int64_t{64} << 20});
  ASSERT_TRUE(executor.ok()) << executor.status();
  std::vector<char> data;
  // 4 tensors of 16 heads x 16384 rows x 128 x 2 bytes = 256 MiB, over the 64 MiB budget.
  const AttentionParams big = Oversized(16, 16384, &data);
  size_t free_before = 0, free_after = 0, total = 0;
  ASSERT_EQ(cudaMemGetInfo(&free_before, &total), cudaSuccess);
  absl::StatusOr<StageTimes> refused = (*executor)->Run(big);
  ASSERT_EQ(cudaMemGetInfo(&free_after, &total), cudaSuccess);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  EXPECT_THAT(refused.status().message(), HasSubstr("needs 268"));
  EXPECT_THAT(refused.status().message(), HasSubstr("budget of 67108864 bytes"));
  EXPECT_EQ(free_before, free_after);  // nothing was allocated for it

  // A batch over the budget whose items fit runs item by item.
  SmallRequest a, b;
  const AttentionParams fits[] = {a.params, b.params};
  for (const absl::StatusOr<StageTimes>& r : (*executor)->RunBatch(fits)) {
    EXPECT_TRUE(r.ok()) << r.status();
  }
}

TEST(CudaPipelineTest, CudaErrorFailsOnlyTheRequestThatMetIt) {
  SKIP_WITHOUT_GPU();
  size_t free_bytes = 0, total = 0;
  ASSERT_EQ(cudaMemGetInfo(&free_bytes, &total), cudaSuccess);
  // A budget larger than the device, so the request below passes it and cudaMalloc fails.
  absl::StatusOr<std::unique_ptr<Executor>> executor =
      MakeCudaExecutor(0, {.streams = 2, .memory_budget_bytes = static_cast<int64_t>(total) * 4});
  ASSERT_TRUE(executor.ok()) << executor.status();
  std::vector<char> data;
  // 4 tensors of 16 heads x 2^24 rows x 128 x 2 bytes = 256 GiB, more than any GPU here holds.
  const AttentionParams huge = Oversized(16, int64_t{1} << 24, &data);
  absl::StatusOr<StageTimes> failed = (*executor)->Run(huge);
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kResourceExhausted) << failed.status();
  EXPECT_THAT(failed.status().message(), HasSubstr("cannot allocate"));
  // The executor keeps serving, on both streams.
  for (int i = 0; i < 4; ++i) {
    SmallRequest ok;
    absl::StatusOr<StageTimes> r = (*executor)->Run(ok.params);
    EXPECT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(ok.o.size(), ok.q.size());
  }
}

}  // namespace
}  // namespace attention::server

namespace attention::server {
namespace {

// A bfloat16 request of p's shape (contiguous) on random q, k, v in host memory, its answer from
// host memory, and the same tensors copied into device memory at `dev` (laid out q | k | v | o, o
// poisoned): what a client's CUDA IPC region resolves to.
struct HostAndDeviceRequest {
  std::vector<uint16_t> q, k, v, o_host;
  AttentionParams host, on_device;
  size_t q_bytes = 0, kv_bytes = 0;

  HostAndDeviceRequest(const AttentionParams& p, std::mt19937_64& rng) : host(p), on_device(p) {
    std::uniform_real_distribution<float> uniform(-2, 2);
    const int64_t q_elems = p.batch * p.heads_q * p.seqlen_q * p.head_dim;
    const int64_t kv_elems = p.batch * p.heads_kv * p.seqlen_k * p.head_dim;
    q.resize(q_elems);
    k.resize(kv_elems);
    v.resize(kv_elems);
    o_host.resize(q_elems);
    for (auto* t : {&q, &k, &v}) {
      for (uint16_t& x : *t) x = FloatToBFloat16(uniform(rng));
    }
    host.q = q.data();
    host.k = k.data();
    host.v = v.data();
    host.o = o_host.data();
    q_bytes = q_elems * 2;
    kv_bytes = kv_elems * 2;
  }
  // Device bytes the tensors take at `dev`.
  size_t DeviceBytes() const { return 2 * q_bytes + 2 * kv_bytes; }
  // Copies q, k, v to dev, poisons o there and points on_device at them.
  void CopyTo(char* dev) {
    ASSERT_EQ(cudaMemcpy(dev, q.data(), q_bytes, cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(dev + q_bytes, k.data(), kv_bytes, cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(dev + q_bytes + kv_bytes, v.data(), kv_bytes, cudaMemcpyHostToDevice),
              cudaSuccess);
    on_device.q = dev;
    on_device.k = dev + q_bytes;
    on_device.v = dev + q_bytes + kv_bytes;
    on_device.o = dev + q_bytes + 2 * kv_bytes;
    PoisonDeviceO();
  }
  void PoisonDeviceO() {
    ASSERT_EQ(cudaMemset(const_cast<void*>(on_device.o), 0xff, q_bytes), cudaSuccess);
  }
  // o as the device request left it.
  std::vector<uint16_t> DeviceO() const {
    std::vector<uint16_t> o(o_host.size());
    EXPECT_EQ(cudaMemcpy(o.data(), on_device.o, q_bytes, cudaMemcpyDeviceToHost), cudaSuccess);
    return o;
  }
};

// q, k, v and o in this device's memory (what a client's CUDA IPC region resolves to): a lone
// dense request is computed in place, D not a multiple of 8 and one beside another request are
// copied device to device; every answer equals the same request from host memory, bit for bit.
TEST(CudaPipelineTest, RequestsInDeviceMemoryEqualTheSameFromHostMemory) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(std::random_device{}());
  for (int64_t d : {128, 36}) {
    SCOPED_TRACE(absl::StrCat("D ", d));
    AttentionParams p;
    p.dtype = DType::kBFloat16;
    p.batch = 2;
    p.heads_q = 4;
    p.heads_kv = 2;
    p.seqlen_q = 77;
    p.seqlen_k = 130;
    p.head_dim = d;
    p.softmax_scale = 0.1f;
    p.SetContiguousStrides(Layout::kBHSD);
    HostAndDeviceRequest r(p, rng);
    ASSERT_TRUE(Runner().Run(r.host).ok());
    void* allocation = nullptr;
    ASSERT_EQ(cudaMalloc(&allocation, r.DeviceBytes()), cudaSuccess);
    ASSERT_NO_FATAL_FAILURE(r.CopyTo(static_cast<char*>(allocation)));
    ASSERT_TRUE(Runner().Run(r.on_device).ok());
    EXPECT_EQ(r.DeviceO(), r.o_host) << "alone";
    // Beside a host request of its shape: one launch, its o copied back device to device.
    ASSERT_NO_FATAL_FAILURE(r.PoisonDeviceO());
    Companion companion(r.host, 0, 0);
    const AttentionParams both[] = {r.on_device, companion.params};
    const absl::StatusOr<cuda::HostRunTimes> batched = Runner().RunBatch(both);
    ASSERT_TRUE(batched.ok()) << batched.status();
    EXPECT_EQ(r.DeviceO(), r.o_host) << "batched";
    cudaFree(allocation);
  }
}

// q, k, v and o in device memory at addresses that are element-aligned but not 16-byte aligned
// (a region reference is checked against the element size only): copied device to device rather
// than read in place by the kernel's 16-byte loads, so no misaligned access (which would take the
// device out of service), and the answer equals the same request from host memory.
TEST(CudaPipelineTest, DeviceTensorsOffSixteenBytesAreCopiedAndEqualTheHostRequest) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(std::random_device{}());
  AttentionParams p;
  p.dtype = DType::kBFloat16;
  p.batch = 1;
  p.heads_q = p.heads_kv = 2;
  p.seqlen_q = 33;
  p.seqlen_k = 70;
  p.head_dim = 64;
  p.window_right = 0;  // causal: the device scan of V too
  p.SetContiguousStrides(Layout::kBHSD);
  HostAndDeviceRequest r(p, rng);
  ASSERT_TRUE(Runner().Run(r.host).ok());
  void* allocation = nullptr;
  ASSERT_EQ(cudaMalloc(&allocation, r.DeviceBytes() + 64), cudaSuccess);
  // 2 bytes past a 256-byte boundary.
  ASSERT_NO_FATAL_FAILURE(r.CopyTo(static_cast<char*>(allocation) + 2));
  const absl::StatusOr<cuda::HostRunTimes> run = Runner().Run(r.on_device);
  ASSERT_TRUE(run.ok()) << run.status();
  EXPECT_EQ(r.DeviceO(), r.o_host);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  cudaFree(allocation);
}

}  // namespace
}  // namespace attention::server

namespace attention::server {
namespace {

// How the request under test shares its launch: alone (in place when dense with D % 8 == 0),
// beside a request of its shape (concatenated along B), or packed as varlen beside one of other
// lengths.
enum class Companions { kNone, kSameShape, kOtherLengths };

const char* CompanionsName(Companions c) {
  return c == Companions::kNone        ? "alone"
         : c == Companions::kSameShape ? "same_shape"
                                       : "other_lengths";
}
// gtest prints the parameter with this instead of its raw bytes.
void PrintTo(Companions c, std::ostream* os) { *os << CompanionsName(c); }

// Runs `p` (host pointers) beside its companions, fresh ones of the same shapes each call.
absl::Status RunWith(const AttentionParams& p, Companions companions) {
  if (companions == Companions::kNone) return Runner().Run(p).status();
  Companion other(p, companions == Companions::kSameShape ? 0 : p.seqlen_q + 7,
                  companions == Companions::kSameShape ? 0 : p.seqlen_k + 29);
  if (!cuda::CanShareLaunch(p, other.params)) {
    return absl::InternalError("the companion cannot share the launch");
  }
  const AttentionParams items[] = {other.params, p};
  return Runner().RunBatch(items).status();
}

using MaskedParam = std::tuple<AttentionCase, DType, Companions>;

class DeviceMemoryMaskedTest : public testing::TestWithParam<MaskedParam> {};

// Masked requests (causal, windows, both alignments) whose q, k, v, o and lse are in this device's
// memory (what a client's CUDA IPC region resolves to), V with NaN or Inf at keys outside some
// rows' windows included: the answer equals the same request from host memory bit for bit (the V
// scan on the device sends exactly the requests the host scan sends to the exact CPU kernel), and
// matches the float64 reference (CheckCase, on the device run's results).
TEST_P(DeviceMemoryMaskedTest, EqualsTheSameRequestFromHostMemory) {
  SKIP_WITHOUT_GPU();
  const auto& [c, dtype, companions] = GetParam();
  if (companions == Companions::kOtherLengths && !c.is_varlen() && c.layout != Layout::kBSHD &&
      c.heads_q > 1) {
    GTEST_SKIP() << "BHSD requests of different lengths do not share a launch";
  }
  kernel_test::CheckCase(
      c, dtype,
      [companions = companions](const AttentionParams& p) -> absl::Status {
        const kernel_test::HostBufferBytes bytes = kernel_test::BufferBytes(p);
        // The host path first, into p's (poisoned) o and lse; kept, then p's o and lse get the
        // device run's results for CheckCase.
        if (absl::Status s = RunWith(p, companions); !s.ok()) return s;
        const std::vector<char> o_host(static_cast<const char*>(p.o),
                                       static_cast<const char*>(p.o) + bytes.o);
        const std::vector<char> lse_host(reinterpret_cast<const char*>(p.lse),
                                         reinterpret_cast<const char*>(p.lse) + bytes.lse);
        void* allocation = nullptr;
        const size_t total = bytes.q + bytes.k + bytes.v + bytes.o + bytes.lse;
        if (cudaMalloc(&allocation, total) != cudaSuccess) {
          return absl::InternalError("cudaMalloc");
        }
        std::unique_ptr<void, decltype(&cudaFree)> owned(allocation, cudaFree);
        char* q = static_cast<char*>(allocation);
        char* k = q + bytes.q;
        char* v = k + bytes.k;
        char* o = v + bytes.v;
        char* lse = o + bytes.o;
        if (cudaMemcpy(q, p.q, bytes.q, cudaMemcpyHostToDevice) != cudaSuccess ||
            cudaMemcpy(k, p.k, bytes.k, cudaMemcpyHostToDevice) != cudaSuccess ||
            cudaMemcpy(v, p.v, bytes.v, cudaMemcpyHostToDevice) != cudaSuccess ||
            cudaMemset(o, 0xff, bytes.o + bytes.lse) != cudaSuccess) {  // NaN: unwritten shows
          return absl::InternalError("copy the inputs to the device");
        }
        AttentionParams on_device = p;
        on_device.q = q;
        on_device.k = k;
        on_device.v = v;
        on_device.o = o;
        on_device.lse = p.lse != nullptr ? reinterpret_cast<float*>(lse) : nullptr;
        if (absl::Status s = RunWith(on_device, companions); !s.ok()) return s;
        if (cudaMemcpy(p.o, o, bytes.o, cudaMemcpyDeviceToHost) != cudaSuccess ||
            (bytes.lse > 0 &&
             cudaMemcpy(p.lse, lse, bytes.lse, cudaMemcpyDeviceToHost) != cudaSuccess)) {
          return absl::InternalError("copy the outputs to the host");
        }
        EXPECT_EQ(std::memcmp(o_host.data(), p.o, bytes.o), 0) << "o differs from the host path's";
        EXPECT_EQ(std::memcmp(lse_host.data(), p.lse, bytes.lse), 0)
            << "lse differs from the host path's";
        return absl::OkStatus();
      },
      kernel_test::DefaultTolerance(dtype));
}

std::vector<AttentionCase> MaskedCases() {
  std::vector<AttentionCase> cases;
  for (AttentionCase c : kernel_test::StandardGrid()) {
    if (c.window_left == kUnboundedWindow && c.window_right == kUnboundedWindow) continue;
    c.return_lse = true;  // lse in device memory too
    cases.push_back(c);
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(
    Grid, DeviceMemoryMaskedTest,
    testing::Combine(testing::ValuesIn(MaskedCases()),
                     testing::Values(DType::kFloat32, DType::kFloat16, DType::kBFloat16),
                     testing::Values(Companions::kNone, Companions::kSameShape,
                                     Companions::kOtherLengths)),
    [](const testing::TestParamInfo<MaskedParam>& info) {
      return absl::StrCat(kernel_test::CaseName(std::get<0>(info.param), std::get<1>(info.param)),
                          "_", CompanionsName(std::get<2>(info.param)));
    });

}  // namespace
}  // namespace attention::server
