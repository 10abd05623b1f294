// A backend-agnostic test grid for attention kernels: the cases every backend must get right
// (ragged lengths, Nq != Nk, GQA/MQA, windows in both mask alignments, varlen, layouts, head dims,
// dtypes, huge inputs,
// rows that see no key, NaN and Inf in K or V at keys outside some rows' windows), random inputs,
// NaN poisoning of the outputs, and the comparison with the float64 reference (kernels/reference).
//
// A backend test supplies a HostForward taking host pointers; a device backend wraps it with
// copies (HostBufferBytes gives the sizes):
//   TEST_P(MyTest, MatchesReference) {
//     CheckCase(c, dtype, [&](const AttentionParams& p) { return backend.Forward(p); },
//               DefaultTolerance(dtype));
//   }
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "kernels/attention_params.h"

namespace attention::kernel_test {

// One attention problem. Inputs are standard normal times `input_scale`, rounded to the dtype
// under test before either the backend or the reference sees them.
struct AttentionCase {
  std::string name;  // unique within a grid, [A-Za-z0-9_]: usable as a gtest parameter name
  int64_t batch = 1;
  int64_t heads_q = 1;
  int64_t heads_kv = 1;
  int64_t seqlen_q = 1;
  int64_t seqlen_k = 1;
  int64_t head_dim = 64;
  Layout layout = Layout::kBHSD;
  int64_t window_left = kUnboundedWindow;
  int64_t window_right = kUnboundedWindow;  // 0 = causal
  MaskAlignment mask_alignment = MaskAlignment::kBottomRight;
  std::optional<float> softmax_scale;  // absent: 1 / sqrt(head_dim)
  bool return_lse = false;
  // Varlen when non-empty: per-item lengths (same count for q and k); batch and seqlen_q/k are
  // then derived from them (count and largest length), and layout is ignored (packed [total, H,
  // D]).
  std::vector<int32_t> varlen_q;
  std::vector<int32_t> varlen_k;
  float input_scale = 1.0f;
  // Open-model options (AttentionParams): random per-head sink logits (normal, sd 2) when set; a
  // logit softcap; a chunk size; V's head dim (0: head_dim).
  bool sinks = false;
  float softcap = 0.0f;
  int64_t chunk_size = 0;
  int64_t v_head_dim = 0;
  // Multiplies the float32 tolerance for cases whose conditioning, not the kernel, limits
  // accuracy: with logits around 1e3 a float32 q.k carries ~1e-4 absolute error, which exp() turns
  // into relative error in o (measured up to 8e-6 on the CPU backend). 16-bit outputs are limited
  // by their own rounding instead, so their tolerance is left as is.
  double float32_tolerance_factor = 1.0;

  // Keys (item-local indices, in every item and kv head) whose K or V row is set to `poison`
  // in all features after the random fill: non-finite values at keys that some rows see and
  // others do not. Rows that see a poisoned key are left out of the comparison; every other row
  // must match the reference (finite, within the bound), whatever the poisoned key holds.
  enum class PoisonTarget { kNone, kK, kV };
  PoisonTarget poison_target = PoisonTarget::kNone;
  float poison = 0.0f;
  std::vector<int64_t> poison_keys;

  bool is_varlen() const { return !varlen_q.empty(); }
};

// gtest prints a parameter with this (its name) instead of its raw bytes.
inline void PrintTo(const AttentionCase& c, std::ostream* os) { *os << c.name; }

// The standard grid (a few dozen cases; the float64 reference of all of them, in all three
// dtypes, runs in seconds).
std::vector<AttentionCase> StandardGrid();
// The open-model options (sinks, softcap, chunk size, V head dim other than QK's) on ragged sizes,
// GQA, causal, windows, varlen and poisoned keys: for backends that serve them.
std::vector<AttentionCase> OpenModelGrid();
// OpenModelGrid for backends that serve sinks, softcap and chunk_size but not a V head dim of its
// own: its cases without one, and those that combine one with other options again with V's head
// dim equal to QK's (named "..._same_dv").
std::vector<AttentionCase> OpenModelGridSameVHeadDim();

// Relative error bound for inputs of `dtype`: 1e-5 for float32, 1e-2 for float16 and bfloat16,
// 2^-7 for float8 e4m3 (whose o is bfloat16; attention_test_grid.cc says why).
double DefaultTolerance(DType dtype);
// The bound for float8 e4m3 on a kernel that rounds P to e4m3 before P V (the wgmma kernel's
// native float8 path): 2^-4 / sqrt(3) + 2^-8 ~= 0.040 (attention_test_grid.cc says why).
double Float8RoundedPTolerance();

// Runs one forward pass; every pointer in host_params (q, k, v, o, lse, cu_seqlens) is host memory
// and the strides are contiguous (SetContiguousStrides).
using HostForward = std::function<absl::Status(const AttentionParams& host_params)>;

// Builds random inputs of `dtype` for `c` (fresh seed each call, or ATTENTION_TEST_SEED when set;
// the seed is printed on failure; float8 also gets random descales, printed too: o is then
// bfloat16 and Inf poison becomes NaN, float8 having no Inf), poisons o and lse with NaN, calls
// `forward` and expects (gtest EXPECT_*) that it returns OK, that o and lse hold no NaN or Inf
// (rows that see a poisoned key excepted: they are not compared), that ||o - ref|| / ||ref|| and
// the same for lse are within `tolerance` (times c.float32_tolerance_factor for float32), and that
// rows which see no key get o = 0 and lse = -inf.
void CheckCase(const AttentionCase& c, DType dtype, const HostForward& forward, double tolerance);

// Byte sizes of the buffers behind contiguous (or packed varlen) params, for device copies.
// cu_seqlens_q and cu_seqlens_k hold batch + 1 int32 each when set.
struct HostBufferBytes {
  size_t q = 0, k = 0, v = 0, o = 0, lse = 0;  // lse = 0 when p.lse is null
};
HostBufferBytes BufferBytes(const AttentionParams& p);

// A gtest parameter name for (case, dtype), e.g. "gqa8_causal_float16".
std::string CaseName(const AttentionCase& c, DType dtype);

}  // namespace attention::kernel_test
